"""Reduce floor/Mod/Max/Min/indicator expressions to polynomials on boxes of integers.

The layout proofs (:mod:`dcp_compile.passes.prove.theorems`) evaluate the real formulas on sympy integer
symbols with known ranges (a *box*: ``symbol -> (lo, hi)``, ``hi`` None for unbounded).
sympy keeps ``floor((16*o + t)/256)`` unevaluated because it does not know ``t < 16``; this
module removes every such function with four rules, each a plain integer lemma, applied only
where the box makes its side condition true:

* FLOOR: ``floor(Q + R) = Q + n`` when Q is an affine form with integer coefficients (so an
  integer, all symbols being integers) and ``n <= R < n + 1`` on the whole box;
* MOD:   ``Mod(a, d) = a - d * floor(a / d)`` for a constant ``d > 0`` (sympy's and Python's
  definition), after which FLOOR applies;
* MAX/MIN: ``Max(a, b) = a`` when ``a - b >= 0`` on the box (``b`` when ``a - b <= 0``);
* EQ:    ``Eq(a, b)`` is true when ``a - b`` is 0 on the box, false when ``a - b`` has no
  root there (Piecewise picks its first true branch; Ne is the negation).

Side conditions are decided exactly: the range of an affine form over a box of independent
integer intervals is attained at its corners. When a condition holds on part of the box only,
the box is *split* into sub-boxes on which it is decided (a threshold on one symbol, or
enumeration of a symbol the caller marks as enumerable) and each piece is reduced again, so
the result is a partition of the box with one polynomial per piece. Nothing is assumed
beyond the box: a rule that cannot be justified raises :class:`Stuck`.
"""

from __future__ import annotations

import math
from fractions import Fraction

import sympy

__all__ = ["Stuck", "Box", "reduce_on_box", "affine", "affine_range", "corners"]

Box = dict  # sympy.Symbol -> (lo: int, hi: int | None)

_MAX_PIECES = 20000


class Stuck(Exception):
    """No rule applies: an argument is not affine, or a side condition needs an unbounded
    symbol split. The caller treats the claim as unproven (and searches for a
    counterexample)."""


class _Split(Exception):
    def __init__(self, pieces):
        super().__init__(len(pieces))
        self.pieces = pieces


# ----------------------------------------------------------------------------------------
# Affine forms
# ----------------------------------------------------------------------------------------


def affine(expr):
    """``({symbol: coefficient}, constant)`` when ``expr`` is affine in its symbols, else
    None; the numbers are ints, or Fractions where they are not integers."""
    expr = sympy.sympify(expr)
    terms = expr.as_coefficients_dict()
    if any(t is not sympy.S.One and not t.is_Symbol for t in terms):
        terms = sympy.expand(expr).as_coefficients_dict()
    coeffs, const = {}, 0
    for term, c in terms.items():
        if not c.is_Rational:
            return None
        # Integer coefficients stay ints (exact, and far cheaper than Fraction arithmetic).
        c = int(c.p) if c.q == 1 else Fraction(int(c.p), int(c.q))
        if term is sympy.S.One:
            const += c
        elif term.is_Symbol:
            coeffs[term] = coeffs.get(term, 0) + c
        else:
            return None
    return {s: c for s, c in coeffs.items() if c != 0}, const


def affine_range(coeffs, const, box):
    """(min, max) of the affine form over the box; None for an unbounded side."""
    lo = hi = const
    for s, c in coeffs.items():
        a, b = box[s]
        if c > 0:
            lo += c * a
            hi = None if hi is None or b is None else hi + c * b
        else:
            lo = None if lo is None or b is None else lo + c * b
            hi = None if hi is None else hi + c * a
        if lo is None and hi is None:
            break
    return lo, hi


def _to_sympy(coeffs, const):
    return sympy.Add(*(sympy.Rational(c.numerator, c.denominator) * s
                       for s, c in coeffs.items()),
                     sympy.Rational(const.numerator, const.denominator))


def corners(symbols, box):
    """The corner points of the box in ``symbols`` (an unbounded side contributes lo, lo+1):
    an affine form that vanishes on every corner vanishes on the whole box."""
    axes = []
    for s in symbols:
        lo, hi = box[s]
        axes.append((s, sorted({lo, lo + 1 if hi is None else hi})))
    points = [{}]
    for s, values in axes:
        points = [{**p, s: v} for p in points for v in values]
    return points


# ----------------------------------------------------------------------------------------
# Splitting a box so that "D >= 0" is decided on each piece
# ----------------------------------------------------------------------------------------


