"""Recurrent mixers of hybrid models, read at the module level: each layer's token-mixing
core becomes one ``dcp`` op with its state as an explicit cache (runtime/kernels/recurrent.py).

transformers' Gated DeltaNet (Qwen3-Next, Qwen3.5) keeps its state in a ``Cache`` object and
picks its kernel by the chunk's length (chunked rule for a prompt, recurrent rule for one
token); neither is a graph input, and the convolution over the sequence is token mixing that
the token-wise check refuses. As ``module_experts`` does for MoE blocks, the frontend swaps
the mixer's forward on the instance for one that runs the model's own projections, gates,
norm and output projection verbatim and calls ``dcp.gated_delta_net`` for the convolution and
the recurrence, reading and writing a ``RecurrentStates`` (the state caches and the step's
per-row state slots); the class is untouched and the swap undone after.

No guessing: a rule (``RULES``, one row per mixer class) names the class, and the source of
every function whose meaning the swap relies on is pinned by its hash (transformers 5.25). A
mixer of a listed class whose code differs is refused naming the function that changed.
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dcp_compile.frontends.module_experts import source_hash
# Each family's swapped forward and state shape (StateShape, RecurrentStates re-exported).
from dcp_compile.frontends.recurrent_mixers import (  # noqa: F401
    StateShape, RecurrentStates, _gdn_shape, _qwen3_next_head, _qwen3_5_head, _olmo_hybrid_head, _olmo_hybrid_beta,
    _gdn_forward,
    _kda_shape, _kimi_gate, _bailing_gate, _kda_forward, _lightning_shape, _lightning_forward,
    _mamba2_shape, _mamba2_forward, _falcon_h1_forward, _mamba_shape, _jamba_forward,
    _zamba_forward, _short_conv_shape, _short_conv_forward, _rglru_shape, _rglru_forward)
from dcp_compile.runtime.errors import DCPHybridError
from dcp_compile.runtime.kernels.recurrent import (  # (and registers the ops)
    CONV_ACTIVATIONS, NO_HEAD_CUT, gated_delta_net_cut, kimi_delta_attention_cut,
    lightning_attention_cut, mamba2_cut, mamba2_whole_bc, short_conv_cut)
from dcp_compile.runtime.kernels.rg_lru import rg_lru_cut
from dcp_compile.runtime.serving.state_cache import StateCacheSpec, StateLayer



@dataclass(frozen=True)
class RecurrentRule:
    """One mixer class: its module path and name, the functions whose source the swap relies
    on (name -> pinned hash), its state's shape and the swapped forward."""

    module: str
    cls: str
    pinned: dict[str, str]
    state: Callable[[nn.Module], StateShape]
    forward: Callable[[nn.Module, RecurrentStates], Callable]
    # (module, tp) -> None when the op runs cut by heads over tp, else why it runs replicated
    # (the rule passes/placement/recurrent.py's HEAD_CUTS applies to the op); None: no cut
    cut: Callable[[nn.Module, int], str | None] | None = None
    # (module, tp) -> the conv channels every rank holds whole under the cut (0: none)
    conv_whole: Callable[[nn.Module, int], int] | None = None


def _original(fn):
    """The function behind transformers' kernel-hub wrapper (``use_kernel_func_from_hub_with_
    fallback`` makes a module whose forward closes over the function as ``func``), or ``fn``."""
    if isinstance(fn, nn.Module):
        forward = type(fn).forward
        cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
        if "func" in cells:
            return cells["func"].cell_contents
    return fn


def _pinned_functions(module: str, names: tuple[str, ...]) -> dict[str, Callable]:
    """The functions a rule pins, by name in ``module`` ("Class.method" or a module-level
    function, unwrapped from transformers' kernel-hub wrapper)."""
    mod = sys.modules.get(module) or __import__(module, fromlist=["_"])

    def find(n):
        owner, _, attr = n.rpartition(".")
        return getattr(getattr(mod, owner), attr) if owner else _original(getattr(mod, n))
    return {n: find(n) for n in names}


