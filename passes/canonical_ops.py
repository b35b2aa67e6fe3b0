"""canonicalize_ops: small canonicalizations of an ordinary model's graph before the cache
insertion, so that the placement rules see the ops they have rules for (rules as data:
``CANONICAL_FORMS``).

  * ``x @ w.T`` with ``w`` a 2-D weight input (Falcon's ``FalconLinear``, hand-written
    linears) -> ``linear(x, w)``: the placement analysis shards linears by role.
  * ``addmm(b, x.view(-1, nx), w).view(*x.shape[:-1], nf)`` with ``w`` a 2-D weight input
    (transformers' ``Conv1D``: GPT-2, GPT-SW3, OpenAI-GPT; a linear whose weight is stored
    ``[in, out]``) -> ``linear(x, w.t(), b)``: a linear over the unflattened tokens, its
    weight read through a transpose (the analysis places the weight itself, dims swapped).
  * ``x.view_as(y)`` -> ``x.view(y.shape)`` (Beam's attention gate): the shape is static.
  * ``x[..., idx, :]`` with ``idx`` a constant of consecutive ascending indices (Falcon's
    ``qkv[..., [-2], :]``, a list index torch.export lifts to a constant) -> a slice of that
    dim: slices are segment-aware (a fused projection's part), gathers are not.
  * slices that partition one dim of one tensor -> one ``split_with_sizes`` (each part of a
    fused projection placed on its own, as a split is).
  * ``x.reshape(-1, H)`` of a ``[B, S, H]`` tensor, ops that act on each row alone (linears,
    a norm over the last dim, elementwise ops), and ``.view(B, S, H')`` back (OPT's MLP):
    the flatten and the view dropped, so the token dim stays a dim (sequence parallelism
    reduce-scatters along it).
  * a q/k/v projection fused per KV-head group (torchtitan's ``wqkv``: ``[q heads; k; v]``
    per group, viewed ``[B, S, kvh, r + 2, D]`` and split) -> one split of the linear's
    output into ``[all q; all k; all v]``, its rows reordered
    (``passes/regroup_fused_qkv.py``).
  * K/V heads repeated tiled (einops ``'b kvh n d -> b (r kvh) n d'``, x-transformers) ->
    the interleaved repeat, with the query heads permuted by the q projection's rows and
    the O projection's columns (``passes/untile_kv_heads.py``).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from .attention_forms import ATTENTION_FORMS, call_like, replace_node
from .infra import DCPPass, Property, val
from .regroup_fused_qkv import qkv_per_group_regrouped
from .untile_kv_heads import tiled_kv_heads_untiled
from .memory import is_view
from .op_classes import (ADDS, ARANGES, ARITHMETIC_IN_PLACE_TWINS, CASTS, CONCATS,
                         COPIES_IN_PLACE,
                         EXPANDS, FRESH_COPIES, IDENTITY_VIEWS, IN_PLACE_TWINS, UNINITIALISED,
                         WRITES_INTO_SLICES,
                         LAYER_NORMS, MATRIX_TRANSPOSES, MULS, RESHAPES, SCATTER_OF_VIEW,
                         SLICES, SQUEEZES, WRITES_IN_PLACE, is_call, skip_casts)

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


def _flattened_rows(v, nx: int) -> Node | None:
    """``x`` if ``v`` is ``x.view(-1, nx)`` folding every dim of ``x`` but its last (nx)."""
    if not is_call(v, RESHAPES) or val(v).dim() != 2:
        return None
    x = v.args[0]
    ok = isinstance(x, Node) and val(x).dim() >= 2 and val(x).shape[-1] == nx
    return x if ok else None


def conv1d_as_linear(gm: GraphModule, weights: set[str], constants) -> int:
    """transformers' ``Conv1D`` (``addmm(bias, x.view(-1, nx), weight)``, weight ``[nx, nf]``)
    -> ``linear(x, weight.t(), bias)`` over x's own dims; the views back to them die."""
    count = 0
    for n in list(gm.graph.nodes):
        if not is_call(n, {aten.addmm.default}) or n.kwargs.get("beta", 1) != 1 \
                or n.kwargs.get("alpha", 1) != 1:
            continue
        bias, rows, w = n.args[:3]
        if not (isinstance(w, Node) and w.op == "placeholder" and w.name in weights
                and val(w).dim() == 2):
            continue
        x = _flattened_rows(rows, val(w).shape[0])
        if x is None or not (isinstance(bias, Node) and val(bias).dim() == 1):
            continue
        with gm.graph.inserting_before(n):
            wt = gm.graph.call_function(aten.t.default, (w,))
            lin = gm.graph.call_function(aten.linear.default, (x, wt, bias))
            flat = gm.graph.call_function(aten.view.default, (lin, list(val(n).shape)))
        shape = [*val(x).shape[:-1], val(w).shape[1]]
        for m in (wt, lin, flat):
            m.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        mode = detect_fake_mode([val(x)])
        with mode:
            wt.meta["val"] = val(w).t()
            lin.meta["val"] = torch.empty(shape, dtype=val(n).dtype, device=val(n).device)
            flat.meta["val"] = lin.meta["val"].view(list(val(n).shape))
        for u in list(n.users):     # the view back to x's dims is the linear itself
            if is_call(u, RESHAPES) and list(val(u).shape) == shape:
                u.replace_all_uses_with(lin)
                gm.graph.erase_node(u)
        n.replace_all_uses_with(flat)
        gm.graph.erase_node(n)
        if not flat.users:
            gm.graph.erase_node(flat)
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


