"""How the layout theorems are proven: mixed-radix positions, residuals reduced piecewise,
counterexamples rechecked with ints. The theorems themselves are the
registry in :mod:`dcp_compile.passes.prove.theorems`.

Method. The formulas in :mod:`dcp_compile.runtime.layout` are built from ``//``, ``%``, ``*``, ``+``,
``-`` and clamps, with periods that all divide ``vblock = block_size * dcp`` (block_size is a
multiple of interleave_size). So every position is written in the mixed radix of the layout,

    N = k*vblock + u*(I*W) + o*I + t,   k >= 0, 0 <= u < B/I, 0 <= o < W, 0 <= t < I,

(every N >= 0 has exactly one such form: t is the offset in an interleave run, o the run's
owner, u the stride row in the vblock, k the vblock), with ``k, u, o, t`` and the rank ``r``
sympy integer symbols (a :class:`Domain`) — nothing is enumerated by block size. Local slots
are ``s = k*B + u*I + t``, prefill chunks ``S = m*W*I`` (m >= 1), block-table entries
``e >= 0``. The formulas are the very functions in ``layout.py`` (they accept sympy values),
evaluated once per theorem; each theorem's residual (lhs - rhs) is then reduced by
:mod:`dcp_compile.passes.prove.integer_reduction` on a partition of that box into pieces, using only integer
lemmas whose side conditions it decides on each piece (floor(Q + R) = Q + n when
n <= R < n + 1, Mod(a, d) = a - d*floor(a/d), Max/Min/[a = b] by the sign of a - b). A
theorem is *proven* only when the residual is exactly 0 on every piece. The number of pieces
depends on dcp (ranks and run owners), not on block_size or interleave_size.

A piece with a non-zero residual yields its corners as candidate counterexamples; each is
evaluated again with Python ints on the formulas and reported only when the claim really fails
there. When a rule cannot be applied (e.g. a broken formula divides by a non-divisor of the
vblock), the claim is evaluated with ints on a grid of small and boundary values; if no
counterexample is found the theorem is reported ``failed`` ("could not prove") — a theorem
is never ``proven`` without a symbolic 0. Brute force over small N is how the tests check
this prover, not a proof.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import sympy

from .integer_reduction import Stuck, affine, affine_range, corners, reduce_on_box
from .certificate import FAILED, PROVEN, Theorem

__all__ = ["Equal", "InRange", "eq01", "int_or_none", "Domain", "domain", "TheoremSpec",
           "Memo", "prove_theorem"]

# Values tried per unbounded symbol when a claim cannot be reduced (bounded symbols try
# their ends and middle).
_SEARCH = {"k": range(0, 8), "m": range(1, 6), "e": (0, 1, 2, 7)}


# ----------------------------------------------------------------------------------------
# Claims: what one theorem asserts for one case
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Equal:
    """lhs == rhs."""

    lhs: Any
    rhs: Any
    what: str = ""


@dataclass(frozen=True)
class InRange:
    """lo <= value < hi."""

    value: Any
    lo: Any
    hi: Any
    what: str = ""


def _parts(claim) -> tuple:
    """A claim function returns one claim or a tuple of claims that must all hold."""
    return claim if isinstance(claim, tuple) else (claim,)


def _holds_concretely(claim) -> bool:
    if isinstance(claim, Equal):
        return bool(claim.lhs == claim.rhs)
    return bool(claim.lo <= claim.value < claim.hi)


def _describe_claim(claim) -> dict:
    out = {"claim": claim.what} if claim.what else {}
    if isinstance(claim, Equal):
        return {**out, "lhs": _jsonable(claim.lhs), "rhs": _jsonable(claim.rhs)}
    return {**out, "lhs": _jsonable(claim.value), "rhs": f"in [{claim.lo}, {claim.hi})"}


def _jsonable(x):
    x = sympy.sympify(x)
    return int(x) if x.is_Integer else str(x)


def int_or_none(x):
    """``x`` as an int when it is one (Python or sympy), else None."""
    if isinstance(x, int):
        return x
    x = sympy.sympify(x)
    return int(x) if x.is_Integer else None


def eq01(a, b):
    """The specification's indicator [a == b] (0/1), for ints and sympy values."""
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        d = sympy.sympify(a) - sympy.sympify(b)
        if d.is_Number:
            return sympy.Integer(int(d == 0))
        return sympy.Piecewise((1, sympy.Eq(d, 0, evaluate=False)), (0, True))
    return int(a == b)