def _with(box, s, lo, hi):
    out = dict(box)
    out[s] = (lo, hi)
    return out


def _threshold_split(coeffs, const, box, s):
    """Cut ``s``'s range where ``D = c*s + rest >= 0`` is decided for every value of rest.

    Returns (pieces, size of the undecided middle) or None when nothing is decided.
    """
    c = coeffs[s]
    lo, hi = box[s]
    m, M = affine_range({x: v for x, v in coeffs.items() if x is not s}, const, box)
    c = Fraction(c)  # exact division below (int / int would be a float)
    if c > 0:  # D < 0 surely iff s < -M/c; D >= 0 surely iff s >= -m/c
        low_end = lo - 1 if M is None else math.ceil(-M / c) - 1
        high_start = hi + 1 if m is None else math.ceil(-m / c)
    else:      # D >= 0 surely iff s <= -m/c; D < 0 surely iff s > -M/c
        low_end = lo - 1 if m is None else math.floor(-m / c)
        high_start = hi + 1 if M is None else math.floor(-M / c) + 1
    low_end, high_start = min(low_end, hi), max(high_start, lo)
    if low_end < lo and high_start > hi:
        return None
    pieces = []
    if low_end >= lo:
        pieces.append(_with(box, s, lo, low_end))
    middle = (max(lo, low_end + 1), min(hi, high_start - 1))
    if middle[0] <= middle[1]:
        pieces.append(_with(box, s, *middle))
    if high_start <= hi:
        pieces.append(_with(box, s, high_start, hi))
    if len(pieces) == 1:  # nothing cut (cannot happen with exact ranges; never loop)
        return None
    return pieces, max(0, middle[1] - middle[0] + 1)


def _split(coeffs, const, box, enumerable):
    """Pieces of ``box`` that make progress on deciding ``D >= 0``; raises Stuck if none."""
    best = None
    for s in coeffs:
        lo, hi = box[s]
        if hi is None or lo == hi:
            continue
        found = _threshold_split(coeffs, const, box, s)
        if found is None:
            continue
        pieces, middle = found
        if middle == 0:
            return pieces
        frac = middle / (hi - lo + 1)
        if best is None or frac < best[0]:
            best = (frac, pieces)
    # Little progress from a threshold: enumerate a small symbol the caller allows instead.
    small = [s for s in coeffs if s in enumerable and box[s][1] is not None
             and box[s][0] < box[s][1]]
    if small and (best is None or best[0] > 0.5):
        s = min(small, key=lambda x: box[x][1] - box[x][0])
        return [_with(box, s, v, v) for v in range(box[s][0], box[s][1] + 1)]
    if best is not None:
        return best[1]
    raise Stuck(f"cannot decide the sign of {_to_sympy(coeffs, const)} on {_show(box)}")


def _show(box):
    return {str(s): (lo, "inf" if hi is None else hi) for s, (lo, hi) in box.items()}


# ----------------------------------------------------------------------------------------
# The reducer
# ----------------------------------------------------------------------------------------


def _symbols_of(e, cache: dict) -> tuple:
    """The free symbols of ``e`` in a fixed order, cached by object identity."""
    hit = cache.get(id(e))
    if hit is None:
        if e.is_Symbol:
            hit = (e,)
        elif e.is_Atom:
            hit = ()
        else:
            hit = tuple(sorted({s for a in e.args for s in _symbols_of(a, cache)},
                               key=lambda x: x.name))
        cache[id(e)] = hit
    return hit


def _is_arithmetic(e) -> bool:
    """``e`` is a sum, a product or an integer power (the nodes reduction keeps, reducing
    only their arguments); a negative power of anything but a number is not."""
    f = e.func
    return f is sympy.Add or f is sympy.Mul or (
        f is sympy.Pow and e.args[1].is_Integer and (e.args[0].is_Number or e.args[1] >= 0))


def _is_polynomial(e, cache: dict) -> bool:
    """True when ``e`` has nothing to reduce (only the arithmetic reduce keeps as it is),
    cached by object identity."""
    hit = cache.get(id(e))
    if hit is None:
        if e.is_Atom:
            hit = True
        elif _is_arithmetic(e):
            hit = all(_is_polynomial(a, cache) for a in e.args)
        else:
            hit = False
        cache[id(e)] = hit
    return hit


