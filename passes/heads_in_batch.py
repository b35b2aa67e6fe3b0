"""Attention on heads flattened into the batch (XGLM, Bloom) rewritten onto [B, H, S, D].

An ``ATTENTION_FORMS`` row of :mod:`dcp_compile.passes.attention_forms`:

  * XGLM: ``bmm`` of [B·H, S, D] operands -> a reshape of ``matmul`` on the [B, H, S, D]
    tensors they flatten; a softmax over the last dim of a [B·H, S, T] reshape -> the
    reshape of the [B, H, S, T] softmax; a reshape and its inverse -> nothing;
  * Bloom: ``alibi.baddbmm(q, k^T, beta, alpha)`` -> ``alibi * beta + bmm * alpha``, and an
    add / mul of merged scores with a scalar or a [B·H, ...] reshape (or batch repeat) of a
    [B, H, ...] / [H, ...] tensor -> the same op on the [B, H, S, T] scores (its ALiBi is
    then read like any other: docs/guarantees.md).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from .infra import call_like, replace_node, val
from .op_classes import CASTS, RESHAPES, SOFTMAX, is_call

aten = torch.ops.aten


def _noop_dropout(n: Node) -> bool:
    return is_call(n, {aten.dropout.default}) and (n.args[1] == 0 or n.args[2] is False)


def _heads_source(n: Node, lead: int):
    """The 4-D [B, H, M, K] tensor whose heads a [B·H, M, K] operand merely flattens
    (through reshapes and eval-mode dropouts; B·H = ``lead``), deepest first; else None.
    Reshapes keep the row-major order, so any chain of them from [B, H, M, K] to
    [B·H, M, K] is that one reshape."""
    found, rows = None, tuple(val(n).shape[1:])
    while is_call(n, RESHAPES) or _noop_dropout(n):
        n = n.args[0]
        shape = tuple(val(n).shape)
        if len(shape) == 4 and shape[0] * shape[1] == lead and shape[2:] == rows:
            found = n
    return found


def _bmm_operands(n: Node):
    """(a4, b4, transpose b4?) of ``bmm(a, b)`` on heads flattened into the batch (XGLM:
    ``bmm(q.reshape(B·H, S, D), k.reshape(B·H, S, D).transpose(1, 2))``); else None."""
    a, b = n.args
    lead = val(n).shape[0]
    a4 = _heads_source(a, lead)
    transposed = is_call(b, {aten.transpose.int}) and {d % 3 for d in b.args[1:]} == {1, 2}
    b4 = _heads_source(b.args[0] if transposed else b, lead)
    if a4 is None or b4 is None or tuple(val(a4).shape[:2]) != tuple(val(b4).shape[:2]):
        return None
    return a4, b4, transposed


def _reshape_round_trip(n: Node):
    """``x`` when ``n`` is a reshape of a reshape of ``x`` back to x's shape; else None."""
    if is_call(n, RESHAPES) and is_call(n.args[0], RESHAPES):
        x = n.args[0].args[0]
        if tuple(val(x).shape) == tuple(val(n).shape):
            return x
    return None


def _softmax_of_merged_heads(n: Node):
    """(y, merged shape) of ``softmax(y.reshape(B·H, S, T), -1)`` with y [B, H, S, T]."""
    if not (is_call(n, SOFTMAX) and n.args[1] in (-1, 2) and is_call(n.args[0], RESHAPES)):
        return None
    y = n.args[0].args[0]
    shape, merged = tuple(val(y).shape), tuple(val(n).shape)
    if len(shape) == 4 and len(merged) == 3 and shape[2:] == merged[1:]:
        return y, list(merged)
    return None


def _baddbmm_split(gm: GraphModule, n: Node) -> bool:
    """Bloom's ``alibi.baddbmm(q, k^T, beta, alpha)`` on heads flattened into the batch ->
    ``alibi * beta + bmm(q, k^T) * alpha`` (the same values), so the bmm reads as above."""
    if not is_call(n, {aten.baddbmm.default}):
        return False
    base, b1, b2 = n.args[:3]
    beta, alpha = n.kwargs.get("beta", 1), n.kwargs.get("alpha", 1)
    if _bmm_operands(call_like(gm, n, aten.bmm.default, (b1, b2))) is None:
        return False
    mm = call_like(gm, n, aten.bmm.default, (b1, b2))
    scaled = call_like(gm, n, aten.mul.Tensor, (mm, alpha)) if alpha != 1 else mm
    base = call_like(gm, n, aten.mul.Tensor, (base, beta)) if beta != 1 else base
    replace_node(gm, n, aten.add.Tensor, (scaled, base))
    return True


