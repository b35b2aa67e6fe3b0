"""Op classes, defined once: every pass that decides by the kind of an op reads these sets
(two passes never keep their own, drifting copies). Pointwise ops are found by their torch
tag (``torch.Tag.pointwise``), not listed."""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

aten = torch.ops.aten

# Leave a value's meaning unchanged: dtype casts and copies (one tensor operand, args[0]).
CASTS = frozenset({aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout,
                   aten.to.device, aten.clone.default, aten.contiguous.default,
                   aten.alias.default, aten.detach.default, aten.type_as.default,
                   aten.lift_fresh_copy.default})

# Keep every dim where it is: the casts, and eval-mode dropout.
IDENTITY_VIEWS = CASTS | {aten.dropout.default}

# Regroup dims by a literal target shape.
RESHAPES = frozenset({aten.reshape.default, aten.view.default, aten._unsafe_view.default})
FLATTENS = frozenset({aten.flatten.using_ints, aten.unflatten.int})
# Ops whose arguments spell out sizes (a rewrite that changes a dim's size must rescale them).
LITERAL_SHAPES = RESHAPES | {aten.expand.default, aten.unflatten.int}

# Move, add or drop dims without touching values.
DIM_MOVES = frozenset({aten.transpose.int, aten.t.default, aten.permute.default,
                       aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                       aten.squeeze.default, aten.expand.default})
# Complex views: a last dim of 2 (re, im) <-> one complex element.
COMPLEX_VIEWS = frozenset({aten.view_as_complex.default, aten.view_as_real.default})

# Take parts of a dim.
SLICES = frozenset({aten.slice.Tensor, aten.narrow.default, aten.select.int})
SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                    aten.unbind.int})
JOINS = frozenset({aten.cat.default, aten.stack.default})

# All ops that only rearrange values (no arithmetic).
SHAPE_OPS = CASTS | RESHAPES | FLATTENS | DIM_MOVES | COMPLEX_VIEWS | SLICES | SPLITS | \
    JOINS | {operator.getitem}

SOFTMAX = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
MATMUL = frozenset({aten.matmul.default})
REDUCTIONS = frozenset({aten.mean.dim, aten.sum.dim_IntList, aten.amax.default,
                        aten.amin.default, aten.var.correction})


def is_call(n, targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def is_pointwise(target) -> bool:
    return torch.Tag.pointwise in getattr(target, "tags", ())


def skip_casts(n: Node) -> Node:
    while is_call(n, CASTS):
        n = n.args[0]
    return n