class _FloorParts:
    """``floor(a)`` split once per affine ``a`` into the integer part Q and the fractional
    part R (``floor(a) = Q + floor(R)``); R is also kept scaled by its common denominator,
    so deciding ``n <= R < n + 1`` on a box takes int arithmetic only."""

    def __init__(self, coeffs, const):
        self.q_coeffs, self.r_coeffs = {}, {}
        for s, c in coeffs.items():
            whole = math.floor(c)
            if whole:
                self.q_coeffs[s] = Fraction(whole)
            if c != whole:
                self.r_coeffs[s] = c - whole
        self.q_const = math.floor(const)
        self.r_const = const - self.q_const
        d = math.lcm(*(Fraction(c).denominator for c in self.r_coeffs.values()),
                     Fraction(self.r_const).denominator)
        self.denominator = d
        self.r_scaled = {s: int(c * d) for s, c in self.r_coeffs.items()}
        self.r_const_scaled = int(self.r_const * d)
        self.results = {}  # n -> Q + n as sympy


class _Caches:
    """What the pieces of one expression share: the expression's subtrees stay alive and
    are interned, so object ids are stable keys."""

    def __init__(self):
        self.memo = {}        # (id of a subtree, ranges of its symbols) -> reduced
        self.symbols = {}     # id of a subtree -> its free symbols in a fixed order
        self.polynomial = {}  # id of a subtree -> nothing to reduce in it
        # id of a subtree -> its symbols (its memo key), None when it has nothing to reduce
        self.key_symbols = {}
        self.affine = {}      # expression -> affine(expression)
        self.floor_parts = {}  # affine expression -> _FloorParts


class _Reducer:
    """Rewrites one expression on one box; raises _Split when the box must be cut."""

    def __init__(self, box: Box, enumerable, caches: _Caches):
        self.box = box
        self.enumerable = enumerable
        self.caches = caches
        self.memo = caches.memo
        self.key_symbols = caches.key_symbols

    def reduce(self, e):
        if e.is_Atom:
            return e
        node = id(e)
        symbols = self.key_symbols.get(node, False)
        if symbols is False:
            symbols = self.key_symbols[node] = (
                None if _is_polynomial(e, self.caches.polynomial)
                else _symbols_of(e, self.caches.symbols))
        if symbols is None:
            return e  # nothing to reduce: rebuilding would give the same expression
        key = (node, tuple(map(self.box.__getitem__, symbols)))
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        f = e.func
        if f is sympy.floor:
            out = self._floor(self.reduce(e.args[0]))
        elif f is sympy.ceiling:
            out = -self._floor(-self.reduce(e.args[0]))
        elif f is sympy.Mod:
            a, d = (self.reduce(x) for x in e.args)
            if not (d.is_Integer and d > 0):
                raise Stuck(f"Mod by a non-constant or non-positive divisor: {e}")
            out = a - d * self._floor(a / d)
        elif f is sympy.Max or f is sympy.Min:
            args = [self.reduce(x) for x in e.args]
            out = args[0]
            for x in args[1:]:
                x_ge = self._nonneg(x - out)
                out = x if x_ge == (f is sympy.Max) else out
        elif f is sympy.Piecewise:
            for value, cond in e.args:
                if self._holds(cond):
                    out = self.reduce(value)
                    break
            else:
                raise Stuck(f"no branch of {e} holds")
        elif _is_arithmetic(e):
            args = [self.reduce(x) for x in e.args]
            # Nothing changed below: rebuilding would give e again (it is canonical).
            unchanged = all(a is x for a, x in zip(args, e.args))
            out = e if unchanged else f(*args)
        else:
            raise Stuck(f"no reduction rule for {f.__name__}: {e}")
        self.memo[key] = out
        return out

    def _affine(self, e):
        cache = self.caches.affine
        lin = cache.get(e, False)
        if lin is False:
            lin = cache[e] = affine(e)
        if lin is None:
            raise Stuck(f"not an affine form: {e}")
        return lin

    def _floor(self, a):
        parts = self.caches.floor_parts.get(a)
        if parts is None:
            parts = self.caches.floor_parts[a] = _FloorParts(*self._affine(a))
        # The range of the fractional part R, scaled by its common denominator to ints.
        lo, hi = affine_range(parts.r_scaled, parts.r_const_scaled, self.box)
        if lo is None or hi is None:
            raise Stuck(f"floor({a}): the fractional part is unbounded on {_show(self.box)}")
        n = lo // parts.denominator
        if hi // parts.denominator == n:
            out = parts.results.get(n)
            if out is None:
                out = parts.results[n] = _to_sympy(parts.q_coeffs, Fraction(parts.q_const + n))
            return out
        raise _Split(_split(parts.r_coeffs, parts.r_const - (n + 1), self.box, self.enumerable))

    def _nonneg(self, e) -> bool:
        coeffs, const = self._affine(e)
        lo, hi = affine_range(coeffs, const, self.box)
        if lo is not None and lo >= 0:
            return True
        if hi is not None and hi < 0:
            return False
        raise _Split(_split(coeffs, const, self.box, self.enumerable))

    def _holds(self, cond) -> bool:
        if cond is sympy.true:
            return True
        if cond is sympy.false:
            return False
        if isinstance(cond, sympy.Eq):
            return self._is_zero(self.reduce(cond.lhs) - self.reduce(cond.rhs))
        if isinstance(cond, sympy.Ne):
            return not self._is_zero(self.reduce(cond.lhs) - self.reduce(cond.rhs))
        if isinstance(cond, (sympy.Ge, sympy.Le, sympy.Gt, sympy.Lt)):
            d = self.reduce(cond.lhs) - self.reduce(cond.rhs)
            if isinstance(cond, (sympy.Le, sympy.Gt)):
                d = -d  # lhs <= rhs  <=>  rhs - lhs >= 0;  lhs > rhs  <=>  not rhs - lhs >= 0
            return self._nonneg(d) if isinstance(cond, (sympy.Ge, sympy.Le)) \
                else not self._nonneg(d)
        logic = sympy.logic.boolalg
        if isinstance(cond, logic.And):
            return all(self._holds(c) for c in cond.args)
        if isinstance(cond, logic.Or):
            return any(self._holds(c) for c in cond.args)
        if isinstance(cond, logic.Not):
            return not self._holds(cond.args[0])
        if isinstance(cond, logic.ITE):  # what sympy makes of a Piecewise in a condition
            a, b, c = cond.args
            return self._holds(b) if self._holds(a) else self._holds(c)
        raise Stuck(f"no reduction rule for the condition {cond}")

    def _is_zero(self, d) -> bool:
        coeffs, const = self._affine(d)
        lo, hi = affine_range(coeffs, const, self.box)
        if lo == hi == 0:  # exact range: 0 at every point of the box
            return True
        if (lo is not None and lo > 0) or (hi is not None and hi < 0):
            return False
        # 0 is inside the range: cut where D >= 0 (or D <= 0) is decided, then again.
        if lo is not None and lo == 0:
            coeffs, const = {s: -c for s, c in coeffs.items()}, -const
        raise _Split(_split(coeffs, const, self.box, self.enumerable))


