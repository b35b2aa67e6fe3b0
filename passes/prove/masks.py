"""Mask theorems: an attention mask K(i, j) (read by dcp_compile.passes.mask_predicate) is,
for EVERY query position i >= 0 and key position j >= 0, exactly causal, ``j <= i``, or
exactly causal within a window W, ``j <= i and i - j < W`` (the paged op's ``window``), each
optionally within the query's own chunk of C positions, ``i // C == j // C`` (Llama 4's
chunked attention: the paged op's ``attention_chunk``).

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

Without a chunk, the window W is not guessed from the captured length: K(n, 0) changes
value only at the atoms' boundaries, so it is evaluated at each boundary (and one on either side); W is the
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
          "each difference-constraint graph); a chunk C's atoms i // C, j // C decided over "
          "(i // C, j // C, i mod C, j mod C) by exact integer rewrites into difference "
          "bounds")


class NotDifference(Exception):
    pass


@dataclass(frozen=True)
class MaskVerdict:
    """The outcome for one mask: the window (0: fully causal), the chunk (0: none), the
    theorem, and when it failed, why (its counterexample {i, j, mask, target} is on the
    theorem)."""

    window: int
    theorem: Theorem
    why: str = ""
    keep: object = None         # K(i, j), the predicate the verdict is about
    chunk: int = 0              # C: the query's own chunk of C positions only

    @property
    def proven(self) -> bool:
        return self.theorem.proven


def target(window: int, chunk: int = 0):
    """The paged op's predicate: causal, within ``window`` when > 0, within the query's own
    chunk of ``chunk`` positions when > 0 (runtime/kernels/live_attention.same_chunk)."""
    causal = J <= I
    keep = sympy.And(causal, I - J <= window - 1) if window else causal
    return sympy.And(keep, sympy.Eq(sympy.floor(I / chunk), sympy.floor(J / chunk))) \
        if chunk else keep


def describe(window: int, chunk: int = 0) -> str:
    base = f"j <= i and i - j < {window}" if window else "j <= i"
    return f"{base} and i // {chunk} == j // {chunk}" if chunk else base


# Vertices of a difference-constraint graph: 0 (the constant), then the variables (i, j).
ZERO, VI, VJ = 0, 1, 2

# The variables of a chunked mask's decision (module doc): A = i // C, B = j // C and the
# remainders R, S.
A, B, R, S = sympy.symbols("A B R S", integer=True)


def _bound(expr, variables=(I, J)):
    """``expr <= 0`` (expr linear in ``variables``) as a difference bound (x, y, c):
    x - y <= c over the vertices 0 (the constant) and 1.. (the variables, in order)."""
    expr = sympy.nsimplify(sympy.expand(expr))
    try:
        poly = sympy.Poly(expr, *variables) if expr.free_symbols <= set(variables) else None
    except sympy.PolynomialError:
        poly = None
    if poly is None or poly.total_degree() > 1:
        raise NotDifference(f"{expr} <= 0 is not linear in {', '.join(map(str, variables))}")
    coeffs = [poly.coeff_monomial(v) for v in variables]
    c = poly.coeff_monomial(1)
    if not all(a.is_integer for a in coeffs) or not c.is_integer:
        raise NotDifference(f"{expr} <= 0 has non-integer coefficients")
    coeffs = [int(a) for a in coeffs]
    g = gcd(*coeffs)
    if g == 0:
        return None if c <= 0 else (ZERO, ZERO, -1)         # constant atom: true / false
    # sum a*v <= -c  ->  sum (a/g)*v <= floor(-c/g): exact over integers.
    unit = [a // g for a in coeffs]
    plus = [k + 1 for k, a in enumerate(unit) if a == 1]
    minus = [k + 1 for k, a in enumerate(unit) if a == -1]
    if len(plus) + len(minus) != sum(map(abs, unit)) or len(plus) > 1 or len(minus) > 1:
        raise NotDifference(f"{expr} <= 0 is not a difference of positions")
    return (plus[0] if plus else ZERO), (minus[0] if minus else ZERO), int(sympy.floor(-c / g))


def _tight(atom):
    """The relation ``atom`` as ``E <= 0`` over integers (E its tightened expression)."""
    d = atom.lhs - atom.rhs
    tight = {sympy.Le: d, sympy.Lt: d + 1, sympy.Ge: -d, sympy.Gt: -d + 1}
    if type(atom) not in tight:
        raise NotDifference(str(atom))
    return tight[type(atom)]


def _atom_bounds(atom, variables=(I, J)) -> tuple[list, list]:
    """(bounds when the atom is true, bounds when it is false), each a conjunction; an
    atom whose negation is a disjunction (Eq) is split before it gets here."""
    x, y, c = _bound(_tight(atom), variables) or (ZERO, ZERO, 0)
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


def _feasible(bounds, size: int = 3) -> list[int] | None:
    """An integer solution (one value per vertex, vertex 0 fixed at 0) of x - y <= c
    bounds, or None (a negative cycle). Floyd-Warshall over the ``size`` vertices."""
    inf = float("inf")
    dist = [[0 if u == v else inf for v in range(size)] for u in range(size)]
    for x, y, c in bounds:                  # x - y <= c: edge y -> x of weight c
        dist[y][x] = min(dist[y][x], c)
    for m, u, v in itertools.product(range(size), repeat=3):
        dist[u][v] = min(dist[u][v], dist[u][m] + dist[m][v])
    if any(dist[u][u] < 0 for u in range(size)):
        return None
    # x_v = -dist(v -> 0) is the largest solution with x_0 = 0; finite thanks to the lower
    # bounds of every variable (edges v -> 0 of weight 0).
    return [int(-dist[v][ZERO]) for v in range(size)]


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


def chunk_of(keep) -> int:
    """C when the mask's floors are all ``i // C`` / ``j // C`` of one constant C > 0; 0
    when it has no floor. Other floors (of another argument, two different C) are left to
    the decision, which refuses them by name."""
    sizes = set()
    for f in keep.atoms(sympy.floor):
        arg = f.args[0]
        for v in (I, J):
            c = sympy.simplify(v / arg)
            if c.is_integer and c > 0 and sympy.expand(arg * c) == v:
                sizes.add(int(c))
                break
        else:
            return 0
    return sizes.pop() if len(sizes) == 1 else 0


def _unit_pair(a: int, b: int) -> bool:
    """``a*x + b*y`` is 0, +-x, +-y or +-(x - y): a difference bound's left side."""
    return (a, b) in {(0, 0), (1, 0), (-1, 0), (0, 1), (0, -1), (1, -1), (-1, 1)}


