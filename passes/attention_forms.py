"""Attention as the model libraries spell it, rewritten into the one form
:mod:`dcp_compile.passes.attention_patterns` reads (rules as data: ``ATTENTION_FORMS``, run
by canonicalize_ops in its table's order). Each rewrite computes the same values (or, where
noted, the same softmax), on static shapes:

  * heads repeated for GQA: torchtune's ``expand(...).flatten(1, 2)``, Falcon's
    ``broadcast_to``, torchtune Gemma 2's repetition on [B, S, H, D] before the head
    transpose -> ``repeat_kv``'s ``unsqueeze(2).expand(...).reshape(...)`` on [B, H, S, D];
  * ``k^T`` as ``k.mT`` or a permute -> ``k.transpose(-2, -1)``;
  * x-transformers: ``einsum`` scores and output -> matmuls, its RoPE's outer-product
    einsum -> a broadcast mul; an autocast region where autocast changes nothing, inlined;
  * XGLM and Bloom: attention on heads flattened into the batch -> matmuls on
    [B, H, S, D] (:mod:`dcp_compile.passes.heads_in_batch`), and XGLM's
    ``max(scores, finfo.min)`` before the softmax dropped;
  * GPT-Neo: ``where(causal, scores, min) + mask`` -> ``scores + where(causal, mask, min)``.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from dcp_compile.runtime.errors import DCPTransformError

from .attention_patterns import MASKED_OUT, reaches_matmul
from .heads_in_batch import heads_unflattened_from_batch
from .infra import call_like, replace_node, source_of, val
from .op_classes import (AUTOCAST_REGIONS, BATCHED_MATMULS, CASTS, CONSTANT_WRAPPERS, EXPANDS,
                         EXPORT_ASSERTS, RESHAPES, SOFTMAX, is_call)

aten = torch.ops.aten


def _as_literal_shape(n: Node):
    """The literal-shape view ``n`` is another spelling of, or None: the flatten of an
    expand (heads repeated) is a reshape, ``broadcast_to`` an expand, to the output's
    (static) shape. Other flattens and ``expand_as`` stay: they name no shape, so sequence
    parallelism need not rescale them (the residual stream's are refused if literal)."""
    if is_call(n, {aten.flatten.using_ints}) and is_call(n.args[0], EXPANDS):
        return aten.reshape.default
    if is_call(n, {aten.broadcast_to.default}):
        return aten.expand.default
    return None


def views_with_literal_shapes(gm: GraphModule, weights: set[str], constants) -> int:
    """``x.flatten(a, b)`` -> ``x.reshape(shape)``, ``x.broadcast_to(s)`` -> ``x.expand(s)``:
    one spelling of each view, the one the GQA reader (``strip_repeat``) and the placement's
    view rules read. torchtune's GQA is ``k.unsqueeze(2).expand(b, n_kv, q_per_kv, s,
    d).flatten(1, 2)``, Falcon's grouped K/V a ``broadcast_to``. Shapes are static here
    (check_static_shapes ran), so the output's shape is the literal."""
    count = 0
    for n in list(gm.graph.nodes):
        target = _as_literal_shape(n)
        if target is not None and all(isinstance(d, int) for d in val(n).shape):
            replace_node(gm, n, target, (n.args[0], list(val(n).shape)))
            count += 1
    return count


def _last_two_swapped(n: Node) -> bool:
    """``x.mT`` or a permute that swaps the last two dims and keeps the others."""
    if is_call(n, {aten.mT.default}):
        return True
    if not is_call(n, {aten.permute.default}):
        return False
    nd, perm = val(n).dim(), [d % val(n).dim() for d in n.args[1]]
    return nd >= 2 and perm == [*range(nd - 2), nd - 1, nd - 2]


def _feeds_right_of_matmul(n: Node) -> bool:
    return bool(n.users) and all(is_call(u, BATCHED_MATMULS) and u.args[1] is n
                                 and u.args[0] is not n for u in n.users)


def _permuted(gm: GraphModule, at: Node, x: Node, perm: list[int]) -> Node:
    """``x.permute(perm)``, composed with a permute / transpose that made ``x`` (a K moved to
    [B, S, H, D] and back is the K it was, whose head repetition the reader then sees)."""
    nd = len(perm)
    if is_call(x, {aten.transpose.int}):
        first = list(range(nd))
        a, b = (d % nd for d in x.args[1:])
        first[a], first[b] = first[b], first[a]
        x, perm = x.args[0], [first[p] for p in perm]
    elif is_call(x, {aten.permute.default}):
        x, perm = x.args[0], [x.args[1][p] % nd for p in perm]
    if perm == list(range(nd)):
        return x
    return call_like(gm, at, aten.permute.default, (x, perm))


def transpose_of_last_two(gm: GraphModule, weights: set[str], constants) -> int:
    """``k.mT``, ``k.permute(0, 1, 3, 2)`` -> ``k.transpose(-2, -1)``; and a permute that also
    moves the leading dims, read as the right operand of a matmul (``q @ k.permute(0, 2, 3,
    1)``, k as [B, S, H, D]) -> ``k.permute(0, 2, 1, 3).transpose(-2, -1)``: the one
    spelling of ``k^T`` the attention reader reads (its K is then the permute)."""
    count = 0
    for n in list(gm.graph.nodes):
        if not isinstance(n.meta.get("val"), torch.Tensor) or val(n).dim() < 3:
            continue
        nd = val(n).dim()
        if _last_two_swapped(n):
            replace_node(gm, n, aten.transpose.int, (n.args[0], nd - 2, nd - 1))
            count += 1
        elif is_call(n, {aten.permute.default}) and _feeds_right_of_matmul(n):
            perm = [d % nd for d in n.args[1]]
            if perm[-2:] == [nd - 2, nd - 1]:
                continue                          # keeps the matrix dims: not a k^T
            k = _permuted(gm, n, n.args[0], perm[:-2] + [perm[-1], perm[-2]])
            replace_node(gm, n, aten.transpose.int, (k, nd - 2, nd - 1))
            count += 1
    return count


def _heads_repeated_token_major(t: Node):
    """``x.expand(B, S, Hkv, g, D).reshape(B, S, Hkv * g, D).transpose(1, 2)`` with x of
    shape [B, S, Hkv, 1, D] (torchtune's Gemma 2) -> (x, its shape); else None."""
    if not (is_call(t, {aten.transpose.int}) and {d % 4 for d in t.args[1:]} == {1, 2}):
        return None
    r = t.args[0]
    if not (is_call(r, RESHAPES) and val(r).dim() == 4 and is_call(r.args[0], EXPANDS)):
        return None
    e = r.args[0]
    x = e.args[0]
    if val(e).dim() != 5:
        return None
    b, s, h, g, d = val(e).shape
    if tuple(val(x).shape) != (b, s, h, 1, d) or tuple(val(r).shape) != (b, s, h * g, d):
        return None
    return x, (b, s, h, g, d)


def repeat_after_head_transpose(gm: GraphModule, weights: set[str], constants) -> int:
    """Heads repeated on [B, S, H, D] then moved to [B, H, S, D] (torchtune's Gemma 2) ->
    moved first, then repeated as ``repeat_kv`` writes it (``x[:, :, None].expand(B, Hkv, g,
    S, D).reshape(B, Hkv * g, S, D)``), which the GQA reader strips: the cache then holds the
    kv heads. Same values: both orders put kv head h // g at head h."""
    count = 0
    for n in list(gm.graph.nodes):
        found = _heads_repeated_token_major(n)
        if found is None:
            continue
        x, (b, s, h, g, d) = found
        kv = x
        for target, args in ((aten.reshape.default, ([b, s, h, d],)), (aten.transpose.int, (1, 2)),
                             (aten.unsqueeze.default, (2,)),
                             (aten.expand.default, ([b, h, g, s, d],))):
            kv = call_like(gm, n, target, (kv, *args))
        replace_node(gm, n, aten.reshape.default, (kv, [b, h * g, s, d]))
        count += 1
    return count


def _terms(equation: str):
    """(input terms, output term) of an einsum without ``...`` or repeated letters."""
    eq = equation.replace(" ", "")
    if "..." in eq or eq.count("->") != 1:
        return None
    ins, out = eq.split("->")
    terms = ins.split(",")
    if any(len(set(t)) != len(t) for t in (*terms, out)):
        return None
    return terms, out


def _matmul_of_einsum(equation: str):
    """A two-operand einsum that is a batched matmul -> whether its right operand is
    transposed (``'b h i d, b h j d -> b h i j'``: True; ``'b h i j, b h j d -> b h i d'``:
    False); None for any other equation. Batch letters must lead every term in the same
    order; one letter is contracted, one kept from each side."""
    found = _terms(equation)
    if found is None or len(found[0]) != 2:
        return None
    (a, b), out = found
    if not (len(a) == len(b) == len(out) >= 3 and a[:-2] == b[:-2] == out[:-2]):
        return None
    i, c = a[-2:]
    if out[-2] != i or c in out:
        return None
    if b[-1] == c and b[-2] == out[-1]:
        return True
    if b[-2] == c and b[-1] == out[-1]:
        return False
    return None


def _is_outer_product(equation: str) -> bool:
    """Two operands, nothing summed (every letter kept, each once per term): a broadcast
    product, as x-transformers' RoPE writes its angles (``'b i , j -> b i j'``)."""
    found = _terms(equation)
    if found is None or len(found[0]) != 2:
        return False
    (a, b), out = found
    return not set(a) & set(b) and set(a) | set(b) == set(out)


def _spread(gm: GraphModule, x: Node, term: str, out: str, meta: dict) -> Node:
    """``x`` (letters ``term``) with its dims in ``out``'s order and a size-1 dim for each
    letter of ``out`` it lacks, so that it broadcasts against the other operand."""
    steps = []
    order = sorted(range(len(term)), key=lambda d: out.index(term[d]))
    if order != list(range(len(term))):
        steps.append((aten.permute.default, (order,)))
    kept = sorted(out.index(c) for c in term)
    steps += [(aten.unsqueeze.default, (d,)) for d in range(len(out)) if d not in kept]
    for target, args in steps:
        with gm.graph.inserting_before(meta["node"]):
            x = gm.graph.call_function(target, (x, *args))
        x.meta.update(meta["meta"])
    return x


def einsum_as_matmul(gm: GraphModule, weights: set[str], constants) -> int:
    """x-transformers' attention: ``einsum('b h i d, b h j d -> b h i j', q, k)`` ->
    ``q @ k.transpose(-2, -1)`` and ``einsum('b h i j, b h j d -> b h i d', p, v)`` -> ``p @
    v``, the forms the attention reader reads; an outer product (its RoPE angles, ``'b i, j
    -> b i j'``) -> a broadcast ``mul``. Other equations are left as they are (and refused
    where they matter: einsum has no placement rule)."""
    count = 0
    for n in list(gm.graph.nodes):
        if not is_call(n, {aten.einsum.default}) or len(n.args[1]) != 2:
            continue
        if _is_outer_product(n.args[0]):
            (ta, tb), out = _terms(n.args[0])
            meta = {"node": n, "meta": {k: v for k, v in n.meta.items() if k != "val"}}
            a, b = (_spread(gm, x, t, out, meta) for x, t in zip(n.args[1], (ta, tb)))
            replace_node(gm, n, aten.mul.Tensor, (a, b))
            count += 1
            continue
        transposed = _matmul_of_einsum(n.args[0])
        if transposed is None:
            continue
        a, b = n.args[1]
        if transposed:
            nd = val(b).dim()
            with gm.graph.inserting_before(n):
                b = gm.graph.call_function(aten.transpose.int, (b, nd - 2, nd - 1))
            b.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        replace_node(gm, n, aten.matmul.default, (a, b))
        count += 1
    return count


def _autocast_region(n: Node):
    """(enabled, the region's GraphModule) of a ``wrap_with_autocast`` call, else None."""
    if not is_call(n, AUTOCAST_REGIONS):
        return None
    _device, _dtype, enabled, _cache, sub = n.args[:5]
    return enabled, getattr(n.graph.owning_module, sub.target)


def _inline(gm: GraphModule, n: Node, sub: GraphModule) -> None:
    """The region's nodes copied in place of ``n``; ``n[i]`` becomes its i-th output. Its
    export asserts are dropped, as drop_export_asserts (run before) did the graph's."""
    env = dict(zip([p for p in sub.graph.nodes if p.op == "placeholder"], n.args[5:]))
    outputs = None
    for s in sub.graph.nodes:
        if s.op == "placeholder" or is_call(s, EXPORT_ASSERTS):   # as drop_export_asserts
            continue
        if s.op == "output":
            outputs = s.args[0]
            break
        with gm.graph.inserting_before(n):
            env[s] = gm.graph.node_copy(s, lambda x: env[x])
    outputs = torch.fx.node.map_arg(outputs, lambda x: env[x])
    for u in list(n.users):
        if u.target is not operator.getitem:
            raise DCPTransformError(f"the autocast region's result is used whole by "
                                    f"{u.name} ({source_of(u)}). Report this model")
        u.replace_all_uses_with(outputs[u.args[1]])
        gm.graph.erase_node(u)
    gm.graph.erase_node(n)


def _region_source(n: Node, sub: GraphModule) -> str:
    """Where the region's code is: its first op that knows its source line (the call node
    itself carries only the module)."""
    for s in sub.graph.nodes:
        if s.meta.get("stack_trace"):
            return source_of(s)
    return source_of(n)


def _autocast_changes_nothing(region: Node, sub: GraphModule) -> bool:
    """Autocast changes nothing in ``region`` when it is disabled (x-transformers' RoPE; on CPU
    torch records autocast to float32 as disabled itself), or when it casts to float32 and
    every floating value the region reads or computes is float32 already (torchtitan's
    router on a GPU capture: its casts, down and up, are no-ops)."""
    _device, dtype, enabled = region.args[:3]
    if not enabled:
        return True
    values = [val(a) for a in region.args[5:] if isinstance(a, Node)] + \
        [s.meta.get("val") for s in sub.graph.nodes if s.op == "call_function"]
    return dtype == torch.float32 and all(
        v.dtype == torch.float32 for v in values
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point)


def autocast_inlined(gm: GraphModule, weights: set[str], constants) -> int:
    """``with torch.autocast(...)``: torch.export keeps the region as a ``wrap_with_autocast``
    call, which no placement rule reads. A region where autocast changes nothing
    (:func:`_autocast_changes_nothing`; the program runs with the captured dtypes) is
    inlined; one that would cast runs its ops in a dtype the graph does not show: refused by
    name."""
    count = 0
    while True:
        regions = [(n, r) for n in gm.graph.nodes if (r := _autocast_region(n)) is not None]
        if not regions:
            return count
        for n, (_enabled, sub) in regions:
            if not _autocast_changes_nothing(n, sub):
                raise DCPTransformError(
                    f"torch.autocast(enabled=True) region at node {n.name} "
                    f"({_region_source(n, sub)}): its ops run in the autocast dtype, which the "
                    f"captured graph does not show. Run the model without autocast (cast "
                    f"it to the dtype you want instead)")
            _inline(gm, n, sub)
            count += 1


def _feeds_softmax(n: Node) -> bool:
    """``n`` reaches a softmax over its last dim through dtype casts only."""
    while len(n.users) == 1:
        (n,) = n.users
        if is_call(n, SOFTMAX):
            return n.args[1] in (-1, val(n).dim() - 1)
        if not is_call(n, CASTS):
            return False
    return False


def _number(x, constants):
    """``x`` as a Python number: a number, or a one-element constant input (GPT-Neo's
    ``torch.tensor(finfo.min)``, lifted by torch.export) through its wrappers; else None."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x
    while is_call(x, CONSTANT_WRAPPERS):
        x = x.args[0]
    if not (isinstance(x, Node) and x.op == "placeholder"):
        return None
    value = constants().get(x.name)
    if value is None or value.is_meta or value.numel() != 1:
        return None
    return value.item()


def _where_masked_scores(a: Node, constants):
    """(cond, scores, fill) of ``where(cond, scores, fill)`` with a masked-out number fill."""
    if not is_call(a, {aten.where.ScalarOther, aten.where.self}) or \
            not isinstance(a.args[1], Node):
        return None
    fill = _number(a.args[2], constants)
    ok = fill is not None and fill <= MASKED_OUT
    return (a.args[0], a.args[1], fill) if ok else None


def where_then_additive_mask(gm: GraphModule, weights: set[str], constants) -> int:
    """GPT-Neo's eager scores, ``where(causal, s, min) + attention_mask`` before a softmax,
    -> ``s + where(causal, attention_mask, min)``: one additive mask (which the mask prover
    reads) on the scores. Equal after the softmax: kept entries are ``s + mask`` in both;
    entries the where hides are ``min + mask`` and ``s + min``, both masked out (exp
    underflows to 0; a causal row keeps its diagonal, which the prover checks)."""
    count = 0
    for n in list(gm.graph.nodes):
        if not (is_call(n, {aten.add.Tensor}) and all(isinstance(x, Node) for x in n.args)
                and _feeds_softmax(n)):
            continue
        for w, m in (n.args, n.args[::-1]):
            found = _where_masked_scores(w, constants)
            if found is None or len(w.users) != 1 or val(m).dtype == torch.bool \
                    or not val(m).dtype.is_floating_point:
                continue
            cond, scores, fill = found
            if not reaches_matmul(scores) or reaches_matmul(m):
                continue       # the where is the mask (HF's where(causal, 0, min)), not this
            with gm.graph.inserting_before(n):
                mask = gm.graph.call_function(aten.where.ScalarOther, (cond, m, fill))
            mask.meta.update({k: v for k, v in w.meta.items() if k != "val"})
            replace_node(gm, n, aten.add.Tensor, (scores, mask))
            count += 1
            break
    return count


def _masked_out_floor(n: Node, constants):
    """``x`` when ``n`` is ``max(x, c)`` / ``clamp_min(x, c)`` with c a masked-out constant
    (XGLM's ``max(scores, finfo.min)``) feeding a softmax: it only turns -inf into another
    masked-out value, the same 0 after the softmax. Else None."""
    if not (is_call(n, {aten.max.other, aten.maximum.default, aten.clamp_min.default})
            and _feeds_softmax(n)):
        return None
    x, c = n.args[:2]
    if is_call(c, {aten.full.default}) and list(c.args[0]) == []:
        c = c.args[1]
    c = _number(c, constants)
    return x if c is not None and c <= MASKED_OUT else None


def masked_out_floor_dropped(gm: GraphModule, weights: set[str], constants) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        if (x := _masked_out_floor(n, constants)) is not None:
            n.replace_all_uses_with(x)
            gm.graph.erase_node(n)
            count += 1
    return count


def _row_max_of(m: Node, x: Node) -> bool:
    """``m`` is x's max over its last dim kept as a dim: ``x.amax(-1, keepdim=True)`` or
    ``x.max(dim=-1, keepdim=True).values`` (the values, item 0 of ``max.dim``), through a
    ``detach`` at most."""
    if is_call(m, {aten.detach.default}):
        m = m.args[0]
    last = (-1, val(x).dim() - 1)
    if is_call(m, {aten.amax.default}):
        dims, keep = (list(m.args[1]) if len(m.args) > 1 else []), \
            (m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim", False))
        return m.args[0] is x and len(dims) == 1 and dims[0] in last and keep is True
    if m.op == "call_function" and m.target is operator.getitem and m.args[1] == 0 \
            and is_call(m.args[0], {aten.max.dim}):
        mx = m.args[0]
        keep = mx.args[2] if len(mx.args) > 2 else mx.kwargs.get("keepdim", False)
        return mx.args[0] is x and mx.args[1] in last and keep is True
    return False


def row_max_subtracted(gm: GraphModule, weights: set[str], constants) -> int:
    """MiMo's (and many eager kernels') ``s - s.max(-1, keepdim=True).values`` before a
    softmax over the same dim -> ``s``: a softmax is the same after subtracting any constant
    from a row, and the paged kernel keeps its own running max (the LSE combine needs it
    over every rank's keys, not one rank's)."""
    count = 0
    for n in list(gm.graph.nodes):
        if not (is_call(n, {aten.sub.Tensor}) and isinstance(n.args[0], Node)
                and isinstance(n.args[1], Node) and len(n.args) == 2 and _feeds_softmax(n)
                and _row_max_of(n.args[1], n.args[0])):
            continue
        n.replace_all_uses_with(n.args[0])
        gm.graph.erase_node(n)
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
    return count


# name -> rewrite(gm, weight input names, constants() -> {input name: tensor}) -> count, in
# the order canonicalize_ops runs them (autocast regions first: their ops are read by the
# others).
ATTENTION_FORMS: dict[str, Callable] = {
    "autocast_inlined": autocast_inlined,
    "views_with_literal_shapes": views_with_literal_shapes,
    "einsum_as_matmul": einsum_as_matmul,
    "transpose_of_last_two": transpose_of_last_two,
    "repeat_after_head_transpose": repeat_after_head_transpose,
    "heads_unflattened_from_batch": heads_unflattened_from_batch,
    "masked_out_floor_dropped": masked_out_floor_dropped,
    "row_max_subtracted": row_max_subtracted,
    "where_then_additive_mask": where_then_additive_mask,
}