_ARITHMETIC = (sympy.Add, sympy.Mul, sympy.Pow)


def _canonical(e, _seen=None):
    """Evaluate the arithmetic of ``e`` (an expression built with sympy's evaluation off)
    while keeping floor/Mod/Max/Min/Piecewise unevaluated, so equal subtrees are equal."""
    seen = {} if _seen is None else _seen
    if e.is_Atom or isinstance(e, sympy.logic.boolalg.BooleanAtom):
        return e
    hit = seen.get(e)
    if hit is not None:
        return hit
    if isinstance(e, sympy.Piecewise):
        out = sympy.Piecewise(*[(_canonical(v, seen), _canonical(c, seen)) for v, c in e.args],
                              evaluate=False)
    elif e.func in _ARITHMETIC:
        out = e.func(*[_canonical(a, seen) for a in e.args])
    else:
        out = e.func(*[_canonical(a, seen) for a in e.args], evaluate=False)
    out = seen.setdefault(out, out)  # equal subtrees become one object: cheap memo keys
    seen[e] = out
    return out


def reduce_on_box(expr, box: Box, enumerable=frozenset()):
    """Partition ``box`` into pieces and reduce ``expr`` to a polynomial on each.

    Returns ``[(piece, reduced), ...]``; symbols whose piece range is one value are
    substituted in ``reduced``. Symbols in ``enumerable`` may be split value by value (their
    ranges must be small). Raises Stuck when a rule's side condition cannot be decided.
    """
    expr = _canonical(sympy.sympify(expr))
    out, stack, caches = [], [box], _Caches()
    while stack:
        piece = stack.pop()
        try:
            reduced = _Reducer(piece, enumerable, caches).reduce(expr)
        except _Split as split:
            stack.extend(reversed(split.pieces))
        else:
            fixed = {s: sympy.Integer(lo) for s, (lo, hi) in piece.items() if lo == hi}
            out.append((piece, reduced.xreplace(fixed) if fixed else reduced))
        if len(out) + len(stack) > _MAX_PIECES:
            raise Stuck(f"more than {_MAX_PIECES} pieces for {expr}")
    return out
