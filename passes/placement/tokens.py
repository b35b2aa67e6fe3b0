"""The token dim (prefill) and any dim carried through ops (the batch dim, positions): the
placement rules, with that dim as the "sharded" one; ``HAND_PLACED_DIMS`` for the ops the
placement analysis places by hand (linear, embedding) or never meets."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.*)

from ..op_classes import (FLATTENS, LOOKUPS, RECURRENT_OPS, RESHAPES, SCATTERS,
                          SHAPE_ONLY_FILLS, UNTAGGED_ELEMENTWISE, VALUES_AND_INDICES)
from .lattice import R, Refusal, Seg, Shard, show
from .node_args import fake, shape_of
from .rules import aligned_dim, rule_for

aten = torch.ops.aten


def token_dim(n: Node, dims: dict[Node, int], tokens: int) -> int:
    """Where the token dim (size ``tokens``, at ``dims[a]`` of each input ``a`` that carries
    it) is in ``n``'s output, if ``n`` keeps tokens apart: the op's placement rule must map a
    token-sharded input to an output sharded on one dim of exactly ``tokens`` elements.
    Inputs without tokens are replicated (broadcast); a per-token side input aligned with the
    token dim counts as token-sharded (callers gather or refuse it). Refusal otherwise."""
    rule = rule_for(n.target)
    if rule is None:
        raise NoPlacementRule(f"{n.target} has no placement rule")
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
            k = aligned_dim(n, a, j)
            if k is not None and k < v.ndim and v.shape[k] == tokens and tokens > 1:
                return Shard(k, seg, "seq")
        return R

    out = rule.forward(n, P)
    outs = out if isinstance(out, tuple) else (out,)
    if not outs or any(not isinstance(o, Shard) or o.segs != seg for o in outs) \
            or len({o.dim for o in outs}) != 1:
        raise Refusal(f"{n.target} does not keep the token dim whole ({show(out)})")
    return outs[0].dim


def _paged_batch(n, dims):
    return (dims[n.args[0]], None, None)


def _getitem_dim(n, dims):
    src = dims[n.args[0]]
    return src[n.args[1]] if isinstance(src, tuple) else None


# Ops the placement analysis places by hand or not at all (its RULES leave them out): where
# a dim of the marked operand lands in the output.
HAND_PLACED_DIMS = {
    aten.outer.default: lambda n, dims: 0 if n.args[0] in dims else 1,
    aten.linear.default: lambda n, dims: dims.get(n.args[0]) if n.args[0] in dims and
    dims[n.args[0]] < len(shape_of(n.args[0])) - 1 else None,
    aten.embedding.default: lambda n, dims: dims.get(n.args[1]),
    aten.index_select.default: lambda n, dims: (n.args[1] % len(shape_of(n)))
    if n.args[2] in dims and n.args[0] not in dims else None,
    torch.ops.dcp.paged_attention.default: _paged_batch,
    operator.getitem: lambda n, dims: _getitem_dim(n, dims)
    if isinstance(dims.get(n.args[0]), tuple) else _rule_dim(n, dims, 0),
}


def _rule_dim(n: Node, dims: dict, size: int):
    ins = {a: dims[a] for a in n.all_input_nodes if isinstance(dims.get(a), int)}
    if not ins:
        raise Refusal("no input carries the dim")
    return token_dim(n, ins, size)


def carried_dim(n: Node, dims: dict, size: int):
    """Where ``n``'s output carries the dim ``dims`` marks on its inputs; Refusal if the
    rules cannot tell."""
    extra = HAND_PLACED_DIMS.get(n.target)
    if extra is None:
        return _rule_dim(n, dims, size)
    try:
        d = extra(n, dims)
    except (KeyError, IndexError, TypeError) as e:
        raise Refusal(f"{n.target} does not carry the dim ({type(e).__name__})") from e
    if d is None:
        raise Refusal(f"{n.target} does not carry the dim")
    return d


# -- token-wise analysis: every op outside attention keeps the tokens apart ------------------


@dataclass(frozen=True)
class Rows:
    """Where a value keeps its rows: dim ``dim``, of ``extent`` elements, one row per token
    (or per (sequence, token) pair once the batch dim is folded into it, as a [B*S, H] MoE
    input is)."""

    dim: int
    extent: int


class NoPlacementRule(Refusal):
    """The op has no placement rule: the analysis cannot say whether it mixes tokens."""


class TokenMixing(Exception):
    """``node`` computes a row from other rows (tokens) of its input: ``reason`` says how.
    ``unknown``: the op has no rule, so it is not shown to keep tokens apart (it may)."""

    def __init__(self, node: Node, reason: str, unknown: bool = False):
        super().__init__(reason)
        self.node, self.reason, self.unknown = node, reason, unknown


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def _reshape_rows(n: Node, rows: dict, tokens: int):
    """A view keeps rows apart iff the elements after the row dim stay together: an output
    dim whose trailing product equals the input's, holding whole rows (a multiple of the
    token count when sequences fold in)."""
    src = n.args[0]
    r, ins, outs = rows[src], list(shape_of(src)), list(shape_of(n))
    inner = _prod(ins[r.dim + 1:])
    for d in reversed(range(len(outs))):
        if _prod(outs[d + 1:]) == inner and outs[d] > 1 and outs[d] % tokens == 0:
            return Rows(d, outs[d])
    raise TokenMixing(n, f"the view {tuple(ins)} -> {tuple(outs)} splits the token dim "
                      f"{r.dim} or folds features into it")


def _attention_rows(n: Node, rows: dict, tokens: int):
    """Attention mixes tokens by design, over the cache: its output rows are its queries'."""
    q = n.args[0]
    if q not in rows:
        raise TokenMixing(n, "attention whose queries are not this step's tokens")
    return (rows[q], None, None)


