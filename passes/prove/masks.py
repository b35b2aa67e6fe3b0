"""Mask theorems: an attention mask K(i, j) (read by dcp_compile.passes.mask_predicate) is,
for EVERY query position i >= 0 and key position j >= 0, exactly causal, ``j <= i``, or
exactly causal within a window W, ``j <= i and i - j < W`` (the paged op's ``window``).

Method (a decision procedure, complete for the masks it accepts). Every atom of K must be,
after dividing by the gcd of its coefficients, a *difference bound* over integers: ``i <= c``,
``j >= c``, ``i - j <= c`` (the forms causal, window and offset masks are made of; ``<``,
``=``, ``!=`` are tightened to ``<=`` over integers). The residual "i, j >= 0 and K xor
target" is a Boolean combination of such atoms: for each assignment of truth values to the
atoms that makes it true, the atoms (true ones as bounds, false ones negated: ``x - y <= c``
false is ``y - x <= -c - 1``) form a difference-constraint system, which has an integer
solution iff its constraint graph has no negative cycle (Bellman-Ford / Floyd-Warshall; the
system is totally unimodular). So the theorem is *proven* when no assignment is feasible,
and otherwise the shortest-path solution is an integer counterexample (i, j). Atoms of other
shapes (``i + j``, ``2*i - j``, ``i // 4``: chunked or block attention) are refused.

The window W is not guessed from the captured length: K(n, 0) changes value only at the
atoms' boundaries, so it is evaluated at each boundary (and one on either side); W is the
first n >= 1 with K(n, 0) false (no such n: fully causal), and the proof then decides it.
"""

from __future__ import annotations

import itertools
from math import gcd
from dataclasses import dataclass

import sympy

from ..mask_predicate import I, J
from .certificate import FAILED, PROVEN, Theorem

__all__ = ["MaskVerdict", "prove_mask", "target", "describe", "METHOD", "mask_theorem_name",
           "unmasked_theorem"]

METHOD = ("K(i, j) read symbolically from the mask's computation (i, j symbolic, not the "
          "captured length); atoms difference bounds over integers; 'i, j >= 0 and K xor "
          "target' infeasible for every truth assignment of the atoms (negative cycle in "
          "each difference-constraint graph)")


class NotDifference(Exception):
    pass


@dataclass(frozen=True)
class MaskVerdict:
    """The outcome for one mask: the window (0: fully causal), the theorem, and when it
    failed, why (its counterexample {i, j, mask, target} is on the theorem)."""

    window: int
    theorem: Theorem
    why: str = ""
    keep: object = None         # K(i, j), the predicate the verdict is about

    @property
    def proven(self) -> bool:
        return self.theorem.proven


def target(window: int):
    """The paged op's predicate: causal, within ``window`` when > 0."""
    causal = J <= I
    return sympy.And(causal, I - J <= window - 1) if window else causal


def describe(window: int) -> str:
    return f"j <= i and i - j < {window}" if window else "j <= i"


# A difference bound ``x - y <= c`` over the variables 0 (the constant), i, j.
ZERO, VI, VJ = 0, 1, 2
_VARS = {(1, 0): (VI, ZERO), (-1, 0): (ZERO, VI), (0, 1): (VJ, ZERO), (0, -1): (ZERO, VJ),
         (1, -1): (VI, VJ), (-1, 1): (VJ, VI)}