_TF = "transformers.models"
# The functions the Gated DeltaNet swap relies on besides the class's own (identical source
# in qwen3_next and qwen3_5), and their hashes (transformers 5.25).
_GDN_FUNCTIONS = {"torch_recurrent_gated_delta_rule": "4bd6ffbdddc0",
                  "torch_chunk_gated_delta_rule": "a1bbf783aa65",
                  "causal_conv1d_forward": "80c94f801beb",
                  "causal_conv1d_fn": "f932149bdf42",
                  "causal_conv1d_update": "bac68342342b",
                  "l2norm": "4b6bd3dc1d2f",
                  "apply_mask_to_padding_states": "ac70fe1177ec"}
# The causal conv functions and the padding mask (identical source in every family here).
_CONV_FUNCTIONS = {"causal_conv1d_forward": "80c94f801beb",
                   "causal_conv1d_fn": "f932149bdf42",
                   "causal_conv1d_update": "bac68342342b",
                   "apply_mask_to_padding_states": "ac70fe1177ec"}
# The same for the Mamba2 mixers (identical source in bamba and granitemoehybrid).
_MAMBA2_FUNCTIONS = {"mamba2_chunk_scan": "8f4198702b90",
                     "mamba2_selective_state_update": "084055312cd5",
                     "causal_conv1d_forward": "80c94f801beb",
                     "causal_conv1d_fn": "f932149bdf42",
                     "causal_conv1d_update": "bac68342342b",
                     "apply_mask_to_padding_states": "ac70fe1177ec"}


def _gdn_cut(m: nn.Module, tp: int) -> str | None:
    return gated_delta_net_cut(m.num_k_heads, tp)


def _mamba2_cut(m: nn.Module, tp: int) -> str | None:
    return mamba2_cut(m.n_groups, m.num_heads, tp)


def _kda_cut(m: nn.Module, tp: int) -> str | None:
    return kimi_delta_attention_cut(m.num_heads, tp)


def _short_conv_cut(m: nn.Module, tp: int) -> str | None:
    return short_conv_cut(m.conv.in_channels, tp)


def _lightning_cut(m: nn.Module, tp: int) -> str | None:
    return lightning_attention_cut(m.num_attention_heads, tp)


def _mamba2_whole(m: nn.Module, tp: int) -> int:
    return 2 * m.n_groups * m.ssm_state_size if mamba2_whole_bc(m.n_groups, tp) else 0


def _rglru_cut(m: nn.Module, tp: int) -> str | None:
    return rg_lru_cut(m.rg_lru.num_attention_heads, tp)


