"""The mixture-of-experts op: ``dcp.moe``, the one node every routed-experts block becomes.

Routing (router linear, softmax or sigmoid, top-k, group limits, normalisation, scaling) stays
the model's own ops: they run on identical, replicated inputs on every rank, so every rank
picks the same experts, ties included. ``dcp.moe`` takes their result and computes

    out[t] = sum_j  w[t, j] * (down_e(glu(gate_e x[t] + bg_e, up_e x[t] + bu_e)) + bd_e),
    e = ids[t, j]

(gated experts), or, for ungated experts (Nemotron-H: up -> act -> down, no gate projection),

    out[t] = sum_j  w[t, j] * (down_e(act(up_e x[t] + bu_e)) + bd_e)

over the experts this rank holds. Shapes are static (tokens x top-k, no data-dependent shape).

Tensor conventions (``layout``: ``ExpertLayout``, a row of ``LAYOUTS``):
  x             [T, H]           tokens (flattened batch and sequence)
  topk_ids      [T, k] int64     global expert ids chosen per token
  topk_weights  [T, k]           their routing weights
  gate_up_proj  [E_local, 2 * I_local, H]   (transposed: [E_local, H, 2 * I_local]); the 2I
                                 dim holds [gate ; up] (concatenated) or gate0, up0, gate1,
                                 up1, ... (interleaved: gpt-oss); ungated layouts: the up
                                 projection alone, [E_local, I_local, H] (transposed
                                 [E_local, H, I_local])
  down_proj     [E_local, H, I_local]       (transposed: [E_local, I_local, H])
  expert_rank   0-d int64        this rank's expert shard: it holds global experts
                                 [expert_rank * E_local, (expert_rank + 1) * E_local)
  gate_up_bias  [E_local, 2 * I_local] or None (laid out like gate_up_proj's 2I dim)
  down_bias     [E_local, H] or None
  inner_rank    0-d int64 or None (0): this rank's slice of every expert's intermediate
                                 dim. The down bias is not a sum over I: only slice 0 adds it,
                                 so the ranks' sum counts it once.
  activation    ``ExpertActivation``: the gate act(gate) * up, or gpt-oss's clamped SwiGLU
                                 (``alpha``, ``limit``); ungated: act(up), ``act`` a row of
                                 ``ACTIVATIONS`` (relu² among them)

Tensor-parallel experts cut I (each rank's output is a partial sum over I); expert-parallel
experts cut E (each rank's output sums only its experts' tokens). Either way the output is a
pending sum the program all-reduces once; on one device (``expert_rank = inner_rank = 0``,
all experts, whole I) it is the block's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import Tensor

from dcp_compile.runtime.kernels.op_defs import dcp_op


class ExpertActivation(StrEnum):
    """The activation of an expert: gated, glu(gate, up); ungated, act(up)."""

    SILU = "silu"                         # act(gate) * up
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU = "relu"
    RELU2 = "relu2"                       # relu(x)² (Primer; Nemotron-H's experts)
    CLAMPED_SWIGLU = "clamped_swiglu"     # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha * g)
    CLAMPED_SILU = "clamped_silu"         # DeepSeek-V4: silu(min(g, limit)) * clamp(up, ±limit)


def _clamped_swiglu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's gate: gate clamped to <= limit, up to [-limit, limit]."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _clamped_silu(gate: Tensor, up: Tensor, alpha, limit: float) -> Tensor:
    """DeepSeek-V4's (and Bailing-hybrid's, with ``swiglu_limits``) gate: the default
    act(gate) * up with the gate clamped to <= limit and up to [-limit, limit]."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _relu2(x: Tensor) -> Tensor:
    """transformers' ``ReLUSquaredActivation``: square(relu(x))."""
    return torch.square(F.relu(x))


# activation -> act(x), the elementwise activations (of the gate, or of the up projection of
# an ungated expert)
ACTIVATIONS = {
    ExpertActivation.SILU: F.silu,
    ExpertActivation.GELU: F.gelu,
    ExpertActivation.GELU_TANH: lambda x: F.gelu(x, approximate="tanh"),
    ExpertActivation.RELU: F.relu,
    ExpertActivation.RELU2: _relu2,
}


def _act_times_up(act):
    return lambda gate, up, alpha, limit: act(gate) * up


# activation -> glu(gate, up, alpha, limit), for gated experts
GATES = {**{a: _act_times_up(act) for a, act in ACTIVATIONS.items()},
         ExpertActivation.CLAMPED_SWIGLU: _clamped_swiglu,
         ExpertActivation.CLAMPED_SILU: _clamped_silu}
# activation -> the parameters it reads (the others must leave alpha and limit unset).
PARAMETERS = {ExpertActivation.CLAMPED_SWIGLU: ("alpha", "limit"),
              ExpertActivation.CLAMPED_SILU: ("limit",)}