def _single_tensor_index(n: Node) -> tuple[int, Node] | None:
    """(dim, index node) of ``x[..., idx]``: an ``aten.index`` with one tensor index (Nones
    before it keep their dims), else None."""
    if not is_call(n, {aten.index.Tensor}):
        return None
    used = [(d, x) for d, x in enumerate(n.args[1]) if x is not None]
    if len(used) != 1 or not isinstance(used[0][1], Node):
        return None
    return used[0]


def constant_index_as_slice(gm: GraphModule, weights: set[str], constants) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        found = _single_tensor_index(n)
        if found is None:
            continue
        d, c = found[0], skip_casts(found[1])
        value = constants().get(c.name) if c.op == "placeholder" else None
        if value is None or value.is_meta:
            continue
        bounds = _consecutive(value, val(n.args[0]).shape[d])
        if bounds is None:
            continue
        replace_node(gm, n, aten.slice.Tensor, (n.args[0], d, *bounds))
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
        found = _single_tensor_index(n)
        if found is None:
            continue
        d, idx = found
        if val(idx).dim() != 1 or val(idx).dtype not in (torch.int64, torch.int32) \
                or not _non_negative(idx, constants):
            continue
        replace_node(gm, n, aten.index_select.default, (n.args[0], d, idx))
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


def _token_flatten(n: Node) -> Node | None:
    """``x`` if ``n`` is ``x.reshape(-1, H)`` folding every dim of an ``x`` of 3 or more dims
    but its last."""
    if not is_call(n, RESHAPES) or val(n).dim() != 2:
        return None
    x = n.args[0]
    ok = isinstance(x, Node) and val(x).dim() >= 3 and val(x).shape[-1] == val(n).shape[-1]
    return x if ok else None


def _row_wise(n: Node) -> bool:
    """Acts on each row of a ``[rows, H]`` tensor on its own: a linear, a norm over the last
    dim, an elementwise op, a cast, eval-mode dropout."""
    if is_call(n, {aten.linear.default}):
        return True
    if is_call(n, LAYER_NORMS):
        return len(n.args[1]) == 1
    return is_call(n, IDENTITY_VIEWS) or n.op == "call_function" and \
        torch.Tag.pointwise in getattr(n.target, "tags", ())