# ----------------------------------------------------------------------------------------
# The domain: symbols with ranges (a box), and the cases each theorem evaluates
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Domain:
    """One configuration's symbols and their ranges (dcp W, interleave I, block B)."""

    W: int
    I: int
    B: int
    symbols: dict  # name -> sympy integer Symbol

    @property
    def vblock(self) -> int:
        return self.B * self.W

    @property
    def U(self) -> int:
        """Stride rows per vblock: B / I."""
        return self.B // self.I

    @property
    def kw(self) -> dict:
        return dict(dcp=self.W, interleave=self.I, block=self.B)

    @property
    def kw_slice(self) -> dict:
        return dict(dcp=self.W, interleave=self.I)

    def ranges(self) -> dict:
        """name -> (lo, hi) inclusive; hi None for unbounded."""
        return {"k": (0, None), "u": (0, self.U - 1), "o": (0, self.W - 1),
                "t": (0, self.I - 1), "r": (0, self.W - 1), "e": (0, None), "m": (1, None)}

    @functools.cached_property
    def box(self) -> dict:
        return {self.symbols[n]: rng for n, rng in self.ranges().items()}

    @functools.cached_property
    def enumerable(self) -> frozenset:
        """Symbols the reducer may split value by value: their ranges are dcp, not block."""
        return frozenset((self.symbols["o"], self.symbols["r"]))

    def v(self, name):
        """The symbol, or its only value when its range has one (e.g. t when I = 1)."""
        lo, hi = self.ranges()[name]
        return sympy.Integer(lo) if lo == hi else self.symbols[name]

    @property
    def e(self):
        return self.v("e")

    @property
    def m(self):
        return self.v("m")

    def positions(self, with_rank=True) -> Iterable[dict]:
        """One case: N = k*vblock + u*stride + o*I + t (x rank r)."""
        N = (self.v("k") * self.vblock + self.v("u") * self.I * self.W
             + self.v("o") * self.I + self.v("t"))
        yield {"N": N, "rank": self.v("r")} if with_rank else {"N": N}

    def slots(self, var="slot") -> Iterable[dict]:
        """One case: s = k*block_size + u*I + t (a block of local slots maps onto a vblock)."""
        yield {var: self.v("k") * self.B + self.v("u") * self.I + self.v("t"),
               "rank": self.v("r")}

    def position_method(self, with_rank=True) -> str:
        rank = f", rank in [0, {self.W})" if with_rank else ""
        return (f"N = k*{self.vblock} + u*{self.I * self.W} + o*{self.I} + t, k >= 0, "
                f"u in [0, {self.U}), o in [0, {self.W}), t in [0, {self.I}){rank}, "
                f"all symbolic")

    def slot_method(self, var="slot") -> str:
        return (f"{var} = k*{self.B} + u*{self.I} + t, k >= 0, u in [0, {self.U}), "
                f"t in [0, {self.I}), rank in [0, {self.W}), all symbolic")

    @property
    def chunk(self):
        """Prefill chunk length S = m * W * I (the model runner's view needs W*I | S)."""
        return self.m * self.W * self.I


def _symbols() -> dict:
    return {n: sympy.Symbol(n, integer=True, nonnegative=True) for n in "kuotre"} | {
        "m": sympy.Symbol("m", integer=True, positive=True)}


def domain(dcp: int, interleave_size: int, block_size: int) -> "Domain":
    """The symbolic domain of one configuration (fresh symbols: nothing is shared)."""
    return Domain(W=dcp, I=interleave_size, B=block_size, symbols=_symbols())


# ----------------------------------------------------------------------------------------
# A theorem as the engine sees it: a name, a statement, the cases it evaluates (values
# contain the domain's symbols) and a claim over one case (dcp_compile.passes.prove.theorems registers them)
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TheoremSpec:
    """One registered theorem. A claim calls only the formulas object it is given, so a
    broken formula is caught (and the real one proven)."""

    name: str
    statement: str
    method: Callable[[Domain], str]
    cases: Callable[[Domain], Iterable[dict]]
    claim: Callable[[Any, Domain, dict], Any]


# ----------------------------------------------------------------------------------------
# The prover
# ----------------------------------------------------------------------------------------


@dataclass
class _Outcome:
    """What checking one theorem found."""

    pieces: int = 0
    # (case, {symbol: int}) corners of pieces whose residual is not 0
    candidates: list = field(default_factory=list)
    stuck: tuple | None = None  # (case, reason) of the first claim no rule could reduce


class Memo:
    """Caches formula calls within one proof run: theorems share most sub-expressions."""

    def __init__(self, formulas):
        self._formulas = formulas
        self._fns: dict[str, Callable] = {}

    def __getattr__(self, name):
        fn = self._fns.get(name)
        if fn is None:
            target = getattr(self._formulas, name)
            cache: dict = {}

            def fn(*args, **kwargs):
                key = (args, tuple(sorted(kwargs.items())))
                try:
                    return cache[key]
                except KeyError:
                    out = cache[key] = target(*args, **kwargs)
                    return out
                except TypeError:  # an unhashable argument: just call
                    return target(*args, **kwargs)

            self._fns[name] = fn
        return fn