def _recurrent_rows(n: Node, rows: dict, tokens: int):
    """A recurrent op mixes tokens by design, in order, through its state cache (the row's
    earlier tokens reach it there, as attention's reach it through the KV cache): its output
    rows are its input's; its state caches have none."""
    x = n.args[0]
    if x not in rows:
        raise TokenMixing(n, "a recurrent op whose input is not this step's tokens")
    return (rows[x],) + (None,) * (len(fake(n)) - 1)


def _moe_rows(n: Node, rows: dict, tokens: int):
    """Routed experts act on each row of ``x`` [T, H] on its own."""
    x = n.args[0]
    if x not in rows or rows[x].dim != 0:
        raise TokenMixing(n, "experts whose input x is not [tokens, hidden]")
    return rows[x]


def _lookup_rows(n: Node, rows: dict, tokens: int):
    """A table (no tokens) read at per-token indices: ``gather(table, dim, index)`` has the
    index's shape, ``table[index]`` puts the index's dims first."""
    table, index = (n.args[0], n.args[2]) if n.target == aten.gather.default else \
        (n.args[0], n.args[1][0] if len(n.args[1]) == 1 else None)
    if n.target == aten.gather.default and isinstance(rows.get(table), Rows) and \
            isinstance(rows.get(index), Rows) and rows[table] == rows[index] and \
            n.args[1] % fake(n).ndim != rows[index].dim:
        return rows[index]          # each row picks within itself (a router's top-k scores)
    if table in rows or index not in rows:
        raise TokenMixing(n, f"{n.target} reads token rows by index")
    return rows[index]


def _along(dim_at: int, default, keepdim_at: int | None = None, keepdim=False):
    """An op that works along one dim (``args[dim_at]``): rows stay apart unless that dim is
    the row dim (or None: all of them); a dim it drops moves the rows down by one."""
    def rule(n: Node, rows: dict, tokens: int):
        x = n.args[0]
        r = rows.get(x)
        if not isinstance(r, Rows):
            raise TokenMixing(n, f"{n.target} over a value without token rows")
        nd = len(shape_of(x))
        d = n.args[dim_at] if len(n.args) > dim_at else n.kwargs.get("dim", default)
        if d is None or d % max(nd, 1) == r.dim:
            raise TokenMixing(n, f"{n.target} works along the token dim {r.dim}")
        kept = n.args[keepdim_at] if keepdim_at is not None and len(n.args) > keepdim_at \
            else n.kwargs.get("keepdim", keepdim)
        out = Rows(r.dim - (not kept and keepdim_at is not None and d % nd < r.dim),
                   r.extent)
        return (out, out) if n.target in _PAIRS else out
    return rule