def _rows_region(flat: Node, x: Node) -> tuple[set[Node], list[Node]] | None:
    """The row-wise ops from ``flat`` (``x`` flattened) to views back to ``x``'s leading
    dims (region, those views); None if a value leaves the region any other way, or an
    operand from outside it is more than a per-feature vector (it would not broadcast)."""
    lead = list(val(x).shape[:-1])
    if not flat.users:
        return None
    region, ends, todo = {flat}, [], list(flat.users)
    while todo:
        u = todo.pop()
        if u in region or u in ends:
            continue
        if is_call(u, RESHAPES) and val(u.args[0]).dim() == 2 \
                and list(val(u).shape[:-1]) == lead and val(u).dim() == len(lead) + 1:
            ends.append(u)
            continue
        if not _row_wise(u):
            return None
        region.add(u)
        todo.extend(u.users)
    for u in region - {flat}:
        operands = [u.args[0]] if is_call(u, {aten.linear.default}) or is_call(u, LAYER_NORMS) \
            else [a for a in u.all_input_nodes]
        for a in operands:
            if a not in region and isinstance(val(a), torch.Tensor) and val(a).dim() > 1:
                return None
    return (region, ends) if ends else None


def token_flatten_dropped(gm: GraphModule, weights: set[str], constants) -> int:
    """OPT's MLP on ``hidden.reshape(-1, H)`` viewed back to ``[B, S, H]``: the row-wise ops
    read ``hidden`` itself and the view is dropped (values are the same row by row)."""
    count = 0
    for n in list(gm.graph.nodes):
        x = _token_flatten(n) if n in gm.graph.nodes else None
        found = _rows_region(n, x) if x is not None else None
        if not found:
            continue
        region, ends = found
        n.replace_all_uses_with(x)
        for e in ends:
            e.replace_all_uses_with(e.args[0])
        count += 1
    return count


def _aliases(u: Node, base: Node) -> bool:
    """``u`` may share ``base``'s memory: a view (a cast to another dtype is a copy)."""
    return is_view(u) and not (is_call(u, CASTS) and val(u).dtype != val(base).dtype)


def _view_chain(x) -> tuple[object, list[Node]]:
    """(base, [views from base to x]) of x reached through slices and selects."""
    views = []
    while is_call(x, SCATTER_OF_VIEW):
        views.append(x)
        x = x.args[0]
    return x, views[::-1]


def _copied_back(u: Node, w: Node, views: list[Node]) -> bool:
    """``u`` copies ``w``'s result back into the part ``w`` wrote: Python's
    ``x[a:b] += y`` is ``add_`` into ``x[a:b]``, then ``copy_`` of that sum into a fresh
    ``x[a:b]`` (the same values into the same elements)."""
    if not (is_call(u, COPIES_IN_PLACE) and u.args[1] is w and u.args[0] is not w):
        return False
    base, again = _view_chain(u.args[0])
    return base is views[0].args[0] and [(v.target, v.args[1:]) for v in again] == \
        [(v.target, v.args[1:]) for v in views]


def _read_after(u: Node, w: Node, order) -> bool:
    """Some reader of the view ``u`` (or of a view of it) runs after ``w``."""
    stack = [u]
    while stack:
        for r in stack.pop().users:
            if order[r] > order[w]:
                return True
            if is_view(r):
                stack.append(r)
    return False


def _runtime_alias_of(n) -> Node | None:
    """The input ``n`` may share memory with at run time though no view says so: a cast to
    its own dtype (``type_as`` of a tensor already of that dtype is that tensor), or an
    in-place op's result (its first argument); else None."""
    if not (isinstance(n, Node) and n.op == "call_function" and n.args
            and isinstance(n.args[0], Node)):
        return None
    if is_call(n, CASTS) and n.target not in FRESH_COPIES and \
            val(n).dtype == val(n.args[0]).dtype:
        return n.args[0]
    return n.args[0] if _mutates(n) else None


def _shared_at_run_time(base: Node) -> bool:
    """A tensor ``base`` may be at run time (through same-dtype casts and in-place results:
    Gemma 3n's ``type_as`` of ``corrected += ...``) is read by something else, which would
    see a write into ``base`` that a value does not show it."""
    x = base
    while (y := _runtime_alias_of(x)) is not None:
        if len(y.users) != 1:
            return True
        x = y
    return False


