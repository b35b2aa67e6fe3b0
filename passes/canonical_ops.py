"""canonicalize_ops: small canonicalizations of an ordinary model's graph before the cache
insertion, so that the placement rules see the ops they have rules for (rules as data:
``CANONICAL_FORMS``).

  * ``x @ w.T`` with ``w`` a 2-D weight input (Falcon's ``FalconLinear``, hand-written
    linears) -> ``linear(x, w)``: the placement analysis shards linears by role.
  * ``x[..., idx, :]`` with ``idx`` a constant of consecutive ascending indices (Falcon's
    ``qkv[..., [-2], :]``, a list index torch.export lifts to a constant) -> a slice of that
    dim: slices are segment-aware (a fused projection's part), gathers are not.
  * slices that partition one dim of one tensor -> one ``split_with_sizes`` (each part of a
    fused projection placed on its own, as a split is).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from .attention_forms import ATTENTION_FORMS, replace_node
from .infra import DCPPass, Property, val
from .op_classes import (ADDS, ARANGES, CASTS, EXPANDS, MATRIX_TRANSPOSES, MULS, RESHAPES,
                         SLICES, SQUEEZES, is_call, skip_casts)

aten = torch.ops.aten


def _weight_transposed(b, weights: set[str]) -> Node | None:
    """``w`` if ``b`` is ``w.T`` of a 2-D weight input, else None."""
    if is_call(b, {aten.permute.default}) and list(b.args[1]) in ([1, 0], [-1, -2]):
        w = b.args[0]
    elif is_call(b, {aten.transpose.int}) and {d % 2 for d in b.args[1:]} == {0, 1}:
        w = b.args[0]
    elif is_call(b, MATRIX_TRANSPOSES):
        w = b.args[0]
    else:
        return None
    ok = isinstance(w, Node) and w.op == "placeholder" and w.name in weights \
        and val(w).dim() == 2
    return w if ok else None


def linear_from_matmul(gm: GraphModule, weights: set[str], constants) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        if not is_call(n, {aten.matmul.default, aten.mm.default}) or val(n.args[0]).dim() < 2:
            continue
        w = _weight_transposed(n.args[1], weights)
        if w is None:
            continue
        with gm.graph.inserting_before(n):
            lin = gm.graph.call_function(aten.linear.default, (n.args[0], w))
        lin.meta.update(n.meta)
        n.replace_all_uses_with(lin)
        gm.graph.erase_node(n)
        count += 1
    return count


def _consecutive(idx: torch.Tensor, size: int) -> tuple[int, int] | None:
    if idx.dim() != 1 or idx.numel() == 0 or idx.dtype not in (torch.int64, torch.int32):
        return None
    idx = idx % size
    start = int(idx[0])
    if not torch.equal(idx, torch.arange(start, start + idx.numel(), dtype=idx.dtype)):
        return None
    return start, start + idx.numel()


def constant_index_as_slice(gm: GraphModule, weights: set[str], constants) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        if not is_call(n, {aten.index.Tensor}):
            continue
        index = list(n.args[1])
        used = [i for i, x in enumerate(index) if x is not None]
        if len(used) != 1 or not isinstance(index[used[0]], Node):
            continue
        d, c = used[0], skip_casts(index[used[0]])
        value = constants().get(c.name) if c.op == "placeholder" else None
        if value is None or value.is_meta:
            continue
        bounds = _consecutive(value, val(n.args[0]).shape[d])
        if bounds is None:
            continue
        with gm.graph.inserting_before(n):
            s = gm.graph.call_function(aten.slice.Tensor, (n.args[0], d, *bounds))
        s.meta.update(n.meta)
        n.replace_all_uses_with(s)
        gm.graph.erase_node(n)
        count += 1
    return count


def _non_negative(n, constants) -> bool:
    """``n`` is >= 0 everywhere: an ``arange`` from a start >= 0, a constant >= 0, or views
    and sums of such (index_select has no negative indices; indexing wraps them)."""
    while is_call(n, CASTS | RESHAPES | SQUEEZES | SLICES | EXPANDS):
        n = n.args[0]
    if isinstance(n, (int, float)):
        return n >= 0
    if is_call(n, ARANGES):
        args = list(n.args) + [1]
        start, step = (0, 1) if n.target == aten.arange.default else (args[0], args[2])
        return isinstance(start, int) and start >= 0 and isinstance(step, int) and step > 0
    if is_call(n, ADDS | MULS):
        return all(_non_negative(a, constants) for a in n.args[:2])
    if isinstance(n, Node) and n.op == "placeholder":
        value = constants().get(n.name)
        return value is not None and not value.is_meta and bool((value >= 0).all())
    return False


def index_as_index_select(gm: GraphModule, weights: set[str], constants) -> int:
    """``x[..., idx]`` with one 1-D tensor index >= 0 (Nones before it keep their dims) ->
    ``index_select(x, d, idx)`` (gpt-fast's ``freqs_cis[input_pos]`` and
    ``causal_mask[None, None, input_pos]``, input_pos an arange): the gather the position
    lifting and the token-dim rules know. Runs after constant_index_as_slice (a constant run
    of indices is a slice)."""
    count = 0
    for n in list(gm.graph.nodes):
        if not is_call(n, {aten.index.Tensor}):
            continue
        index = list(n.args[1])
        used = [i for i, x in enumerate(index) if x is not None]
        if len(used) != 1 or not isinstance(index[used[0]], Node):
            continue
        idx = index[used[0]]
        if val(idx).dim() != 1 or val(idx).dtype not in (torch.int64, torch.int32) \
                or not _non_negative(idx, constants):
            continue
        replace_node(gm, n, aten.index_select.default, (n.args[0], used[0], idx))
        count += 1
    return count


def _mutates(n: Node) -> bool:
    """An in-place op (``copy_`` into a slice: a view written through stays a slice)."""
    schema = getattr(n.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _partitioning_slices(gm: GraphModule):
    """(source, dim, bounds, slice nodes) of the first group of step-1 slices that
    partition one dim of one tensor, in at least two parts; None if there is none."""
    from .placement import slice_bounds
    groups: dict = {}
    for n in gm.graph.nodes:
        if is_call(n, {aten.slice.Tensor}) and not any(_mutates(u) for u in n.users):
            d, start, end, step = slice_bounds(n)
            if step == 1:
                groups.setdefault((n.args[0], d), []).append((start, end, n))
    for (src, d), parts in groups.items():
        bounds = sorted({(a, b) for a, b, _ in parts})
        edges = [a for a, _ in bounds] + [bounds[-1][1]]
        if len(bounds) >= 2 and edges[0] == 0 and edges[-1] == val(src).shape[d] and \
                all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1)):
            return src, d, bounds, parts
    return None


def slices_as_split(gm: GraphModule, weights: set[str], constants) -> int:
    """Slices of one tensor along one dim that partition it exactly (Falcon's fused
    ``qkv[..., :-2, :]``, ``[-2]``, ``[-1]``) -> one ``split_with_sizes``: the split rule
    is segment-aware for fused projections (each part placed on its own)."""
    count = 0
    while (found := _partitioning_slices(gm)) is not None:
        src, d, bounds, parts = found
        with gm.graph.inserting_after(src):
            split = gm.graph.call_function(aten.split_with_sizes.default,
                                           (src, [b - a for a, b in bounds], d))
        items = {}
        for i, ab in enumerate(bounds):
            with gm.graph.inserting_after(items[bounds[i - 1]] if i else split):
                items[ab] = gm.graph.call_function(operator.getitem, (split, i))
        split.meta.update({k: v for k, v in parts[0][2].meta.items() if k != "val"})
        mode = detect_fake_mode([val(src)])
        with mode:
            split.meta["val"] = aten.split_with_sizes.default(val(src), split.args[1], d)
        for i, ab in enumerate(bounds):
            items[ab].meta.update(split.meta, val=split.meta["val"][i])
        for a, b, n in parts:
            n.replace_all_uses_with(items[(a, b)])
            gm.graph.erase_node(n)
        count += 1
    return count


# name -> rewrite(gm, weight input names, constants() -> {input name: tensor}) -> count
CANONICAL_FORMS: dict[str, Callable] = {
    "autocast_off_inlined": ATTENTION_FORMS["autocast_off_inlined"],
    "linear_from_matmul": linear_from_matmul,
    "constant_index_as_slice": constant_index_as_slice,
    "index_as_index_select": index_as_index_select,
    "slices_as_split": slices_as_split,
    **ATTENTION_FORMS,                  # the attention forms (passes/attention_forms.py)
}


def canonicalize_ops(gm: GraphModule, weights: set[str], constants) -> dict[str, int]:
    found = {name: rewrite(gm, weights, constants) for name, rewrite in
             CANONICAL_FORMS.items()}
    gm.graph.eliminate_dead_code()
    return {k: v for k, v in found.items() if v}


class CanonicalizeOps(DCPPass):
    """An ordinary model's graph (the ordinary frontend builds this pass): each of
    ``CANONICAL_FORMS`` rewritten where it matches; ``constants``: the model's tensors by
    input name (asked only when a constant index is met)."""

    name = "canonicalize_ops"
    required = frozenset({Property.NO_EXPORT_ASSERTS})
    ensured = frozenset({Property.CANONICAL_OPS})

    def __init__(self, ctx, *, weights: set[str], constants: Callable[[], dict]):
        super().__init__(ctx)
        self.weights, self.constants = set(weights), constants
        self._values = None

    def _constant_values(self) -> dict:
        if self._values is None:
            self._values = self.constants()
        return self._values

    def call(self, gm):
        nodes = len(gm.graph.nodes)
        found = canonicalize_ops(gm, self.weights, self._constant_values)
        self.record(**found)
        return PassResult(gm, bool(found) or len(gm.graph.nodes) != nodes)
