"""Placement analysis: how every tensor of the graph is laid out over the tensor-parallel ranks.

Run before any rewrite (``analyze``); :mod:`passes.shard_tensor_parallel` then follows it.

A placement says what rank r holds of a tensor:
  * ``Replicate()``: the whole tensor.
  * ``Shard(dim, segs, axis)``: along ``dim`` the full tensor is the concatenation of
    segments ``segs``; rank r holds, of each segment, piece ``(r % group) // replicas`` of
    ``pieces`` equal pieces, concatenated in segment order. One segment is an ordinary shard
    (a GQA KV head replicated on consecutive ranks has ``replicas > 1``); several segments are
    a fused projection's output whose parts are each sharded (vLLM's QKVParallelLinear,
    MergedColumnParallelLinear): ``[q; k; v]`` rows, ``[gate; up]``, ``[q; gate]``.
    ``axis`` names the group: ``attn`` (attention heads: full TP in decode, dcp_tp in
    prefill) or ``mlp`` (full TP).
  * ``Partial(axis, scale)``: a pending sum over the axis (a row-parallel linear, or a
    mean/sum over a sharded dim); the rewrite all-reduces it at once, so its consumers read
    ``Replicate()``.

Rules are data: ``RULES`` maps an op (or an op family, found by ``rule_for``) to a forward
rule (input placements -> output placement) and a backward rule (a placement required of
the output -> what each input must be). Shape ops map dims with torch.distributed.tensor's
own view dim maps (``_view_ops.view_groups``, ``dim_transpose``, ``expand``...). DTensor's
sharding propagator itself is not used: its placements cannot say "segment by segment" or
"piece i on ``replicas`` consecutive ranks", which fused projections and GQA need.

Where the roles come from: ``dcp.attention``'s q/k/v must be sharded on their head dim
(q by heads over the attention group, k/v by KV heads, replicated when there are fewer KV
heads than ranks); that requirement runs backward to the projections (a column shard, segment
by segment for a fused one) and to any parameter on the way (a norm weight over all heads).
The attention output runs forward to a linear, which becomes row-parallel. A linear whose
input is still unknown after that (an MLP's down projection) is made row-parallel over full
TP, and its requirement runs backward to the MLP's column projections. A linear reaching the
output is the vocab-parallel LM head; an embedding is vocab-parallel. Finally a strict
forward pass recomputes every placement from the decided weights and checks the attention
inputs and graph outputs: any op without a rule for its input placements, any conflict, is
a ``DCPTransformError`` naming the op, the placements and the source line. Ops whose inputs
are all replicated need no rule (every rank computes the same thing).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch.distributed.tensor._ops._view_ops import (Broadcast, Flatten, InputDim, Split,
                                                     dim_squeeze, dim_transpose,
                                                     dim_unsqueeze, expand, view_groups)
from torch.fx import GraphModule, Node

from dcp_compile.errors import DCPTransformError

from .infra import attention_nodes, source_of
from .insert_rank import RANK_INPUT

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------
# Placements
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seg:
    """A segment of ``size`` elements cut in ``pieces``; each piece on ``replicas`` ranks."""

    size: int
    pieces: int
    replicas: int = 1

    @property
    def local(self) -> int:
        return self.size // self.pieces

    def scaled(self, num: int, den: int = 1) -> "Seg":
        return Seg(self.size * num // den, self.pieces, self.replicas)

    def __str__(self):
        return f"{self.size}/{self.pieces}" + (f"x{self.replicas}" if self.replicas > 1 else "")


@dataclass(frozen=True)
class Replicate:
    def __str__(self):
        return "Replicate"


@dataclass(frozen=True)
class Shard:
    dim: int
    segs: tuple[Seg, ...]
    axis: str = "attn"

    @property
    def full(self) -> int:
        return sum(s.size for s in self.segs)

    @property
    def local(self) -> int:
        return sum(s.local for s in self.segs)

    def __str__(self):
        kind = "Shard" if len(self.segs) == 1 else "Segmented"
        return f"{kind}(dim={self.dim}, [{', '.join(map(str, self.segs))}], {self.axis})"


@dataclass(frozen=True)
class Partial:
    axis: str
    scale: float = 1.0        # multiply the local value by this before the sum

    def __str__(self):
        return f"Partial({self.axis})"


R = Replicate()
Placement = object  # Replicate | Shard | Partial | tuple of those (multi-output ops)


def canon(p):
    """A shard whose every segment is whole on several ranks (pieces 1, replicas > 1: an MQA
    KV head) is replicated data, and so is a single head on a group of one rank. (Pieces 1 of
    wider segments on a group of 1 stay a shard: the O projection of a dcp_tp group of one
    rank is still row-parallel, with a trivial sum.)"""
    if isinstance(p, Shard) and all(s.pieces == 1 and (s.replicas > 1 or s.size == 1)
                                    for s in p.segs):
        return R
    return p


def show(p) -> str:
    if isinstance(p, tuple):
        return "(" + ", ".join(show(x) for x in p) + ")"
    return "unknown" if p is None else str(p)


class Refusal(Exception):
    """A rule cannot place this op; the analysis turns it into a DCPTransformError."""


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


def fake(n):
    return n.meta.get("val") if isinstance(n, Node) else None


def shape_of(n) -> tuple[int, ...]:
    return tuple(fake(n).shape)


def tensor_args(n: Node) -> list[Node]:
    """Tensor-valued node inputs in argument order (lists flattened)."""
    out = []
    for a in list(n.args) + list(n.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(x, Node) and isinstance(fake(x), (torch.Tensor, tuple, list)):
                out.append(x)
    return out


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def _arg(n: Node, i: int, name: str, default=None):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _scale_segs(segs, num, den=1):
    out = []
    for s in segs:
        if (s.size * num) % den or (s.local * num) % den:
            raise Refusal(f"segment {s} does not divide by {den}")
        out.append(s.scaled(num, den))
    return tuple(out)


# ------------------------------------------------------------------------------------------
# Dim maps (torch.distributed.tensor's DimSpec) in both directions
# ------------------------------------------------------------------------------------------


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
        return _scale_segs(segs, inner) * outer
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
        out = _scale_segs(segs, 1, inner)
    else:  # the shard sits inside a repeated block: each block must be one whole segment
        if len(segs) != outer or len(set(segs)) != 1:
            raise Refusal("segments do not repeat with the outer dims")
        out = _scale_segs(segs[:1], 1, inner)
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


def _backward_spec(spec, segs, in_shape) -> tuple[int, tuple[Seg, ...]]:
    """(input dim, its segments) so that the output dim ``spec`` carries ``segs``."""
    if isinstance(spec, InputDim):
        return spec.input_dim, segs
    if isinstance(spec, Split):
        gs, j = spec.group_shape, spec.split_id
        outer, inner = math.prod(gs[:j]), math.prod(gs[j + 1:])
        return _backward_spec(spec.input_dim, _scale_segs(segs, inner) * outer, in_shape)
    if isinstance(spec, Flatten):
        sizes = [_spec_size(s, in_shape) for s in spec.input_dims]
        i = next(i for i, s in enumerate(sizes) if s > 1)
        return _backward_spec(spec.input_dims[i], _scale_segs(segs, 1, math.prod(sizes[i + 1:])),
                              in_shape)
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


DIM_MAPS: dict = {
    aten.view.default: lambda n: view_groups(list(shape_of(n.args[0])), list(shape_of(n))),
    aten.reshape.default: lambda n: view_groups(list(shape_of(n.args[0])), list(shape_of(n))),
    aten._unsafe_view.default: lambda n: view_groups(list(shape_of(n.args[0])),
                                                     list(shape_of(n))),
    aten.unflatten.int: lambda n: view_groups(list(shape_of(n.args[0])), list(shape_of(n))),
    aten.flatten.using_ints: lambda n: view_groups(list(shape_of(n.args[0])),
                                                   list(shape_of(n))),
    aten.transpose.int: lambda n: dim_transpose(len(shape_of(n.args[0])), n.args[1], n.args[2]),
    aten.t.default: lambda n: dim_transpose(2, 0, 1),
    aten.permute.default: _permute,
    aten.unsqueeze.default: lambda n: dim_unsqueeze(len(shape_of(n.args[0])), n.args[1]),
    aten.squeeze.dim: lambda n: dim_squeeze(shape_of(n.args[0]), n.args[1]),
    aten.squeeze.dims: lambda n: dim_squeeze(shape_of(n.args[0]), tuple(n.args[1])),
    aten.squeeze.default: lambda n: dim_squeeze(shape_of(n.args[0])),
    aten.expand.default: lambda n: expand(shape_of(n.args[0]), shape_of(n)),
}
# Ops that keep every dim as it is (type conversions, copies, eval-mode dropout).
for _op in (aten.clone.default, aten.contiguous.default, aten.alias.default,
            aten.detach.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
            aten._to_copy.default, aten.lift_fresh_copy.default, aten.dropout.default,
            aten.type_as.default):
    DIM_MAPS[_op] = _identity


# ------------------------------------------------------------------------------------------
# Rules: forward (node, placements of its tensor inputs) -> placement; backward
# (node, required output placement) -> {input: required placement}.
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    name: str
    forward: Callable
    backward: Callable | None = None


def _dims_fw(n, P):
    return dims_forward(DIM_MAPS[n.target](n), P(n.args[0]), shape_of(n.args[0]))


def _dims_bw(n, req):
    return {n.args[0]: dims_backward(DIM_MAPS[n.target](n), req, shape_of(n.args[0]))}


def _pointwise_fw(n, P):
    """Broadcasting elementwise op: every sharded operand must agree; a replicated operand
    may only be broadcast (size 1) along the sharded dim."""
    out_nd = fake(n).ndim
    shard = None
    for a in tensor_args(n):
        p = P(a)
        if isinstance(p, Shard):
            q = replace(p, dim=p.dim + out_nd - fake(a).ndim)
            if shard is not None and q != shard:
                raise Refusal(f"operands are sharded differently ({shard} and {q})")
            shard = q
        elif p != R:
            raise Refusal(f"operand {a.name} is {show(p)}")
    if shard is None:
        return R
    if fake(n).shape[shard.dim] != shard.full:
        raise Refusal("the sharded dim is broadcast")
    for a in tensor_args(n):
        if P(a) == R:
            k = shard.dim - (out_nd - fake(a).ndim)
            if k >= 0 and fake(a).shape[k] != 1:
                raise Refusal(f"replicated operand {a.name} of shape {shape_of(a)} spans the "
                              f"sharded dim {shard.dim}")
    return shard


def _pointwise_bw(n, req):
    out_nd = fake(n).ndim
    need = {}
    for a in tensor_args(n):
        k = req.dim - (out_nd - fake(a).ndim)
        need[a] = None if k < 0 or fake(a).shape[k] == 1 else replace(req, dim=k)
    return need


# -- splitting along a dim: split / chunk / unbind (outputs via getitem), slice, select ----

def _split_ranges(n) -> tuple[int, list[tuple[int, int]]]:
    """(dim, [start, end) of each output) of a split-like op, on full sizes."""
    x = n.args[0]
    nd = len(shape_of(x))
    t = n.target
    if t == aten.unbind.int:
        d = norm_dim(_arg(n, 1, "dim", 0), nd)
        return d, [(i, i + 1) for i in range(shape_of(x)[d])]
    d = norm_dim(_arg(n, 2, "dim", 0), nd)
    sizes = [tuple(v.shape)[d] for v in fake(n)]
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    return d, bounds


def _covering(segs, start, end):
    """The segments exactly covering [start, end), or Refusal."""
    out, pos = [], 0
    for s in segs:
        if pos >= start and pos + s.size <= end:
            out.append(s)
        elif pos < end and pos + s.size > start:
            raise Refusal(f"[{start}, {end}) cuts segment {s} at offset {pos}")
        pos += s.size
    if sum(s.size for s in out) != end - start:
        raise Refusal(f"[{start}, {end}) is not a run of whole segments")
    return tuple(out)


def _split_fw(n, P):
    p = P(n.args[0])
    if not isinstance(p, Shard):
        return tuple(p for _ in fake(n))
    d, bounds = _split_ranges(n)
    if d != p.dim:
        q = replace(p, dim=p.dim - (n.target == aten.unbind.int and d < p.dim))
        return tuple(q for _ in bounds)
    if n.target == aten.unbind.int:
        raise Refusal("unbinds the sharded dim")
    return tuple(canon(Shard(d, _covering(p.segs, a, b), p.axis)) for a, b in bounds)


def _slice_bounds(n):
    x = n.args[0]
    nd = len(shape_of(x))
    size = lambda d: shape_of(x)[d]  # noqa: E731
    if n.target == aten.select.int:
        d = norm_dim(n.args[1], nd)
        i = n.args[2] % size(d)
        return d, i, i + 1, 1
    if n.target == aten.narrow.default:
        d = norm_dim(n.args[1], nd)
        return d, n.args[2] % size(d), n.args[2] % size(d) + n.args[3], 1
    d = norm_dim(_arg(n, 1, "dim", 0), nd)
    start, end, step = _arg(n, 2, "start"), _arg(n, 3, "end"), _arg(n, 4, "step", 1)
    start, end, _ = slice(start, end, step).indices(size(d))
    return d, start, max(end, start), step


def _slice_fw(n, P):
    p = P(n.args[0])
    if not isinstance(p, Shard):
        return p
    d, start, end, step = _slice_bounds(n)
    if d != p.dim:
        return replace(p, dim=p.dim - (n.target == aten.select.int and d < p.dim))
    if n.target == aten.select.int or step != 1:
        raise Refusal("selects inside the sharded dim")
    return canon(Shard(d, _covering(p.segs, start, end), p.axis))


def _slice_bw(n, req):
    d, *_ = _slice_bounds(n)
    k = req.dim + (n.target == aten.select.int and d <= req.dim)
    if k == d:
        return {}   # a run of segments: combined over all of the input's range users
    return {n.args[0]: replace(req, dim=k)}


def _getitem_fw(n, P):
    p = P(n.args[0])
    return p[n.args[1]] if isinstance(p, tuple) else p


def _cat_fw(n, P):
    xs = [x for x in n.args[0] if isinstance(x, Node)]
    ps = [P(x) for x in xs]
    nd = fake(n).ndim
    d = norm_dim(_arg(n, 1, "dim", 0), nd)
    if all(p == R for p in ps):
        return R
    if not all(isinstance(p, Shard) for p in ps):
        raise Refusal(f"mixes placements {[show(p) for p in ps]}")
    if n.target == aten.stack.default:
        if len(set(ps)) != 1:
            raise Refusal("stacks tensors sharded differently")
        return replace(ps[0], dim=ps[0].dim + (d <= ps[0].dim))
    if all(p.dim == d for p in ps) and len({p.axis for p in ps}) == 1:
        return Shard(d, tuple(s for p in ps for s in p.segs), ps[0].axis)
    if len(set(ps)) != 1 or ps[0].dim == d:
        raise Refusal(f"concatenates tensors sharded differently {[show(p) for p in ps]}")
    return ps[0]


def _cat_bw(n, req):
    xs = [x for x in n.args[0] if isinstance(x, Node)]
    d = norm_dim(_arg(n, 1, "dim", 0), fake(n).ndim)
    if n.target == aten.stack.default:
        if req.dim == d:
            raise Refusal("the stacked dim cannot be sharded")
        return {x: replace(req, dim=req.dim - (d < req.dim)) for x in xs}
    if req.dim != d:
        return {x: req for x in xs}
    out, pos = {}, 0
    for x in xs:
        size = shape_of(x)[d]
        out[x] = Shard(d, _covering(req.segs, pos, pos + size), req.axis)
        pos += size
    return out


# -- reductions --------------------------------------------------------------------------

def _reduced_dims(n) -> tuple[list[int], bool]:
    nd = len(shape_of(n.args[0]))
    dims = _arg(n, 1, "dim")
    if dims is None or dims == []:
        dims = list(range(nd))
    elif isinstance(dims, int):
        dims = [dims]
    keep = _arg(n, 2, "keepdim", False) if n.target != aten.var.correction else \
        n.kwargs.get("keepdim", False)
    return sorted(norm_dim(d, nd) for d in dims), bool(keep)


SUMMABLE = {aten.mean.dim, aten.sum.dim_IntList}


def _reduce_fw(n, P):
    p = P(n.args[0])
    if not isinstance(p, Shard):
        return p
    dims, keep = _reduced_dims(n)
    if p.dim not in dims:
        return replace(p, dim=p.dim - (0 if keep else sum(d < p.dim for d in dims)))
    if n.target not in SUMMABLE:
        raise Refusal(f"reduces over the sharded dim {p.dim} with {n.target}, which is not a "
                      f"sum (only sum and mean, e.g. RMSNorm, become an all-reduce)")
    if len({s.replicas for s in p.segs}) != 1:
        raise Refusal("reduces over segments replicated unevenly")
    reps = p.segs[0].replicas
    scale = 1.0 / reps
    if n.target == aten.mean.dim:   # local mean -> local sum / global count
        scale *= p.local / p.full
    return Partial(p.axis, scale)


def _reduce_bw(n, req):
    dims, keep = _reduced_dims(n)
    if keep:
        return {n.args[0]: req}
    k = req.dim
    for d in dims:
        if d <= k:
            k += 1
    return {n.args[0]: replace(req, dim=k)}


def _softmax_fw(n, P):
    p = P(n.args[0])
    if isinstance(p, Shard) and norm_dim(n.args[1], fake(n).ndim) == p.dim:
        raise Refusal("softmax over the sharded dim")
    return p


_ALONG_DIMS = {aten.roll.default: 2, aten.flip.default: 1, aten.cumsum.default: 1}


def _along_dims(n):
    nd = len(shape_of(n.args[0]))
    dims = _arg(n, _ALONG_DIMS[n.target], "dims", None)
    if n.target == aten.roll.default and (dims is None or dims == []):
        return set(range(nd))           # roll without dims rolls the flattened tensor
    dims = [dims] if isinstance(dims, int) else list(dims)
    return {norm_dim(d, nd) for d in dims}


def _along_fw(n, P):
    """An op that moves or accumulates elements along some dims (roll, flip, cumsum)."""
    p = P(n.args[0])
    if isinstance(p, Shard) and p.dim in _along_dims(n):
        raise Refusal(f"moves elements along the sharded dim {p.dim}")
    return p


def _along_bw(n, req):
    if req.dim in _along_dims(n):
        raise Refusal(f"moves elements along dim {req.dim}")
    return {n.args[0]: req}


def _layer_norm_fw(n, P):
    """layer_norm / rms_norm over the last len(normalized_shape) dims: fine when those dims
    are not sharded (and the affine parameters are whole on every rank)."""
    p = P(n.args[0])
    for a in tensor_args(n)[1:]:
        if P(a) != R:
            raise Refusal(f"norm parameter {a.name} is {show(P(a))}")
    if isinstance(p, Shard) and p.dim >= len(shape_of(n.args[0])) - len(n.args[1]):
        raise Refusal(f"normalises over the sharded dim {p.dim} (only mean-of-squares "
                      f"written out, as in RMSNorm, becomes an all-reduce)")
    return p


def _layer_norm_bw(n, req):
    if req.dim >= len(shape_of(n.args[0])) - len(n.args[1]):
        raise Refusal("normalises over the required dim")
    return {n.args[0]: req}


RULES: dict = {}
for _op in (aten.layer_norm.default, aten.rms_norm.default):
    RULES[_op] = Rule("layer norm over the last dims", _layer_norm_fw, _layer_norm_bw)
for _op in _ALONG_DIMS:
    RULES[_op] = Rule("along dims (roll, flip, cumsum)", _along_fw, _along_bw)
for _op in DIM_MAPS:
    RULES[_op] = Rule("dim map (torch.distributed.tensor view ops)", _dims_fw, _dims_bw)
for _op in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
            aten.unbind.int):
    RULES[_op] = Rule("split (segment-aware)", _split_fw, None)
for _op in (aten.slice.Tensor, aten.narrow.default, aten.select.int):
    RULES[_op] = Rule("slice (segment-aware)", _slice_fw, _slice_bw)
for _op in (aten.cat.default, aten.stack.default):
    RULES[_op] = Rule("concatenate", _cat_fw, _cat_bw)
for _op in (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default,
            aten.var.correction):
    RULES[_op] = Rule("reduction", _reduce_fw, _reduce_bw)
for _op in (aten._softmax.default, aten.softmax.int, aten._log_softmax.default):
    RULES[_op] = Rule("softmax", _softmax_fw, lambda n, req: {n.args[0]: req})
RULES[operator.getitem] = Rule("getitem", _getitem_fw, None)
POINTWISE = Rule("pointwise (torch.Tag.pointwise, broadcasting)", _pointwise_fw, _pointwise_bw)


def rule_for(target) -> Rule | None:
    r = RULES.get(target)
    if r is None and torch.Tag.pointwise in getattr(target, "tags", ()):
        return POINTWISE
    return r


# ------------------------------------------------------------------------------------------
# The analysis
# ------------------------------------------------------------------------------------------

LINEAR = aten.linear.default
EMBEDDING = aten.embedding.default
ATTENTION = torch.ops.dcp.attention.default


@dataclass
class PlacementPlan:
    placements: dict[Node, object]              # every node: its placement (Partial: pending)
    params: dict[Node, Shard]                   # parameter placeholders that are sharded
    linears: dict[Node, str]                    # linear -> column | row | lm_head
    roles: dict[str, str] = field(default_factory=dict)   # linear/embedding name -> role
    embeddings: list[Node] = field(default_factory=list)
    kv_shard: Shard | None = None
    # attention node -> {"q"/"k"/"v": linears behind it, "o": its row-parallel O projection}
    attention: dict[Node, dict] = field(default_factory=dict)

    def of(self, n: Node):
        return self.placements.get(n)


def _replicated(p) -> bool:
    return all(_replicated(x) for x in p) if isinstance(p, tuple) else p == R


def _err(n: Node, what: str, fix: str) -> DCPTransformError:
    return DCPTransformError(f"{what}: node {n.name} ({n.target}) at {source_of(n)}. {fix}.")


def head_shards(config) -> tuple[Shard, Shard]:
    """What dcp.attention needs of q and of k/v ([B, S, H, D], heads at dim 2)."""
    a = config.attention_shard
    hq, hkv = config.num_q_heads, config.num_kv_heads
    q = Shard(2, (Seg(hq, a),), "attn")
    kv = Shard(2, (Seg(hkv, min(hkv, a), max(1, a // hkv)),), "attn")
    return q, canon(kv)


class Analysis:
    def __init__(self, gm: GraphModule, config):
        self.gm, self.cfg = gm, config
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        rank = [n for n in self.nodes if n.op == "placeholder" and n.name == RANK_INPUT]
        first_user = self.order[rank[0]] if rank else None
        self.params = {n for n in self.nodes if n.op == "placeholder" and (
            first_user is None and n.name.startswith(("p_", "b_", "c_"))
            or first_user is not None and self.order[n] < first_user)}
        self.attn = attention_nodes(gm)
        self.q_shard, self.kv_shard = head_shards(config)
        self.known: dict[Node, object] = {}
        self.req: dict[Node, object] = {}
        self.decided: dict[Node, object] = {}     # param -> placement
        self.linears: dict[Node, str] = {}

    # -- pieces ----------------------------------------------------------------------------

    def P(self, n: Node):
        if n in self.params:
            return self.decided.get(n, R)
        return self.known.get(n)

    def decide(self, param: Node, p, why: Node) -> None:
        old = self.decided.get(param)
        if old is not None and old != p:
            raise _err(why, f"parameter {param.name} is needed as {show(old)} and as {show(p)}",
                       "Tied or shared weights must be cut the same way; untie them")
        self.decided[param] = p

    def require(self, n: Node, p, why: Node) -> bool:
        if p is None:
            return False
        old = self.req.get(n)
        if old is not None and old != p:
            raise _err(why, f"{n.name} is required to be {show(old)} and {show(p)}",
                       "The model mixes layouts that no single weight cut serves")
        self.req[n] = p
        return old is None

    def _refuse(self, n: Node, ins, reason: str):
        placed = ", ".join(f"{a.name}={show(self.P(a))}" for a in ins)
        return _err(n, f"no placement rule for {n.target} with inputs [{placed}] ({reason})",
                    "Write this op as an elementwise/view/split/sum op over replicated or "
                    "head-sharded tensors, or add a rule to passes.placement.RULES")

    # -- forward ---------------------------------------------------------------------------

    def forward(self, n: Node, strict: bool):
        """This node's placement from its inputs', or None when an input is still unknown."""
        if n.op == "placeholder":
            if n in self.params:
                return self.decided.get(n, R)
            if n.name == RANK_INPUT:
                return "rank"
            return R
        if n.op == "output":
            return None
        ins = tensor_args(n)
        t = n.target
        if t == LINEAR:
            return self._linear_fw(n, strict)
        if t == EMBEDDING:
            return R if self.P(n.args[0]) is not None else None
        if t == ATTENTION:
            return self._attention_fw(n, strict)
        ps = [self.P(a) for a in ins]
        if any(p == "rank" for p in ps):
            return R  # rank arithmetic (inserted masks) is per-rank by design
        if any(p is None for p in ps):
            if not strict and rule_for(t) is POINTWISE:
                self._sideways(n, ins)
            return None
        ps = [R if isinstance(p, Partial) else p for p in ps]  # reduced at once
        if all(_replicated(p) for p in ps):
            return R if not isinstance(fake(n), (tuple, list)) else tuple(R for _ in fake(n))
        rule = rule_for(t)
        if rule is None:
            raise self._refuse(n, ins, "no rule for this op")
        try:
            if rule is POINTWISE and not strict:
                self._adopt_params(n, ins)
            return rule.forward(n, lambda a: R if isinstance(self.P(a), Partial) else self.P(a))
        except Refusal as e:
            raise self._refuse(n, ins, str(e)) from None

    def _adopt_params(self, n, ins):
        """A parameter combined elementwise with a sharded tensor (a norm weight over all
        heads) takes the same cut."""
        sh = [self.P(a) for a in ins if isinstance(self.P(a), Shard)]
        if not sh:
            return
        out_nd = fake(n).ndim
        a0 = next(a for a in ins if isinstance(self.P(a), Shard))
        j = sh[0].dim + out_nd - fake(a0).ndim
        for a in ins:
            if a in self.params and a not in self.decided:
                k = j - (out_nd - fake(a).ndim)
                if k >= 0 and fake(a).shape[k] != 1:
                    self.decide(a, replace(sh[0], dim=k), n)

    def _sideways(self, n, ins):
        """Pointwise op with a known sharded operand and unknown ones: they must match it."""
        known = [a for a in ins if isinstance(self.P(a), Shard)]
        if not known:
            return
        out_nd = fake(n).ndim
        p = self.P(known[0])
        self.require(n, replace(p, dim=p.dim + out_nd - fake(known[0]).ndim), n)

    def _linear_fw(self, n, strict):
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else None
        px, pw = self.P(x), self.decided.get(w)
        if pw is None and strict:
            pw = R
        if px is None or pw is None or (b is not None and self.P(b) is None):
            return None
        px = R if isinstance(px, Partial) else px
        kind = self.linears.get(n)
        last = len(shape_of(n)) - 1
        if px == R and pw == R and kind == "replicated":
            return R
        if px == R and isinstance(pw, Shard) and pw.dim == 0:
            if b is not None and self.P(b) != replace(pw, dim=0):
                raise _err(n, f"bias {b.name} is {show(self.P(b))}, weight {show(pw)}",
                           "A column-parallel bias must be cut like the weight's rows")
            if kind == "lm_head":
                return R   # all-gathered over the vocab
            return replace(pw, dim=last)
        if isinstance(px, Shard) and isinstance(pw, Shard) and pw.dim == 1 \
                and px.dim == len(shape_of(x)) - 1 and replace(px, dim=1) == pw:
            if b is not None and self.P(b) != R:
                raise _err(n, f"row-parallel bias {b.name} is {show(self.P(b))}",
                           "The bias is added once after the all-reduce; keep it replicated")
            return Partial(pw.axis)
        raise _err(n, f"linear with input {show(px)} and weight {show(pw)} has no "
                      f"tensor-parallel form",
                   "Column-parallel needs a replicated input, row-parallel an input sharded "
                   "like the weight's columns")

    def _attention_fw(self, n, strict):
        q, k, v, kc, vc = n.args[:5]
        ps = [self.P(a) for a in (q, k, v, kc, vc)]
        if any(p is None for p in ps):
            # Its output is sharded by q heads whatever comes in (checked in the strict pass):
            # known early, so that an output gate can learn its cut from it.
            return None if strict else (self.q_shard, self.kv_shard, self.kv_shard)
        want = [self.q_shard, self.kv_shard, self.kv_shard, self.kv_shard, self.kv_shard]
        for what, a, p, w in zip(("q", "k", "v", "key_cache", "value_cache"),
                                 (q, k, v, kc, vc), ps, want):
            if p != w:
                raise _err(n, f"attention {what} ({a.name}) is {show(p)}, expected {show(w)}",
                           "q, k and v must each come from projections cut by heads; check "
                           "that nothing mixes heads between the projection and attention")
        for a in n.args[5:7]:
            if self.P(a) not in (R, None):
                raise _err(n, f"attention input {a.name} is {show(self.P(a))}",
                           "positions and block tables must be replicated")
        return (self.q_shard, self.kv_shard, self.kv_shard)

    # -- backward --------------------------------------------------------------------------

    def backward_sweep(self) -> bool:
        changed = False
        for n in reversed(self.nodes):
            if n.op != "call_function" and n not in self.params:
                if n.op == "placeholder" and isinstance(self.req.get(n), Shard) \
                        and n.name not in {a.name for at in self.attn for a in at.args[3:5]}:
                    raise _err(n, f"input {n.name} is replicated but needed as "
                                  f"{show(self.req[n])}", "Only weights can be cut")
                continue
            if n in self.params:
                if n in self.req and n not in self.decided:
                    self.decide(n, self.req[n], n)
                    changed = True
                continue
            if n in self.known or n.target == operator.getitem or n.target in (
                    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                    aten.unbind.int):
                continue   # split outputs: their input collects them (_from_range_users)
            req = self.req.get(n)
            if req is None:
                req = self._from_range_users(n)
                if req is not None:
                    changed |= self.require(n, req, n)
            if req is None:
                continue
            if n.target == LINEAR:
                changed |= self._decide_column(n, req)
                continue
            if n.target == EMBEDDING or n.target == ATTENTION:
                continue
            rule = rule_for(n.target)
            if req == R:   # replicated output from replicated inputs, for any op
                for a in tensor_args(n):
                    if self.P(a) is None or a in self.params:
                        changed |= self.require(a, R, n)
                continue
            if rule is None or rule.backward is None:
                raise self._refuse(n, tensor_args(n), f"required to be {show(req)}, and the "
                                                       f"op has no backward rule")
            try:
                need = rule.backward(n, req)
            except Refusal as e:
                raise self._refuse(n, tensor_args(n), f"required to be {show(req)}: {e}") \
                    from None
            for a, p in need.items():
                if p is not None and (self.P(a) is None or a in self.params):
                    changed |= self.require(a, p, n)
        return changed

    def _from_range_users(self, n: Node):
        """A tensor whose users split it (split/chunk/unbind via getitem, or slices) into runs
        along one dim, each run required sharded there: it is the concatenation (segmented)."""
        runs = []
        for u in n.users:
            if u.op != "call_function":
                return None
            if u.target in (aten.split.Tensor, aten.split_with_sizes.default,
                            aten.chunk.default):
                d, bounds = _split_ranges(u)
                items = {g.args[1]: g for g in u.users}
                for i, (a, b) in enumerate(bounds):
                    g = items.get(i)
                    runs.append((a, b, self.req.get(g) if g is not None else None, d))
            elif u.target in (aten.slice.Tensor, aten.narrow.default):
                d, a, b, step = _slice_bounds(u)
                runs.append((a, b, self.req.get(u) if step == 1 else None, d))
            elif u.target == aten.unbind.int:
                return self._same_for_all(u, n)
            else:
                return None
        if not runs:
            return None
        dims = {r[3] for r in runs}
        reqs = [r[2] for r in runs if r[2] is not None]
        if len(dims) != 1 or not reqs:
            return None
        d = dims.pop()
        if all(r == R for r in reqs):
            return R if len(reqs) == len(runs) else None
        if any(r != R and r.dim != d for r in reqs):
            same = set(reqs)   # split off the sharded dim: all pieces alike
            if len(same) == 1 and all(r[2] is not None for r in runs):
                return same.pop()
            return None
        if any(r[2] is None for r in runs):
            return None        # wait until every run is known
        axis = next(r.axis for r in reqs if isinstance(r, Shard))
        group = self.cfg.attention_shard if axis == "attn" else self.cfg.tp
        runs = [(a, b, Shard(d, (Seg(b - a, 1, group),), axis) if r == R else r, dd)
                for a, b, r, dd in runs]    # a replicated run: whole on every rank
        runs.sort()
        pos, segs = 0, []
        for a, b, r, _ in runs:
            if a != pos or r.full != b - a:
                return None    # overlapping or gapped runs: not a partition
            segs.extend(r.segs)
            pos = b
        if pos != shape_of(n)[d] or len({r.axis for _, _, r, _ in runs}) != 1:
            return None
        return Shard(d, tuple(segs), reqs[0].axis)

    def _same_for_all(self, u, n):
        reqs = [self.req.get(g) for g in u.users]
        if not reqs or any(r is None for r in reqs) or len(set(reqs)) != 1:
            return None
        r = reqs[0]
        d = norm_dim(_arg(u, 1, "dim", 0), len(shape_of(n)))
        return replace(r, dim=r.dim + (d <= r.dim))

    def _decide_column(self, n: Node, req) -> bool:
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else None
        if n in self.linears:
            return False
        if self.P(x) is None and isinstance(req, Shard):
            # A column projection reads a replicated input: a low-rank path before it (MLA's
            # q_a_proj -> RMSNorm -> q_b_proj) is then replicated, not an MLP down projection.
            return self.require(x, R, n)
        if self.P(x) != R and not isinstance(self.P(x), Partial):
            return False
        last = len(shape_of(n)) - 1
        if req == R:   # an MQA KV projection: every rank computes the one head
            self._check_weight(n, w)
            self.decide(w, R, n)
            if b is not None:
                self.decide(b, R, n)
            self.linears[n] = "replicated"
            return True
        if not isinstance(req, Shard) or req.dim != last:
            raise _err(n, f"linear output is required to be {show(req)}",
                       "Only the output features of a projection can be cut")
        self._check_weight(n, w)
        self.decide(w, replace(req, dim=0), n)
        if b is not None:
            self.decide(b, replace(req, dim=0), n)
        self.linears[n] = "column"
        return True

    def _check_weight(self, n, w):
        if w not in self.params:
            raise _err(n, f"linear weight {w.name} is not a parameter",
                       "Use nn.Linear weights directly (no transposed or computed weights)")

    def _decide_row(self, n: Node, px: Shard) -> None:
        self._check_weight(n, n.args[1])
        self.decide(n.args[1], replace(px, dim=1), n)
        self.linears[n] = "row"

    # -- driver ----------------------------------------------------------------------------

    def forward_sweep(self) -> bool:
        changed = False
        for n in self.nodes:
            if n in self.known:
                continue
            p = self.forward(n, strict=False)
            if p is not None:
                self.known[n] = p
                changed = True
        for n in self.nodes:  # a linear reading a sharded input is row-parallel
            if n.target == LINEAR and n not in self.linears and isinstance(
                    self.P(n.args[0]), Shard):
                px = self.P(n.args[0])
                if px.dim != len(shape_of(n.args[0])) - 1:
                    raise _err(n, f"linear input is {show(px)}", "Only the input features "
                               "of a row-parallel projection can be cut")
                self._decide_row(n, px)
                changed = True
        return changed

    def run(self) -> PlacementPlan:
        if not self.attn:
            raise DCPTransformError("placement analysis found no dcp.attention node. Run "
                                    "canonicalize_attention first.")
        for at in self.attn:
            for i, want in ((0, self.q_shard), (1, self.kv_shard), (2, self.kv_shard)):
                self.require(at.args[i], want, at)
            for c in at.args[3:5]:
                self.known[c] = self.kv_shard
        while True:
            while self.forward_sweep() | self.backward_sweep():
                pass
            pending = [n for n in self.nodes if n.target == LINEAR and n not in self.linears]
            down = [n for n in pending if self.P(n.args[0]) is None]
            if down:   # an MLP's down projection: row-parallel over full TP
                n = down[0]
                k = shape_of(n.args[0])[-1]
                px = Shard(len(shape_of(n.args[0])) - 1, (Seg(k, self.cfg.tp),), "mlp")
                if k % self.cfg.tp:
                    raise _err(n, f"linear input features {k} do not split over "
                                  f"tp={self.cfg.tp}", "Pick a tp that divides them")
                self._decide_row(n, px)
                self.require(n.args[0], px, n)
                continue
            break
        for n in pending:
            if n in self.linears:
                continue
            if not _reaches_output_directly(n):
                raise _err(n, "cannot tell how to shard this linear: it is not a q/k/v/o "
                              "projection, an MLP pair or the LM head",
                           "Refusing to leave it unsharded; restructure the model")
            vocab = shape_of(n)[-1]
            if vocab % self.cfg.tp:
                raise _err(n, f"vocabulary of {vocab} does not split over tp={self.cfg.tp}",
                           "Pad the vocabulary to a multiple of tp")
            self._check_weight(n, n.args[1])
            spec = Shard(0, (Seg(vocab, self.cfg.tp),), "mlp")
            self.decide(n.args[1], spec, n)
            if len(n.args) > 2 and n.args[2] is not None:
                self.decide(n.args[2], spec, n)
            self.linears[n] = "lm_head"
        embeddings = [n for n in self.nodes if n.target == EMBEDDING]
        for e in embeddings:
            vocab = shape_of(e.args[0])[0]
            if vocab % self.cfg.tp:
                raise _err(e, f"vocabulary of {vocab} does not split over tp={self.cfg.tp}",
                           "Pad the vocabulary to a multiple of tp")
            self.decide(e.args[0], Shard(0, (Seg(vocab, self.cfg.tp),), "mlp"), e)
        return self.check(embeddings)

    def check(self, embeddings) -> PlacementPlan:
        """Strict forward pass: every node placed by a rule, every requirement met."""
        self.known = {}
        for c in {c for at in self.attn for c in at.args[3:5]}:
            self.known[c] = self.kv_shard
        for n in self.nodes:
            if n in self.known:
                continue
            p = self.forward(n, strict=True)
            if p is None and n.op != "output":
                raise _err(n, "no placement could be derived", "Report this model")
            self.known[n] = p
        out = next(n for n in self.nodes if n.op == "output")
        for a in tensor_args(out):
            p = self.known[a]
            if p != R and not (isinstance(p, Shard) and p == self.kv_shard
                               and a.target == operator.getitem
                               and a.args[0].target == ATTENTION):
                raise _err(a, f"graph output {a.name} is {show(p)}",
                           "Outputs other than the KV caches must be replicated")
        params = {p: s for p, s in self.decided.items() if isinstance(s, Shard)}
        for p in params:
            self.known[p] = params[p]
        roles = self._roles(embeddings)
        return PlacementPlan(self.known, params, dict(self.linears), roles, embeddings,
                             self.kv_shard, self._projections())

    def _projections(self) -> dict[Node, dict]:
        out = {}
        for at in self.attn:
            sites = {w: sorted(_linears_behind(at.args[i]), key=self.order.__getitem__)
                     for i, w in enumerate("qkv")}
            ahead = _linears_ahead(at)
            o = ahead[0] if len(ahead) == 1 else None
            if o is not None and not (self.linears.get(o) == "row"
                                      and self.decided[o.args[1]].axis == "attn"):
                o = None
            out[at] = {**sites, "o": o}
        return out

    def _roles(self, embeddings) -> dict[str, str]:
        roles = {}
        feeds = {}
        for at in self.attn:
            for i, what in enumerate("qkv"):
                for lin in _linears_behind(at.args[i]):
                    feeds.setdefault(lin, set()).add(what)
        for n, kind in self.linears.items():
            if kind == "lm_head":
                roles[n.name] = "lm_head"
            elif kind == "row":
                roles[n.name] = "o_proj" if self.decided[n.args[1]].axis == "attn" \
                    else "mlp_row"
            elif n in feeds:
                roles[n.name] = "".join(w for w in "qkv" if w in feeds[n]) + "_proj"
            elif kind == "replicated":       # e.g. MLA's q_a_proj (low-rank q path)
                roles[n.name] = "replicated"
            else:
                roles[n.name] = "mlp_column" if self.decided[n.args[1]].axis == "mlp" \
                    else "attention_column"
        for e in embeddings:
            roles[e.name] = "embedding"
        return roles


def _linears_reached(starts: list[Node], onward) -> list[Node]:
    """Linears reached from ``starts`` following ``onward`` (inputs or users), stopping at
    each linear and at attention."""
    out, seen, stack = [], set(), list(starts)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target == LINEAR:
            out.append(n)
        elif n.op == "call_function" and n.target != ATTENTION:
            stack.extend(onward(n))
    return out


def _linears_behind(start: Node) -> set[Node]:
    """Linears ``start`` is computed from, back to the nearest linear or attention."""
    return set(_linears_reached([start], lambda n: n.all_input_nodes))


def _linears_ahead(start: Node) -> list[Node]:
    """Linears reached forward from ``start`` before any other linear or attention."""
    return _linears_reached(list(start.users), lambda n: n.users)


def _reaches_output_directly(start: Node) -> bool:
    """Does ``start`` reach the graph output without passing another linear or attention?"""
    seen, stack, reaches, other = set(), list(start.users), False, False
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output":
            reaches = True
        elif n.target in (LINEAR, ATTENTION):
            other = True
        else:
            stack.extend(n.users)
    return reaches and not other


def analyze(gm: GraphModule, config) -> PlacementPlan:
    """Every node's placement over the tensor-parallel ranks, or DCPTransformError."""
    return Analysis(gm, config).run()