RULES = (
    RecurrentRule(f"{_TF}.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet",
                  {"Qwen3NextGatedDeltaNet.forward": "d267e937a25e",
                   "Qwen3NextGatedDeltaNet.fix_query_key_value_ordering": "1b706d1f9a49",
                   "Qwen3NextRMSNormGated.forward": "5a4bd64da7fd",
                   **_GDN_FUNCTIONS},
                  _gdn_shape, lambda m, s: _gdn_forward(m, s, _qwen3_next_head), _gdn_cut),
    RecurrentRule(f"{_TF}.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet",
                  {"Qwen3_5GatedDeltaNet.forward": "a43ffe9ab7f4",
                   "Qwen3_5RMSNormGated.forward": "5a4bd64da7fd", **_GDN_FUNCTIONS},
                  _gdn_shape, lambda m, s: _gdn_forward(m, s, _qwen3_5_head), _gdn_cut),
    RecurrentRule(f"{_TF}.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet",
                  {"Qwen3_5MoeGatedDeltaNet.forward": "a43ffe9ab7f4",
                   "Qwen3_5MoeRMSNormGated.forward": "5a4bd64da7fd", **_GDN_FUNCTIONS},
                  _gdn_shape, lambda m, s: _gdn_forward(m, s, _qwen3_5_head), _gdn_cut),
    # OLMo-hybrid: Qwen3.5's Gated DeltaNet with separate q / k / v projections, its own
    # output gate (g_proj), beta doubled (allow_neg_eigval) and o_norm / o_proj
    RecurrentRule(f"{_TF}.olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet",
                  {"OlmoHybridGatedDeltaNet.forward": "8b7eda855f07",
                   "OlmoHybridRMSNormGated.forward": "5a4bd64da7fd", **_GDN_FUNCTIONS},
                  _gdn_shape,
                  lambda m, s: _gdn_forward(m, s, _olmo_hybrid_head, _olmo_hybrid_beta,
                                            norm="o_norm", out="o_proj"), _gdn_cut),
    # LaRA-mini: Qwen3.5's Gated DeltaNet forward (same source), its gated norm in fp32
    RecurrentRule(f"{_TF}.lara_mini.modeling_lara_mini", "LaraMiniGatedDeltaNet",
                  {"LaraMiniGatedDeltaNet.forward": "a43ffe9ab7f4",
                   "LaraMiniRMSNormGated.forward": "536ae00bbdc7", **_GDN_FUNCTIONS},
                  _gdn_shape, lambda m, s: _gdn_forward(m, s, _qwen3_5_head), _gdn_cut),
    # Qwen4-exp (text): Qwen3.5's Gated DeltaNet forward (same source); its gated norm's
    # activation is the config's output_gate_type (the model's own module runs it)
    RecurrentRule(f"{_TF}.qwen4_exp.modeling_qwen4_exp", "Qwen4ExpTextGatedDeltaNet",
                  {"Qwen4ExpTextGatedDeltaNet.forward": "a43ffe9ab7f4",
                   "Qwen4ExpTextRMSNormGated.forward": "5a4bd64da7fd", **_GDN_FUNCTIONS},
                  _gdn_shape, lambda m, s: _gdn_forward(m, s, _qwen3_5_head), _gdn_cut),
    RecurrentRule(f"{_TF}.bamba.modeling_bamba", "BambaMixer",
                  {"BambaMixer.forward": "6e1e9d6ce582", "mamba2_scan_forward": "a08b6a3202e2",
                   "BambaRMSNormGated.forward": "2ed3aa30edfb", **_MAMBA2_FUNCTIONS},
                  _mamba2_shape, _mamba2_forward, _mamba2_cut, _mamba2_whole),
    # Granite-4-H: Bamba's code (copied by transformers' modular; only a docstring differs)
    RecurrentRule(f"{_TF}.granitemoehybrid.modeling_granitemoehybrid",
                  "GraniteMoeHybridMambaLayer",
                  {"GraniteMoeHybridMambaLayer.forward": "6e1e9d6ce582",
                   "mamba2_scan_forward": "26a2b2ba22ea",
                   "GraniteMoeHybridRMSNormGated.forward": "2ed3aa30edfb", **_MAMBA2_FUNCTIONS},
                  _mamba2_shape, _mamba2_forward, _mamba2_cut, _mamba2_whole),
    # Nemotron-H, Zamba2: Bamba's mixer code (transformers' modular copies; only the scan's
    # docstring differs, its hash therefore does), the group-wise gated RMSNorm
    RecurrentRule(f"{_TF}.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer",
                  {"NemotronHMamba2Mixer.forward": "6e1e9d6ce582",
                   "mamba2_scan_forward": "171adefd1a44",
                   "NemotronHRMSNormGated.forward": "2ed3aa30edfb", **_MAMBA2_FUNCTIONS},
                  _mamba2_shape, _mamba2_forward, _mamba2_cut, _mamba2_whole),
    # Falcon-H1: a Mamba2 mixer beside attention in every layer, with mup multipliers
    RecurrentRule(f"{_TF}.falcon_h1.modeling_falcon_h1", "FalconH1Mixer",
                  {"FalconH1Mixer.forward": "3003699349bf",
                   "mamba2_scan_forward": "7b310fabf179",
                   "FalconH1RMSNormGated.forward": "6be41dfb6ca8", **_MAMBA2_FUNCTIONS},
                  _mamba2_shape, _falcon_h1_forward, _mamba2_cut, _mamba2_whole),
    RecurrentRule(f"{_TF}.zamba2.modeling_zamba2", "Zamba2MambaMixer",
                  {"Zamba2MambaMixer.forward": "6e1e9d6ce582",
                   "mamba2_scan_forward": "9cef438529d0",
                   "Zamba2RMSNormGated.forward": "2ed3aa30edfb", **_MAMBA2_FUNCTIONS},
                  _mamba2_shape, _mamba2_forward, _mamba2_cut, _mamba2_whole),
    # Jamba: Mamba-1 (dcp.short_conv, then dcp.mamba_ssm)
    RecurrentRule(f"{_TF}.jamba.modeling_jamba", "JambaMambaMixer",
                  {"JambaMambaMixer.forward": "ac728d5d7b51",
                   "mamba_scan_forward": "0d8232904026",
                   "mamba_selective_scan": "b43a3221205e",
                   "mamba_selective_state_update": "1c7cf7fce076",
                   **_CONV_FUNCTIONS, "apply_mask_to_padding_states": "7785177646b3"},
                  _mamba_shape, _jamba_forward),
    # Zamba: Mamba-1 with per-head x_proj / dt_proj (dcp.short_conv, then dcp.mamba_ssm)
    RecurrentRule(f"{_TF}.zamba.modeling_zamba", "ZambaMambaMixer",
                  {"ZambaMambaMixer.forward": "9c3eb8e340c4",
                   "mamba_selective_scan": "b43a3221205e",
                   "mamba_selective_state_update": "1c7cf7fce076", **_CONV_FUNCTIONS},
                  _mamba_shape, _zamba_forward),
    # Kimi Linear: KDA, Gated DeltaNet with a decay per key channel (its conv has no bias)
    RecurrentRule(f"{_TF}.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention",
                  {"KimiLinearDeltaAttention.forward": "d2b6ce659c7d",
                   "recurrent_kimi_delta_attention": "a7d81011bd15",
                   "chunk_kimi_delta_attention": "1a4cae129dee",
                   "l2norm": "c0e36905d6b9", **_CONV_FUNCTIONS},
                  _kda_shape, _kda_forward, _kda_cut),
    # Bailing-hybrid: the same KDA (its own forget gate module and a one-linear output gate)
    RecurrentRule(f"{_TF}.bailing_hybrid.modeling_bailing_hybrid",
                  "BailingHybridDeltaAttention",
                  {"BailingHybridDeltaAttention.forward": "4691bf7cc273",
                   "recurrent_kimi_delta_attention": "a7d81011bd15",
                   "chunk_kimi_delta_attention": "1a4cae129dee",
                   "l2norm": "c0e36905d6b9", **_CONV_FUNCTIONS},
                  _kda_shape, lambda m, s: _kda_forward(m, s, _bailing_gate), _kda_cut),
    # MiniMax: lightning attention (no convolution: a recurrence cache only)
    RecurrentRule(f"{_TF}.minimax.modeling_minimax", "MiniMaxLightningAttention",
                  {"MiniMaxLightningAttention.forward": "03c3f915c0c9",
                   "MiniMaxLightningAttention.get_slope_rate": "c7263d11caad",
                   "apply_mask_to_padding_states": "ac70fe1177ec"},
                  _lightning_shape, _lightning_forward, _lightning_cut),
    # RecurrentGemma: a causal Conv1d (dcp.short_conv), then the RG-LRU (dcp.rg_lru); the
    # block keeps no layer index (recurrent_layers records it from the module path)
    RecurrentRule(f"{_TF}.recurrent_gemma.modeling_recurrent_gemma",
                  "RecurrentGemmaRecurrentBlock",
                  {"RecurrentGemmaRecurrentBlock.forward": "cce3570274ab",
                   "RecurrentGemmaRglru.forward": "b4ad72fdf0d8",
                   "RecurrentGemmaRglru._rnn_scan": "edcf0cbffabc",
                   "SqrtBoundDerivative.forward": "085338b81f4e"},
                  _rglru_shape, _rglru_forward, _rglru_cut),
    RecurrentRule(f"{_TF}.lfm2.modeling_lfm2", "Lfm2ShortConv",
                  {"Lfm2ShortConv.forward": "ab35322f9346", **_CONV_FUNCTIONS},
                  _short_conv_shape, _short_conv_forward, _short_conv_cut),
    RecurrentRule(f"{_TF}.lfm2_moe.modeling_lfm2_moe", "Lfm2MoeShortConv",
                  {"Lfm2MoeShortConv.forward": "ab35322f9346", **_CONV_FUNCTIONS},
                  _short_conv_shape, _short_conv_forward, _short_conv_cut),
    # LFM3: LFM2's short conv (the same forward) beside gated, sliding and full attention
    RecurrentRule(f"{_TF}.lfm3.modeling_lfm3", "Lfm3ShortConv",
                  {"Lfm3ShortConv.forward": "ab35322f9346", **_CONV_FUNCTIONS},
                  _short_conv_shape, _short_conv_forward, _short_conv_cut),
)


