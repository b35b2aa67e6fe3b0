"""ModelFacts: what capture and the passes find out about a model (layers, cache dtype,
sliding windows, latent attention), typed; the program carries them."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class LatentAttention:
    """An MLA layer's widths, as absorb_latent_attention found them (docs/moe-mla.md: MLA)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    heads: int
    scale: float | None = None


@dataclass(frozen=True)
class KVLayout:
    """One KV cache layout (before tensor-parallel sharding): its KV heads and head_dim."""

    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVLayers:
    """Per-layer KV layouts (Gemma 4: head_dim by layer type) and KV shared across layers
    (Gemma 4's ``num_kv_shared_layers``), as insert_paged_cache found them (docs/models.md:
    Per-layer KV layouts). ``caches[c]`` is cache c's layout (one key and one value cache
    each, flat ``[k_0, v_0, k_1, v_1, ...]``); ``reads[l]`` is the cache attention layer l
    reads: a layer that reads another layer's keys and values reads that layer's cache and
    has none of its own."""

    caches: tuple[KVLayout, ...]
    reads: tuple[int, ...]

    @property
    def uniform(self) -> bool:
        return len(set(self.caches)) == 1 and len(self.reads) == len(self.caches)


@dataclass(frozen=True)
class MixtureOfExperts:
    """The model's dcp.moe blocks, as canonicalize_moe found them (docs/moe-mla.md: Mixture
    of experts)."""

    layers: int                       # MoE layers (dcp.moe nodes)
    experts: tuple[int, ...]          # distinct expert counts
    top_k: tuple[int, ...]            # distinct top-k
    expert_parallel: bool


@dataclass(frozen=True)
class ModelFacts:
    """Facts about the model; ``None`` where nothing has told yet.

    A frontend gives what it knows before capture (a paged model states its layer count);
    a pass returns what it finds in the graph (``insert_paged_cache``: layers, cache dtype,
    windows, MLA); the driver merges them (``merged``) and hands them to later passes.
    """

    num_layers: int | None = None
    cache_dtype: torch.dtype | None = None
    windows: tuple[int, ...] | None = None      # per layer; 0: full attention
    chunks: tuple[int, ...] | None = None       # per layer; 0: not chunked (Llama 4's C)
    # (input name, dim) of each constant table the prompt step sliced by its length
    # (passes/positions.py): a one-token step reads ``table[:1]`` as position rows too.
    position_tables: tuple[tuple[str, int], ...] | None = None
    mla: LatentAttention | None = None
    moe: MixtureOfExperts | None = None
    # One mask theorem per attention layer of an ordinary model (passes/prove/masks.py
    # Theorems), for the certificate.
    mask_theorems: tuple | None = None
    # The longest sequence the model is served for (hf.prepare(max_model_len=...)): a
    # decision on max(positions) proven constant below it is folded (check_token_wise).
    max_model_len: int | None = None
    # Per-layer KV layouts and shared KV (None: one layout, one cache per layer).
    kv_layers: KVLayers | None = None
    # The model config's RoPE variant (Hugging Face rope_parameters), named in refusals.
    rope_type: str | None = None
    # Each recurrent mixer's layout over TP (passes/placement/recurrent.py): (its module path,
    # "head cut" or "replicated (<why>)"), in graph order; None: no recurrent layer.
    recurrent_layout: tuple[tuple[str, str], ...] | None = None

    def merged(self, found: "ModelFacts | None") -> "ModelFacts":
        """These facts with every field ``found`` knows replaced by its value."""
        if found is None:
            return self
        known = {f.name: getattr(found, f.name) for f in fields(found)
                 if getattr(found, f.name) is not None}
        return ModelFacts(**{**{f.name: getattr(self, f.name) for f in fields(self)},
                             **known})
