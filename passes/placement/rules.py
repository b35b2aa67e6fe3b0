"""Placement rules by op family, as data: ``RULES`` maps an op to a forward rule (input
placements -> output placement) and a backward rule (a placement required of the output ->
what each input must be); ``rule_for`` finds pointwise ops by their torch tag. A rule that
cannot place an op raises :class:`Refusal`."""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch.fx import Node

from ..op_classes import (BATCHED_MATMULS, JOINS, LAYER_NORMS, LOG_SOFTMAX, PADS, REDUCTIONS,
                          SLICES, SOFTMAX, SPLITS, SUM_REDUCTIONS, VECTOR_NORMS, VIEW_SCATTERS,
                          WHERES, MULTIPLY_ALIASES)
from .dim_maps import COLLECTIVES, DIM_MAPS, dims_backward, dims_forward
from .lattice import R, Partial, Refusal, Shard, canon, show
from .node_args import fake, node_arg, norm_dim, shape_of, tensor_args

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------
# Rules: forward (node, placements of its tensor inputs) -> placement; backward
# (node, required output placement) -> {input: required placement}.
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    name: str
    forward: Callable
    backward: Callable | None = None
    # (node, P) -> {replicated operand: the placement it needs}: a parameter reached through
    # views takes that cut (the analysis maps it back to the parameter; MLA's W_UK / W_UV are
    # per-head views of kv_b_proj's weight met by head-sharded activations).
    adopt: Callable | None = None
    # (node, operand, output dim) -> the operand's dim indexed like that output dim, or None;
    # None here: broadcasting alignment (trailing dims line up), as for elementwise ops.
    aligned: Callable | None = None


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

def split_ranges(n) -> tuple[int, list[tuple[int, int]]]:
    """(dim, [start, end) of each output) of a split-like op, on full sizes."""
    x = n.args[0]
    nd = len(shape_of(x))
    t = n.target
    if t == aten.unbind.int:
        d = norm_dim(node_arg(n, 1, "dim", 0), nd)
        return d, [(i, i + 1) for i in range(shape_of(x)[d])]
    d = norm_dim(node_arg(n, 2, "dim", 0), nd)
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
    d, bounds = split_ranges(n)
    if d != p.dim:
        q = replace(p, dim=p.dim - (n.target == aten.unbind.int and d < p.dim))
        return tuple(q for _ in bounds)
    if n.target == aten.unbind.int:
        raise Refusal("unbinds the sharded dim")
    return tuple(canon(Shard(d, _covering(p.segs, a, b), p.axis)) for a, b in bounds)


def slice_bounds(n):
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
    d = norm_dim(node_arg(n, 1, "dim", 0), nd)
    start, end, step = node_arg(n, 2, "start"), node_arg(n, 3, "end"), node_arg(n, 4, "step", 1)
    start, end, _ = slice(start, end, step).indices(size(d))
    return d, start, max(end, start), step


def _slice_fw(n, P):
    p = P(n.args[0])
    if not isinstance(p, Shard):
        return p
    d, start, end, step = slice_bounds(n)
    if d != p.dim:
        return replace(p, dim=p.dim - (n.target == aten.select.int and d < p.dim))
    if n.target == aten.select.int or step != 1:
        raise Refusal("selects inside the sharded dim")
    return canon(Shard(d, _covering(p.segs, start, end), p.axis))


def _slice_bw(n, req):
    d, *_ = slice_bounds(n)
    k = req.dim + (n.target == aten.select.int and d <= req.dim)
    if k == d:
        return {}   # a run of segments: combined over all of the input's range users
    return {n.args[0]: replace(req, dim=k)}


def _scatter_src_dim(n, dim: int) -> int:
    """The dim of a view scatter's source indexed like its output's ``dim`` (a select
    scatter's source has no scattered dim)."""
    d = norm_dim(node_arg(n, 2, "dim", 0), fake(n).ndim)
    return dim - (n.target == aten.select_scatter.default and d < dim)