# Config-level signs of a hybrid (no model built): the model types of RULES' classes (and the
# multimodal wrappers vLLM serves them under), and the per-layer kinds of recurrent layers.
HYBRID_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                                "qwen3_5_moe_text", "bamba", "granitemoehybrid", "lfm2",
                                "lfm2_moe", "jamba", "nemotron_h", "falcon_h1", "zamba2",
                                "olmo_hybrid",
                                "kimi_linear", "minimax", "recurrent_gemma",
                                "bailing_hybrid", "lfm3", "lara_mini", "qwen4_exp",
                                "qwen4_exp_text"})
RECURRENT_LAYER_KINDS = frozenset({"linear_attention", "mamba", "mamba2", "conv", "recurrent",
                                   "hybrid"})


def hybrid_config(hf_config) -> str | None:
    """What shows ``hf_config`` (a transformers config, or a namespace of its fields) to be a
    hybrid's, or None: its model type, or a recurrent kind in its ``layer_types``."""
    if hf_config is None:
        return None
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        kind = getattr(cfg, "model_type", None)
        if kind in HYBRID_MODEL_TYPES:
            return f"model_type={kind!r}"
        recurrent = sorted(set(getattr(cfg, "layer_types", None) or ()) & RECURRENT_LAYER_KINDS)
        if recurrent:
            return f"layer_types with {recurrent}"
    return None