def _check_part(part, ctx: Domain, out: _Outcome, case: dict) -> None:
    """Reduce one claim on the box; add its pieces, or the corners where it fails."""
    if isinstance(part, Equal):
        forms = [(sympy.sympify(part.lhs) - sympy.sympify(part.rhs), "zero")]
    else:
        v = sympy.sympify(part.value)
        forms = [(v - part.lo, "nonneg"), (part.hi - v, "positive")]
    for form, need in forms:
        if form == 0:
            out.pieces += 1
            continue
        free = form.free_symbols
        box = {s: rng for s, rng in ctx.box.items() if s in free}
        for piece, reduced in reduce_on_box(form, box, ctx.enumerable):
            out.pieces += 1
            lin = affine(reduced)
            if lin is None:  # a polynomial: its corners are candidates, then the grid
                if sympy.expand(reduced) != 0:
                    out.candidates += _points(case, reduced.free_symbols, piece)
                    raise Stuck(f"residual {reduced} is not affine on {piece}")
                continue
            coeffs, const = lin
            lo, hi = affine_range(coeffs, const, piece)
            holds = {"zero": lo == hi == 0,
                     "nonneg": lo is not None and lo >= 0,
                     "positive": lo is not None and lo > 0}[need]
            if not holds:
                out.candidates += _points(case, coeffs, piece)


def _points(case, symbols, piece) -> list:
    """The piece's corners in ``symbols`` (the residual's), its low end in the others."""
    low = {s: lo for s, (lo, _) in piece.items()}
    return [(case, {**low, **p}) for p in corners(symbols, piece)]


def prove_theorem(spec: TheoremSpec, formulas, raw_formulas, ctx: Domain) -> Theorem:
    """Prove one theorem: reduce each claim piecewise; search counterexamples if it fails."""
    out = _Outcome()
    for case in spec.cases(ctx):
        try:
            # Unevaluated construction: sympy's own floor/Mod/Max evaluation queries its
            # assumption system at every step (slow) and cannot use the box anyway.
            with sympy.evaluate(False):
                parts = _parts(spec.claim(formulas, ctx, case))
        except Exception as exc:  # noqa: BLE001 - a formula sympy cannot handle is unproven
            out.stuck = out.stuck or (case, f"{type(exc).__name__}: {exc}")
            continue
        for part in parts:
            try:
                _check_part(part, ctx, out, case)
            except Stuck as exc:
                what = f"{part.what}: " if part.what else ""
                out.stuck = out.stuck or (case, what + str(exc))
    method = f"{spec.method(ctx)}; residual 0 on every one of {out.pieces} pieces"
    if not out.candidates and out.stuck is None:
        return Theorem(spec.name, spec.statement, method, PROVEN, None, out.pieces)
    points = list(out.candidates)
    if out.stuck is not None:
        points += _grid(out.stuck[0], ctx)
    cex = _first_counterexample(spec, raw_formulas, ctx, points)
    if cex is None:
        case, reason = out.stuck or (out.candidates[0][0], "the reduced residual is not 0 "
                                     "but no corner fails with ints (a reducer defect)")
        cex = {"could_not_prove": True, "case": {n: str(v) for n, v in case.items()},
               "residual": reason,
               "searched": {s: [min(r), max(r)] for s, r in _SEARCH.items()}}
    return Theorem(spec.name, spec.statement, method, FAILED, cex, out.pieces)


def _grid(case, ctx: Domain) -> list:
    """Small and boundary values of every symbol of a case that no rule could reduce."""
    free = sorted({s for v in case.values() if isinstance(v, sympy.Basic)
                   for s in v.free_symbols}, key=lambda s: s.name)
    axes = []
    for s in free:
        lo, hi = ctx.box[s]
        if hi is None:
            axes.append(_SEARCH[s.name])
        else:
            axes.append(sorted({lo, lo + 1, (lo + hi) // 2, hi - 1, hi} & set(range(lo, hi + 1))))
    return [(case, dict(zip(free, values))) for values in itertools.product(*axes)]


def _concrete_case(case, point, ctx) -> dict:
    """The case at ``point``; symbols the point leaves free take their lowest value."""
    env = {s: sympy.Integer(point.get(s, lo)) for s, (lo, _) in ctx.box.items()}
    return {name: (int(v.xreplace(env)) if isinstance(v, sympy.Basic) else v)
            for name, v in case.items()}


def _first_counterexample(spec, formulas, ctx, points) -> dict | None:
    """The smallest (in case order: N, rank, ...) point where the claim fails with ints."""
    concrete = {}
    for case, point in points:
        c = _concrete_case(case, point, ctx)
        key = tuple(v for v in c.values() if isinstance(v, int)) + (str(c),)
        concrete.setdefault(key, c)
    for key in sorted(concrete):
        c = concrete[key]
        try:
            parts = _parts(spec.claim(formulas, ctx, c))
            bad = next((p for p in parts if not _holds_concretely(p)), None)
        except Exception as exc:  # noqa: BLE001 - report, don't crash the certificate
            return {**c, "error": f"{type(exc).__name__}: {exc}"}
        if bad is not None:
            return {**c, **_describe_claim(bad)}
    return None
