"""A finalize rule: a KV cache write of a few tokens as in-place updates, not a scatter.

``dcp.cache_write`` decomposes to ``index_put`` at (block, offset) of the cache, which
torch-mlir lowers to ``stablehlo.scatter``. XLA costs a scatter as a whole-operand op (its
cost analysis counts reading and writing the whole cache, every layer, every decode step).
A decode step writes one token per sequence, so the scatter becomes a chain of
``dynamic_update_slice`` of one token each, which XLA does in place and costs by the token.

The rewrite is exact for any index: a scatter skips an update whose row is out of bounds,
and ``dynamic_update_slice`` clamps its start instead, so an out-of-bounds update writes back
the (clamped) row it would overwrite. Duplicate rows: the chain applies the updates in
order, one of the orders a scatter with ``unique_indices = false`` may take.
"""

from __future__ import annotations

import re

# Scatters of at most this many rows become row updates (a decode step writes one per
# sequence and layer); a prompt step's thousands of rows stay one scatter.
MAX_ROW_UPDATES = 64

_ROW_SCATTER = re.compile(r"update_window_dims = \[([\d, ]*)\], inserted_window_dims = "
                          r"\[([\d, ]*)\], scatter_dims_to_operand_dims = \[([\d, ]*)\], "
                          r"index_vector_dim = 1>")


def _ints(text: str) -> list[int]:
    return [int(d) for d in text.replace(" ", "").split(",") if d]


def _row_scatter_shape(op):
    """(updates M, index dims K, operand type) if ``op`` writes M whole entries of the leading
    K dims of one operand (``indices [M, K]``, M <= MAX_ROW_UPDATES), else None."""
    from torch_mlir import ir
    if len(op.operands) != 3 or len(op.results) != 1:
        return None
    m = _ROW_SCATTER.search(str(op.attributes["scatter_dimension_numbers"]))
    operand_t = ir.RankedTensorType(op.operands[0].type)
    indices_t = ir.RankedTensorType(op.operands[1].type)
    updates_t = ir.RankedTensorType(op.operands[2].type)
    if m is None or indices_t.rank != 2:
        return None
    rows, k = indices_t.shape
    window, inserted, to_operand = (_ints(g) for g in m.groups())
    rank = operand_t.rank
    if (inserted != list(range(k)) or to_operand != list(range(k))
            or window != list(range(1, rank - k + 1))
            or list(updates_t.shape) != [rows, *operand_t.shape[k:]]
            or not 1 <= rows <= MAX_ROW_UPDATES or not _replaces(op)):
        return None
    return rows, k, operand_t


def _replaces(op) -> bool:
    """The update computation returns the update (its second argument): a plain write."""
    block = op.regions[0].blocks[0]
    ret = list(block.operations)[-1]
    return (len(list(block.operations)) == 1 and len(ret.operands) == 1
            and ret.operands[0] == block.arguments[1])


def row_scatter_to_updates(op):
    """stablehlo.scatter of a few whole entries -> dynamic_update_slice per entry (module
    doc); None (left as is) for any other scatter."""
    from torch_mlir import ir
    shape = _row_scatter_shape(op)
    if shape is None:
        return None
    rows, k, operand_t = shape
    ip, loc = ir.InsertionPoint(op), op.location
    i64 = ir.RankedTensorType(op.operands[1].type).element_type     # the indices' type
    scalar = ir.RankedTensorType.get([], i64)
    pred = ir.RankedTensorType.get([], ir.IntegerType.get_signless(1))
    row_t = ir.RankedTensorType.get([1] * k + operand_t.shape[k:], operand_t.element_type)
    update_t = ir.RankedTensorType.get([1, *operand_t.shape[k:]], operand_t.element_type)

    def create(name, operands, result, **attributes):
        return ir.Operation.create(name, results=[result], operands=operands,
                                   attributes=attributes, ip=ip, loc=loc).results[0]

    def constant(value):
        return create("stablehlo.constant", [], scalar,
                      value=ir.DenseElementsAttr.get_splat(scalar, ir.IntegerAttr.get(i64,
                                                                                     value)))

    def row_slice(value, start, limit, t):
        return create("stablehlo.slice", [value], t,
                      start_indices=ir.DenseI64ArrayAttr.get(start),
                      limit_indices=ir.DenseI64ArrayAttr.get(limit),
                      strides=ir.DenseI64ArrayAttr.get([1] * len(start)))

    def compare(a, b, direction):
        return create("stablehlo.compare", [a, b], pred, comparison_direction=ir.Attribute.parse(
            f"#stablehlo<comparison_direction {direction}>"))

    current, indices, updates = op.operands
    zero = constant(0)
    bounds = [constant(n) for n in operand_t.shape[:k]]
    others = [zero] * (operand_t.rank - k)
    index_t = ir.RankedTensorType.get([1, 1], i64)     # one index of one update
    for m in range(rows):
        where = [create("stablehlo.reshape", [row_slice(indices, [m, j], [m + 1, j + 1],
                                                        index_t)], scalar) for j in range(k)]
        update = create("stablehlo.reshape", [row_slice(
            updates, [m] + [0] * (operand_t.rank - k), [m + 1, *operand_t.shape[k:]],
            update_t)], row_t)
        in_bounds = None
        for index, bound in zip(where, bounds):
            inside = create("stablehlo.and", [compare(index, zero, "GE"),
                                              compare(index, bound, "LT")], pred)
            in_bounds = inside if in_bounds is None else create(
                "stablehlo.and", [in_bounds, inside], pred)
        kept = create("stablehlo.dynamic_slice", [current, *where, *others], row_t,
                      slice_sizes=ir.DenseI64ArrayAttr.get(list(row_t.shape)))
        update = create("stablehlo.select", [in_bounds, update, kept], row_t)
        current = create("stablehlo.dynamic_update_slice", [current, update, *where, *others],
                         op.results[0].type)
    return current.owner