def _written_part(w: Node) -> tuple[Node, list[Node]] | None:
    """(base, views) if the write ``w`` writes ``base`` through the chain of cutting views
    ``base -> views[0] -> ... -> views[-1]`` (each read by nothing but the next; none if it
    writes ``base`` itself), ``base`` a tensor the graph makes (not an input, not a view of
    one, nor a tensor it may be at run time that others read), no view of ``base`` taken
    before ``w`` read after it (it would see the write) and
    the write's own result unread unless it is ``base`` or copied straight back into the
    same part (``x[a:b] += y``); else None. Writes of a computed value
    (``WRITES_INTO_SLICES``) qualify through views only, ``copy_`` not into a tensor
    allocated without a value (MLA's key, read by absorb_latent_attention)."""
    base, views = _view_chain(w.args[0])
    if not isinstance(base, Node) or base.op != "call_function" or is_view(base) \
            or _shared_at_run_time(base):
        return None
    if is_call(w, WRITES_INTO_SLICES) and \
            (not views or is_call(w, COPIES_IN_PLACE) and is_call(base, UNINITIALISED)):
        return None
    chain = views + [w]
    if any(list(v.users) != [nxt] for v, nxt in zip(views, chain[1:])) or \
            (views and not all(_copied_back(u, w, views) for u in w.users)):
        return None
    order = {n: i for i, n in enumerate(w.graph.nodes)}
    first = chain[0]
    if any(u is not first and order[u] < order[w] and _aliases(u, base)
           and _read_after(u, w, order) for u in base.users):
        return None
    return base, views


def _written_value(gm: GraphModule, w: Node, constants) -> Node | None:
    """The written part's new value, computed out of place (None: not rewritten)."""
    if is_call(w, COPIES_IN_PLACE):     # the source, when it is already the part's value
        src = w.args[1]
        same = isinstance(src, Node) and val(src).dtype == val(w.args[0]).dtype and \
            tuple(val(src).shape) == tuple(val(w.args[0]).shape)
        return src if same and not w.kwargs else None
    twin = IN_PLACE_TWINS.get(w.target) or ARITHMETIC_IN_PLACE_TWINS[w.target]
    args = list(w.args)
    if w.target == aten.fill_.Tensor:       # a lifted constant (litgpt's ``= 0.0``): a scalar
        c = skip_casts(args[1])
        value = constants().get(c.name) if c.op == "placeholder" else None
        if value is not None and not value.is_meta and value.numel() == 1:
            twin, args[1] = aten.fill.Scalar, value.item()
    return call_like(gm, w, twin, args) if not w.kwargs else None


def writes_out_of_place(gm: GraphModule, weights: set[str], constants) -> int:
    """A write into a tensor the graph makes, or into a slice / select of it (litgpt's
    sliding-window mask: ``full(-inf)``, then ``mask[i, a:b] = 0.0`` row by row, kept by
    torch.export as ``fill_`` into ``select``/``slice`` views) -> its value out of place:
    ``x.slice(...).fill_(v)`` becomes ``x' = slice_scatter(x, fill(x.slice(...), v), ...)``,
    ``masked_fill_`` ``masked_fill``, and every reader of ``x`` after the write (program
    order) reads ``x'``. Values then are the computation (the mask reader follows values, not
    memory). A write into an input or a view of one, through a view other than a slice or
    select, with a view of ``x`` read before it, or by another op (``copy_``, ``index_put_``:
    MLA's key is built by ``copy_`` and read as such) stays as it is (and a mask built so is
    refused by name)."""
    count, kept = 0, set()
    while True:
        found = next(((w, part) for w in gm.graph.nodes
                      if is_call(w, WRITES_IN_PLACE | WRITES_INTO_SLICES) and w not in kept
                      and (part := _written_part(w)) is not None), None)
        if found is None:
            return count
        w, (base, views) = found
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        part = new = _written_value(gm, w, constants)
        if new is None:
            kept.add(w)
            continue
        for v in reversed(views):
            new = call_like(gm, w, SCATTER_OF_VIEW[v.target], (v.args[0], new, *v.args[1:]))
        for u in list(base.users):
            if u in order and order[u] > order[w]:
                u.replace_input_with(base, new)
        # The write's result is the written part (through views: its copy back reads it).
        w.replace_all_uses_with(part if views else new)
        gm.graph.erase_node(w)
        count += 1


