"""The piecewise reducer behind the layout proofs, checked against brute force with ints.

Every rule it applies (floor, Mod, Max/Min, Eq/inequalities in Piecewise) is exercised on
random expressions over small boxes; each returned piece's polynomial must equal the
expression at every integer point of the piece, and the pieces must partition the box.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
import random

import pytest
import sympy

from dcp_compile.passes.prove.integer_reduction import Stuck, reduce_on_box

X, Y, Z = (sympy.Symbol(n, integer=True) for n in "xyz")
BOX = {X: (0, 4), Y: (-2, 3), Z: (2, 5)}


def _affine(rng):
    return (rng.randint(-3, 3) * X + rng.randint(-2, 2) * Y + rng.randint(-1, 2) * Z
            + rng.randint(-5, 5))


def _div(a, d):
    return sympy.Mul(a, sympy.Rational(1, d), evaluate=False)


def _expr(rng, depth=0):
    """A random expression of the shapes the layout formulas produce."""
    a = _affine(rng) if depth > 1 or rng.random() < 0.4 else _expr(rng, depth + 1)
    b = _affine(rng)
    d = rng.randint(1, 7)
    shape = rng.randrange(8)
    if shape == 0:
        return sympy.floor(_div(a, d), evaluate=False)
    if shape == 1:
        return sympy.Mod(a, d, evaluate=False)
    if shape == 2:
        return sympy.Max(a, b, evaluate=False)
    if shape == 3:
        return sympy.Min(a, b, rng.randint(-4, 4), evaluate=False)
    if shape == 4:
        return sympy.Piecewise((1, sympy.Eq(a, b, evaluate=False)), (0, True), evaluate=False)
    if shape == 5:
        rel = rng.choice([sympy.Ge, sympy.Gt, sympy.Le, sympy.Lt])
        return sympy.Piecewise((a, rel(a, b, evaluate=False)), (b - 1, True), evaluate=False)
    if shape == 6:
        is_zero = sympy.Eq(b, 0, evaluate=False)
        return a * sympy.Piecewise((1, is_zero), (0, True), evaluate=False) + b
    return (sympy.floor(_div(sympy.Max(a, 0, evaluate=False), d), evaluate=False)
            - sympy.Mod(a, d, evaluate=False))


_OPS = {
    sympy.Add: lambda *a: sum(a), sympy.Mul: lambda *a: math.prod(a),
    sympy.Pow: lambda a, b: a ** b, sympy.floor: math.floor, sympy.Mod: lambda a, d: a % d,
    sympy.Max: max, sympy.Min: min, sympy.Eq: lambda a, b: a == b,
    sympy.Ne: lambda a, b: a != b, sympy.Ge: lambda a, b: a >= b,
    sympy.Gt: lambda a, b: a > b, sympy.Le: lambda a, b: a <= b,
    sympy.Lt: lambda a, b: a < b, sympy.And: lambda *a: all(a), sympy.Or: lambda *a: any(a),
    sympy.Not: lambda a: not a, sympy.ITE: lambda a, b, c: b if a else c,
}


def _value(e, env):
    """``e`` at the integer point ``env``, in exact Python arithmetic (no sympy rewriting)."""
    if e.is_Symbol:
        return env[e]
    if e.is_Rational:
        return Fraction(int(e.p), int(e.q))
    if e in (sympy.true, sympy.false):
        return bool(e)
    if isinstance(e, sympy.Piecewise):
        return next(_value(v, env) for v, c in e.args if _value(c, env))
    return _OPS[e.func](*(_value(a, env) for a in e.args))


def _ints(expr):
    return lambda *args: _value(expr, dict(zip(BOX, args)))


def _points(piece):
    axes = [range(lo, hi + 1) for lo, hi in piece.values()]
    for values in itertools.product(*axes):
        yield dict(zip(piece, values))


@pytest.mark.parametrize("seed", range(8))
def test_pieces_partition_the_box_and_agree_with_ints(seed):
    rng = random.Random(seed)
    for _ in range(8):
        expr = sympy.Add(_expr(rng), _expr(rng, 1), evaluate=False)
        pieces = reduce_on_box(expr, dict(BOX), enumerable={Z})
        seen = set()
        f_expr = _ints(expr)
        for piece, reduced in pieces:
            f_reduced = _ints(reduced)
            assert not reduced.atoms(sympy.floor, sympy.Mod, sympy.Max, sympy.Min,
                                     sympy.Piecewise), reduced
            for point in _points(piece):
                key = tuple(point[s] for s in BOX)
                assert key not in seen, "pieces overlap"
                seen.add(key)
                args = [point.get(s, BOX[s][0]) for s in BOX]
                assert f_reduced(*args) == f_expr(*args), (expr, point)
        assert len(seen) == 5 * 6 * 4, "pieces do not cover the box"


def test_unbounded_symbol_in_a_fractional_part_is_stuck():
    k = sympy.Symbol("k", integer=True, nonnegative=True)
    with pytest.raises(Stuck, match="unbounded"):
        reduce_on_box(sympy.floor(k / 3), {k: (0, None)})


def test_unbounded_symbol_with_integer_coefficient_reduces():
    k, t = (sympy.Symbol(n, integer=True) for n in "kt")
    pieces = reduce_on_box(sympy.floor((12 * k + t) / 4) - sympy.Mod(12 * k + t, 4),
                           {k: (0, None), t: (0, 3)})
    assert [r for _, r in pieces] == [3 * k - t]


def test_non_affine_argument_is_stuck():
    x, y = sympy.symbols("x y", integer=True)
    with pytest.raises(Stuck, match="affine"):
        reduce_on_box(sympy.floor(x * y / 2), {x: (0, 3), y: (0, 3)})