def _view_scatter_fw(n, P):
    """``slice_scatter(x, src, dim, ...)`` / ``select_scatter(x, src, dim, i)``: x with src
    written into a slice / select of ``dim`` (canonical_ops made an in-place write a value:
    Gemma 3n's ``corrected[1:] += x``). Each element comes from x or from the element of src
    at the same place along every other dim, so it is placed as x when src is placed the
    same on those dims and ``dim`` is not the sharded one."""
    x, src = n.args[0], n.args[1]
    px, ps = P(x), P(src)
    if px == R and ps == R:
        return R
    if not isinstance(px, Shard):
        raise Refusal(f"writes {show(ps)} into {show(px)}")
    d = norm_dim(node_arg(n, 2, "dim", 0), fake(n).ndim)
    if px.dim == d:
        raise Refusal(f"writes into the sharded dim {d}")
    if ps != replace(px, dim=_scatter_src_dim(n, px.dim)):
        raise Refusal(f"writes {show(ps)} into {show(px)}")
    return px


def _view_scatter_aligned(n, x, out_dim: int) -> int | None:
    """x's dims are the output's; the source's skip a select scatter's dim."""
    if x is n.args[0]:
        return out_dim
    d = norm_dim(node_arg(n, 2, "dim", 0), fake(n).ndim)
    if n.target == aten.select_scatter.default and out_dim == d:
        return None
    return _scatter_src_dim(n, out_dim)


def _view_scatter_bw(n, req):
    d = norm_dim(node_arg(n, 2, "dim", 0), fake(n).ndim)
    if req.dim == d:
        raise Refusal(f"writes into dim {d}")
    return {n.args[0]: req, n.args[1]: replace(req, dim=_scatter_src_dim(n, req.dim))}


