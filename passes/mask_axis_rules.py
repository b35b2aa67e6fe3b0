"""The mask reader's rules for ops along one axis of a symbolic tensor (a constant pad, a
first difference, a running sum): rows of :data:`dcp_compile.passes.mask_predicate.RULES`,
each ``(node, symbolic args) -> Sym`` (passes/symbolic_tensors.py), or NotAFormula."""

from __future__ import annotations

import sympy
import torch

from .infra import val
from .op_classes import PADS
from .symbolic_tensors import (NotAFormula, Sym, _fold, as_number, axis, broadcast_to,
                               constant, rename)

aten = torch.ops.aten


def _out(n) -> tuple[tuple[int, ...], bool]:
    v = val(n)
    return tuple(int(s) for s in v.shape), v.dtype == torch.bool


def _pad(n, args):
    """``pad(x, pad, mode="constant", value)`` / ``constant_pad_nd(x, pad, value)``: x read
    at ``a - left`` along each padded axis, ``value`` (0 unless given) outside it. ``pad``
    pairs (left, right) from the last axis back; a negative side crops."""
    x, (shape, boolean) = args[0], _out(n)
    pads = list(args[1])
    mode = args[2] if n.target is aten.pad.default and len(args) > 2 else "constant"
    value = args[3 if n.target is aten.pad.default else 2] \
        if len(args) > (3 if n.target is aten.pad.default else 2) else None
    if mode != "constant":
        raise NotAFormula(f"a {mode!r} pad (only a constant pad is a formula)")
    if isinstance(value, Sym):
        raise NotAFormula("a pad with a tensor value")
    mapping, outside = {}, []
    for k in range(len(pads) // 2):
        dim = len(shape) - 1 - k
        left, right = pads[2 * k], pads[2 * k + 1]
        a = axis(dim)
        mapping[dim] = a - left
        outside += ([a < left] if left > 0 else []) + \
            ([a >= left + x.shape[dim]] if right > 0 else [])
    inner = rename(x.expr, mapping)
    fill = constant(value if value is not None else (False if boolean else 0), boolean)
    hit = sympy.Or(*outside)
    if boolean:
        return Sym(shape, sympy.Or(sympy.And(hit, fill), sympy.And(sympy.Not(hit), inner)),
                   True)
    return Sym(shape, _fold(sympy.Piecewise((fill, hit), (inner, True))), False)


def _diff(n, args):
    """diff(x, n=1, dim, prepend): y[a] = x[a] - (prepend[0] if a == 0 else x[a - 1])."""
    x, (shape, _) = args[0], _out(n)
    order = args[1] if len(args) > 1 else 1
    dim = (args[2] if len(args) > 2 else -1) % len(x.shape)
    prepend = args[3] if len(args) > 3 else None
    append = args[4] if len(args) > 4 else None
    if order != 1 or append is not None or not isinstance(prepend, Sym) \
            or prepend.shape[dim] != 1 or x.boolean:
        raise NotAFormula("diff other than first order with a one-element prepend")
    a = axis(dim)
    before = rename(x.expr, {dim: a - 1})
    first = rename(broadcast_to(prepend, x.shape[:dim] + (1,) + x.shape[dim + 1:]),
                   {dim: sympy.Integer(0)})
    return Sym(shape, _fold(sympy.simplify(
        sympy.Piecewise((x.expr - first, sympy.Eq(a, 0)), (x.expr - before, True)))), False)


def _cumsum(n, args):
    """cumsum along an axis the summand does not depend on: (index + 1) * summand."""
    x, (shape, _) = args[0], _out(n)
    dim = args[1] % len(x.shape)
    summand = sympy.simplify(as_number(x.expr, x.boolean))
    if axis(dim) in summand.free_symbols:
        raise NotAFormula("a running sum of values that vary along the summed axis")
    return Sym(shape, _fold((axis(dim) + 1) * summand), False)


AXIS_RULES = {aten.diff.default: _diff, aten.cumsum.default: _cumsum,
              **dict.fromkeys(PADS, _pad)}
