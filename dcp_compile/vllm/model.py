"""``DcpCompiledForCausalLM``: a vLLM model whose whole step is a dcp_compile program.

vLLM builds it on every worker with stub attention layers (dcp_compile/vllm/attention.py),
so that it sizes, allocates and block-tables the KV cache as for any model. vLLM's loader
streams the checkpoint's tensors into ``load_weights``: the model transforms the
checkpoint's model (built on the meta device: no weights) for vLLM's tp, dcp, block size and
interleave, and keeps of each streamed tensor only this rank's shard boxes
(``StreamedCheckpoint``). At the first real step, when vLLM has sized the cache, it
transforms again for that cache (the proof reused), with the garbage block first (vLLM's
null block), binds vLLM's own groups to the program's roles, loads the kept shards, and
from then on runs each vLLM batch as program calls (dcp_compile/vllm/batch.py) on vLLM's
own KV tensors.

The program's shapes follow vLLM's (``vllm_shapes``): rows per call = ``max_num_seqs``, the
prompt step = ``max_num_batched_tokens`` tokens (at most ``max_model_len``), the chunk step
(a chunk after prior context in one call) as wide, up to the proven 64; the block-table
width from ``max_model_len``, the cache from the block count vLLM sized. Any of them, the
decode width and context buckets can be set in ``hf_overrides={"dcp_compile": {...}}``
(``OPTIONS``).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from dcp_compile.runtime.errors import DCPCompilerBug, DCPConfigError, DCPInputError
from dcp_compile.runtime.garbage_block import FIRST
from dcp_compile.runtime.names import Mode, StepKind
from dcp_compile.vllm.batch import (ProgramShapes, at_bucket, calls_of, scatter_logits,
                                    table_rows)

# The options of hf_overrides["dcp_compile"] -> the least value each takes (chunk_len 0: no
# chunk step, later chunks as decode steps); "buckets" is a list of context lengths.
OPTIONS = {"batch": 1, "context_len": 1, "chunk_len": 0, "decode_len": 1}
DECODE_LEN = 4          # tokens per row of a decode step unless hf_overrides says


def vllm_shapes(*, max_num_seqs: int, max_num_batched_tokens: int,
                max_model_len: int) -> dict:
    """The program options vLLM's scheduler limits give (module doc): every request of a
    step in one call's rows, a step's whole token budget in one prompt or chunk row."""
    from dcp_compile.passes.prove.theorems import MAX_DECODE_LEN
    tokens = min(max_num_batched_tokens, max_model_len)
    return {"batch": max_num_seqs, "context_len": tokens, "decode_len": DECODE_LEN,
            "chunk_len": min(tokens, MAX_DECODE_LEN), "buckets": []}


def program_options(hf_config, **limits) -> dict:
    """The program shapes: ``vllm_shapes(**limits)``, overridden by ``hf_config.dcp_compile``
    (hf_overrides), checked by name."""
    from dcp_compile.passes.prove.theorems import MAX_DECODE_LEN
    given = dict(getattr(hf_config, "dcp_compile", None) or {})
    unknown = sorted(set(given) - set(OPTIONS) - {"buckets"})
    if unknown:
        raise DCPConfigError(f"unknown dcp_compile options in hf_overrides: {unknown}. Use "
                             f"{sorted(OPTIONS) + ['buckets']}.")
    out = vllm_shapes(**limits) | given
    bad = [f"{k}={out[k]!r} (needs >= {least})" for k, least in OPTIONS.items()
           if not isinstance(out[k], int) or isinstance(out[k], bool) or out[k] < least]
    if out["chunk_len"] > MAX_DECODE_LEN:
        bad.append(f"chunk_len={out['chunk_len']} (the chunk step is a decode step, proven "
                   f"for widths up to {MAX_DECODE_LEN})")
    if not isinstance(out["buckets"], list):
        bad.append(f"buckets={out['buckets']!r} (a list of context lengths in tokens)")
    if bad:
        raise DCPConfigError(f"dcp_compile options out of range: {', '.join(bad)}. Pass e.g. "
                             f"{{'batch': 4, 'context_len': 64, 'chunk_len': 32, "
                             f"'decode_len': 4, 'buckets': [64, 128]}}.")
    return out


def refuse_unserved(vllm_config) -> None:
    """DCPConfigError for the vLLM features the plugin does not serve, by name, before any
    of its setup runs (docs/vllm.md "What works through the plugin")."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1 or parallel.prefill_context_parallel_size != 1:
        raise DCPConfigError(
            f"dcp_compile serves tensor + decode context parallelism only: "
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}, "
            f"prefill_context_parallel_size={parallel.prefill_context_parallel_size}. "
            f"Use 1 for both.")
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        raise DCPConfigError(
            f"speculative decoding (speculative_config method="
            f"{getattr(spec, 'method', None)!r}) is not served by the dcp_compile plugin: "
            f"its draft proposals and verify steps are not wired to the program. Serve "
            f"without speculative_config (the project's own Engine verifies drafts: "
            f"docs/speculative-prefix.md).")
    from dcp_compile.frontends.module_recurrent import hybrid_config
    model = getattr(vllm_config, "model_config", None)
    hybrid = hybrid_config(getattr(model, "hf_config", None))
    if hybrid is not None:
        from dcp_compile.runtime.errors import DCPHybridError
        raise DCPHybridError(
            f"hybrid model ({hybrid}): the dcp_compile plugin does not serve recurrent layers: "
            f"vLLM's cache manager would size their state as KV pages, and the plugin does "
            f"not pass state slots to the program. Serve it with dcp_compile's own Engine "
            f"(docs/hybrid.md), or with vLLM without the plugin.")