def _padded_dims(n) -> set[int]:
    """The dims ``pad(x, [last_lo, last_hi, prev_lo, prev_hi, ...])`` pads (nonzero)."""
    nd, pads = len(shape_of(n.args[0])), node_arg(n, 1, "pad")
    return {nd - 1 - i // 2 for i, w in enumerate(pads) if w}


def _pad_fw(n, P):
    p = P(n.args[0])
    if isinstance(p, Partial):
        raise Refusal("pads a pending sum")
    if isinstance(p, Shard) and p.dim in _padded_dims(n):
        raise Refusal(f"pads the sharded dim {p.dim}")
    return p


def _pad_bw(n, req):
    if req.dim in _padded_dims(n):
        raise Refusal(f"pads the sharded dim {req.dim}")
    return {n.args[0]: req}


def _getitem_fw(n, P):
    p = P(n.args[0])
    return p[n.args[1]] if isinstance(p, tuple) else p


def _cat_fw(n, P):
    xs = [x for x in n.args[0] if isinstance(x, Node)]
    ps = [P(x) for x in xs]
    nd = fake(n).ndim
    d = norm_dim(node_arg(n, 1, "dim", 0), nd)
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
    d = norm_dim(node_arg(n, 1, "dim", 0), fake(n).ndim)
    if n.target == aten.stack.default:
        if req.dim == d:
            raise Refusal("the stacked dim cannot be sharded")
        return {x: replace(req, dim=req.dim - (d < req.dim)) for x in xs}
    if req.dim != d:
        return {x: req for x in xs}
    out, pos = {}, 0
    for x in xs:
        size = shape_of(x)[d]
        try:
            out[x] = Shard(d, _covering(req.segs, pos, pos + size), req.axis)
        except Refusal as e:
            if len(xs) > 1 and size < max(s.size for s in req.segs):
                raise Refusal(_finer_parts(req, size, len(xs))) from e
            raise
        pos += size
    return out


def _finer_parts(req, size: int, parts: int) -> str:
    # Each part its own computation (StableLM's qk_layernorm: one LayerNorm module, with its
    # own weight, per head over split + cat): which parts a rank computes depends on the
    # rank, and one graph for every rank (weights cut per parameter) cannot say that.
    return (f"concatenates {parts} parts of {size} along the dim cut as {show(req)}, each "
            f"inside one cut segment: a rank would compute other parts than its neighbours "
            f"(per-head modules with their own parameters). Write it as one op over all parts "
            f"(one norm with a [heads, head_dim] weight)")


# -- reductions --------------------------------------------------------------------------

def _reduced_dims(n) -> tuple[list[int], bool]:
    nd = len(shape_of(n.args[0]))
    at = 2 if n.target in VECTOR_NORMS else 1          # after a norm's `ord`
    dims = node_arg(n, at, "dim")
    if dims is None or dims == []:
        dims = list(range(nd))
    elif isinstance(dims, int):
        dims = [dims]
    keep = node_arg(n, at + 1, "keepdim", False) if n.target != aten.var.correction else \
        n.kwargs.get("keepdim", False)
    return sorted(norm_dim(d, nd) for d in dims), bool(keep)


def _reduce_fw(n, P):
    p = P(n.args[0])
    if not isinstance(p, Shard):
        return p
    dims, keep = _reduced_dims(n)
    if p.dim not in dims:
        return replace(p, dim=p.dim - (0 if keep else sum(d < p.dim for d in dims)))
    if n.target not in SUM_REDUCTIONS:
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
    dims = node_arg(n, _ALONG_DIMS[n.target], "dims", None)
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


# -- batched matmul (matmul / bmm): DTensor's strategies, the head dim as a batch dim ------

def _mm_role(n, x, i: int, p) -> tuple[str, int]:
    """(role, output dim) of operand i's (0: left, 1: right) sharded dim: a batch dim (any but
    the last two), left rows, right columns, or the contracted dim."""
    nd, out_nd = fake(x).ndim, fake(n).ndim
    if p.dim < nd - 2:
        return "batch", p.dim + out_nd - nd
    if p.dim == (nd - 2 if i == 0 else nd - 1):
        return ("rows", out_nd - 2) if i == 0 else ("columns", out_nd - 1)
    return "contracted", -1


def _mm_operands(n):
    a, b = n.args[0], n.args[1]
    if fake(a).ndim < 2 or fake(b).ndim < 2:
        raise Refusal("a vector operand (only matrices and batches of them have a rule)")
    return a, b


def _broadcast_at(x, out_dim: int, out_nd: int) -> bool:
    k = out_dim - (out_nd - fake(x).ndim)
    return k < 0 or fake(x).shape[k] == 1


def _matmul_fw(n, P):
    """Both operands sharded alike on one batch dim (a replicated operand only broadcast
    there) -> sharded there; left rows x replicated -> rows; replicated x right columns ->
    columns. Anything else (a contracted dim sharded: a pending sum; a sharded batch dim met
    by a whole replicated operand; two different cuts) is refused by name."""
    a, b = _mm_operands(n)
    out_nd = fake(n).ndim
    ps = [P(a), P(b)]
    for x, p in zip((a, b), ps):
        if p != R and not isinstance(p, Shard):
            raise Refusal(f"operand {x.name} is {show(p)}")
    placed = [(i, _mm_role(n, x, i, p), p) for i, (x, p) in enumerate(zip((a, b), ps))
              if isinstance(p, Shard)]
    if not placed:
        return R
    roles = {role for _, (role, _), _ in placed}
    if "contracted" in roles:
        raise Refusal("contracts over the sharded dim (a pending sum; not a head-parallel "
                      "product)")
    (i, (role, d), p) = placed[0]
    out = replace(p, dim=d)
    if role == "batch":
        if len(placed) == 2:
            (_, (role2, d2), p2) = placed[1]
            if role2 != "batch" or replace(p2, dim=d2) != out:
                raise Refusal(f"operands are cut differently ({show(p)} and {show(p2)})")
        elif not _broadcast_at((a, b)[1 - i], d, out_nd):
            raise Refusal(f"batch dim {d} is sharded on {(a, b)[i].name} but operand "
                          f"{(a, b)[1 - i].name} is whole there (it needs the same cut)")
        if fake(n).shape[d] != out.full:
            raise Refusal("the sharded batch dim is broadcast")
        return out
    if len(placed) == 2:
        raise Refusal(f"both operands sharded ({show(ps[0])} and {show(ps[1])}) off the "
                      f"batch dims")
    return out


def _matmul_bw(n, req):
    a, b = _mm_operands(n)
    out_nd = fake(n).ndim
    if req.dim < out_nd - 2:
        return {x: None if _broadcast_at(x, req.dim, out_nd)
                else replace(req, dim=req.dim - (out_nd - fake(x).ndim)) for x in (a, b)}
    if req.dim == out_nd - 2:
        return {a: replace(req, dim=fake(a).ndim - 2), b: None}
    return {a: None, b: replace(req, dim=fake(b).ndim - 1)}


def _matmul_aligned(n, x, out_dim: int) -> int | None:
    """Batch dims line up by broadcasting; the output rows are the left operand's rows, the
    columns the right one's (the contracted dim has no output dim)."""
    a, b = _mm_operands(n)
    out_nd, nd = fake(n).ndim, fake(x).ndim
    if out_dim < out_nd - 2:
        k = out_dim - (out_nd - nd)
        return k if k >= 0 else None
    if out_dim == out_nd - 2:
        return nd - 2 if x is a else None
    return nd - 1 if x is b else None


def _matmul_adopt(n, P) -> dict:
    """One operand sharded on a batch dim, the other replicated there: the other needs the
    same cut (taken by a parameter behind views, refused otherwise)."""
    a, b = _mm_operands(n)
    out_nd = fake(n).ndim
    ps = [P(a), P(b)]
    for i in (0, 1):
        p, other = ps[i], (a, b)[1 - i]
        if isinstance(p, Shard) and ps[1 - i] == R:
            role, d = _mm_role(n, (a, b)[i], i, p)
            if role == "batch" and not _broadcast_at(other, d, out_nd):
                return {other: replace(p, dim=d - (out_nd - fake(other).ndim))}
    return {}


RULES: dict = {}
for _op in BATCHED_MATMULS:
    RULES[_op] = Rule("batched matmul (heads as a batch dim)", _matmul_fw, _matmul_bw,
                      _matmul_adopt, _matmul_aligned)
for _op in LAYER_NORMS:
    RULES[_op] = Rule("layer norm over the last dims", _layer_norm_fw, _layer_norm_bw)
for _op in _ALONG_DIMS:
    RULES[_op] = Rule("along dims (roll, flip, cumsum)", _along_fw, _along_bw)
for _op in DIM_MAPS:
    RULES[_op] = Rule("dim map (torch.distributed.tensor view ops)", _dims_fw, _dims_bw)
for _op in COLLECTIVES:
    RULES[_op] = Rule("dim map (collective, elementwise across ranks)", _dims_fw, _dims_bw)
for _op in SPLITS:
    RULES[_op] = Rule("split (segment-aware)", _split_fw, None)
for _op in SLICES:
    RULES[_op] = Rule("slice (segment-aware)", _slice_fw, _slice_bw)
for _op in JOINS:
    RULES[_op] = Rule("concatenate", _cat_fw, _cat_bw)
for _op in VIEW_SCATTERS:
    RULES[_op] = Rule("view scatter (a write into a slice / select)", _view_scatter_fw,
                      _view_scatter_bw, aligned=_view_scatter_aligned)
for _op in REDUCTIONS:
    RULES[_op] = Rule("reduction", _reduce_fw, _reduce_bw)
for _op in SOFTMAX | LOG_SOFTMAX:
    RULES[_op] = Rule("softmax", _softmax_fw, lambda n, req: {n.args[0]: req})
RULES[operator.getitem] = Rule("getitem", _getitem_fw, None)
for _op in PADS:
    RULES[_op] = Rule("pad (other dims than the sharded one)", _pad_fw, _pad_bw)
# The recurrent ops' row: passes/placement/recurrent.py adds it (it places their linears
# too, through the weights module, which reads this one).

POINTWISE = Rule("pointwise (torch.Tag.pointwise, broadcasting)", _pointwise_fw, _pointwise_bw)


# Elementwise ops without torch's pointwise tag: where with a scalar branch (Gemma 3n clamps
# its per-layer ids: where(in_table, ids, 0)) and torch.multiply (mul's alias, Gemma 3n).
UNTAGGED_POINTWISE = WHERES | MULTIPLY_ALIASES


def rule_for(target) -> Rule | None:
    r = RULES.get(target)
    if r is None and (torch.Tag.pointwise in getattr(target, "tags", ())
                      or target in UNTAGGED_POINTWISE):
        return POINTWISE
    return r


def aligned_dim(n: Node, x: Node, out_dim: int) -> int | None:
    """The dim of ``n``'s tensor input ``x`` indexed like ``n``'s output dim ``out_dim``
    (None: x does not carry that dim). Broadcasting alignment unless the op's rule says
    otherwise (a matmul's right operand has no row dim)."""
    rule = rule_for(n.target)
    if rule is not None and rule.aligned is not None:
        return rule.aligned(n, x, out_dim)
    k = out_dim - (fake(n).ndim - fake(x).ndim)
    return k if k >= 0 else None
