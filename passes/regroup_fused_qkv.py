"""A q/k/v projection fused per KV-head group read as [all q; all k; all v].

``qkv_per_group_regrouped``, a row of canonicalize_ops' ``CANONICAL_FORMS``.

torchtitan's fused ``wqkv`` holds, for each KV head g, the rows of its r query heads, then
its key, then its value: ``[q_g0 .. q_g(r-1); k_g; v_g]`` per group, read as
``linear(x, wqkv).view(B, S, kvh, r + 2, D).split([r, 1, 1], dim=-2)`` and each part's
``(kvh, n)`` dims merged into heads. A rank of a decode program at tp > kvh holds part of one
group's query heads and the whole of its key and value: two cuts of one dim that one
(segmented) shard cannot say. In the canonical order ``[all q; all k; all v]`` the same rows
are three segments, each cut by heads, as every other fused projection is.

The rewrite reads the weight (and its bias) with its rows reordered into that order (the
placeholder records ``(0, perm)``, ``META_WEIGHT_PERM``; the program's ``ShardSpec`` cuts the
reordered weight and a checkpoint read takes the boxes of its rows) and splits the linear's
output into the three parts, each viewed as its heads: the same values as the model's own
view, split and merge. Only that exact chain is rewritten (each part's one user the merge of
its group dim with its head dim); anything else stays as it was and the placement analysis
judges it.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from dcp_compile.runtime.names import META_WEIGHT_PERM

from .attention_forms import call_like
from .infra import val
from .op_classes import RESHAPES, is_call
from .untile_kv_heads import values_of_new_nodes

aten = torch.ops.aten
LINEAR = aten.linear.default


def _per_group_chain(lin: Node, weights: set[str]):
    """(view, split, [the merge of each part], sizes, kvh, D) when ``lin``'s output is a
    q/k/v projection fused per KV-head group (module doc), else None."""
    w = lin.args[1]
    if not (isinstance(w, Node) and w.op == "placeholder" and w.name in weights
            and len(w.users) == 1 and META_WEIGHT_PERM not in w.meta):
        return None
    bias = lin.args[2] if len(lin.args) > 2 else None
    if bias is not None and not (isinstance(bias, Node) and bias.op == "placeholder"
                                 and bias.name in weights and len(bias.users) == 1):
        return None
    if len(lin.users) != 1:
        return None
    view = next(iter(lin.users))
    if not is_call(view, RESHAPES) or "val" not in view.meta:
        return None
    x, y = tuple(val(lin).shape), tuple(val(view).shape)
    if len(y) != len(x) + 2 or y[:len(x) - 1] != x[:-1] or y[-3] * y[-2] * y[-1] != x[-1]:
        return None
    kvh, per, d = y[-3:]
    if len(view.users) != 1:
        return None
    split = next(iter(view.users))
    if not is_call(split, {aten.split_with_sizes.default}):
        return None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim % len(y) != len(y) - 2:
        return None
    sizes = list(split.args[1])
    if len(sizes) != 3 or sum(sizes) != per or sizes[1] != sizes[2]:
        return None
    parts = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    if sorted(parts) != [0, 1, 2] or len(split.users) != 3:
        return None
    merges = []
    for i in range(3):
        g = parts[i]
        if len(g.users) != 1:
            return None
        m = next(iter(g.users))
        want = (*x[:-1], kvh * sizes[i], d)
        if not is_call(m, RESHAPES) or tuple(val(m).shape) != want:
            return None
        merges.append(m)
    return view, split, merges, sizes, kvh, d


def _perm(sizes, kvh: int, d: int) -> tuple[int, ...]:
    """Row i of [all q; all k; all v] (each group-major) -> its row in the per-group order."""
    per = sum(sizes)
    starts = [0, sizes[0], sizes[0] + sizes[1]]
    return tuple(g * per * d + (starts[part] + j) * d + i
                 for part in range(3) for g in range(kvh)
                 for j in range(sizes[part]) for i in range(d))


def qkv_per_group_regrouped(gm: GraphModule, weights: set[str], constants) -> int:
    """Every q/k/v projection fused per KV-head group rewritten (module doc); their count."""
    found = 0
    for lin in list(gm.graph.nodes):
        if not (lin.op == "call_function" and lin.target == LINEAR
                and any(is_call(u, RESHAPES) for u in lin.users)):
            continue
        if found == 0:
            values_of_new_nodes(gm)
        chain = _per_group_chain(lin, weights)
        if chain is None:
            continue
        view, split, merges, sizes, kvh, d = chain
        perm = _perm(sizes, kvh, d)
        for w in [lin.args[1], *(lin.args[2:3] if len(lin.args) > 2 else [])]:
            if w is not None:
                w.meta[META_WEIGHT_PERM] = (0, perm)
        widths = [kvh * n * d for n in sizes]
        parts = call_like(gm, view, aten.split_with_sizes.default, (lin, widths, -1))
        for i, m in enumerate(merges):
            with gm.graph.inserting_before(m):
                flat = gm.graph.call_function(operator.getitem, (parts, i))
            flat.meta.update({k: v for k, v in m.meta.items() if k != "val"})
            flat.meta["val"] = val(parts)[i]
            heads = call_like(gm, m, aten.view.default, (flat, list(val(m).shape)))
            m.replace_all_uses_with(heads)
        found += 1
    return found