# Hybrids whose attention layers are not "every layer without a recurrent mixer", by model
# type: the config's layer indices that attend (hf_config.attention_windows). Nemotron-H has
# MLP-only blocks besides its Mamba2 and attention blocks.
ATTENTION_LAYERS = {
    "nemotron_h": lambda c: [i for i, t in enumerate(c.layers_block_type)
                             if t in ("attention", "full_attention")],
    # every Falcon-H1 layer runs its Mamba2 mixer and its attention side by side
    "falcon_h1": lambda c: range(c.num_hidden_layers),
    # Zamba2: every layer has a Mamba2 mixer; its "hybrid" layers also call a shared
    # attention block (one site, and one KV cache, per calling layer)
    "zamba2": lambda c: c.hybrid_layer_ids,
    "zamba": lambda c: [i for i, t in enumerate(c.layers_block_type) if t == "hybrid"],
}


def attention_layer_ids(model: nn.Module) -> set[int] | None:
    """The decoder layers of ``model`` that attend, when ``ATTENTION_LAYERS`` names its model
    type; None otherwise (then: every layer without a recurrent mixer)."""
    config = getattr(model, "config", None)
    rule = ATTENTION_LAYERS.get(getattr(config, "model_type", None))
    return None if rule is None else set(rule(config))


def _rule_of(m: nn.Module) -> RecurrentRule | None:
    cls = type(m)
    return next((r for r in RULES if cls.__name__ == r.cls and cls.__module__ == r.module), None)


def _check_pins(rule: RecurrentRule, where: str) -> None:
    functions = _pinned_functions(rule.module, tuple(rule.pinned))
    for name, expected in rule.pinned.items():
        got = source_hash(functions[name])
        if got != expected:
            raise DCPHybridError(
                f"recurrent mixer {rule.cls} at {where}: the source of {name} is not the code "
                f"dcp.gated_delta_net was written against (sha256 {got}, pinned {expected}). "
                f"Use the transformers version of requirements/corpus.txt, or re-check the "
                f"swap against the new code and update RULES in "
                f"dcp_compile/frontends/module_recurrent.py.")


