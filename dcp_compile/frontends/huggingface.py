"""Hugging Face transformers frontend: run a transformers decoder with DCP paged attention.

transformers (5.x) routes every attention call of a model that "supports the attention
backend" through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``, called as
``fn(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)`` with
query/key/value in ``[batch, heads, seq, head_dim]`` and the extra ``**kwargs`` of the
model's forward passed through every decoder layer. We register ``"dcp_paged"`` there; it
calls ``torch.ops.dcp.paged_attention`` with the layer's caches, which travel in one such
keyword argument (``dcp_paged_step``), and hands the new caches back through the same object.
No attention-mask function is registered for ``"dcp_paged"``, so transformers builds no
mask (positions carry causality and padding).

``prepare(hf_model)`` wraps a ``*ForCausalLM`` in a module with the demo model's step
signature, which ``dcp_compile.transform`` captures::

    forward(input_ids [B, S], positions [B, S], block_table [B, M], kv_caches)
        -> (logits [B, S, vocab], new_kv_caches)

The wrapper runs the model's own forward (embedding, rotary embedding, decoder layers, final
norm, LM head). It switches the model's attention to ``"dcp_paged"`` only for the duration
of its own call, so the Hugging Face model keeps its own attention everywhere else.

What the paged op needs from the model is checked when ``prepare`` runs (a trace on fake
tensors): no attention mask, softcap, attention parameters outside the projections or
sliding window the paged op cannot honour, and one attention call per layer. How the
projections are laid out (separate or fused q/k/v, gates, norms over all heads) is the
placement analysis' business at transform time (dcp_compile.passes.placement), which refuses by op and
source line what it cannot shard.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dcp_compile.runtime.kernels import ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime.errors import (DCPKVLayoutError, DCPSparseAttentionError,
                                        DCPTransformError)
from .module_compressed_attention import refuse_compressed_attention
from .hf_config import config_field as _field, kv_layouts
from .hf_config import (_text_config, attention_windows, check_hf_config,  # noqa: F401
                        declared_chunks, declared_windows, is_hf)
from .hf_experts import (_ACTIVATIONS, _GATES, EXPERTS_IMPLEMENTATION,  # noqa: F401
                         _default_gate, _gpt_oss_gate, dcp_experts_forward, experts_form)
from .module_experts import module_experts_enabled, stacked_experts
from .module_recurrent import refuse_hybrid_prepare

ATTN_IMPLEMENTATION = "dcp_paged"
STEP_KWARG = "dcp_paged_step"

# Attention keyword arguments that change the attention's result; the paged op computes plain
# causal softmax attention, so any of these set means "not supported", never "ignored".
_UNSUPPORTED_KWARGS = ("softcap", "sinks", "position_bias", "attention_chunk_size",
                       "cu_seq_lens_q", "cu_seq_lens_k")


@dataclass
class PagedStep:
    """One step's paged-attention state, passed to every layer through the model's kwargs.

    ``kv_caches`` are the step's inputs (flat [k0, v0, k1, v1, ...]); each attention call
    puts its layer's new caches in ``new_caches``. This is plain Python state around the
    traced tensors: under torch.export the caches stay graph inputs and the new caches
    become graph outputs because ``DCPCausalLM.forward`` returns them.
    """

    positions: Tensor
    block_table: Tensor
    kv_caches: list[Tensor]
    num_layers: int
    max_model_len: int | None
    module_names: dict[int, str]
    # Per-layer windows the config declares (declared_windows): what the
    # model's own mask applies when its attention function is not told (Qwen2-MoE, PhiMoE).
    windows: list[int] | None = None
    # Per-layer attention chunks the config declares (declared_chunks, Llama 4): applied by
    # the model's mask only, so the paged op is told (attention_chunk).
    chunks: list[int] | None = None
    new_caches: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    attention_modules: dict[int, nn.Module] = field(default_factory=dict)

    def collect(self, model_name: str) -> list[Tensor]:
        missing = [i for i in range(self.num_layers) if i not in self.new_caches]
        if missing:
            raise DCPTransformError(
                f"{model_name}: layers {missing} of {self.num_layers} did not call attention "
                f"through transformers' AttentionInterface, so their KV caches would not be "
                f"written. Only decoders whose every layer's attention goes through "
                f"ALL_ATTENTION_FUNCTIONS are supported (no hybrid linear-attention layers).")
        out = []
        for i in range(self.num_layers):
            out += list(self.new_caches[i])
        return out


def _name(step: PagedStep, module: nn.Module) -> str:
    return step.module_names.get(id(module), type(module).__name__)


def _window_of(step: PagedStep, module, layer: int, kwargs) -> tuple[int | None, str]:
    """The layer's sliding window and who says so: the attention call, else the attention
    module, else the config (models that apply the window only through their mask)."""
    told = kwargs.get("sliding_window")
    if told is not None:
        return told, "sliding_window"
    attr = getattr(module, "sliding_window", None)
    if isinstance(attr, int) and attr > 0:
        return attr, "its attention module's sliding_window (not passed to the attention call)"
    declared = step.windows[layer] if step.windows and layer < len(step.windows) else 0
    if declared:
        return declared, ("the config's sliding_window / layer_types (applied only through "
                          "the model's mask, which DCP paged attention does not build)")
    return None, ""


def _check_kwargs(step: PagedStep, module, attention_mask, dropout, kwargs) -> None:
    name = _name(step, module)
    if attention_mask is not None:
        raise DCPTransformError(
            f"{name} received an attention mask of shape {tuple(attention_mask.shape)}: the "
            f"model builds its own mask, which DCP paged attention cannot apply (it masks by "
            f"positions only). Models whose masks go through transformers' "
            f"create_causal_mask are supported.")
    if dropout:
        raise DCPTransformError(
            f"{name} runs attention with dropout={dropout}: the model is in training mode. "
            f"Call model.eval() before dcp_compile.hf.prepare.")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise DCPTransformError(
            f"{name} is not causal (is_causal=False): DCP paged attention is causal decoder "
            f"attention only. Use a causal decoder.")
    for key in _UNSUPPORTED_KWARGS:
        if kwargs.get(key) is not None:
            raise DCPTransformError(
                f"{name} passes {key}={_describe(kwargs[key])} to its attention function: DCP "
                f"paged attention does not implement it and would compute a different "
                f"attention. Use a model without {key}.")
    _check_temperature(step, module)
    window, source = _window_of(step, module, module.layer_idx, kwargs)
    if window is not None and (step.max_model_len is None or step.max_model_len > window):
        raise DCPTransformError(
            f"{name} uses sliding-window attention (from {source}): sliding_window={window}, "
            f"max_model_len="
            f"{step.max_model_len}. DCP paged attention attends to the whole causal context, "
            f"which equals the window only while sequences are no longer than it. Pass "
            f"max_model_len <= {window} to dcp_compile.hf.prepare (and serve no longer "
            f"sequences), or set config.sliding_window=None.")


def _check_temperature(step: PagedStep, module) -> None:
    """Llama 4's NoPE layers scale the query by log1p(floor((p + 1) / floor_scale)) * a + 1
    with p from arange(S) plus the cache's length, not from position_ids: under the paged
    cache (no transformers cache) every step numbers its tokens from 0, so the scale equals
    the model's only while every position p < floor_scale - 1 (the scale is then 1)."""
    if not getattr(module, "attn_temperature_tuning", False) or \
            getattr(module, "use_rope", True):
        return
    floor = int(module.floor_scale)
    if step.max_model_len is None or step.max_model_len > floor - 1:
        raise DCPTransformError(
            f"{_name(step, module)} is a NoPE layer with attention temperature tuning "
            f"(attn_temperature_tuning, floor_scale={floor}): it scales queries by a function "
            f"of arange(S) and the cache's length, not of position_ids, which a paged step "
            f"does not reproduce past position {floor - 2}; max_model_len="
            f"{step.max_model_len}. Pass max_model_len <= {floor - 1} to "
            f"dcp_compile.hf.prepare, or set config.attn_temperature_tuning=False.")


