"""Tiled K/V heads read as GQA with the query heads permuted (a form of canonicalize_ops).

``tiled_kv_heads_untiled``, a row of canonicalize_ops' ``CANONICAL_FORMS``.

x-transformers repeats K/V heads by tiling (einops ``'b kvh n d -> b (r kvh) n d'``): query
head ``h`` reads KV head ``h % kvh``. ``dcp.attention`` groups query heads as
``h // q_per_kv`` (``repeat_kv``'s order), and so does the placement analysis: a rank's
contiguous block of query heads shares its KV heads. The two orders differ by a permutation
of the query heads, ``h' = g * r + j`` for ``h = j * kvh + g``. So the graph is rewritten to
compute in the permuted order, with the same result:

  * each tiled repeat becomes the interleaved one (``unsqueeze(2)`` instead of ``(1)``);
  * the weights whose output carries the query heads (the q projection's rows, and its
    bias) and those that read them back (the O projection's columns) are read with their
    head blocks reordered: the placeholder records ``(dim, perm)`` (``META_WEIGHT_PERM``),
    the program's ``ShardSpec`` carries it, and every rank's shard (cut from the model's
    weight or read from a checkpoint, by boxes) is of the reordered weight.

That is exact only if everything between those linears treats every head alike. The region
is the forward closure of the repeats and of the linears that feed it heads; every op in it
has a rule below that follows the heads' dim (views, permutes, splits, joins, softmax over
another dim, matmuls batched over the heads, SDPA, elementwise ops), and every operand from
outside the region must be broadcast over the heads (a RoPE table, a causal mask). A
per-head bias, an op without a rule, or a value leaving the region other than through a
linear's input is a refusal that names the node ('K/V heads tiled ...').

A distance table (x-transformers' T5 bias or MLP of the distance, a ``[H, L]`` buffer named
``DISTANCE_TABLE``: frontends/module_position_bias.py) carries the heads too: it joins the
region as a seed holding them at dim 0, read by ``table[:, index]`` and padded along the
keys (rules below), and is read with its rows reordered like the q projection's
(``META_WEIGHT_PERM``, the same permutation for every layer that reads it).
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.names import DISTANCE_TABLE, META_WEIGHT_PERM

from .attention_forms import call_like
from .attention_patterns import repeated_heads
from .infra import linears_reached, source_of, val
from .op_classes import (BATCHED_MATMULS, CASTS, EXPANDS, IDENTITY_VIEWS, JOINS, LOG_SOFTMAX,
                         PADS,
                         PERMUTES, RESHAPES, SDPA_OPS, SLICES, SOFTMAX, SPLITS, SQUEEZES,
                         UNTAGGED_ELEMENTWISE, is_call)

aten = torch.ops.aten
LINEAR = aten.linear.default


@dataclass(frozen=True)
class Heads:
    """Where a value of the region holds the heads: dim ``dim``, of size H, or (``block``
    set) of size H * block, heads major (a projection's flat output)."""

    dim: int
    block: int | None = None


class _Refused(Exception):
    def __init__(self, node: Node, why: str):
        super().__init__(why)
        self.node, self.why = node, why


def _tensors(n: Node) -> list[Node]:
    out = []
    for a in list(n.args) + list(n.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(x, Node) and isinstance(x.meta.get("val"), (torch.Tensor, tuple, list)):
                out.append(x)
    return out


def _norm(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def _pointwise(n: Node) -> bool:
    return n.op == "call_function" and (
        torch.Tag.pointwise in getattr(n.target, "tags", ()) or n.target in UNTAGGED_ELEMENTWISE)


class _Region:
    """The values computed in the permuted head order, and what they hold where."""

    def __init__(self, gm: GraphModule, heads: int, r: int, kvh: int):
        self.gm, self.H, self.r, self.kvh = gm, heads, r, kvh
        self.seeds: dict[Node, Heads] = {}      # tiled repeats, linears feeding heads
        self.states: dict[Node, Heads] = {}
        self.sinks: list[Node] = []             # linears reading the heads back

    # -- the closure ---------------------------------------------------------------------

    def grow(self) -> None:
        """Closure of the seeds; an operand carrying heads from outside pulls its linear in
        (then the closure is taken again)."""
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        while True:
            members = set(self.seeds)
            work = list(self.seeds)
            sinks = []
            while work:
                n = work.pop()
                for u in n.users:
                    if u in members or u in sinks:
                        continue
                    if u.op == "call_function" and u.target == LINEAR and u.args[0] is n \
                            and n not in u.args[1:]:
                        sinks.append(u)
                        continue
                    if u.op == "output":
                        raise _Refused(n, "a value in the query heads' order is returned")
                    members.add(u)
                    work.append(u)
            self.states = dict(self.seeds)
            pulled = None
            for n in sorted(members - set(self.seeds), key=order.__getitem__):
                pulled = self._place(n, members)
                if pulled is not None:
                    break
            if pulled is None:
                for s in sinks:
                    self._check_sink(s)
                self.sinks = sinks
                return
            self.seeds[pulled[0]] = pulled[1]

    @staticmethod
    def _outside_ok(u: Node, out_dim: int, out_ndim: int) -> bool:
        """Whether ``u`` (not in the region) is broadcast over the heads' dim ``out_dim`` of
        an ``out_ndim``-dim result (aligned from the right, as broadcasting does)."""
        a = out_dim - (out_ndim - val(u).dim())
        return a < 0 or val(u).shape[a] == 1

    def _table_reach(self) -> set[Node]:
        """Every node downstream of a distance table seeded in the region."""
        out, work = set(), [t for t in self.seeds if t.op == "placeholder"]
        while work:
            x = work.pop()
            for y in x.users:
                if y not in out:
                    out.add(y)
                    work.append(y)
        return out

    def _repeat_upstream(self, u: Node) -> Node | None:
        """A tiled K/V repeat of this region's shape upstream of ``u``, not seeded yet."""
        seen, work = set(), [u]
        while work:
            x = work.pop()
            if x in seen:
                continue
            seen.add(x)
            rep = repeated_heads(x) if x.op == "call_function" else None
            if rep is not None and rep[1] == 1 and x not in self.seeds \
                    and val(x).shape[1] == self.H and val(rep[0]).shape[1] == self.kvh:
                return x
            work.extend(x.all_input_nodes)
        return None

    def _pull(self, n: Node, u: Node) -> Node:
        """The one linear ``u`` reads its heads from (nearest linears upstream)."""
        found = set(linears_reached([u], _tensors))     # through attention too
        if len(found) != 1:
            raise _Refused(n, f"its operand {u.name} carries heads that come from "
                              f"{len(found)} projections, not one (a per-head bias)")
        lin = found.pop()
        if val(lin).shape[-1] % self.H:
            raise _Refused(n, f"its operand {u.name} comes from {lin.name}, whose "
                              f"{val(lin).shape[-1]} features are not {self.H} heads")
        return lin

    def _place(self, n: Node, members: set) -> tuple[Node, Heads] | None:
        """``n``'s heads from its operands' (``self.states``); or a value to seed first: an
        operand from outside that carries heads (a tiled repeat, or a linear's output)."""
        ins = [u for u in _tensors(n) if u in members]
        outside = [u for u in _tensors(n) if u not in members
                   and isinstance(val(u), torch.Tensor)]
        out = val(n)
        reads_all = _pointwise(n) or is_call(n, BATCHED_MATMULS | SDPA_OPS)
        if reads_all and ins and isinstance(out, torch.Tensor):
            a = self.states[ins[0]].dim + out.dim() - val(ins[0]).dim()
            for u in outside:
                if not self._outside_ok(u, a, out.dim()):
                    rep = repeated_heads(u)
                    if rep is not None and rep[1] == 1 and val(u).shape[1] == self.H \
                            and val(rep[0]).shape[1] == self.kvh:
                        return u, Heads(1)
                    table = _distance_table(u)
                    if table is not None and table not in self.seeds:
                        return table, Heads(0)
                    if table is not None or n in self._table_reach():
                        # another layer's scores met through a shared distance table: seed
                        # that layer's tiled repeats first (its q projection follows)
                        up = self._repeat_upstream(u)
                        if up is not None:
                            return up, Heads(1)
                    lin = self._pull(n, u)
                    return lin, Heads(val(lin).dim() - 1, val(lin).shape[-1] // self.H)
        st = self._rule(n, ins)
        if isinstance(out, torch.Tensor):
            if st.block is None and out.shape[st.dim] != self.H:
                raise _Refused(n, f"the heads' dim {st.dim} has size {out.shape[st.dim]}, "
                                  f"not {self.H}")
            if not reads_all and not is_call(n, CASTS):
                for u in outside:
                    if not self._outside_ok(u, st.dim, out.dim()):
                        raise _Refused(n, f"its operand {u.name} is not broadcast over the "
                                          f"heads")
        self.states[n] = st
        return None

    def _rule(self, n: Node, ins: list[Node]) -> Heads | None:
        S = self.states
        out = val(n)
        if n.op != "call_function":
            raise _Refused(n, f"a {n.op} node")
        if n.target is operator.getitem:
            return S[n.args[0]]
        first = S.get(n.args[0]) if n.args and isinstance(n.args[0], Node) else None
        if is_call(n, IDENTITY_VIEWS):
            if first is None:
                raise _Refused(n, "a cast of a value outside the region")
            return first
        if _pointwise(n) or is_call(n, {aten.masked_fill.Scalar, aten.masked_fill.Tensor}):
            got = {Heads(S[u].dim + out.dim() - val(u).dim(), S[u].block) for u in ins}
            if len(got) != 1:
                raise _Refused(n, "its operands hold the heads at different dims")
            return got.pop()
        if is_call(n, JOINS):
            parts = n.args[0]
            if not all(isinstance(p, Node) and S.get(p) == S.get(parts[0]) for p in parts) \
                    or S.get(parts[0]) is None:
                raise _Refused(n, "joins values that do not all hold the heads alike")
            a, blk = S[parts[0]].dim, S[parts[0]].block
            d = n.args[1] if len(n.args) > 1 else 0
            if n.target == aten.stack.default:
                d = _norm(d, out.dim())
                return Heads(a + (d <= a), blk)
            if _norm(d, out.dim()) == a:
                raise _Refused(n, "joins along the heads' dim")
            return Heads(a, blk)
        if first is None:
            raise _Refused(n, f"{n.target} reads the heads through a later operand")
        shape_in, shape_out = tuple(val(n.args[0]).shape), tuple(out.shape) \
            if isinstance(out, torch.Tensor) else ()
        a, blk = first.dim, first.block
        if is_call(n, RESHAPES):
            if shape_in[:a + 1] == shape_out[:a + 1]:
                return first
            if blk is not None and shape_out[:a] == shape_in[:a] \
                    and shape_out[a:a + 2] == (self.H, blk) \
                    and shape_out[a + 2:] == shape_in[a + 1:]:
                return Heads(a)
            if blk is None and a + 1 < len(shape_in) and shape_out[:a] == shape_in[:a] \
                    and shape_out[a] == self.H * shape_in[a + 1] \
                    and shape_out[a + 1:] == shape_in[a + 2:]:
                return Heads(a, shape_in[a + 1])
            raise _Refused(n, f"a view {shape_in} -> {shape_out} regroups the heads")
        if blk is not None and not is_call(n, SLICES | SPLITS | JOINS | SQUEEZES):
            raise _Refused(n, f"{n.target} on the projection's flat output")
        if is_call(n, PERMUTES):
            if n.target == aten.transpose.int:
                d0, d1 = (_norm(d, len(shape_in)) for d in n.args[1:3])
                return Heads({d0: d1, d1: d0}.get(a, a), blk)
            dims = [_norm(d, len(shape_in)) for d in n.args[1]]
            return Heads(dims.index(a), blk)
        if is_call(n, SQUEEZES):
            if n.target == aten.unsqueeze.default:
                d = _norm(n.args[1], len(shape_out))
                return Heads(a + (d <= a), blk)
            dims = [i for i in range(len(shape_in)) if len(shape_out) < len(shape_in)
                    and shape_in[i] == 1] if n.target == aten.squeeze.default else \
                [_norm(d, len(shape_in)) for d in (n.args[1] if isinstance(n.args[1], (list, tuple))
                                                   else [n.args[1]])]
            if a in dims and shape_in[a] == 1:
                raise _Refused(n, "squeezes the heads' dim")
            return Heads(a - sum(1 for d in dims if d < a and shape_in[d] == 1), blk)
        if is_call(n, EXPANDS):
            lead = len(shape_out) - len(shape_in)
            if shape_out[a + lead] != shape_in[a]:
                raise _Refused(n, "expands the heads' dim")
            return Heads(a + lead, blk)
        if is_call(n, SLICES | SPLITS):
            d = _norm(n.args[1] if len(n.args) > 1 else 0, len(shape_in)) \
                if n.target != aten.split.Tensor and n.target != aten.split_with_sizes.default \
                and n.target != aten.chunk.default else \
                _norm(n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0), len(shape_in))
            if n.target == aten.unbind.int:
                d = _norm(n.args[1] if len(n.args) > 1 else 0, len(shape_in))
            if d == a:
                raise _Refused(n, "cuts the heads' dim")
            if n.target in (aten.select.int, aten.unbind.int):
                return Heads(a - (d < a), blk)
            return first
        if is_call(n, {aten.index.Tensor}):     # table[:, index]: the heads' dim kept, first
            idx = list(n.args[1])
            if a != 0 or len(idx) < 2 or idx[0] is not None:
                raise _Refused(n, "indexes the heads' dim, or the dims before it")
            return first
        if is_call(n, PADS):                    # a constant pad of other dims than the heads'
            pads = list(n.args[1])
            side = len(shape_in) - 1 - a
            if any(pads[2 * side:2 * side + 2]):
                raise _Refused(n, "pads the heads' dim")
            return first
        if is_call(n, SOFTMAX | LOG_SOFTMAX):
            if _norm(n.args[1], len(shape_in)) == a:
                raise _Refused(n, "a softmax over the heads")
            return first
        if is_call(n, BATCHED_MATMULS):
            got = {S[u].dim + len(shape_out) - val(u).dim() for u in ins}
            if len(got) != 1 or got.pop() != a + len(shape_out) - len(shape_in) \
                    or a + len(shape_out) - len(shape_in) >= len(shape_out) - 2:
                raise _Refused(n, "a matmul whose operands do not hold the heads as a batch dim")
            return Heads(a + len(shape_out) - len(shape_in))
        if is_call(n, SDPA_OPS):
            if n.kwargs.get("enable_gqa") or any(S.get(u) != Heads(1) for u in n.args[:3]):
                raise _Refused(n, "SDPA's q, k and v do not all hold the heads at dim 1")
            return Heads(1)
        raise _Refused(n, f"no rule says how {n.target} treats the heads")

    def _check_sink(self, lin: Node) -> None:
        st = self.states.get(lin.args[0])
        x = val(lin.args[0])
        if st is None or st.block is None or st.dim != x.dim() - 1:
            raise _Refused(lin, "a projection reads the heads other than as its flat input")

    # -- the rewrite ---------------------------------------------------------------------

    def perm(self, block: int) -> tuple[int, ...]:
        """Index i of the permuted order -> index in the model's order, for a flat dim of
        H heads of ``block`` features: head h' = g * r + j is the model's h = j * kvh + g."""
        return tuple(((h % self.r) * self.kvh + h // self.r) * block + i
                     for h in range(self.H) for i in range(block))


def _weight(n: Node, lin: Node, i: int, weights: set[str]) -> Node | None:
    w = lin.args[i] if len(lin.args) > i else None
    if w is None:
        return None
    if not (isinstance(w, Node) and w.op == "placeholder" and w.name in weights):
        raise _Refused(lin, f"its {'weight' if i == 1 else 'bias'} is not a parameter")
    if len(w.users) != 1 or META_WEIGHT_PERM in w.meta:
        raise _Refused(lin, f"its {'weight' if i == 1 else 'bias'} {w.name} is read "
                            f"elsewhere too (tied)")
    return w


def _distance_table(u: Node) -> Node | None:
    """The one distance-table buffer ``u`` is computed from (module doc), or None."""
    seen, work, found = set(), [u], set()
    while work:
        x = work.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder" and DISTANCE_TABLE in x.name:
            found.add(x)
        work.extend(x.all_input_nodes)
    return found.pop() if len(found) == 1 else None


def _table_perm(t: Node, perm: tuple[int, ...]) -> None:
    """The distance table ``t`` read with its rows (heads) reordered by ``perm``; refused if
    another region reads it in another order."""
    had = t.meta.get(META_WEIGHT_PERM)
    if had is not None and had != (0, perm):
        raise _Refused(t, "the distance table is read by layers whose heads are permuted "
                          "differently")
    t.meta[META_WEIGHT_PERM] = (0, perm)


def _refuse(node: Node, why: str, heads: int, kvh: int):
    raise DCPTransformError(
        f"K/V heads tiled (q head h reads kv head h % {kvh}, as einops' 'b kvh n d -> b "
        f"(r kvh) n d' repeats them), and they cannot be read as grouped-query attention with "
        f"the {heads} query heads permuted: {why}, at node {node.name} ({source_of(node)}). "
        f"Repeat each kv head in place ('b kvh n d -> b (kvh r) n d', "
        f"k.repeat_interleave(r, dim=1)), or keep every op between the q projection and the "
        f"O projection the same for every head")


def values_of_new_nodes(gm: GraphModule) -> None:
    """The fake values of the nodes canonicalize_ops' earlier rows made (the pass manager
    gives them after the pass; the rules here read shapes now)."""
    mode = None
    for n in gm.graph.nodes:
        if n.op != "call_function" or "val" in n.meta:
            continue
        fakes = torch.fx.node.map_arg((n.args, n.kwargs), lambda x: val(x))
        mode = mode or detect_fake_mode([x.meta["val"] for x in gm.graph.nodes
                                         if isinstance(x.meta.get("val"), torch.Tensor)])
        with mode or contextlib.nullcontext():
            n.meta["val"] = n.target(*fakes[0], **fakes[1])


def tiled_kv_heads_untiled(gm: GraphModule, weights: set[str], constants) -> int:
    """Every region of tiled K/V repeats rewritten (module doc); the number of repeats."""
    if not any(repeated_heads_tiled(n) for n in gm.graph.nodes):
        return 0
    values_of_new_nodes(gm)
    done: set[Node] = set()
    count = 0
    for t in list(gm.graph.nodes):
        rep = repeated_heads(t) if t not in done else None
        if rep is None or rep[1] != 1 or val(rep[0]).shape[1] == 1:
            continue
        x = rep[0]
        b, kvh, s, d = val(x).shape
        heads = val(t).shape[1]
        region = _Region(gm, heads, heads // kvh, kvh)
        region.seeds[t] = Heads(1)
        try:
            region.grow()
            linears = [n for n in region.seeds if n.op == "call_function" and n.target == LINEAR]
            tables = [n for n in region.seeds if n.op == "placeholder"]
            if not linears or not region.sinks:
                raise _Refused(t, "no q projection or no O projection found around it")
            plan = [(w, 0, region.perm(val(lin).shape[-1] // heads))
                    for lin in linears for w in (_weight(t, lin, 1, weights),
                                                 _weight(t, lin, 2, weights)) if w is not None]
            plan += [(_weight(t, lin, 1, weights), 1,
                      region.perm(val(lin.args[0]).shape[-1] // heads)) for lin in region.sinks]
            for table in tables:
                _table_perm(table, region.perm(1))
        except _Refused as e:
            _refuse(e.node, e.why, heads, kvh)
        for w, dim, perm in plan:
            w.meta[META_WEIGHT_PERM] = (dim, perm)
        for rep_node in [n for n in region.seeds if n not in linears and n not in tables]:
            _interleave(gm, rep_node)
            done.add(rep_node)
            count += 1
    return count


def repeated_heads_tiled(n: Node) -> bool:
    """Whether ``n`` may repeat K/V heads tiled (a reshape of an expand of
    ``unsqueeze(x, 1)``), read without fake values (``repeated_heads`` says for sure)."""
    return is_call(n, RESHAPES) and is_call(n.args[0], EXPANDS) \
        and is_call(n.args[0].args[0], {aten.unsqueeze.default}) \
        and n.args[0].args[0].args[1] == 1


def _interleave(gm: GraphModule, t: Node) -> None:
    """The tiled repeat ``t`` replaced by the interleaved one (same shape)."""
    x, _ = repeated_heads(t)
    b, kvh, s, d = val(x).shape
    r = val(t).shape[1] // kvh
    u = call_like(gm, t, aten.unsqueeze.default, (x, 2))
    e = call_like(gm, t, aten.expand.default, (u, [b, kvh, r, s, d]))
    new = call_like(gm, t, aten.reshape.default, (e, list(val(t).shape)))
    t.replace_all_uses_with(new)
