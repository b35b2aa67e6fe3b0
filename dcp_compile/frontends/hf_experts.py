"""transformers' experts interface, routed to ``dcp.moe``: the experts implementation
``"dcp"`` (registered here), and how an experts class's flags and gate become dcp.moe's data
(``experts_form``, the gate table ``_GATES``). The HF frontend (huggingface.py) switches a
model's experts to it while it captures; docs/moe-mla.md, Mixture of experts."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dcp_compile.runtime.kernels import ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime.errors import DCPTransformError

from .module_experts import expert_activation, hf_expert_activations, more_expert_gates

EXPERTS_IMPLEMENTATION = "dcp"


def dcp_experts_forward(experts: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                        top_k_weights: Tensor) -> Tensor:
    """transformers experts implementation ``"dcp"`` -> ``torch.ops.dcp.moe``.

    Every experts class decorated with transformers' ``use_experts_implementation`` hands its
    forward here (eager loop, ``grouped_mm`` and ``batched_mm`` compute the same function on
    the same ``gate_up_proj`` / ``down_proj`` (+ biases)); the router before it stays the
    model's own. How the class computes (layout flags, gate, activation) becomes dcp.moe's
    data arguments (``experts_form``); what dcp.moe does not compute is refused by class."""
    form = experts_form(experts)
    if hidden_states.dim() != 2 or top_k_index.shape != top_k_weights.shape:
        raise DCPTransformError(
            f"{type(experts).__name__} got hidden states {tuple(hidden_states.shape)} and "
            f"routing {tuple(top_k_index.shape)} / {tuple(top_k_weights.shape)}: dcp.moe "
            f"takes [tokens, hidden] and [tokens, top_k]. Flatten the tokens before the "
            f"experts, as transformers' MoE blocks do.")
    rank0 = torch.zeros((), dtype=torch.int64, device=hidden_states.device)
    first = _first_projection(experts)
    biases = {"gate_up_bias": getattr(experts, f"{first}_bias"),
              "down_bias": experts.down_proj_bias} if experts.has_bias else {}
    return torch.ops.dcp.moe(hidden_states, top_k_index.long(), top_k_weights,
                             getattr(experts, first), experts.down_proj, rank0, **biases,
                             **form)


def _first_projection(experts: nn.Module) -> str:
    """The experts' first stacked weight: ``gate_up_proj`` (gated), ``up_proj`` (transformers'
    ``has_gate=False``: Nemotron-H's ungated experts)."""
    return "gate_up_proj" if getattr(experts, "has_gate", True) else "up_proj"


# transformers' experts flags dcp.moe cannot honour -> what it needs instead.
_UNSUPPORTED_FLAGS = {"has_post_expert_norm": False, "_is_expert_parallel": False}


def experts_form(experts: nn.Module) -> dict:
    """dcp.moe's data arguments (activation, layout, alpha, limit) for a transformers experts
    module: the layout from ``is_transposed`` and the gate's own split, the activation from
    its gate (``_GATES``: the default ``act_fn(gate) * up``, or a known custom gate)."""
    from dcp_compile.runtime.kernels.moe import LAYOUTS

    name = type(experts).__name__
    wrong = {k: getattr(experts, k, None) for k, v in _UNSUPPORTED_FLAGS.items()
             if getattr(experts, k, None) != v}
    gated = bool(getattr(experts, "has_gate", True))
    first = _first_projection(experts)
    biases = (f"{first}_bias", "down_proj_bias")
    if getattr(experts, "has_bias", False) and not all(
            isinstance(getattr(experts, b, None), nn.Parameter) for b in biases):
        wrong["has_bias"] = f"True without {' / '.join(biases)} parameters"
    # Ungated experts (up -> act_fn -> down) never call a gate: their activation is act_fn.
    gate = _GATES.get(getattr(type(experts), "_apply_gate", None)) if gated else _ungated
    if gate is None:
        wrong["_apply_gate"] = f"{type(experts).__qualname__}._apply_gate (custom, unknown)"
    if wrong:
        raise DCPTransformError(
            f"{name} has an experts form dcp.moe does not compute: {wrong}. dcp.moe computes "
            f"gated experts (act(gate) * up over concatenated [gate; up], or gpt-oss's clamped "
            f"SwiGLU over interleaved gate/up) and ungated ones (act(up)), optionally biased "
            f"or transposed, no post-expert norm; use such a model (or add its gate to "
            f"dcp_compile.frontends.hf_experts._GATES).")
    activation, interleaved, params = gate(experts)
    transposed = bool(getattr(experts, "is_transposed", False))
    layout = next(k for k, v in LAYOUTS.items()
                  if (v.transposed, v.interleaved, v.gated) == (transposed, interleaved, gated))
    return {"activation": activation.value, "layout": layout.value, **params}


def _default_gate(experts: nn.Module):
    """transformers' ``act_fn(gate) * up`` over concatenated [gate; up]."""
    act = expert_activation(fn := getattr(experts, "act_fn", None))   # a module, or F.silu
    if act is None:
        raise DCPTransformError(f"{type(experts).__name__}'s activation "
            f"{getattr(fn, '__name__', None) or type(fn).__name__} is not one dcp.moe computes "
            f"({sorted(a.value for a in set(_ACTIVATIONS.values()))}). Use hidden_act='silu' "
            f"(or add it to dcp_compile.runtime.kernels.moe.GATES and dcp_compile.frontends.module_experts.hf_expert_activations).")
    return act, False, {}


def _ungated(experts: nn.Module):
    """transformers' ``has_gate=False`` experts: ``down(act_fn(up x))``, no gate to read."""
    return _default_gate(experts)


def _gpt_oss_gate(experts: nn.Module):
    """gpt-oss's ``_apply_gate``: gate/up interleaved, clamped SwiGLU (alpha, limit)."""
    from dcp_compile.runtime.kernels.moe import ExpertActivation
    return (ExpertActivation.CLAMPED_SWIGLU, True,
            {"alpha": float(experts.alpha), "limit": float(experts.limit)})


def _gate_table() -> dict:
    """experts class ``_apply_gate`` -> (activation, interleaved, params) of dcp.moe."""
    from transformers.integrations.moe import _default_apply_gate
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    return {_default_apply_gate: _default_gate, GptOssExperts._apply_gate: _gpt_oss_gate,
            **more_expert_gates()}


def _register_experts() -> None:
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, dcp_experts_forward)


_register_experts()


_ACTIVATIONS = hf_expert_activations()
_GATES = _gate_table()
