"""Symbolic proofs of the DCP layout theorems (DESIGN.md: Proofs).

``prove(dcp, interleave_size, block_size)`` proves, for every sequence length N >= 0, the
properties the rewritten graph relies on: exactly one rank owns each position, ``local_filled``
counts owned positions, local slots are dense and invert to global positions, the prefill
interleave slice partitions a chunk in order, and ``slot_mapping`` writes only on the owner.

Method. The formulas in :mod:`dcp_compile.layout` are built from ``//``, ``%``, ``*``, ``+``,
``-`` and clamps, with periods that all divide ``vblock = block_size * dcp`` (block_size is a
multiple of interleave_size). So every position is written in the mixed radix of the layout,

    N = k*vblock + u*(I*W) + o*I + t,   k >= 0, 0 <= u < B/I, 0 <= o < W, 0 <= t < I,

(every N >= 0 has exactly one such form: t is the offset in an interleave run, o the run's
owner, u the stride row in the vblock, k the vblock), with ``k, u, o, t`` and the rank ``r``
sympy integer symbols — nothing is enumerated by block size. Local slots are
``s = k*B + u*I + t``, prefill chunks ``S = m*W*I`` (m >= 1), block-table entries ``e >= 0``.
The formulas are the very functions in ``layout.py`` (they accept sympy values), evaluated
once per theorem; each theorem's residual (lhs - rhs) is then reduced by
:mod:`passes.integer_reduction` on a partition of that box into pieces, using only
integer lemmas whose side conditions it decides on each piece (floor(Q + R) = Q + n when
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
import importlib.util
import itertools
import json
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import sympy

from runtime.config import DCPConfig, layout_config
from .integer_reduction import Stuck, affine, affine_range, corners, reduce_on_box

__all__ = ["Theorem", "Certificate", "prove", "prove_config", "layout_config", "layout_with",
           "theorem_names"]

PROVEN, FAILED = "proven", "failed"

# The layout functions the theorems call (a ``formulas`` object must provide them).
_FORMULAS = ("owner", "local_filled", "dcp_active_mask", "local_slot", "global_position",
             "slot_mapping", "interleave_slice_index", "q_unshuffle_index")

# Values tried per unbounded symbol when a claim cannot be reduced (bounded symbols try
# their ends and middle).
_SEARCH = {"k": range(0, 8), "m": range(1, 6), "e": (0, 1, 2, 7)}

METHOD = ("N = k*vblock + u*(I*W) + o*I + t with integers k >= 0, 0 <= u < B/I, 0 <= o < W, "
          "0 <= t < I (slots s = k*B + u*I + t); k, u, o, t, rank symbolic; residuals "
          "reduced piecewise by floor(Q + R) = Q + n (n <= R < n+1), Mod(a, d) = "
          "a - d*floor(a/d), Max/Min/[a = b] by sign; proven when every piece's residual is 0")


# Certificate
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Theorem:
    """One layout theorem for one configuration, with its outcome."""

    name: str
    statement: str
    method: str
    status: str  # "proven" | "failed"
    counterexample: dict | None = None
    cases: int = 0  # pieces of the symbolic domain the proof checked

    @property
    def proven(self) -> bool:
        return self.status == PROVEN

    def to_json(self) -> dict:
        return {"name": self.name, "statement": self.statement, "method": self.method,
                "status": self.status, "counterexample": self.counterexample,
                "cases": self.cases}


@dataclass(frozen=True)
class Certificate:
    """The outcome of ``prove`` for one (dcp, interleave_size, block_size)."""

    dcp: int
    interleave_size: int
    block_size: int
    theorems: tuple[Theorem, ...]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(t.proven for t in self.theorems)

    @property
    def vblock(self) -> int:
        return self.block_size * self.dcp

    @property
    def failed(self) -> tuple[Theorem, ...]:
        return tuple(t for t in self.theorems if not t.proven)

    def __getitem__(self, name: str) -> Theorem:
        for t in self.theorems:
            if t.name == name:
                return t
        raise KeyError(name)

    def describe(self) -> str:
        n_ok = sum(t.proven for t in self.theorems)
        return (f"dcp={self.dcp}, interleave_size={self.interleave_size}, "
                f"block_size={self.block_size} (vblock={self.vblock}): "
                f"{n_ok}/{len(self.theorems)} theorems proven")

    def raise_if_failed(self) -> "Certificate":
        """Raise DCPProofError (carrying this certificate) unless every theorem is proven."""
        if not self.ok:
            from runtime.errors import DCPProofError
            raise DCPProofError(self)
        return self

    def to_json(self) -> dict:
        return {"ok": self.ok, "dcp": self.dcp, "interleave_size": self.interleave_size,
                "block_size": self.block_size, "vblock": self.vblock,
                "seconds": round(self.seconds, 4),
                "theorems": [t.to_json() for t in self.theorems]}

    def format_table(self) -> str:
        name_w = max(len(t.name) for t in self.theorems)
        lines = [self.describe(), "",
                 f"{'theorem':<{name_w}}  {'status':<6}  {'pieces':>6}  statement",
                 f"{'-' * name_w}  ------  ------  ---------"]
        for t in self.theorems:
            lines.append(f"{t.name:<{name_w}}  {t.status:<6}  {t.cases:>6}  {t.statement}")
            if t.counterexample is not None:
                lines.append(f"{'':<{name_w}}  counterexample: "
                             f"{json.dumps(t.counterexample, default=str)}")
        lines.append("")
        lines.append(f"method: {METHOD}.")
        lines.append(f"result: {'all theorems proven' if self.ok else 'PROOF FAILED'} "
                     f"({self.seconds:.2f} s)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Claims: what one theorem asserts for one case
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Eq:
    """lhs == rhs."""

    lhs: Any
    rhs: Any
    what: str = ""


@dataclass(frozen=True)
class _Range:
    """lo <= value < hi."""

    value: Any
    lo: Any
    hi: Any
    what: str = ""


def _parts(claim) -> tuple:
    """A claim function returns one claim or a tuple of claims that must all hold."""
    return claim if isinstance(claim, tuple) else (claim,)


def _holds_concretely(claim) -> bool:
    if isinstance(claim, _Eq):
        return bool(claim.lhs == claim.rhs)
    return bool(claim.lo <= claim.value < claim.hi)


def _describe_claim(claim) -> dict:
    out = {"claim": claim.what} if claim.what else {}
    if isinstance(claim, _Eq):
        return {**out, "lhs": _jsonable(claim.lhs), "rhs": _jsonable(claim.rhs)}
    return {**out, "lhs": _jsonable(claim.value), "rhs": f"in [{claim.lo}, {claim.hi})"}


def _jsonable(x):
    x = sympy.sympify(x)
    return int(x) if x.is_Integer else str(x)


def _int_or_none(x):
    """``x`` as an int when it is one (Python or sympy), else None."""
    if isinstance(x, int):
        return x
    x = sympy.sympify(x)
    return int(x) if x.is_Integer else None


def _eq01(a, b):
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
class _Ctx:
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


# ----------------------------------------------------------------------------------------
# The theorems. Each is a name, a statement in the specification's words, the cases it
# evaluates (values contain the box's symbols) and a claim over one case. A claim calls only
# the formulas object, so a broken formula is caught (and the real one proven).
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    name: str
    statement: str
    method: Callable[[_Ctx], str]
    cases: Callable[[_Ctx], Iterable[dict]]
    claim: Callable[[Any, _Ctx, dict], Any]


_THEOREMS: list[_Spec] = []


def _theorem(name, statement, cases, method):
    def register(claim):
        _THEOREMS.append(_Spec(name, statement, method, cases, claim))
        return claim
    return register


@_theorem("exactly_one_owner",
          "exactly one rank owns each position: sum_r dcp_active_mask(N, r) = 1",
          cases=lambda c: c.positions(with_rank=False),
          method=lambda c: c.position_method(with_rank=False))
def _exactly_one_owner(f, c, x):
    total = sum(f.dcp_active_mask(x["N"], r, **c.kw) for r in range(c.W))
    return _Eq(total, 1)


@_theorem("active_mask_is_owner",
          "dcp_active_mask(N, r) = 1 exactly when owner(N) = floor(pos_in_vblock / "
          "interleave_size) % dcp_size equals r",
          cases=lambda c: c.positions(), method=lambda c: c.position_method())
def _active_mask_is_owner(f, c, x):
    return _Eq(f.dcp_active_mask(x["N"], x["rank"], **c.kw),
               _eq01(f.owner(x["N"], **c.kw), x["rank"]))


@_theorem("owner_stride_periodic",
          "ownership repeats every stride = interleave_size * dcp_size positions: "
          "owner(N + stride) = owner(N) (so a chunk starting at a multiple of the stride "
          "sees the same owners as one starting at 0)",
          cases=lambda c: c.positions(with_rank=False),
          method=lambda c: c.position_method(with_rank=False))
def _owner_stride_periodic(f, c, x):
    return _Eq(f.owner(x["N"] + c.I * c.W, **c.kw), f.owner(x["N"], **c.kw))


@_theorem("local_filled_sum",
          "the shards hold every prior token once: sum_r local_filled(N, r) = N",
          cases=lambda c: c.positions(with_rank=False),
          method=lambda c: c.position_method(with_rank=False))
def _local_filled_sum(f, c, x):
    return _Eq(sum(f.local_filled(x["N"], r, **c.kw) for r in range(c.W)), x["N"])


@_theorem("local_filled_empty",
          "an empty sequence fills no slot: local_filled(0, r) = 0",
          cases=lambda c: ({"N": 0, "rank": c.v("r")},),
          method=lambda c: f"N = 0, rank in [0, {c.W}) symbolic")
def _local_filled_empty(f, c, x):
    return _Eq(f.local_filled(x["N"], x["rank"], **c.kw), 0)


@_theorem("local_filled_step",
          "local_filled(N + 1, r) = local_filled(N, r) + dcp_active_mask(N, r); with "
          "local_filled_empty, by induction local_filled(N, r) = #{p < N : owner(p) = r}",
          cases=lambda c: c.positions(), method=lambda c: c.position_method())
def _local_filled_step(f, c, x):
    N, r = x["N"], x["rank"]
    return _Eq(f.local_filled(N + 1, r, **c.kw),
               f.local_filled(N, r, **c.kw) + f.dcp_active_mask(N, r, **c.kw))


@_theorem("local_slot_dense",
          "the local slot of an owned position is the number of earlier positions the rank "
          "owns: dcp_active_mask(N, r) * (local_slot(N) - local_filled(N, r)) = 0 (so local "
          "slots are dense, distinct and in position order)",
          cases=lambda c: c.positions(), method=lambda c: c.position_method())
def _local_slot_dense(f, c, x):
    N, r = x["N"], x["rank"]
    mask = f.dcp_active_mask(N, r, **c.kw)
    return _Eq(mask * f.local_slot(N, **c.kw), mask * f.local_filled(N, r, **c.kw))


@_theorem("global_position_inverts_local_slot",
          "the prior-slot -> global-position map inverts the local slot: for owned N, "
          "global_position(local_slot(N), r) = N",
          cases=lambda c: c.positions(), method=lambda c: c.position_method())
def _global_position_inverts(f, c, x):
    N, r = x["N"], x["rank"]
    mask = f.dcp_active_mask(N, r, **c.kw)
    return _Eq(mask * f.global_position(f.local_slot(N, **c.kw), r, **c.kw_slice), mask * N)


@_theorem("local_slot_inverts_global_position",
          "every local slot s of rank r holds a position r owns, at slot s: "
          "owner(global_position(s, r)) = r and local_slot(global_position(s, r)) = s",
          cases=lambda c: c.slots(), method=lambda c: c.slot_method())
def _local_slot_inverts(f, c, x):
    s, r = x["slot"], x["rank"]
    p = f.global_position(s, r, **c.kw_slice)
    return (_Eq(f.owner(p, **c.kw), r, "owner(global_position(s, r)) = r"),
            _Eq(f.local_slot(p, **c.kw), s, "local_slot(global_position(s, r)) = s"))


@_theorem("interleave_slice_owned_in_order",
          "the prefill interleave slice keeps rank r's own tokens in order: the j-th kept "
          "chunk index p = interleave_slice_index(j, r) has owner(p) = r and local_slot(p) = j",
          cases=lambda c: c.slots("j"), method=lambda c: c.slot_method("j"))
def _interleave_slice_owned(f, c, x):
    j, r = x["j"], x["rank"]
    p = f.interleave_slice_index(j, r, **c.kw_slice)
    return (_Eq(f.owner(p, **c.kw), r, "owner(interleave_slice_index(j, r)) = r"),
            _Eq(f.local_slot(p, **c.kw), j, "local_slot(interleave_slice_index(j, r)) = j"))


@_theorem("interleave_slice_within_chunk",
          "rank r's slice of a chunk of S = m*dcp*interleave_size tokens runs from "
          "interleave_slice_index(0, r) = r*I to interleave_slice_index(S/dcp - 1, r) = "
          "S - 1 - (dcp-1-r)*I; with the order above, every kept index lies in [0, S)",
          cases=lambda c: ({"end": end, "j": j, "rank": c.v("r"), "S": c.chunk}
                           for end, j in (("first", 0), ("last", c.chunk / c.W - 1))),
          method=lambda c: f"S = m*{c.W * c.I}, m >= 1 symbolic, j in {{0, S/{c.W} - 1}}, "
                           f"rank in [0, {c.W}) symbolic")
def _interleave_slice_within_chunk(f, c, x):
    j, r, S = x["j"], x["rank"], x["S"]
    expected = r * c.I if x["end"] == "first" else S - 1 - (c.W - 1 - r) * c.I
    return _Eq(f.interleave_slice_index(j, r, **c.kw_slice), expected)


@_theorem("q_unshuffle_inverts_slice",
          "Q unshuffle undoes the gather of the slices: q_unshuffle_index("
          "interleave_slice_index(j, r), S) = r*(S/dcp) + j, so the slices of all ranks "
          "partition the chunk [0, S) and the gathered Q returns to global order",
          cases=lambda c: ({**x, "S": c.chunk} for x in c.slots("j")),
          method=lambda c: f"{c.slot_method('j')}, S = m*{c.W * c.I}, m >= 1")
def _q_unshuffle_inverts(f, c, x):
    j, r, S = x["j"], x["rank"], x["S"]
    p = f.interleave_slice_index(j, r, **c.kw_slice)
    return _Eq(f.q_unshuffle_index(p, S, **c.kw_slice), r * (S // c.W) + j)


@_theorem("slot_mapping_owner_writes",
          "the owner writes the active token's slot iff its dcp_active_mask is 1: with "
          "block-table entry e >= 0, slot_mapping(N, r, e) lies in block e "
          "([e*block_size, (e+1)*block_size), so >= 0) when dcp_active_mask(N, r) = 1 "
          "and is -1 when it is 0",
          cases=lambda c: ({**x, "block_table_entry": c.e} for x in c.positions()),
          method=lambda c: c.position_method() + ", entry e >= 0 symbolic")
def _slot_mapping_owner_writes(f, c, x):
    N, r, e = x["N"], x["rank"], x["block_table_entry"]
    mask = f.dcp_active_mask(N, r, **c.kw)
    slot = f.slot_mapping(N, r, e, **c.kw)
    owned = _int_or_none(mask)
    if owned == 1:
        return _Range(slot, e * c.B, (e + 1) * c.B, "owner writes inside block e")
    if owned == 0:
        return _Eq(slot, -1, "non-owner writes -1")
    if owned is not None:
        return _Range(mask, 0, 2, "dcp_active_mask is 0 or 1")
    # A symbolic mask: the same three statements, weighted by it (decided piece by piece).
    return (_Range(mask, 0, 2, "dcp_active_mask is 0 or 1"),
            _Range(mask * (slot - e * c.B), 0, c.B, "owner writes inside block e"),
            _Eq((1 - mask) * (slot + 1), 0, "non-owner writes -1"))


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


class _Memo:
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




def _check_part(part, ctx: _Ctx, out: _Outcome, case: dict) -> None:
    """Reduce one claim on the box; add its pieces, or the corners where it fails."""
    if isinstance(part, _Eq):
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


def _prove_one(spec: _Spec, formulas, raw_formulas, ctx: _Ctx) -> Theorem:
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


def _grid(case, ctx: _Ctx) -> list:
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


def prove(dcp: int, interleave_size: int, block_size: int, *, formulas=None) -> Certificate:
    """Prove the layout theorems for every sequence length N >= 0 (see module docstring).

    ``formulas`` defaults to :mod:`dcp_compile.layout`; pass any object with the same
    function names (e.g. :func:`layout_with`) to prove — or refute — other formulas.
    Invalid sizes raise ``DCPConfigError``.
    """
    layout_config(dcp, interleave_size, block_size)
    if formulas is not None:
        missing = [n for n in _FORMULAS if not callable(getattr(formulas, n, None))]
        if missing:
            raise TypeError(f"formulas lacks layout functions: {missing}. Pass an object "
                            f"with every function of dcp_compile.layout (see layout_with).")
        return _prove(dcp, interleave_size, block_size, formulas)
    from runtime import layout
    # Keyed on the function objects too, so a patched layout is proven afresh.
    fns = tuple(getattr(layout, name) for name in layout.__all__)
    return _prove_real_layout(dcp, interleave_size, block_size, fns)


@functools.lru_cache(maxsize=64)
def _prove_real_layout(dcp, interleave_size, block_size, _fns) -> Certificate:
    from runtime import layout
    return _prove(dcp, interleave_size, block_size, layout)


def _symbols() -> dict:
    return {n: sympy.Symbol(n, integer=True, nonnegative=True) for n in "kuotre"} | {
        "m": sympy.Symbol("m", integer=True, positive=True)}


def _prove(dcp, interleave_size, block_size, formulas) -> Certificate:
    start = time.perf_counter()
    ctx = _Ctx(W=dcp, I=interleave_size, B=block_size, symbols=_symbols())
    memo = _Memo(formulas)
    theorems = tuple(_prove_one(spec, memo, formulas, ctx) for spec in _THEOREMS)
    return Certificate(dcp, interleave_size, block_size, theorems,
                       seconds=time.perf_counter() - start)


def prove_config(config: DCPConfig, *, formulas=None) -> Certificate:
    """``prove`` for the KV layout of a validated DCPConfig."""
    return prove(config.dcp, config.interleave_size, config.block_size, formulas=formulas)


def theorem_names() -> list[str]:
    return [spec.name for spec in _THEOREMS]


def layout_with(**overrides) -> types.ModuleType:
    """A fresh copy of :mod:`dcp_compile.layout` with some functions replaced.

    The copy has its own globals, so a replaced ``owner`` is also what its
    ``dcp_active_mask`` and ``slot_mapping`` call — the way to test the prover on a
    deliberately broken formula. The real module is untouched.
    """
    from runtime import layout
    spec = importlib.util.spec_from_file_location("dcp_compile._layout_copy", layout.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, fn in overrides.items():
        if name not in layout.__all__:
            raise AttributeError(f"layout has no formula {name!r}")
        setattr(module, name, fn)
    return module