class DcpCompiledForCausalLM(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        from dcp_compile.vllm.attention import DcpStubBackend
        from dcp_compile.vllm.slot_mapping import register_slot_mapping

        refuse_unserved(vllm_config)
        register_slot_mapping()
        self.vllm_config = vllm_config
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        hf = model.hf_config
        self.tp = parallel.tensor_parallel_size
        self.dcp = parallel.decode_context_parallel_size
        self.interleave = parallel.cp_kv_cache_interleave_size
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = model.max_model_len
        self.vocab_size = hf.vocab_size
        scheduler = vllm_config.scheduler_config
        self.options = program_options(hf, max_num_seqs=scheduler.max_num_seqs,
                                       max_num_batched_tokens=scheduler.max_num_batched_tokens,
                                       max_model_len=model.max_model_len)
        self.head_dim = model.get_head_size()
        heads, kv_heads = model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel)
        self.attn = nn.ModuleList(
            Attention(heads, self.head_dim, self.head_dim ** -0.5, num_kv_heads=kv_heads,
                      cache_config=vllm_config.cache_config,
                      prefix=f"{prefix}model.layers.{i}.self_attn.attn",
                      attn_backend=DcpStubBackend)
            for i in range(hf.num_hidden_layers))
        self.layer_names = [a.layer_name for a in self.attn]
        self.loaded = None                  # the program on this rank, from the first step
        self.program = None
        self.planned = None                 # the program load_weights planned the read with
        self.weights = None                 # this rank's shard boxes of vLLM's weight stream
        kinds = (StepKind.CONTEXT, StepKind.CHUNK, StepKind.DECODE)
        self.calls = {kind: 0 for kind in kinds}            # program calls so far
        self.most_calls = {kind: 0 for kind in kinds}       # the most in one vLLM step

    # -- the vLLM model interface ----------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise DCPInputError("DcpCompiledForCausalLM takes token ids, not embeddings: its "
                            "program embeds them itself. Pass prompts as text or token ids.")

    def load_weights(self, weights) -> set[str]:
        """Keep this rank's shard boxes of each tensor vLLM's loader streams (module doc).
        The model has no parameters of its own for vLLM to check off: none are named."""
        from vllm.distributed.parallel_state import get_tp_group

        from dcp_compile.meta_init import meta_model
        from dcp_compile.runtime.program.checkpoint import StreamedCheckpoint

        start = time.perf_counter()
        # A plain attribute, not a submodule: vLLM would count its (meta) parameters as
        # weights this model failed to load.
        object.__setattr__(self, "meta", meta_model(self.vllm_config.model_config.model))
        # The cache size is vLLM's only after loading: a provisional one (the weights, their
        # names and shards do not depend on it; _build checks that).
        self.planned = self._transform(num_blocks=2)
        self.weights = StreamedCheckpoint(
            weights, self.planned.checkpoint_boxes(get_tp_group().rank_in_group),
            name="vLLM's weight iterator")
        self.load_seconds = time.perf_counter() - start
        return set()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states                # forward returns the program's logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
        caches = self._caches()
        if metadata is None or caches is None:
            # vLLM's profiling and warm-up runs (no KV cache, or no requests): no tokens
            # are generated from them, and the program cannot run without a cache.
            return torch.zeros(input_ids.shape[0], self.vocab_size)
        if isinstance(metadata, list):
            raise DCPConfigError("micro-batched steps (vLLM's dual batch overlap) are not "
                                 "served by dcp_compile. Leave enable_dbo off.")
        common = metadata[self.layer_names[0]]
        if self.loaded is None:
            self._build(caches)
        return self._step(input_ids, positions, common, caches)

    # -- the program -----------------------------------------------------------------------

    def _caches(self) -> list[torch.Tensor] | None:
        """[k_0, v_0, k_1, v_1, ...] as views of vLLM's own KV tensors, or None before
        vLLM has allocated them."""
        from dcp_compile.vllm.attention import kv_views
        out = []
        for layer in self.attn:
            kv = layer.kv_cache
            kv = kv[0] if isinstance(kv, (list, tuple)) else kv
            if kv.numel() == 0:
                return None
            out.extend(kv_views(kv, self.head_dim))
        return out

    def _build(self, caches: list[torch.Tensor]) -> None:
        """Transform for vLLM's layout and cache size, bind vLLM's groups, read this rank's
        weight shards (module doc)."""
        from dcp_compile.runtime.serving.rank_engine import load_rank
        from dcp_compile.vllm.groups import vllm_group_names

        if self.weights is None:
            raise DCPConfigError(
                f"vLLM did not stream the checkpoint's weights to the model (load_format="
                f"{self.vllm_config.load_config.load_format!r}): dcp_compile serves the "
                f"checkpoint's own weights. Use load_format='auto' or 'safetensors'.")
        start = time.perf_counter()
        self.program = self._transform(num_blocks=int(caches[0].shape[0]),
                                       certificate=self.planned.certificate)
        if (self.program.weight_inputs, self.program.shards) != \
                (self.planned.weight_inputs, self.planned.shards):
            raise DCPCompilerBug("the vLLM plugin's first step", AssertionError(
                "the program for vLLM's cache has other weights or shards than the one "
                "load_weights read them for"))
        self.buckets = self.program.buckets
        spec = self.program.cache_spec()
        for i, cache in enumerate(caches):
            if tuple(cache.shape) != tuple(spec.shape) or cache.dtype != spec.dtype:
                raise DCPConfigError(
                    f"vLLM's KV cache {i} is {cache.dtype} {list(cache.shape)}, the program's "
                    f"is {spec.dtype} {list(spec.shape)}. Serve the checkpoint in its own "
                    f"dtype (dtype='auto') with kv_cache_dtype='auto'.")
        rank, names = vllm_group_names(self.program.topology)
        # vLLM's engine is the host side, so the rank is loaded without one of ours.
        self.loaded = load_rank(self.program, rank, names, checkpoint=self.weights)
        self.build_seconds = time.perf_counter() - start

    def _transform(self, num_blocks: int, certificate=None):
        """The meta model transformed for vLLM's layout and shapes (module doc)."""
        import dcp_compile
        from dcp_compile.runtime.serving.engine import StepShapes

        vblock = self.block_size * self.dcp
        o = self.options
        self.shapes = ProgramShapes(batch=o["batch"], context_len=o["context_len"],
                                    decode_len=o["decode_len"], chunk_len=o["chunk_len"],
                                    max_blocks=-(-self.max_model_len // vblock), vblock=vblock)
        return dcp_compile.transform(
            self.meta, tp=self.tp, dcp=self.dcp, mode=Mode.DECODE,
            block_size=self.block_size, interleave_size=self.interleave, check=False,
            garbage_block=FIRST, buckets=o["buckets"], certificate=certificate,
            shapes=StepShapes(batch=o["batch"], context_len=o["context_len"],
                              max_blocks=self.shapes.max_blocks, num_blocks=num_blocks,
                              decode_len=o["decode_len"], chunk_len=o["chunk_len"]))

    def _step(self, input_ids, positions, common, caches) -> torch.Tensor:
        n_req = common.num_reqs
        starts = common.query_start_loc_cpu[:n_req + 1].tolist()
        seq_lens = common.seq_lens[:n_req].tolist()
        table = table_rows(common.block_table_tensor[:n_req].cpu(), seq_lens, self.shapes)
        ids, pos = input_ids.cpu().to(torch.int64), positions.cpu().to(torch.int64)
        done = []
        calls = calls_of(ids, pos, starts, table, self.shapes)
        for kind in self.most_calls:
            self.most_calls[kind] = max(self.most_calls[kind],
                                        sum(c.kind == kind for c in calls))
        for call in calls:
            call = at_bucket(call, self.buckets, self.shapes)
            logits, out = self.loaded.run(call.kind, call.input_ids, call.positions,
                                          call.block_table, caches)
            # Zero copy: the program wrote vLLM's own tensors in place, never a copy.
            if any(o.data_ptr() != c.data_ptr() for o, c in zip(out, caches)):
                raise AssertionError("the program returned other KV tensors than vLLM's")
            self.calls[call.kind] += 1
            done.append((call, logits))
        return scatter_logits(done, input_ids.shape[0], self.vocab_size)