_LAYER_OF_PATH = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _with_layer_idx(name: str, m: nn.Module) -> nn.Module:
    """``m``, its decoder layer's index in ``m.layer_idx``: a mixer that keeps none
    (RecurrentGemma's block) gets the index of the ``layers.<i>`` its path runs through."""
    if getattr(m, "layer_idx", None) is None:
        found = _LAYER_OF_PATH.findall(name)
        if not found:
            raise DCPHybridError(
                f"recurrent mixer {type(m).__name__} at {name}: it keeps no layer_idx and its "
                f"path names no decoder layer (layers.<i>). Give the module a layer_idx.")
        m.layer_idx = int(found[-1])
    return m


def recurrent_layers(model: nn.Module) -> list[tuple[str, nn.Module, RecurrentRule]]:
    """Every recurrent mixer of ``model`` that a rule names: (module path, module, rule)."""
    return [(name, _with_layer_idx(name, m), rule) for name, m in model.named_modules()
            if (rule := _rule_of(m)) is not None]


def state_spec(model: nn.Module, num_slots: int, *, tp: int = 1,
               dtype=torch.float32) -> StateCacheSpec:
    """The state cache of ``model``'s recurrent layers for ``num_slots`` sequences, channels
    and heads cut ``tp`` ways (runtime/serving/state_cache.py); the recurrence in fp32."""
    layers = []
    for _, m, rule in recurrent_layers(model):
        shape = rule.state(m)
        whole = rule.conv_whole(m, tp) if tp > 1 and rule.conv_whole is not None else 0
        layers.append(StateLayer(m.layer_idx, shape.conv, shape.rec, whole))
    return StateCacheSpec(tuple(layers), num_slots, tp, conv_dtype=dtype)


def recurrent_layout(model: nn.Module, tp: int) -> dict[int, str]:
    """Each recurrent layer's layout over ``tp`` ranks: "head cut" (its op cut by heads, its
    state 1/tp per rank) or "replicated (<why>)" (docs/hybrid.md, "The layout")."""
    out = {}
    for _, m, rule in recurrent_layers(model):
        why = NO_HEAD_CUT if rule.cut is None else rule.cut(m, tp)
        out[m.layer_idx] = "head cut" if why is None else f"replicated ({why})"
    return out


def state_tp(model: nn.Module, tp: int) -> int:
    """How many ways the program's state caches are cut: ``tp`` when every recurrent layer
    runs cut by heads, 1 when none does; a model whose layers differ is refused by name."""
    layout = recurrent_layout(model, tp)
    cut = {la == "head cut" for la in layout.values()}
    if len(cut) > 1:
        raise DCPHybridError(
            f"recurrent layers of {type(model).__name__} differ in layout over tp={tp} "
            f"({layout}): one state cache spec cuts every layer alike. Pick a tp every "
            f"layer's heads divide, or tp=1.")
    return tp if cut == {True} else 1


def allocate_states(model: nn.Module, num_slots: int, *, dtype=torch.float32,
                    device=None) -> RecurrentStates:
    """Zeroed state caches for ``num_slots`` sequences (+ the garbage slot) per recurrent
    layer, one device (``state_spec`` at tp=1)."""
    states = RecurrentStates()
    for layer, (conv, rec) in state_spec(model, num_slots, dtype=dtype).allocate(device).items():
        if conv is not None:
            states.conv[layer] = conv
        if rec is not None:
            states.rec[layer] = rec
    return states


@contextlib.contextmanager
def recurrent_as_ops(model: nn.Module, states: RecurrentStates):
    """Within the block, each recurrent mixer of ``model`` runs as its ``dcp`` op over
    ``states`` (the swap is on the instances, undone on exit)."""
    swapped = []
    try:
        for name, m, rule in recurrent_layers(model):
            _check_pins(rule, name)
            act = getattr(m, "activation", "identity")
            if act not in CONV_ACTIVATIONS:
                raise DCPHybridError(
                    f"recurrent mixer {rule.cls} at {name}: its convolution's activation "
                    f"{act!r} is not one the recurrent ops apply ({sorted(CONV_ACTIVATIONS)}). "
                    f"Add it to CONV_ACTIVATIONS in runtime/kernels/recurrent.py.")
            m.forward = rule.forward(m, states)
            swapped.append(m)
        yield states
    finally:
        for m in swapped:
            del m.forward