def _lift_atom(atom, chunk: int):
    """One atom of a chunked mask (linear over i, j, A = i // C, B = j // C) as a Boolean
    of difference bounds over (A, B, R, S) (module doc: exact over integers). With
    i = C*A + R, j = C*B + S the atom is ``s*D + T <= c``, D = dA*A + dB*B, T = a*R + b*S
    (s = C for an atom over i, j alone)."""
    # Scaled to integer coefficients before < is tightened to <= (i/4 < B + 1 is i < 4*B + 4).
    raw = sympy.expand(atom.lhs - atom.rhs)
    denominators = [sympy.Rational(c).q for c in raw.as_coefficients_dict().values()
                    if c.is_rational]
    e = sympy.expand(_tight(type(atom)(raw * sympy.ilcm(1, *denominators), 0,
                                       evaluate=False)))
    try:
        poly = sympy.Poly(e, I, J, A, B)
    except sympy.PolynomialError:
        poly = None
    if poly is None or not e.free_symbols <= {I, J, A, B} or poly.total_degree() > 1:
        raise NotDifference(f"{atom} is not linear in i, j, i // {chunk}, j // {chunk}")
    coeffs = [sympy.Rational(poly.coeff_monomial(v)) for v in (I, J, A, B)] + \
        [sympy.Rational(poly.coeff_monomial(1))]
    scale = sympy.ilcm(*(c.q for c in coeffs))
    a, b, alpha, beta, c0 = (int(c * scale) for c in coeffs)
    if a == b == 0:
        return e <= 0                                   # over A, B: a difference bound
    ka, kb = chunk * a + alpha, chunk * b + beta        # i = C*A + R, j = C*B + S
    g = gcd(a, b, ka, kb)
    a, b, ka, kb, c = a // g, b // g, ka // g, kb // g, -c0 // g     # ka*A + kb*B + T <= c
    step = gcd(ka, kb)
    da, db = (ka // step, kb // step) if step else (0, 0)
    if not (_unit_pair(a, b) and _unit_pair(da, db)):
        raise NotDifference(f"{atom} is not a difference of positions or of their chunks")
    d, t = da * A + db * B, a * R + b * S
    if not step:
        return t <= c
    tlo = min(0, a) * (chunk - 1) + min(0, b) * (chunk - 1)
    thi = max(0, a) * (chunk - 1) + max(0, b) * (chunk - 1)
    q, m = divmod(c, step)                             # step*D + T <= step*q + m
    k0, k1 = (m - thi) // step, (m - tlo) // step
    if k1 - k0 > 4:
        raise NotDifference(f"{atom} steps by {step}, finer than the chunk {chunk}")
    return sympy.Or(d <= q + k0, *(sympy.And(sympy.Eq(d, q + k), t <= m - step * k)
                                   for k in range(k0 + 1, k1 + 1)))


# Atoms of one mask the procedure enumerates the truth assignments of (2**MAX_ATOMS).
MAX_ATOMS = 20


def decide(keep, want, chunk: int = 0):
    """An integer (i, j >= 0) where ``keep`` and ``want`` differ, or None (they agree for
    every i, j >= 0). Raises NotDifference for atoms outside the procedure. ``chunk``: the
    C of their ``i // C`` / ``j // C`` atoms (decided over A, B, R, S; module doc)."""
    residual = sympy.Xor(keep, want)
    if chunk:   # i // C, j // C named before Eq is split (sympy folds floor(x) >= B into x >= B)
        residual = residual.xreplace({sympy.floor(I / chunk): A, sympy.floor(J / chunk): B})
    residual = _split_equalities(residual)
    if chunk:
        residual = _split_equalities(residual.xreplace(
            {a: _lift_atom(a, chunk) for a in _atoms(residual)}))
        variables = (A, B, R, S)
        domain = [(ZERO, v, 0) for v in (1, 2, 3, 4)] + \
            [(v, ZERO, chunk - 1) for v in (3, 4)]              # A, B >= 0; 0 <= R, S < C
    else:
        variables = (I, J)
        domain = [(ZERO, VI, 0), (ZERO, VJ, 0)]              # 0 - i <= 0, 0 - j <= 0
    atoms = _atoms(residual)
    if len(atoms) > MAX_ATOMS + 8 * bool(chunk):
        raise NotDifference(f"{len(atoms)} comparisons, too many to enumerate")
    table = [_atom_bounds(a, variables) for a in atoms]
    symbols = sympy.symbols(f"a0:{len(atoms)}")
    formula = sympy.lambdify(symbols, residual.xreplace(dict(zip(atoms, symbols))), "math")
    for truth in itertools.product((True, False), repeat=len(atoms)):
        if not formula(*truth):
            continue
        bounds = domain + [b for t, (yes, no) in zip(truth, table) for b in (yes if t else no)]
        point = _feasible(bounds, 1 + len(variables))
        if point is not None:
            if chunk:
                _, a, b, r, s = point
                return {"i": chunk * a + r, "j": chunk * b + s}
            return {"i": point[VI], "j": point[VJ]}
    return None


def _window_in_chunk(keep, chunk: int) -> int:
    """W of a chunked mask: the first n in [1, C) with K(C*M + n, C*M) false (M a chunk
    past every constant of the mask); 0 when none (no window inside a chunk)."""
    consts = [abs(int(c)) for c in keep.atoms(sympy.Integer)] or [0]
    base = chunk * (2 + max(consts) // chunk)
    at = sympy.lambdify((I, J), keep, "math")
    return next((n for n in range(1, chunk) if not at(base + n, base)), 0)


def _at(k, i, j) -> bool:
    return bool(k.subs({I: i, J: j}))


def prove_mask(keep, *, name: str, where: str, expected: int | None = None) -> MaskVerdict:
    """Find W (and C, from the mask's ``i // C`` atoms) and prove K == target(W, C) for all
    i, j >= 0 (see module doc). ``expected`` (a declared window) is proven instead of the
    found one, so a wrong declaration fails with its counterexample."""
    chunk = chunk_of(keep)

    def verdict(window, status, why="", example=None):
        statement = (f"{where}: the mask keeps key j for query i iff "
                     f"{describe(window, chunk)}, for all positions i, j >= 0 (mask: "
                     f"{sympy.sstr(keep)})")
        return MaskVerdict(window, Theorem(name, statement, METHOD, status, example, 1), why,
                           keep, chunk)

    if not _at(keep, 0, 0):
        return verdict(0, FAILED, "the mask hides a query's own position",
                       {"i": 0, "j": 0, "mask": False, "target": True})
    if expected is None:
        expected = _window_in_chunk(keep, chunk) if chunk else \
            next((n for n in _boundaries(_atoms(keep)) if n >= 1 and not _at(keep, n, 0)), 0)
    want = target(expected, chunk)
    # The atoms' boundaries first (exact values, so a difference there is a counterexample):
    # a mask written row by row at fixed positions (a Python loop over the captured length)
    # has too many atoms to enumerate, and differs at its last written row.
    points = _boundaries(_atoms(keep)) if not chunk else []
    point = next(({"i": i, "j": j} for i in points for j in points
                  if _at(keep, i, j) != _at(want, i, j)), None)
    if point is None and not chunk and len(_atoms(sympy.Xor(keep, want))) > MAX_ATOMS:
        return verdict(expected, FAILED, f"the mask compares positions in more than "
                                         f"{MAX_ATOMS} ways, too many to decide")
    try:
        point = point or decide(keep, want, chunk)
    except NotDifference as e:
        return verdict(expected, FAILED, f"the mask is not made of differences of positions "
                                         f"or of their chunks i // C ({e}): e.g. block-local "
                                         f"attention")
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
