"""The mixture-of-experts op: ``dcp.moe``, the one node every routed-experts block becomes.

Routing (router linear, softmax or sigmoid, top-k, group limits, normalisation, scaling) stays
the model's own ops: they run on identical, replicated inputs on every rank, so every rank
picks the same experts, ties included. ``dcp.moe`` takes their result and computes

    out[t] = sum_j  w[t, j] * down_e( act(gate_e x[t]) * up_e x[t] ),   e = ids[t, j]

over the experts this rank holds. Shapes are static (tokens x top-k, no data-dependent shape).

Tensor conventions:
  x             [T, H]           tokens (flattened batch and sequence)
  topk_ids      [T, k] int64     global expert ids chosen per token
  topk_weights  [T, k]           their routing weights
  gate_up_proj  [E_local, 2 * I_local, H]   [gate ; up] rows (transformers' layout)
  down_proj     [E_local, H, I_local]
  expert_rank   0-d int64        this rank's expert shard: it holds global experts
                                 [expert_rank * E_local, (expert_rank + 1) * E_local)

Tensor-parallel experts cut I (each rank's output is a partial sum over I); expert-parallel
experts cut E (each rank's output sums only its experts' tokens). Either way the output is a
pending sum the program all-reduces once; on one device (``expert_rank = 0``, all experts,
whole I) it is the block's output.
"""

from __future__ import annotations

from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import Tensor


class ExpertActivation(StrEnum):
    """The gate activation of a gated (SwiGLU-style) expert: act(gate) * up."""

    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU = "relu"


ACTIVATIONS = {
    ExpertActivation.SILU: F.silu,
    ExpertActivation.GELU: F.gelu,
    ExpertActivation.GELU_TANH: lambda x: F.gelu(x, approximate="tanh"),
    ExpertActivation.RELU: F.relu,
}


def _activation(name: str):
    try:
        return ACTIVATIONS[ExpertActivation(name)]
    except ValueError:
        raise ValueError(f"dcp.moe activation {name!r} is not one of "
                         f"{[a.value for a in ExpertActivation]}") from None


def local_experts(topk_ids: Tensor, expert_rank: Tensor, num_local: int):
    """(local id clamped into range, mask of the choices this rank holds)."""
    local = topk_ids - expert_rank * num_local
    mine = (local >= 0) & (local < num_local)
    return torch.where(mine, local, torch.zeros_like(local)), mine


def _combine(y: Tensor, topk_weights: Tensor, mine: Tensor, dtype) -> Tensor:
    """sum_j w[t, j] * y[t, j] over this rank's choices, accumulated in float32 (as
    transformers' batched_mm / grouped_mm sum their (T, k, H) products)."""
    weighted = y.float() * topk_weights.float().unsqueeze(-1)
    weighted = torch.where(mine.unsqueeze(-1), weighted, torch.zeros_like(weighted))
    return weighted.sum(dim=1).to(dtype)


def _moe_impl(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor,
              down_proj: Tensor, expert_rank: Tensor, activation: str = "silu") -> Tensor:
    """Reference (and decomposition): gather each choice's expert weights, [T, k] static."""
    act = _activation(activation)
    ids, mine = local_experts(topk_ids, expert_rank, gate_up_proj.shape[0])
    w1 = gate_up_proj[ids]                                        # [T, k, 2I, H]
    h = torch.einsum("th,tkih->tki", x.to(w1.dtype), w1)
    gate, up = h.chunk(2, dim=-1)
    w2 = down_proj[ids]                                           # [T, k, H, I]
    y = torch.einsum("tki,tkhi->tkh", act(gate) * up, w2)
    return _combine(y, topk_weights, mine, x.dtype)


@torch.library.custom_op("dcp::moe", mutates_args=())
def moe(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor,
        down_proj: Tensor, expert_rank: Tensor, activation: str = "silu") -> Tensor:
    """Routed experts over this rank's expert shard (see the module doc); returns [T, H]."""
    return _moe_impl(x, topk_ids, topk_weights, gate_up_proj, down_proj, expert_rank,
                     activation)


@moe.register_fake
def _(x, topk_ids, topk_weights, gate_up_proj, down_proj, expert_rank, activation="silu"):
    return torch.empty_like(x)


@torch.library.custom_op("dcp::moe_grouped", mutates_args=())
def moe_grouped(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor,
                down_proj: Tensor, expert_rank: Tensor, activation: str = "silu") -> Tensor:
    """Eager kernel of ``dcp.moe``: sort the (token, choice) pairs by expert and run one
    matmul per expert over its contiguous rows (a grouped matmul). The group sizes are data
    (one host sync), which is why only eager backends run it (runtime/eager.py)."""
    act = _activation(activation)
    num_tokens, k = topk_ids.shape
    ids, mine = local_experts(topk_ids, expert_rank, gate_up_proj.shape[0])
    flat_ids = torch.where(mine, ids, torch.full_like(ids, gate_up_proj.shape[0])).reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0] + 1).tolist()
    rows = x.to(gate_up_proj.dtype)[order // k]                   # [T*k, H] by expert
    y = torch.zeros(num_tokens * k, x.shape[-1], dtype=gate_up_proj.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts[:-1]):                           # the last: not this rank's
        if n:
            h = rows[start:start + n] @ gate_up_proj[e].t()
            gate, up = h.chunk(2, dim=-1)
            y[start:start + n] = (act(gate) * up) @ down_proj[e].t()
        start += n
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return _combine(unsorted.view(num_tokens, k, -1), topk_weights, mine, x.dtype)


@moe_grouped.register_fake
def _(x, topk_ids, topk_weights, gate_up_proj, down_proj, expert_rank, activation="silu"):
    return torch.empty_like(x)


DECOMPOSITIONS = {torch.ops.dcp.moe.default: _moe_impl,
                  torch.ops.dcp.moe_grouped.default: _moe_impl}
