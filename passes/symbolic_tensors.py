"""Symbolic tensors: a tensor as its shape and ONE sympy expression of its element indices
(``axis(k)`` for axis k), the values :mod:`dcp_compile.passes.mask_predicate` interprets a
mask's or a score bias's computation on. Helpers only; the op rules live with the reader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy


def axis(k: int) -> sympy.Symbol:
    """The index symbol of a symbolic tensor's axis k."""
    return sympy.Symbol(f"x{k}", integer=True, nonnegative=True)


@dataclass(frozen=True)
class Sym:
    """A tensor as its shape and one sympy expression of its indices (axis(k), k < rank).
    Booleans are sympy Boolean; numbers are Expr (Piecewise for -inf fills)."""

    shape: tuple[int, ...]
    expr: sympy.Basic
    boolean: bool


class NotAFormula(Exception):
    """Raised by a rule that meets a value it cannot express; turned into a refusal."""


# -- helpers over symbolic tensors ------------------------------------------------------------


def constant(c, boolean: bool) -> sympy.Basic:
    if boolean:
        return sympy.true if c else sympy.false
    if isinstance(c, bool):
        return sympy.Integer(int(c))
    if isinstance(c, int):
        return sympy.Integer(c)
    if isinstance(c, float):
        if math.isinf(c):
            return sympy.oo if c > 0 else -sympy.oo
        return sympy.Integer(int(c)) if c.is_integer() else sympy.Float(c)
    raise NotAFormula(f"constant {c!r}")


def rename(expr, mapping: dict[int, sympy.Basic]):
    """Replace axis(k) by mapping[k], all at once."""
    return expr.xreplace({axis(k): v for k, v in mapping.items()})


def broadcast_to(v: Sym, shape: tuple[int, ...]) -> sympy.Basic:
    """v's expression on the axes of ``shape`` (numpy broadcasting: aligned right; a size-1
    axis stretched to a longer one is read at index 0)."""
    off = len(shape) - len(v.shape)
    if off < 0:
        raise NotAFormula(f"cannot broadcast {v.shape} to {shape}")
    mapping = {}
    for k, n in enumerate(v.shape):
        if n == 1 and shape[k + off] != 1:
            mapping[k] = sympy.Integer(0)
        elif n != shape[k + off]:
            raise NotAFormula(f"cannot broadcast {v.shape} to {shape}")
        else:
            mapping[k] = axis(k + off)
    return rename(v.expr, mapping)


def as_bool(e, boolean: bool):
    return e if boolean else relation(sympy.Ne, e, sympy.Integer(0))


def as_number(e, boolean: bool):
    return sympy.Piecewise((1, e), (0, True)) if boolean else e


def pieces(e) -> list[tuple[sympy.Basic, sympy.Basic]]:
    """(value, condition) pairs with mutually exclusive conditions covering everything."""
    e = sympy.piecewise_fold(e)
    if not isinstance(e, sympy.Piecewise):
        return [(e, sympy.true)]
    out, before = [], sympy.false
    for value, cond in e.args:
        out.append((value, sympy.And(cond, sympy.Not(before))))
        before = sympy.Or(before, cond)
    return out


def relation(op, a, b):
    """op(a, b) for numbers that may be Piecewise: an Or over the pieces of a and b."""
    terms = []
    for va, ca in pieces(a):
        for vb, cb in pieces(b):
            terms.append(sympy.And(ca, cb, op(va, vb)))
    return sympy.Or(*terms)


def _fold(e):
    return sympy.piecewise_fold(e)


# A finite fill plus a bias still hides a key when the fill alone is beyond any bias: an
# fp32/bf16 finfo.min (Falcon adds ALiBi to a mask filled with it), not fp16's -65504.
HIDDEN_UNDER_BIAS = -1e30


def hidden_under_bias(value) -> bool:
    """``-inf + bias`` (sympy keeps it as a sum) or ``finfo.min + bias``: the key is hidden."""
    if not isinstance(value, sympy.Add):
        return False
    return any(a.is_number and (a == -sympy.oo or float(a) <= HIDDEN_UNDER_BIAS)
               for a in value.args)
