"""Prefill DCP: the interleave slice and Q unshuffle of a chunk with *any* prior length
(the ops ``dcp.interleave_slice_index`` and ``dcp.q_unshuffle_index``; ops re-exports them).

A prefill row holds one chunk of one sequence, left-packed: positions start, start + 1,
..., start + len - 1, then -1 (the engine's packing). The spec's model runner slices a
chunk with ``view(S // (W*I), W, I)[:, R, :]``, which keeps the tokens rank R owns only
when ``start`` is a multiple of ``W*I``. Here the kept tokens are, for any start, exactly
the positions R owns, found through the proven slot maps: R's j-th owned position at or
after ``start`` is the one in its local slot ``local_filled(start, R) + j`` (local slots are
dense and in position order: theorems local_filled_step, local_slot_dense,
local_slot_inverts_global_position), i.e. ``global_position(local_filled(start, R) + j, R)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dcp_compile.runtime import layout
from dcp_compile.runtime.kernels.op_defs import dcp_op


def owned_capacity(chunk_len: int, *, dcp: int, interleave: int) -> int:
    """Most positions one rank can own among ``chunk_len`` consecutive ones, any start.

    ``chunk_len = q * W*I + t`` covers q whole strides (I owned positions each) plus t < W*I
    positions, which meet the rank's runs of I in at most min(t, I) places. Equals
    ``chunk_len / W`` when W*I divides it (the spec's S/DCP).
    """
    stride = dcp * interleave
    return (chunk_len // stride) * interleave + min(chunk_len % stride, interleave)


def _interleave_slice_index_impl(positions: Tensor, rank: Tensor, capacity: int, dcp: int,
                                 interleave: int, block: int) -> Tensor:
    kw = dict(dcp=dcp, interleave=interleave, block=block)
    start = positions[:, :1].clamp(min=0)                                   # [B, 1]
    length = (positions >= 0).sum(dim=1, keepdim=True)                      # [B, 1]
    j = torch.arange(capacity, device=positions.device)                     # [C]
    slot = layout.local_filled(start, rank, **kw) + j                       # [B, C]
    index = layout.global_position(slot, rank, dcp=dcp, interleave=interleave) - start
    return torch.where(index < length, index, torch.full_like(index, -1))


@dcp_op("interleave_slice_index", mutates_args=())
def interleave_slice_index(positions: Tensor, rank: Tensor, capacity: int, dcp: int,
                           interleave: int, block: int) -> Tensor:
    """[B, capacity] chunk indices of the tokens ``rank`` owns, in order; -1 pads the row.

    With ``start`` a multiple of W*I and a full chunk this is the spec's interleave slice
    (``layout.interleave_slice_index``); any other start is handled the same way.
    """
    return _interleave_slice_index_impl(positions, rank, capacity, dcp, interleave, block)


@interleave_slice_index.register_fake
def _(positions, rank, capacity, dcp, interleave, block):
    return positions.new_empty((positions.shape[0], capacity))


def _q_unshuffle_index_impl(positions: Tensor, capacity: int, dcp: int, interleave: int,
                            block: int) -> Tensor:
    kw = dict(dcp=dcp, interleave=interleave, block=block)
    pos = positions.clamp(min=0)
    start = positions[:, :1].clamp(min=0)
    r = layout.owner(pos, **kw)
    # Tokens r owns in [start, pos): pos's index in r's slice (local_slot_dense).
    j = layout.local_filled(pos, r, **kw) - layout.local_filled(start, r, **kw)
    row = r * capacity + j
    return torch.where(positions >= 0, row, torch.zeros_like(row))


@dcp_op("q_unshuffle_index", mutates_args=())
def q_unshuffle_index(positions: Tensor, capacity: int, dcp: int, interleave: int,
                      block: int) -> Tensor:
    """[B, S]: row of the rank-major gathered slices ([B, W * capacity]) holding each chunk
    token, so that gathering them puts Q back in chunk order (0 on padding)."""
    return _q_unshuffle_index_impl(positions, capacity, dcp, interleave, block)


@q_unshuffle_index.register_fake
def _(positions, capacity, dcp, interleave, block):
    return torch.empty_like(positions)


# Decompositions to ATen (joined into ops.DECOMPOSITIONS).
DECOMPOSITIONS = {torch.ops.dcp.interleave_slice_index.default: _interleave_slice_index_impl,
                  torch.ops.dcp.q_unshuffle_index.default: _q_unshuffle_index_impl}