def _bound(expr):
    """``expr <= 0`` (expr linear in i, j) as a difference bound (x, y, c): x - y <= c."""
    expr = sympy.nsimplify(sympy.expand(expr))
    try:
        poly = sympy.Poly(expr, I, J) if expr.free_symbols <= {I, J} else None
    except sympy.PolynomialError:
        poly = None
    if poly is None or poly.total_degree() > 1:
        raise NotDifference(f"{expr} <= 0 is not linear in i, j")
    a, b = (int(poly.coeff_monomial(m)) if poly.coeff_monomial(m).is_integer else None
            for m in (I, J))
    c = poly.coeff_monomial(1)
    if a is None or b is None or not c.is_integer:
        raise NotDifference(f"{expr} <= 0 has non-integer coefficients")
    g = gcd(a, b)
    if g == 0:
        return None if c <= 0 else (ZERO, ZERO, -1)         # constant atom: true / false
    # a*i + b*j <= -c  ->  (a/g)*i + (b/g)*j <= floor(-c/g): exact over integers.
    key = (a // g, b // g)
    if key not in _VARS:
        raise NotDifference(f"{expr} <= 0 is not a difference of positions")
    x, y = _VARS[key]
    return x, y, int(sympy.floor(-c / g))


def _atom_bounds(atom) -> tuple[list, list]:
    """(bounds when the atom is true, bounds when it is false), each a conjunction; an
    atom whose negation is a disjunction (Eq) is split before it gets here."""
    d = atom.lhs - atom.rhs
    tight = {sympy.Le: d, sympy.Lt: d + 1, sympy.Ge: -d, sympy.Gt: -d + 1}
    if type(atom) not in tight:
        raise NotDifference(str(atom))
    x, y, c = _bound(tight[type(atom)]) or (ZERO, ZERO, 0)
    return [(x, y, c)], [(y, x, -c - 1)]


def _split_equalities(k):
    """Eq / Ne atoms as two inequalities (every atom left is <, <=, >, >=)."""
    def split(a):
        if isinstance(a, sympy.Eq):
            return sympy.And(a.lhs <= a.rhs, a.lhs >= a.rhs)
        if isinstance(a, sympy.Ne):
            return sympy.Or(a.lhs < a.rhs, a.lhs > a.rhs)
        return a
    return k.xreplace({a: split(a) for a in k.atoms(sympy.Eq, sympy.Ne)})


def _feasible(bounds) -> dict | None:
    """An integer solution {i, j} of x - y <= c bounds with 0 fixed, or None (a negative
    cycle). Floyd-Warshall over the three variables."""
    inf = float("inf")
    dist = [[0 if u == v else inf for v in range(3)] for u in range(3)]
    for x, y, c in bounds:                  # x - y <= c: edge y -> x of weight c
        dist[y][x] = min(dist[y][x], c)
    for m, u, v in itertools.product(range(3), repeat=3):
        dist[u][v] = min(dist[u][v], dist[u][m] + dist[m][v])
    if any(dist[u][u] < 0 for u in range(3)):
        return None
    # x_v = -dist(v -> 0) is the largest solution with x_0 = 0; finite thanks to i, j >= 0
    # (edges i -> 0 and j -> 0 of weight 0).
    return {"i": int(-dist[VI][ZERO]), "j": int(-dist[VJ][ZERO])}


def _atoms(k):
    return sorted(k.atoms(sympy.core.relational.Relational), key=sympy.default_sort_key)


def _boundaries(atoms) -> list[int]:
    """Integers n where some atom, at j = 0, i = n, changes value (and their neighbours)."""
    points = {0, 1, 2}
    for a in atoms:
        d = sympy.expand(a.lhs - a.rhs).subs(J, 0)
        coeff = d.coeff(I)
        if coeff != 0 and coeff.is_number:
            root = -(d - coeff * I) / coeff
            if root.is_number:
                for x in (sympy.floor(root), sympy.ceiling(root)):
                    points.update(int(x) + e for e in (-1, 0, 1))
    return sorted(p for p in points if p >= 0)


def _at(k, i, j) -> bool:
    return bool(k.subs({I: i, J: j}))


# Atoms of one mask the procedure enumerates the truth assignments of (2**MAX_ATOMS).
MAX_ATOMS = 20


def decide(keep, want):
    """An integer (i, j >= 0) where ``keep`` and ``want`` differ, or None (they agree for
    every i, j >= 0). Raises NotDifference for atoms outside the procedure."""
    residual = sympy.Xor(_split_equalities(keep), want)
    atoms = _atoms(residual)
    table = [_atom_bounds(a) for a in atoms]
    symbols = sympy.symbols(f"a0:{len(atoms)}")
    formula = sympy.lambdify(symbols, residual.xreplace(dict(zip(atoms, symbols))), "math")
    domain = [(ZERO, VI, 0), (ZERO, VJ, 0)]              # 0 - i <= 0, 0 - j <= 0
    for truth in itertools.product((True, False), repeat=len(atoms)):
        if not formula(*truth):
            continue
        bounds = domain + [b for t, (yes, no) in zip(truth, table) for b in (yes if t else no)]
        point = _feasible(bounds)
        if point is not None:
            return point
    return None


def prove_mask(keep, *, name: str, where: str, expected: int | None = None) -> MaskVerdict:
    """Find W and prove K == target(W) for all i, j >= 0 (see module doc). ``expected``
    (a declared window) is proven instead of the found one, so a wrong declaration fails
    with its counterexample."""
    def verdict(window, status, why="", example=None):
        statement = (f"{where}: the mask keeps key j for query i iff {describe(window)}, for "
                     f"all positions i, j >= 0 (mask: {sympy.sstr(keep)})")
        return MaskVerdict(window, Theorem(name, statement, METHOD, status, example, 1), why,
                           keep)

    if expected is None:
        if not _at(keep, 0, 0):
            return verdict(0, FAILED, "the mask hides a query's own position",
                           {"i": 0, "j": 0, "mask": False, "target": True})
        expected = next((n for n in _boundaries(_atoms(keep))
                         if n >= 1 and not _at(keep, n, 0)), 0)
    want = target(expected)
    # The atoms' boundaries first (exact values, so a difference there is a counterexample):
    # a mask written row by row at fixed positions (a Python loop over the captured length)
    # has too many atoms to enumerate, and differs at its last written row.
    points = _boundaries(_atoms(keep))
    point = next(({"i": i, "j": j} for i in points for j in points
                  if _at(keep, i, j) != _at(want, i, j)), None)
    if point is None and len(_atoms(sympy.Xor(keep, want))) > MAX_ATOMS:
        return verdict(expected, FAILED, f"the mask compares positions in more than "
                                         f"{MAX_ATOMS} ways, too many to decide")
    try:
        point = point or decide(keep, want)
    except NotDifference as e:
        return verdict(expected, FAILED, f"the mask is not made of differences of positions "
                                         f"({e}): e.g. chunked or block-local attention")
    if point is None:
        return verdict(expected, PROVEN)
    i, j = point["i"], point["j"]
    example = {"i": i, "j": j, "mask": _at(keep, i, j), "target": _at(want, i, j)}
    return verdict(expected, FAILED, "the mask differs from it", example)


def mask_theorem_name(layer: int) -> str:
    return f"mask_layer_{layer}"


def unmasked_theorem(layer: int, causal: bool, window: int, node: str) -> Theorem:
    """The theorem of a layer with no mask tensor: SDPA's ``is_causal`` is causal by its
    definition; a window there can only come from the config (it is not in the graph)."""
    source = (f", with the window {window} the config declares (layer_types / "
              f"sliding_window; is_causal cannot show one)" if window else "")
    return Theorem(mask_theorem_name(layer),
                   f"layer {layer} ({node}): is_causal={causal} keeps key j for query i iff "
                   f"{describe(window)} for all positions i, j >= 0{source}",
                   "the attention kernel's is_causal definition (no mask tensor)", PROVEN,
                   None, 1)