def _describe(value) -> str:
    return f"tensor{tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)


def _sinks_of(step: PagedStep, module: nn.Module, q_heads: int, kwargs) -> Tensor | None:
    """gpt-oss's attention sinks: ``s_aux``, one learned logit per q head, which dcp.paged_attention
    takes as ``sinks`` (it joins the softmax denominator once, after the DCP combine)."""
    s_aux = kwargs.get("s_aux")
    if s_aux is None:
        return None
    if not isinstance(s_aux, Tensor) or tuple(s_aux.shape) != (q_heads,):
        raise DCPTransformError(
            f"{_name(step, module)} passes s_aux={_describe(s_aux)} to its attention "
            f"function: DCP attention sinks are one logit per q head, shape ({q_heads},). "
            f"Use a model whose s_aux is a [num_attention_heads] parameter (gpt-oss).")
    return s_aux


def _check_structure(step: PagedStep, module: nn.Module, sinks: Tensor | None) -> None:
    """Attention parameters outside any projection are refused by name.

    Fused projections ([q; k; v], [h, 3, d], [3, h, d], [q; gate]) and norms over all heads
    (OLMo2's q_norm/k_norm) are not refused here: the placement analysis
    (dcp_compile.passes.placement) cuts them segment by segment and all-reduces the norm's statistic,
    and refuses, naming the op, whatever it cannot place.
    """
    name = _name(step, module)
    for pname, p in module.named_parameters(recurse=False):
        if p is sinks:   # passed as s_aux: dcp.paged_attention's sinks, cut like q's heads
            continue
        raise DCPTransformError(
            f"parameter {name}.{pname} of shape {tuple(p.shape)} is used by attention outside "
            f"any projection (attention sinks or per-head scales): DCP does not shard it. "
            f"Use a model without it.")