def parameters_agree(activation: str, alpha, limit) -> bool:
    """``activation`` gets exactly the parameters it reads (``PARAMETERS``)."""
    given = {name for name, v in (("alpha", alpha), ("limit", limit)) if v is not None}
    return given == set(PARAMETERS.get(ExpertActivation(activation), ()))


class ExpertLayout(StrEnum):
    """How the stacked expert weights are laid out (transformers' ``is_concatenated``,
    ``is_transposed`` and ``has_gate``)."""

    CONCATENATED = "concatenated"                    # Mixtral, Qwen-MoE, DeepSeek-V3, ...
    CONCATENATED_TRANSPOSED = "concatenated_transposed"
    INTERLEAVED = "interleaved"
    INTERLEAVED_TRANSPOSED = "interleaved_transposed"   # gpt-oss
    UNGATED = "ungated"                              # Nemotron-H: up_proj [E, I, H], no gate
    UNGATED_TRANSPOSED = "ungated_transposed"


@dataclass(frozen=True)
class WeightLayout:
    transposed: bool     # weights stored [in, out] (x @ w) rather than [out, in] (x @ w.T)
    interleaved: bool    # the 2I dim alternates gate and up columns
    gated: bool = True   # False: the first projection is the up projection alone (I, not 2I)

    @property
    def gate_up_inner_dim(self) -> int:
        """The 2I (ungated: I) dim of gate_up_proj [E, ., .] (the dim tensor-parallel experts
        cut)."""
        return 2 if self.transposed else 1

    @property
    def down_inner_dim(self) -> int:
        """The I dim of down_proj [E, ., .]."""
        return 1 if self.transposed else 2

    @property
    def projections(self) -> int:
        """How many projections of width I the first weight stacks: 2 (gate, up) or 1 (up)."""
        return 2 if self.gated else 1

    def split(self, h: Tensor) -> tuple[Tensor, ...]:
        """[..., 2I] -> (gate, up) [..., I]; ungated: (up,)."""
        if not self.gated:
            return (h,)
        return (h[..., 0::2], h[..., 1::2]) if self.interleaved else h.chunk(2, dim=-1)

    def matrix(self, w: Tensor) -> Tensor:
        """One expert's (or a gather's) weight as [..., in, out]."""
        return w if self.transposed else w.transpose(-1, -2)


LAYOUTS = {
    ExpertLayout.CONCATENATED: WeightLayout(transposed=False, interleaved=False),
    ExpertLayout.CONCATENATED_TRANSPOSED: WeightLayout(transposed=True, interleaved=False),
    ExpertLayout.INTERLEAVED: WeightLayout(transposed=False, interleaved=True),
    ExpertLayout.INTERLEAVED_TRANSPOSED: WeightLayout(transposed=True, interleaved=True),
    ExpertLayout.UNGATED: WeightLayout(transposed=False, interleaved=False, gated=False),
    ExpertLayout.UNGATED_TRANSPOSED: WeightLayout(transposed=True, interleaved=False,
                                                  gated=False),
}


# dcp.moe's operands in schema order (positional indices for the passes, which normalise
# every dcp.moe node to positional arguments: passes/canonicalize_moe.py).
OPERANDS = ("x", "topk_ids", "topk_weights", "gate_up_proj", "down_proj", "expert_rank",
            "activation", "gate_up_bias", "down_bias", "inner_rank", "layout", "alpha",
            "limit")
ARG = {name: i for i, name in enumerate(OPERANDS)}


def _form(activation: str, layout: str, alpha, limit):
    """(inner, WeightLayout) of the op's data arguments: ``inner`` maps the first projection's
    output [..., 2I] (ungated: [..., I]) to the down projection's input [..., I]; ValueError
    names a bad argument."""
    try:
        act, lay = ExpertActivation(activation), ExpertLayout(layout)
    except ValueError as e:
        raise ValueError(f"dcp.moe: {e}; activations {[a.value for a in ExpertActivation]}, "
                         f"layouts {[x.value for x in ExpertLayout]}") from None
    if not parameters_agree(act, alpha, limit):
        raise ValueError(f"dcp.moe activation {act.value} with alpha={alpha}, limit={limit}: "
                         f"it reads {PARAMETERS.get(act, ())} (PARAMETERS)")
    form = LAYOUTS[lay]
    if not form.gated:
        if act not in ACTIVATIONS:
            raise ValueError(f"dcp.moe activation {act.value} is a gate, and layout "
                             f"{lay.value} has no gate projection: ungated experts take "
                             f"{[a.value for a in ACTIVATIONS]}")
        return (lambda h: ACTIVATIONS[act](h)), form
    glu = GATES[act]
    return (lambda h: glu(*form.split(h), alpha, limit)), form


def local_experts(topk_ids: Tensor, expert_rank: Tensor, num_local: int):
    """(local id clamped into range, mask of the choices this rank holds)."""
    local = topk_ids - expert_rank * num_local
    mine = (local >= 0) & (local < num_local)
    return torch.where(mine, local, torch.zeros_like(local)), mine