# What a hybrid model cannot do yet, by name (docs/hybrid.md).
UNSUPPORTED = {
    "prefix_caching": "prefix caching needs the recurrent state checkpointed at vblock "
                      "boundaries; a cached prefix's KV alone cannot restore it (a decode "
                      "program built with StepShapes(state_checkpoints=N) keeps them)",
}


# Recurrent mixers known by name whose dcp op is not built yet, and what it would take
# (their refusal names them, not a list of every module that looks recurrent).
NOT_BUILT: dict[str, str] = {}
# Parts of 2026 models (transformers 5.25) that no dcp op computes, by class name; a model
# holding one is refused naming it (``refuse_not_built``, FRONTEND_RULES' first row) before
# any rule swaps its other mixers (Qwen4-exp's Gated DeltaNet has a rule, its attention not).
NOT_BUILT.update({
    "Qwen4ExpTextQSAIndexer":
        "its indexed_attention layers (every attention layer of Qwen4-exp) attend through "
        "QSA (Qwen4ExpTextQSAIndexer): the visible keys are mean-pooled in blocks of "
        "indexer_compress_ratio tokens, RMS-normed and roped at the block's first position, "
        "scored by relu(q . k) summed over the indexer heads, and the top "
        "indexer_budget / indexer_compress_ratio blocks plus the incomplete tail block are "
        "attended; it is not the per-token top-k of dcp's DSA support. An op for it needs the "
        "block pooling over the DCP shards (a block may straddle two ranks' vblocks), the "
        "block top-k over all prior blocks as on one device, and the tail kept whole",
    "Qwen4ExpTextPLELayer":
        "its PLE layers (ple_layer_ids) embed hashed n-grams of the last ngram_size token "
        "ids (reset at EOS) and add a dilated depthwise convolution (dilation ngram_size): "
        "decode needs a per-sequence state of the last ngram_size - 1 token ids and a "
        "dilated conv state, and dcp.short_conv has no dilation. An op for it needs both "
        "states in the state cache beside the layer's Gated DeltaNet state",
    "ZayaCCAProjection":
        "its attention projects q, k and v through Compressed Convolutional Attention "
        "(ZayaCCAProjection): q | k pass a depthwise causal Conv1d (cca_time0) and then a "
        "grouped causal Conv1d (cca_time1, one group per head: it mixes a head's channels), "
        "and half of each value head comes from the previous token (a one-token delayed "
        "projection). No dcp op computes it (dcp.short_conv is depthwise only); an op for it "
        "needs the two stacked convolutions with a conv state of cca_time0 + cca_time1 - 2 "
        "tokens over the q | k channels and a one-token value state per sequence slot, "
        "inside the attention layer (its KV cache then holds the convolved keys)",
    "InklingShortConvolution":
        "every Inkling layer runs four depthwise short convolutions (k and v before "
        "attention, the attention and MLP outputs after, each with a residual, in fp32) and "
        "adds to its attention scores a position bias computed from the hidden states "
        "(InklingRelativeLogits: r_proj mixes a bank of bias-vs-distance profiles per "
        "query). dcp.short_conv computes each convolution, but the state cache keeps one "
        "conv state per layer and no dcp attention takes a per-query bias over distances; "
        "an op for it needs four conv states per layer and the relative bias gathered by "
        "distance on each DCP shard (exact under the LSE combine)",
})


_MIXER_NAMES = re.compile(r"mamba|mixer|linear_?attn|linearattention|deltanet|recurrent|"
                          r"lightning|conv", re.IGNORECASE)


def unruled_mixers(model: nn.Module) -> list[str]:
    """The class names of ``model``'s modules that look like recurrent mixers (by name) when
    its config shows a hybrid (``hybrid_config``) and no rule of ``RULES`` names any of its
    modules; [] otherwise (a hybrid type built with attention layers only has none)."""
    if hybrid_config(getattr(model, "config", None)) is None or recurrent_layers(model):
        return []
    return sorted({type(m).__name__ for _, m in model.named_modules()
                   if _MIXER_NAMES.search(type(m).__name__)})


def not_built_parts(model: nn.Module) -> list[tuple[str, str]]:
    """``model``'s modules whose class ``NOT_BUILT`` names: (module path, class), the first
    of each class."""
    seen: dict[str, str] = {}
    for name, m in model.named_modules():
        seen.setdefault(type(m).__name__, name)
    return [(path, cls) for cls, path in seen.items() if cls in NOT_BUILT]