def _merged_operand(gm: GraphModule, at: Node, x, heads: tuple[int, int]):
    """A [B·H, ...] operand of an elementwise op at ``at`` as the [B, H, ...] tensor it
    flattens: a reshape of one (Bloom's alibi [B, H, S] reshaped [B·H, 1, S]), or a repeat
    over the batch of an [H, ...] one (Bloom's alibi of positions, ``[H, 1, S].repeat(B, 1,
    1)``: expanded); a scalar as it is; else None."""
    if not isinstance(x, Node) or val(x).dim() == 0:
        return x
    while is_call(x, CASTS) and val(x).dtype == val(x.args[0]).dtype:   # .to(same dtype)
        x = x.args[0]
    shape, (b, h) = tuple(val(x).shape), heads
    if shape[0] != b * h:
        return None
    four = [b, h, *shape[1:]]
    if is_call(x, RESHAPES) and tuple(val(x.args[0]).shape[:2]) == heads:
        return call_like(gm, at, aten.reshape.default, (x.args[0], four))
    if is_call(x, {aten.repeat.default}) and list(x.args[1]) == [b] + [1] * (len(shape) - 1) \
            and val(x.args[0]).shape[0] == h:
        one = call_like(gm, at, aten.unsqueeze.default, (x.args[0], 0))
        return call_like(gm, at, aten.expand.default, (one, four))
    return None


def _pointwise_of_merged_heads(gm: GraphModule, n: Node) -> bool:
    """``op(y.reshape(B·H, S, T), z)`` with z a scalar or a reshape of a [B, H, ...] tensor
    (add / mul: Bloom's alibi and scale on the merged scores) -> ``op(y, z as [B, H, ...])
    .reshape(B·H, S, T)``: the same values, the heads kept as a dim."""
    if not (is_call(n, {aten.add.Tensor, aten.mul.Tensor}) and len(n.args) == 2
            and not n.kwargs and is_call(n.args[0], RESHAPES) and val(n).dim() == 3):
        return False
    y = n.args[0].args[0]
    shape = tuple(val(y).shape)
    if len(shape) != 4 or tuple(val(n.args[0]).shape) != (shape[0] * shape[1], *shape[2:]):
        return False
    other = _merged_operand(gm, n, n.args[1], shape[:2])
    if other is None:
        return False
    op = call_like(gm, n, n.target, (y, other))
    replace_node(gm, n, aten.reshape.default, (op, list(val(n).shape)))
    return True


def _unflatten_heads_once(gm: GraphModule) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        if not n.users:
            continue
        if _baddbmm_split(gm, n) or _pointwise_of_merged_heads(gm, n):
            pass
        elif is_call(n, {aten.bmm.default}) and (found := _bmm_operands(n)) is not None:
            a4, b4, transposed = found
            if transposed:
                b4 = call_like(gm, n, aten.transpose.int, (b4, 2, 3))
            mm = call_like(gm, n, aten.matmul.default, (a4, b4))
            replace_node(gm, n, aten.reshape.default, (mm, list(val(n).shape)))
        elif (found := _softmax_of_merged_heads(n)) is not None:
            y, merged = found
            sm = call_like(gm, n, n.target, (y, -1, *n.args[2:]))
            replace_node(gm, n, aten.reshape.default, (sm, merged))
        elif (x := _reshape_round_trip(n)) is not None:
            n.replace_all_uses_with(x)
        else:
            continue
        count += 1
    return count


def heads_unflattened_from_batch(gm: GraphModule, weights: set[str], constants) -> int:
    """XGLM's attention on heads flattened into the batch: ``bmm`` of [B·H, S, D] operands
    -> a reshape of ``matmul`` on the [B, H, S, D] tensors they flatten; a softmax over the
    last dim of a [B·H, S, T] reshape -> the reshape of the [B, H, S, T] softmax; a
    reshape and its inverse -> nothing. Repeated until nothing changes: the attention then
    reads as ``softmax(q @ k^T + mask) @ v`` on [B, H, S, D]."""
    count = 0
    while (step := _unflatten_heads_once(gm)) > 0:
        count += step
        for n in list(gm.graph.nodes):
            if _noop_dropout(n) and not n.users:   # seeded: eliminate_dead_code keeps it
                gm.graph.erase_node(n)
        gm.graph.eliminate_dead_code()
    return count