__all__ = ["Seg", "Shard", "Replicate", "Partial", "R", "Rule", "RULES", "rule_for",
           "PlacementPlan", "analyze", "head_shards", "show", "DIM_MAPS"]


# ------------------------------------------------------------------------------------------
# The token dim (prefill): the same rules, with tokens as the "sharded" dim
# ------------------------------------------------------------------------------------------

# Collectives act on each element on its own across ranks: every dim passes through.
for _op in (torch.ops._c10d_functional.all_reduce.default,
            torch.ops._c10d_functional.wait_tensor.default):
    DIM_MAPS[_op] = _identity
    RULES[_op] = Rule("dim map (collective, elementwise across ranks)", _dims_fw, _dims_bw)


def token_dim(n: Node, dims: dict[Node, int], tokens: int) -> int:
    """Where the token dim (size ``tokens``, at ``dims[a]`` of each input ``a`` that carries
    it) is in ``n``'s output, if ``n`` keeps tokens apart: the op's placement rule must map a
    token-sharded input to an output sharded on one dim of exactly ``tokens`` elements.
    Inputs without tokens are replicated (broadcast); a per-token side input aligned with the
    token dim counts as token-sharded (callers gather or refuse it). Refusal otherwise."""
    rule = rule_for(n.target)
    if rule is None:
        raise Refusal(f"{n.target} has no placement rule")
    seg = (Seg(tokens, tokens),)
    out_nd = fake(n).ndim if isinstance(fake(n), torch.Tensor) else None
    first = next(iter(dims))
    first_nd = fake(first).ndim if isinstance(fake(first), torch.Tensor) else out_nd
    j = None if out_nd is None else dims[first] + out_nd - first_nd

    def P(a):
        if a in dims:
            return Shard(dims[a], seg, "seq")
        v = fake(a)
        if j is not None and isinstance(v, torch.Tensor):
            k = j - (out_nd - v.ndim)
            if 0 <= k < v.ndim and v.shape[k] == tokens and tokens > 1:
                return Shard(k, seg, "seq")
        return R

    out = rule.forward(n, P)
    outs = out if isinstance(out, tuple) else (out,)
    if not outs or any(not isinstance(o, Shard) or o.segs != seg for o in outs) \
            or len({o.dim for o in outs}) != 1:
        raise Refusal(f"{n.target} does not keep the token dim whole ({show(out)})")
    return outs[0].dim
