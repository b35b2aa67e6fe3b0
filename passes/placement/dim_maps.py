"""Dim maps of shape ops (torch.distributed.tensor's DimSpec), applied to placements in both
directions: forward (the input's shard -> the output's) and backward (the output's required
shard -> the input's, checked to round-trip)."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor._ops._view_ops import (Broadcast, Flatten, InputDim, NewDim, Split,
                                                     dim_repeat, dim_squeeze, dim_transpose,
                                                     dim_unsqueeze, expand, view_groups)

from dcp_compile.runtime.distributed.roles import COLLECTIVES as ROLE_COLLECTIVES, WAIT_TARGET

from ..op_classes import BROADCAST_VIEWS, FLATTENS, IDENTITY_VIEWS, RESHAPES
from .lattice import Refusal, Seg, Shard, canon, scale_segs
from .node_args import norm_dim, shape_of

aten = torch.ops.aten


def _spec_size(spec, in_shape) -> int:
    if isinstance(spec, InputDim):
        return in_shape[spec.input_dim]
    if isinstance(spec, Flatten):
        return math.prod(_spec_size(s, in_shape) for s in spec.input_dims)
    if isinstance(spec, Split):
        return spec.group_shape[spec.split_id]
    return 1


def _forward_spec(spec, shard: Shard, in_shape):
    """Segments of ``shard`` along the output dim described by ``spec``; None when that dim
    does not carry the shard."""
    if isinstance(spec, InputDim):
        return shard.segs if spec.input_dim == shard.dim else None
    if isinstance(spec, Flatten):
        sizes = [_spec_size(s, in_shape) for s in spec.input_dims]
        hits = [(i, _forward_spec(s, shard, in_shape)) for i, s in enumerate(spec.input_dims)]
        hits = [(i, s) for i, s in hits if s is not None]
        if not hits:
            return None
        i, segs = hits[0]
        outer, inner = math.prod(sizes[:i]), math.prod(sizes[i + 1:])
        return scale_segs(segs, inner) * outer
    if isinstance(spec, Split):
        segs = _forward_spec(spec.input_dim, shard, in_shape)
        if segs is None or _split_landing(spec, segs) != spec.split_id:
            return None
        return _split_segs(spec, segs, spec.split_id)
    if isinstance(spec, Broadcast) and _forward_spec(spec.dim, shard, in_shape) is not None:
        raise Refusal("broadcasts the sharded dim")
    if hasattr(spec, "input_dim") or hasattr(spec, "dim"):
        inner = getattr(spec, "input_dim", None) or getattr(spec, "dim", None)
        if _forward_spec(inner, shard, in_shape) is not None:
            raise Refusal(f"{type(spec).__name__} of the sharded dim")
    return None


def _split_segs(spec: Split, segs, j):
    gs = spec.group_shape
    outer, inner, n = math.prod(gs[:j]), math.prod(gs[j + 1:]), gs[j]
    if outer == 1:
        out = scale_segs(segs, 1, inner)
    else:  # the shard sits inside a repeated block: each block must be one whole segment
        if len(segs) != outer or len(set(segs)) != 1:
            raise Refusal("segments do not repeat with the outer dims")
        out = scale_segs(segs[:1], 1, inner)
    if sum(s.size for s in out) != n or any(s.size % s.pieces for s in out):
        raise Refusal("pieces do not align with the dim")
    return out


def _split_landing(spec: Split, segs) -> int | None:
    """Which dim of a split group carries the shard: the first one its pieces align with."""
    for j in range(len(spec.group_shape)):
        try:
            _split_segs(spec, segs, j)
            return j
        except Refusal:
            continue
    raise Refusal(f"no dim of the view {spec.group_shape} holds the shard "
                  f"[{', '.join(map(str, segs))}] whole")


def _finer_than_groups(segs, groups: int, inner: int) -> str:
    # A per-group fused layout ([groups, ...] rows: torchtitan's wqkv by KV head, CodeGen's
    # mp_num shards) cut finer than its groups: a rank would hold part of one group's q heads
    # and all of its k/v; one Shard of one dim cannot say that.
    cut = ", ".join(map(str, segs))
    return (f"the cut [{cut}] is finer than the {groups} groups of {inner} this view merges "
            f"(a projection fused per group: each rank would hold part of one group); "
            f"the attention shard (tp in decode, tp/dcp in prefill) must divide {groups}")


def _backward_spec(spec, segs, in_shape) -> tuple[int, tuple[Seg, ...]]:
    """(input dim, its segments) so that the output dim ``spec`` carries ``segs``."""
    if isinstance(spec, InputDim):
        return spec.input_dim, segs
    if isinstance(spec, Split):
        gs, j = spec.group_shape, spec.split_id
        outer, inner = math.prod(gs[:j]), math.prod(gs[j + 1:])
        return _backward_spec(spec.input_dim, scale_segs(segs, inner) * outer, in_shape)
    if isinstance(spec, Flatten):
        sizes = [_spec_size(s, in_shape) for s in spec.input_dims]
        i = next(i for i, s in enumerate(sizes) if s > 1)
        inner = math.prod(sizes[i + 1:])
        if any(s.local % inner for s in segs) and sizes[i] > 1:
            raise Refusal(_finer_than_groups(segs, sizes[i], inner))
        return _backward_spec(spec.input_dims[i], scale_segs(segs, 1, inner), in_shape)
    raise Refusal(f"{type(spec).__name__} cannot carry a shard")


def dims_forward(specs, p, in_shape):
    if not isinstance(p, Shard):
        return p
    hits = [(j, _forward_spec(s, p, in_shape)) for j, s in enumerate(specs)]
    hits = [(j, s) for j, s in hits if s is not None]
    if len(hits) != 1:
        raise Refusal(f"the sharded dim {p.dim} maps to {len(hits)} output dims")
    j, segs = hits[0]
    return canon(Shard(j, tuple(segs), p.axis))


def dims_backward(specs, req, in_shape):
    if not isinstance(req, Shard):
        return req
    d, segs = _backward_spec(specs[req.dim], req.segs, in_shape)
    got = dims_forward(specs, Shard(d, tuple(segs), req.axis), in_shape)
    if got != req:  # the inverse must round-trip, or the view cannot carry the shard
        raise Refusal(f"no input placement gives {req} (closest: {got})")
    return Shard(d, tuple(segs), req.axis)


def _identity(n):
    return tuple(InputDim(i) for i in range(len(shape_of(n.args[0]))))


def _permute(n):
    nd = len(shape_of(n.args[0]))
    return tuple(InputDim(norm_dim(d, nd)) for d in n.args[1])


def _view_as_real(n):
    """complex [..., d] -> real [..., d, 2]: every dim kept, a new (re, im) dim last."""
    return _identity(n) + (NewDim(2),)


def _view_as_complex(n):
    """real [..., d, 2] -> complex [..., d]: the (re, im) dim is consumed (a shard on it
    maps nowhere: refused)."""
    return _identity(n)[:-1]


def _regroup(n):
    """A reshape, flatten or unflatten: dims regrouped from the input's shape to the output's."""
    return view_groups(list(shape_of(n.args[0])), list(shape_of(n)))


DIM_MAPS: dict = {
    aten.view_as_real.default: _view_as_real,
    aten.view_as_complex.default: _view_as_complex,
    **dict.fromkeys(RESHAPES | FLATTENS, _regroup),
    aten.transpose.int: lambda n: dim_transpose(len(shape_of(n.args[0])), n.args[1], n.args[2]),
    aten.t.default: lambda n: dim_transpose(2, 0, 1),
    aten.permute.default: _permute,
    aten.unsqueeze.default: lambda n: dim_unsqueeze(len(shape_of(n.args[0])), n.args[1]),
    aten.squeeze.dim: lambda n: dim_squeeze(shape_of(n.args[0]), n.args[1]),
    aten.squeeze.dims: lambda n: dim_squeeze(shape_of(n.args[0]), tuple(n.args[1])),
    aten.squeeze.default: lambda n: dim_squeeze(shape_of(n.args[0])),
    # repeat: a dim repeated more than once is not carried (Gemma 3n's AltUp repeats its
    # coefficients over the tokens' feature dims, never the token dim).
    aten.repeat.default: lambda n: dim_repeat(len(shape_of(n.args[0])), tuple(n.args[1])),
    # x.expand_as(y) (F.normalize) is an expand to y's shape; y gives only its shape.
    **dict.fromkeys(BROADCAST_VIEWS, lambda n: expand(shape_of(n.args[0]), shape_of(n))),
}
# Ops that keep every dim as it is (type conversions, copies, eval-mode dropout).
for _op in IDENTITY_VIEWS:
    DIM_MAPS[_op] = _identity


# Collectives that act on each element on its own across ranks (all_reduce), and the wait:
# every dim passes through (the token dim of prefill meets them after the tensor-parallel
# rewrite).
COLLECTIVES = tuple(t for t, kind in ROLE_COLLECTIVES.items() if kind.dim == "elementwise") \
    + (WAIT_TARGET,)
for _op in COLLECTIVES:
    DIM_MAPS[_op] = _identity