def paged_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs):
    """transformers attention function ``"dcp_paged"`` -> ``torch.ops.dcp.paged_attention``.

    query/key/value arrive as [B, H, S, D] (RoPE applied); the op takes [B, S, H, D] and
    returns the layer's new caches, which go back through ``kwargs[STEP_KWARG]``.
    """
    step = kwargs.get(STEP_KWARG)
    if step is None and getattr(_wrapper_running, "active", False):
        raise DCPTransformError(
            f"{type(module).__name__} was called without the keyword arguments of the model's "
            f"forward: its decoder layer does not pass **kwargs on to attention, so "
            f"dcp_compile.hf.prepare cannot hand it the paged KV cache. Pass the model itself "
            f"to dcp_compile.transform (attn_implementation='sdpa' or 'eager'): that path "
            f"inserts the KV cache from the captured graph.")
    if step is None:
        raise DCPTransformError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} called without its paged KV "
            f"cache ({type(module).__name__}): it serves only models wrapped by "
            f"dcp_compile.hf.prepare. Run the wrapper, or set the model's own attention back "
            f"with model.set_attn_implementation('sdpa').")
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int) or not 0 <= layer < step.num_layers:
        raise DCPTransformError(
            f"{_name(step, module)} has layer_idx={layer!r}, expected an int in "
            f"[0, {step.num_layers}): the layer's KV cache cannot be found. Only decoders "
            f"whose attention modules carry their layer index are supported.")
    if layer in step.new_caches:
        raise DCPTransformError(
            f"layer {layer} called attention twice in one step ({_name(step, module)} and "
            f"{_name(step, step.attention_modules[layer])}): each layer must own one KV "
            f"cache. Models that share attention across calls are not supported.")
    _check_kwargs(step, module, attention_mask, dropout, kwargs)
    sinks = _sinks_of(step, module, query.shape[1], kwargs)
    _check_structure(step, module, sinks)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    options = {} if sinks is None else {"sinks": sinks}
    chunk = step.chunks[layer] if step.chunks and layer < len(step.chunks) else 0
    if chunk:
        options["attention_chunk"] = chunk
    out, key_cache, value_cache = torch.ops.dcp.paged_attention(
        q, k, v, step.kv_caches[2 * layer], step.kv_caches[2 * layer + 1], step.positions,
        step.block_table, float(scaling), **options)
    step.new_caches[layer] = (key_cache, value_cache)
    step.attention_modules[layer] = module
    # transformers expects [B, S, H, D] back (what sdpa_attention_forward returns).
    return out, None