def _adds_down_bias(inner_rank: Tensor | None, like: Tensor) -> Tensor | float:
    """1 on the intermediate slice that adds the down bias (slice 0), else 0: static."""
    return 1.0 if inner_rank is None else (inner_rank == 0).to(like.dtype)


def _combine(y: Tensor, topk_weights: Tensor, mine: Tensor, dtype) -> Tensor:
    """sum_j w[t, j] * y[t, j] over this rank's choices, accumulated in float32 (as
    transformers' batched_mm / grouped_mm sum their (T, k, H) products)."""
    weighted = y.float() * topk_weights.float().unsqueeze(-1)
    weighted = torch.where(mine.unsqueeze(-1), weighted, torch.zeros_like(weighted))
    return weighted.sum(dim=1).to(dtype)


def _moe_impl(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor,
              down_proj: Tensor, expert_rank: Tensor, activation: str = "silu",
              gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None,
              inner_rank: Tensor | None = None, layout: str = "concatenated",
              alpha: float | None = None, limit: float | None = None) -> Tensor:
    """Reference (and decomposition): gather each choice's expert weights, [T, k] static."""
    inner, form = _form(activation, layout, alpha, limit)
    ids, mine = local_experts(topk_ids, expert_rank, gate_up_proj.shape[0])
    w1 = form.matrix(gate_up_proj[ids])                           # [T, k, H, 2I]
    h = torch.einsum("th,tkhi->tki", x.to(w1.dtype), w1)
    if gate_up_bias is not None:
        h = h + gate_up_bias[ids]
    w2 = form.matrix(down_proj[ids])                              # [T, k, I, H]
    y = torch.einsum("tki,tkih->tkh", inner(h), w2)
    if down_bias is not None:
        y = y + down_bias[ids] * _adds_down_bias(inner_rank, y)
    return _combine(y, topk_weights, mine, x.dtype)


@dcp_op("moe", mutates_args=())
def moe(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor,
        down_proj: Tensor, expert_rank: Tensor, activation: str = "silu",
        gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None,
        inner_rank: Tensor | None = None, layout: str = "concatenated",
        alpha: float | None = None, limit: float | None = None) -> Tensor:
    """Routed experts over this rank's expert shard (see the module doc); returns [T, H]."""
    return _moe_impl(x, topk_ids, topk_weights, gate_up_proj, down_proj, expert_rank,
                     activation, gate_up_bias, down_bias, inner_rank, layout, alpha, limit)


@moe.register_fake
def _(x, topk_ids, topk_weights, gate_up_proj, down_proj, expert_rank, activation="silu",
      gate_up_bias=None, down_bias=None, inner_rank=None, layout="concatenated", alpha=None,
      limit=None):
    return torch.empty_like(x)


@dcp_op("moe_grouped", mutates_args=())
def moe_grouped(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor,
                down_proj: Tensor, expert_rank: Tensor, activation: str = "silu",
                gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None,
                inner_rank: Tensor | None = None, layout: str = "concatenated",
                alpha: float | None = None, limit: float | None = None) -> Tensor:
    """Eager kernel of ``dcp.moe``: sort the (token, choice) pairs by expert and run one
    matmul per expert over its contiguous rows (a grouped matmul). The group sizes are data
    (one host sync), which is why only eager backends run it (runtime/kernels/eager.py)."""
    inner, form = _form(activation, layout, alpha, limit)
    num_tokens, k = topk_ids.shape
    ids, mine = local_experts(topk_ids, expert_rank, gate_up_proj.shape[0])
    flat_ids = torch.where(mine, ids, torch.full_like(ids, gate_up_proj.shape[0])).reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0] + 1).tolist()
    rows = x.to(gate_up_proj.dtype)[order // k]                   # [T*k, H] by expert
    y = torch.zeros(num_tokens * k, x.shape[-1], dtype=gate_up_proj.dtype, device=x.device)
    first = _adds_down_bias(inner_rank, y)
    start = 0
    for e, n in enumerate(counts[:-1]):                           # the last: not this rank's
        if n:
            h = rows[start:start + n] @ form.matrix(gate_up_proj[e])
            if gate_up_bias is not None:
                h = h + gate_up_bias[e]
            out = inner(h) @ form.matrix(down_proj[e])
            y[start:start + n] = out if down_bias is None else out + down_bias[e] * first
        start += n
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return _combine(unsorted.view(num_tokens, k, -1), topk_weights, mine, x.dtype)


@moe_grouped.register_fake
def _(x, topk_ids, topk_weights, gate_up_proj, down_proj, expert_rank, activation="silu",
      gate_up_bias=None, down_bias=None, inner_rank=None, layout="concatenated", alpha=None,
      limit=None):
    return torch.empty_like(x)


DECOMPOSITIONS = {torch.ops.dcp.moe.default: _moe_impl,
                  torch.ops.dcp.moe_grouped.default: _moe_impl}