def view_as_as_view(gm: GraphModule, weights: set[str], constants) -> int:
    """``x.view_as(other)`` -> ``x.view(other.shape)`` (shapes are static: the other tensor
    gives only its shape, so no data of it flows into the result; Beam's attention gate)."""
    count = 0
    for n in list(gm.graph.nodes):
        if is_call(n, {aten.view_as.default}):
            replace_node(gm, n, aten.view.default, (n.args[0], list(val(n.args[1]).shape)))
            count += 1
    return count


def empty_cat_parts_dropped(gm: GraphModule, weights: set[str], constants) -> int:
    """``cat([empty, x, ...])`` without its 1-D empty parts (torch.cat skips them: XLM joins
    one where its cache would be): a part that adds no element and no placement."""
    count = 0
    for n in list(gm.graph.nodes):
        if not is_call(n, CONCATS) or not isinstance(n.args[0], (list, tuple)):
            continue
        parts = list(n.args[0])
        kept = [p for p in parts if not (isinstance(p, Node) and val(p) is not None
                                         and val(p).dim() == 1 and val(p).numel() == 0)]
        if len(kept) == len(parts) or not kept:
            continue
        if len(kept) == 1 and val(kept[0]).shape == val(n).shape:
            n.replace_all_uses_with(kept[0])
        else:
            n.args = (kept, *n.args[1:])
        count += 1
    return count


# name -> rewrite(gm, weight input names, constants() -> {input name: tensor}) -> count
CANONICAL_FORMS: dict[str, Callable] = {
    # first: the ops of an autocast region are read by the rows after it
    "autocast_inlined": ATTENTION_FORMS["autocast_inlined"],
    # before the slices are read: a slice written through is not a part of a value
    "writes_out_of_place": writes_out_of_place,
    "view_as_as_view": view_as_as_view,
    "empty_cat_parts_dropped": empty_cat_parts_dropped,
    "linear_from_matmul": linear_from_matmul,
    "conv1d_as_linear": conv1d_as_linear,
    "constant_index_as_slice": constant_index_as_slice,
    "index_as_index_select": index_as_index_select,
    "slices_as_split": slices_as_split,
    # torchtitan's wqkv ([q heads; k; v] per KV head) as [all q; all k; all v], its rows
    # reordered (passes/regroup_fused_qkv.py)
    "qkv_per_group_regrouped": qkv_per_group_regrouped,
    **ATTENTION_FORMS,                  # the attention forms (passes/attention_forms.py)
    # after them (its rules read their one spelling): tiled K/V heads as GQA with the query
    # heads permuted, the permutation recorded on the weights (passes/untile_kv_heads.py)
    "tiled_kv_heads_untiled": tiled_kv_heads_untiled,
    # last: the ops it moves off the flattened rows get their values from the pass manager
    "token_flatten_dropped": token_flatten_dropped,
}


def canonicalize_ops(gm: GraphModule, weights: set[str], constants,
                     forms: tuple[str, ...] | None = None) -> dict[str, int]:
    found = {name: rewrite(gm, weights, constants) for name, rewrite in
             CANONICAL_FORMS.items() if forms is None or name in forms}
    gm.graph.eliminate_dead_code()
    return {k: v for k, v in found.items() if v}


class CanonicalizeOps(DCPPass):
    """An ordinary model's graph (the ordinary frontend builds this pass): each of
    ``CANONICAL_FORMS`` (or of ``forms``, by name) rewritten where it matches; ``constants``:
    the model's tensors by input name (asked only when a constant index is met)."""

    name = "canonicalize_ops"
    required = frozenset({Property.NO_EXPORT_ASSERTS})
    ensured = frozenset({Property.CANONICAL_OPS})

    def __init__(self, ctx, *, weights: set[str], constants: Callable[[], dict],
                 forms: tuple[str, ...] | None = None):
        super().__init__(ctx)
        self.weights, self.constants, self.forms = set(weights), constants, forms
        self._values = None

    def _constant_values(self) -> dict:
        if self._values is None:
            self._values = self.constants()
        return self._values

    def call(self, gm):
        nodes = len(gm.graph.nodes)
        found = canonicalize_ops(gm, self.weights, self._constant_values, self.forms)
        self.record(**found)
        return PassResult(gm, bool(found) or len(gm.graph.nodes) != nodes)