def _register() -> None:
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError("dcp_compile.hf needs transformers 5.x: pip install "
                          "'dcp_compile[hf]' (or transformers>=5,<6).") from e
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


_register()


# The attention switch edits the model's shared config: wrapper calls are serialised.
_switch_lock = threading.RLock()
# Set while a DCPCausalLM runs its model: an attention call without the step keyword then
# means a layer dropped the model's **kwargs (not a call from outside the wrapper).
_wrapper_running = threading.local()


def _attention_configs(hf_model: nn.Module) -> list:
    """Every distinct config object the model's modules read ``_attn_implementation`` (or
    ``_experts_implementation``) from."""
    configs = {}
    for m in hf_model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            configs[id(cfg)] = cfg
    return list(configs.values())


# config attribute -> the implementation the wrapper routes it to while it runs.
ATTENTION_SWITCH = {"_attn_implementation_internal": ATTN_IMPLEMENTATION}
EXPERTS_SWITCH = {"_experts_implementation_internal": EXPERTS_IMPLEMENTATION}


@contextlib.contextmanager
def _switched(configs: list, switches: dict):
    """Set each config attribute of ``switches`` the configs have for the duration of the
    block, then restore."""
    # Dynamo cannot trace a lock; under torch.compile the switch happens at trace time only.
    lock = contextlib.nullcontext() if torch.compiler.is_compiling() else _switch_lock
    with lock:
        saved = [(c, attr, getattr(c, attr)) for c in configs for attr in switches
                 if hasattr(c, attr)]
        try:
            for c, attr, _ in saved:
                setattr(c, attr, switches[attr])
            yield
        finally:
            for c, attr, old in saved:
                setattr(c, attr, old)


def _paged_attention_enabled(configs: list):
    """Route attention to ``"dcp_paged"`` and experts to ``"dcp"`` (dcp.moe)."""
    return _switched(configs, {**ATTENTION_SWITCH, **EXPERTS_SWITCH})


def dcp_experts_enabled(hf_model: nn.Module):
    """Route a transformers model's experts to ``"dcp"`` (dcp.moe) for the duration of the
    block (the ordinary frontend captures HF MoE models so; their attention stays theirs)."""
    return _switched(_attention_configs(hf_model), EXPERTS_SWITCH)


class DCPCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` with the demo model's step signature (see module doc)."""

    def __init__(self, hf_model: nn.Module, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, max_model_len: int | None):
        super().__init__()
        self.hf_model = hf_model
        self._num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_model_len = max_model_len
        self._module_names = {id(m): n for n, m in hf_model.named_modules()}
        self._configs = _attention_configs(hf_model)
        self._windows = declared_windows(hf_model)
        self._chunks = declared_chunks(hf_model)
        # MoE blocks outside transformers' experts interface (Llama-4) as dcp.moe.
        self.library_experts = stacked_experts(hf_model)

    @property
    def config(self):
        return self.hf_model.config

    @property
    def checkpoint_module(self) -> nn.Module:
        """The model whose parameter names a checkpoint uses (the frontends read it)."""
        return self.hf_model

    # canonical_ops' forms a paged capture still needs: GPT-2's Conv1D, OPT's flattened MLP
    canonical_forms = ("conv1d_as_linear", "token_flatten_dropped")

    # Facts transform() reads.
    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def rope_type(self) -> str | None:
        """The config's RoPE variant ('default', 'longrope', 'dynamic', ...), for refusals."""
        cfg = _text_config(self.hf_model.config)
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
        if isinstance(params, dict) and isinstance(params.get("rope_type"), str):
            return params["rope_type"]
        return None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(self, input_ids: Tensor, positions: Tensor, block_table: Tensor,
                kv_caches: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        step = PagedStep(positions=positions, block_table=block_table,
                         kv_caches=list(kv_caches), num_layers=self._num_layers,
                         max_model_len=self.max_model_len, module_names=self._module_names,
                         windows=self._windows, chunks=self._chunks)
        with _paged_attention_enabled(self._configs), \
                module_experts_enabled(self.hf_model, self.library_experts):
            _wrapper_running.active = True
            try:
                # Padding rows (position -1) get RoPE of position 0; the op zeroes their output.
                out = self.hf_model(input_ids=input_ids, position_ids=positions.clamp(min=0),
                                    use_cache=False, return_dict=True, **{STEP_KWARG: step})
            finally:
                _wrapper_running.active = False
        return out.logits, step.collect(type(self.hf_model).__name__)


# Config fields only a Multi-head Latent Attention model has (DeepSeek-V2/V3, MiniCPM3, ...).
MLA_FIELDS = ("kv_lora_rank",)
DSA_FIELDS = ("index_topk",)    # DeepSeek Sparse Attention's indexer (V3.2, GLM-5)


def _set_fields(cfg, names) -> str:
    """``name=value, ...`` of the config fields among ``names`` that are set (for a message)."""
    return ", ".join(f"{k}={_field(cfg, k)}" for k in names if _field(cfg, k) is not None)


def prepare(hf_model: nn.Module, *, max_model_len: int | None = None) -> DCPCausalLM:
    """Wrap a transformers causal LM for ``dcp_compile.transform``.

    ``max_model_len`` bounds the sequence length the program will serve; it is needed only
    for sliding-window models, which are exact while sequences fit in the window. The model
    must be in eval mode (its weights stay shared, no copy). Raises DCPTransformError naming
    the module for what DCP would shard wrong (module doc), DCPHybridError for a hybrid."""
    from transformers import PreTrainedModel

    name = type(hf_model).__name__
    if not isinstance(hf_model, PreTrainedModel):
        raise DCPTransformError(f"{name} is not a transformers PreTrainedModel. Pass a "
                                f"*ForCausalLM model (e.g. LlamaForCausalLM).")
    refuse_hybrid_prepare(hf_model)
    if not getattr(hf_model, "_supports_attention_backend", False):
        raise DCPTransformError(
            f"{name} does not route its attention through transformers' AttentionInterface "
            f"(_supports_attention_backend is False), so its attention cannot be replaced by "
            f"DCP paged attention. Pass the model itself to dcp_compile.transform "
            f"(attn_implementation='eager' or 'sdpa'): that path reads its attention from the "
            f"captured graph.")
    if hf_model.training:
        raise DCPTransformError(f"{name} is in training mode: attention dropout would be "
                                f"active. Call model.eval() first.")
    refuse_compressed_attention(hf_model)      # DeepSeek-V4's indexer is not DSA's alone
    cfg = _text_config(hf_model.config)
    sparse = _set_fields(cfg, DSA_FIELDS)
    if sparse:
        raise DCPSparseAttentionError(
            f"DeepSeek Sparse Attention: the indexer's top-k over a sharded context. {name} "
            f"keeps per query the {sparse} prior tokens its indexer scores best; under DCP a "
            f"rank holds only its shard of the keys, so its own top-k would select a different "
            f"set. hf.prepare's paged op caches neither the MLA latent nor the indexer's K and "
            f"emits no selection. Pass the model itself to dcp_compile.transform "
            f"(attn_implementation='eager' or 'sdpa'): that path caches the indexer's K beside "
            f"the latent and emits the exact DCP selection (docs/moe-mla.md, DSA).")
    latent = _set_fields(cfg, MLA_FIELDS)
    if latent:
        raise DCPTransformError(
            f"{name} is a Multi-head Latent Attention model ({latent}): "
            f"hf.prepare's paged op caches full K and V per head, not MLA's latent cache. "
            f"Pass the model itself to dcp_compile.transform (attn_implementation='eager' or "
            f"'sdpa'): that path absorbs MLA into latent attention (docs/moe-mla.md: Multi-head "
            f"Latent Attention).")
    layouts = kv_layouts(cfg)
    if layouts:
        raise DCPKVLayoutError(
            f"{name} has per-layer KV layouts or KV shared across layers ({layouts}): "
            f"hf.prepare's wrapper keeps one cache layout per model and one cache per layer. "
            f"Pass the model itself to dcp_compile.transform (attn_implementation='eager' or "
            f"'sdpa'): that path gives each layout its cache group and a layer that reads "
            f"another layer's K/V that layer's cache (docs/models.md: Per-layer KV layouts).")
    num_layers = _field(cfg, "num_hidden_layers")
    num_q_heads = _field(cfg, "num_attention_heads")
    num_kv_heads = _field(cfg, "num_key_value_heads") or num_q_heads
    hidden = _field(cfg, "hidden_size")
    head_dim = _field(cfg, "head_dim") or (hidden // num_q_heads
                                           if isinstance(hidden, int) and num_q_heads else None)
    if not all(isinstance(x, int) for x in (num_layers, num_q_heads, num_kv_heads, head_dim)):
        raise DCPTransformError(
            f"{name}'s config does not describe its attention (num_hidden_layers="
            f"{num_layers}, num_attention_heads={num_q_heads}, num_key_value_heads="
            f"{num_kv_heads}, head_dim={head_dim}). Use a decoder config with those fields.")
    wrapper = DCPCausalLM(hf_model, num_layers=num_layers, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, max_model_len=max_model_len)
    _trace_check(wrapper)
    return wrapper


def _trace_check(wrapper: DCPCausalLM) -> None:
    """Run one step on fake tensors: every check in the attention function fires here, at
    prepare time, with no compute and no allocation (meta-device models work too)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..capture import keeps_tensor_attributes

    params = list(wrapper.parameters())
    device = params[0].device if params else torch.device("cpu")
    dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    name = type(wrapper.hf_model).__name__
    try:
        with keeps_tensor_attributes(wrapper), FakeTensorMode(allow_non_fake_inputs=True), \
                torch.no_grad():
            ids = torch.zeros(1, 2, dtype=torch.int64, device=device)
            positions = torch.arange(2, device=device).unsqueeze(0)
            table = torch.zeros(1, 1, dtype=torch.int64, device=device)
            caches = [torch.zeros(wrapper.kv_cache_shape(2, 2), dtype=dtype, device=device)
                      for _ in range(2 * wrapper.num_layers)]
            logits, new = wrapper(ids, positions, table, caches)
    except DCPTransformError:
        raise
    except Exception as e:
        raise DCPTransformError(
            f"{name} could not run one step on fake tensors: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}. The step must have static shapes "
            f"and no data-dependent Python control flow (e.g. rope_type='dynamic' recomputes "
            f"RoPE frequencies from the largest position at run time).") from e
    if len(new) != 2 * wrapper.num_layers or logits.dim() != 3:
        raise DCPTransformError(
            f"{name} did not produce logits [B, S, vocab] and "
            f"{wrapper.num_layers} layers' caches (got logits of shape {tuple(logits.shape)} "
            f"and {len(new)} caches). Pass a *ForCausalLM model.")


__all__ = ["ATTENTION_SWITCH", "ATTN_IMPLEMENTATION", "DCPCausalLM", "EXPERTS_IMPLEMENTATION",
           "EXPERTS_SWITCH", "PagedStep", "STEP_KWARG", "attention_windows", "check_hf_config",
           "dcp_experts_enabled", "dcp_experts_forward", "declared_chunks", "declared_windows",
           "experts_form", "is_hf", "paged_attention_forward", "prepare"]