def refuse_not_built(model: nn.Module) -> None:
    """``DCPHybridError`` naming each part of ``model`` no dcp op computes (``NOT_BUILT``)
    and what an op for it needs; nothing for a model without one."""
    parts = not_built_parts(model)
    if parts:
        what = "; ".join(f"{cls} at {path or '<root>'}: {NOT_BUILT[cls]}" for path, cls in parts)
        raise DCPHybridError(f"{type(model).__name__}: {what}. Serve this model without DCP.")


def refuse_unruled_hybrid(model: nn.Module) -> None:
    """``DCPHybridError`` for a Hugging Face hybrid (``unruled_mixers``) none of whose mixers a
    rule of ``RULES`` names (RecurrentGemma, OLMo-hybrid, ...)."""
    mixers = unruled_mixers(model)
    if not mixers:
        return
    sign = hybrid_config(model.config)
    known = sorted({type(m).__name__ for _, m in model.named_modules()} & set(NOT_BUILT))
    if known:
        raise DCPHybridError(
            f"hybrid model {type(model).__name__} ({sign}): {NOT_BUILT[known[0]]}. Serve this "
            f"model without DCP.")
    raise DCPHybridError(
        f"hybrid model {type(model).__name__} ({sign}): no swap rule runs its recurrent "
        f"layers as a dcp op (modules {mixers[:4]}); the "
        f"rules (RULES in dcp_compile/frontends/module_recurrent.py) name "
        f"{sorted({r.cls for r in RULES})}. Serve this model without DCP, or add a rule "
        f"for its mixer (docs/hybrid.md).")


def refuse_hybrid(model: nn.Module, *, prefix_caching: bool = False) -> None:
    """Raise ``DCPHybridError`` naming what a hybrid ``model`` asks for that is not done
    (prefix caching); nothing for a model without recurrent mixers or for a request a hybrid
    program serves (frontends/hybrid.py; speculative width-K decode is served: its decode
    step keeps a state snapshot per draft position)."""
    layers = recurrent_layers(model)
    if not layers or not prefix_caching:
        return
    name, m, rule = layers[0]
    raise DCPHybridError(
        f"hybrid model: {len(layers)} recurrent layer(s) ({rule.cls}, first at {name}); "
        f"{UNSUPPORTED['prefix_caching']} (prefix_caching=True). Turn prefix caching off.")


def refuse_hybrid_prepare(hf_model: nn.Module) -> None:
    """``DCPHybridError`` for a hybrid (recurrent mixers beside attention, docs/hybrid.md):
    ``prepare``'s wrapper has no recurrent state to give its mixers (by design: its step is
    the paged attention's, KV caches only, and its attention function replaces attention
    calls only), so each step's mixers would start from nothing. A hybrid with swap rules is
    served by ``transform`` on the model itself; one without is refused as ``transform``
    refuses it (``refuse_unruled_hybrid``; a part no op computes: ``refuse_not_built``)."""
    refuse_not_built(hf_model)
    refuse_unruled_hybrid(hf_model)
    layers = recurrent_layers(hf_model)
    if not layers:
        return
    name = type(hf_model).__name__
    classes = sorted({rule.cls for _, _, rule in layers})
    sign = hybrid_config(hf_model.config) or "recurrent mixers"
    raise DCPHybridError(
        f"{name} is a hybrid model ({sign}: {len(layers)} recurrent layer(s), {classes}, "
        f"first at {layers[0][0]}): hf.prepare carries no recurrent state, by design. Its "
        f"wrapper's step is the paged attention's (input_ids, positions, block_table, "
        f"kv_caches -> logits, kv_caches) and its attention function replaces the attention "
        f"calls only: a recurrent mixer would run its own scan over each step's tokens with "
        f"no state from the steps before (transformers keeps it in the Cache object, which "
        f"the wrapper does not pass). Pass the model itself to dcp_compile.transform "
        f"(attn_implementation='sdpa' or 'eager'): that path runs each mixer as its dcp op "
        f"with its state in per-sequence state caches beside the KV cache (docs/hybrid.md).")