_PAIRS = VALUES_AND_INDICES


def _elementwise(n: Node, rows: dict, tokens: int):
    """An elementwise op torch does not tag pointwise (polar, complex): rows where the
    broadcast output has them, the same for every operand that has them."""
    out_nd = fake(n).ndim
    found = {Rows(r.dim + out_nd - fake(a).ndim, r.extent)
             for a in n.all_input_nodes if isinstance(r := rows.get(a), Rows)}
    if len(found) != 1:
        raise TokenMixing(n, f"{n.target}'s operands hold their rows apart ({found})")
    return found.pop()


def _scatter_rows(n: Node, rows: dict, tokens: int):
    """``scatter(self, dim, index, src)`` along another dim than the rows': row by row."""
    d = n.args[1] % max(fake(n).ndim, 1)
    found = {rows[a] for a in n.all_input_nodes if isinstance(rows.get(a), Rows)}
    if len(found) != 1 or d == next(iter(found)).dim or \
            any(fake(a).ndim != fake(n).ndim for a in n.all_input_nodes if a in rows):
        raise TokenMixing(n, f"{n.target} scatters along the token dim or mixes layouts")
    return found.pop()


def _untracked(n: Node, rows: dict, tokens: int):
    """A value made from another's shape only (ones_like, zeros_like): no token's data."""
    return None


def _getitem_rows(n: Node, rows: dict, tokens: int):
    src = rows[n.args[0]]
    return src[n.args[1]] if isinstance(src, tuple) else src


# Ops the token-wise analysis reads by hand (rows of a whole op, not a placement rule).
ROW_RULES = {
    **dict.fromkeys(RESHAPES | FLATTENS, _reshape_rows),
    torch.ops.dcp.paged_attention.default: _attention_rows,
    torch.ops.dcp.attention.default: _attention_rows,
    torch.ops.dcp.moe.default: _moe_rows,
    **dict.fromkeys(RECURRENT_OPS, _recurrent_rows),
    **dict.fromkeys(LOOKUPS, _lookup_rows),
    aten.topk.default: _along(2, -1),
    aten.sort.default: _along(1, -1),
    aten.argsort.default: _along(1, -1),
    aten.max.dim: _along(1, None, 2), aten.min.dim: _along(1, None, 2),
    aten.argmax.default: _along(1, None, 2), aten.argmin.default: _along(1, None, 2),
    aten.repeat_interleave.self_int: _along(2, None),
    **dict.fromkeys(UNTAGGED_ELEMENTWISE, _elementwise),
    **dict.fromkeys(SCATTERS, _scatter_rows),
    **dict.fromkeys(SHAPE_ONLY_FILLS, _untracked),
    operator.getitem: _getitem_rows,
}


def follow_tokens(nodes, seeds: dict[Node, Rows], tokens: int) -> dict:
    """The rows of every value computed from ``seeds`` (token data, positions), in graph
    order; raises :class:`TokenMixing` at the first op that computes a row from other rows
    (placement rules with the row dim as the "sharded" one; ``ROW_RULES`` by hand)."""
    rows: dict = dict(seeds)
    for n in nodes:
        if n.op != "call_function" or n in rows:
            continue
        ins = [a for a in n.all_input_nodes if isinstance(rows.get(a), Rows)]
        if not ins and not any(isinstance(rows.get(a), tuple) for a in n.all_input_nodes):
            continue
        hand = ROW_RULES.get(n.target)
        if hand is not None:
            got = hand(n, rows, tokens)
            if got is not None:
                rows[n] = got
            continue
        extents = {rows[a].extent for a in ins}
        if len(extents) != 1:
            raise TokenMixing(n, f"operands hold their rows in dims of different sizes "
                              f"{sorted(extents)}")
        extent = extents.pop()
        try:
            d = carried_dim(n, {a: rows[a].dim for a in ins}, extent)
        except Refusal as e:
            raise TokenMixing(n, str(e), unknown=isinstance(e, NoPlacementRule)) from e
        rows[n] = tuple(None if x is None else Rows(x, extent) for x in d) \
            if isinstance(d, tuple) else Rows(d, extent)
    return rows
