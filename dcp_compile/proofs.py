"""Symbolic proofs of the DCP layout theorems (DESIGN.md: Proofs).

``prove(dcp, interleave_size, block_size)`` proves, for every sequence length N >= 0, the
properties the rewritten graph relies on: exactly one rank owns each position, ``local_filled``
counts owned positions, local slots are dense and invert to global positions, the prefill
interleave slice partitions a chunk in order, and ``slot_mapping`` writes only on the owner.

Method. Every formula in :mod:`dcp_compile.layout` depends on N only through N // vblock
(linearly) and N mod vblock, with ``vblock = block_size * dcp`` a multiple of every period
involved (block_size is a multiple of interleave_size). Write N = k * vblock + j with ``k`` a
sympy integer symbol (k >= 0) and enumerate j over one period [0, vblock) and every rank.
sympy reduces floor(k + c) to k + floor(c) and Mod(k * vblock + j, d) to j mod d for every
divisor d of vblock, so each theorem's residual (lhs - rhs) becomes an expression in k, and
the theorem is *proven* only when that residual simplifies to exactly 0 for every (j, rank)
case. Local slots are written s = k * block_size + t, prefill chunks S = m * dcp * I with m
symbolic, and a block-table entry is a symbol e >= 0. The formulas are the very functions in
``layout.py`` (they accept sympy values), so the proof covers the code that runs.

When a residual does not vanish, the same claim is evaluated with Python ints for small k
(and the other symbols) to find a concrete counterexample; if none is found the theorem is
still reported ``failed`` ("could not prove") — a theorem is never ``proven`` without a
symbolic 0. Brute force over small N is how the tests check this prover, not a proof.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import sympy

from .config import DCPConfig
from .errors import DCPConfigError

__all__ = ["Theorem", "Certificate", "prove", "prove_config", "layout_config", "layout_with",
           "theorem_names"]

PROVEN, FAILED = "proven", "failed"

# The layout functions the theorems call (a ``formulas`` object must provide them).
_FORMULAS = ("owner", "local_filled", "dcp_active_mask", "local_slot", "global_position",
             "slot_mapping", "interleave_slice_index", "q_unshuffle_index")

# Concrete values tried per free symbol when a residual does not simplify to 0.
_SEARCH = {"k": range(0, 8), "m": range(1, 6), "e": (0, 1, 2, 7)}


# ----------------------------------------------------------------------------------------
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
    cases: int = 0

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
            from .errors import DCPProofError
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
                 f"{'theorem':<{name_w}}  {'status':<6}  {'cases':>5}  statement",
                 f"{'-' * name_w}  ------  -----  ---------"]
        for t in self.theorems:
            lines.append(f"{t.name:<{name_w}}  {t.status:<6}  {t.cases:>5}  {t.statement}")
            if t.counterexample is not None:
                lines.append(f"{'':<{name_w}}  counterexample: "
                             f"{json.dumps(t.counterexample, default=str)}")
        lines.append("")
        lines.append("method: N = k*vblock + j, k >= 0 a sympy integer symbol, j and rank "
                     "enumerated; a theorem is proven when every residual simplifies to 0.")
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


class _Undecidable(Exception):
    """A value a claim must branch on (the active mask) did not simplify to a number."""


def _sym_zero(expr, simplify=True) -> bool:
    """True only when sympy reduces ``expr`` to exactly 0."""
    expr = sympy.sympify(expr)
    if expr == 0:
        return True
    return simplify and sympy.simplify(expr) == 0


def _sym_decided(relation, expr, simplify=True) -> bool:
    """True only when sympy decides ``relation(expr, 0)`` (e.g. Ge) is true."""
    expr = sympy.sympify(expr)
    if relation(expr, 0) is sympy.true:
        return True
    return simplify and relation(sympy.simplify(expr), 0) is sympy.true


def _holds_symbolically(claim, simplify=True) -> bool:
    if isinstance(claim, _Eq):
        return _sym_zero(sympy.sympify(claim.lhs) - sympy.sympify(claim.rhs), simplify)
    v = sympy.sympify(claim.value)
    return (_sym_decided(sympy.Ge, v - claim.lo, simplify)
            and _sym_decided(sympy.Gt, claim.hi - v, simplify))


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


def _concrete(x):
    """``x`` as an int when sympy reduced it to an integer; raise _Undecidable otherwise."""
    x = sympy.sympify(x)
    if x.is_Integer:
        return int(x)
    raise _Undecidable(str(x))


def _eq01(a, b):
    """The specification's indicator [a == b] (0/1), for ints and sympy values."""
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        d = sympy.simplify(sympy.sympify(a) - b)
        if d.is_number:
            return sympy.Integer(int(d == 0))
        return sympy.Piecewise((1, sympy.Eq(d, 0)), (0, True))
    return int(a == b)


# ----------------------------------------------------------------------------------------
# The theorems. Each is a name, a statement in the specification's words, the cases it
# enumerates (values may contain the symbols k, m, e) and a claim over one case. A claim
# calls only the formulas object, so a broken formula is caught (and the real one proven).
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ctx:
    W: int
    I: int
    B: int
    k: sympy.Symbol
    m: sympy.Symbol
    e: sympy.Symbol

    @property
    def vblock(self) -> int:
        return self.B * self.W

    @property
    def kw(self) -> dict:
        return dict(dcp=self.W, interleave=self.I, block=self.B)

    @property
    def kw_slice(self) -> dict:
        return dict(dcp=self.W, interleave=self.I)

    def positions(self, with_rank=True) -> Iterable[dict]:
        """N = k*vblock + j for j in one period (x every rank)."""
        for j in range(self.vblock):
            if not with_rank:
                yield {"N": self.k * self.vblock + j}
                continue
            for r in range(self.W):
                yield {"N": self.k * self.vblock + j, "rank": r}

    def slots(self, var="slot") -> Iterable[dict]:
        """s = k*block_size + t (a block of local slots maps onto one vblock)."""
        for t in range(self.B):
            for r in range(self.W):
                yield {var: self.k * self.B + t, "rank": r}

    def position_method(self, with_rank=True) -> str:
        ranks = f", rank in [0, {self.W})" if with_rank else ""
        return f"N = k*{self.vblock} + j, k >= 0 symbolic, j in [0, {self.vblock}){ranks}"

    def slot_method(self, var="slot") -> str:
        return (f"{var} = k*{self.B} + t, k >= 0 symbolic, t in [0, {self.B}), "
                f"rank in [0, {self.W})")

    @property
    def chunk(self):
        """Prefill chunk length S = m * W * I (the model runner's view needs W*I | S)."""
        return self.m * self.W * self.I


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
          cases=lambda c: ({"N": 0, "rank": r} for r in range(c.W)),
          method=lambda c: f"N = 0, rank in [0, {c.W})")
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
          cases=lambda c: ({"end": end, "j": j, "rank": r, "S": c.chunk}
                           for r in range(c.W)
                           for end, j in (("first", 0), ("last", c.chunk / c.W - 1))),
          method=lambda c: f"S = m*{c.W * c.I}, m >= 1 symbolic, j in {{0, S/{c.W} - 1}}, "
                           f"rank in [0, {c.W})")
def _interleave_slice_within_chunk(f, c, x):
    j, r, S = x["j"], x["rank"], x["S"]
    expected = r * c.I if x["end"] == "first" else S - 1 - (c.W - 1 - r) * c.I
    return _Eq(f.interleave_slice_index(j, r, **c.kw_slice), expected)


@_theorem("q_unshuffle_inverts_slice",
          "Q unshuffle undoes the gather of the slices: q_unshuffle_index("
          "interleave_slice_index(j, r), S) = r*(S/dcp) + j, so the slices of all ranks "
          "partition the chunk [0, S) and the gathered Q returns to global order",
          cases=lambda c: ({**x, "S": c.chunk} for x in c.slots("j")),
          method=lambda c: f"{c.slot_method('j')}, S = m*{c.W * c.I}, m >= 1 symbolic")
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
    owned = _concrete(mask)
    if owned == 1:
        return _Range(slot, e * c.B, (e + 1) * c.B, "owner writes inside block e")
    if owned == 0:
        return _Eq(slot, -1, "non-owner writes -1")
    return _Range(mask, 0, 2, "dcp_active_mask is 0 or 1")


# ----------------------------------------------------------------------------------------
# The prover
# ----------------------------------------------------------------------------------------


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


def _prove_one(spec: _Spec, formulas, raw_formulas, ctx: _Ctx) -> Theorem:
    """Prove one theorem over all its cases.

    Pass 1 keeps the cases whose residual sympy does not reduce to 0 on construction (the
    real layout has none). Pass 2 looks for a concrete counterexample among them with ints,
    which is cheap; only if there is none does pass 3 spend ``sympy.simplify`` on them.
    """
    cases = list(spec.cases(ctx))
    method = spec.method(ctx) + "; every residual simplifies to 0"
    pending = []  # (case, claim parts or the exception sympy raised)
    for case in cases:
        try:
            parts = _parts(spec.claim(formulas, ctx, case))
        except Exception as exc:  # noqa: BLE001 - a formula sympy cannot handle is unproven
            pending.append((case, exc))
            continue
        if not all(_holds_symbolically(p, simplify=False) for p in parts):
            pending.append((case, parts))
    for case, _ in pending:
        cex = _search_counterexample(spec, raw_formulas, ctx, case)
        if cex is not None:
            return Theorem(spec.name, spec.statement, method, FAILED, cex, len(cases))
    undecided = []  # (case, residual text)
    for case, parts in pending:
        if isinstance(parts, Exception):
            undecided.append((case, f"{type(parts).__name__}: {parts}"))
            continue
        failing = [p for p in parts if not _holds_symbolically(p)]
        if failing:
            undecided.append((case, _residual_text(failing[0])))
    if not undecided:
        return Theorem(spec.name, spec.statement, method, PROVEN, None, len(cases))
    case, residual = undecided[0]
    cex = {"could_not_prove": True, "undecided_cases": len(undecided),
           "case": {n: str(v) for n, v in case.items()}, "residual": residual,
           "searched": {s: [min(r), max(r)] for s, r in _SEARCH.items()}}
    return Theorem(spec.name, spec.statement, method, FAILED, cex, len(cases))


def _residual_text(claim) -> str:
    what = f"{claim.what}: " if claim.what else ""
    if isinstance(claim, _Eq):
        return what + f"lhs - rhs = {sympy.simplify(sympy.sympify(claim.lhs) - claim.rhs)}"
    return what + f"{sympy.simplify(claim.value)} not provably in [{claim.lo}, {claim.hi})"


def _search_counterexample(spec, formulas, ctx, case) -> dict | None:
    """Evaluate one unproven case with Python ints for small values of its symbols."""
    free = sorted({s for v in case.values() if isinstance(v, sympy.Basic)
                   for s in v.free_symbols}, key=lambda s: s.name)
    for values in itertools.product(*(_SEARCH[s.name] for s in free)):
        env = dict(zip(free, values))
        concrete = {name: (int(v.subs(env)) if isinstance(v, sympy.Basic) else v)
                    for name, v in case.items()}
        try:
            parts = _parts(spec.claim(formulas, ctx, concrete))
            bad = next((p for p in parts if not _holds_concretely(p)), None)
        except Exception as exc:  # noqa: BLE001 - report, don't crash the certificate
            return {**concrete, "error": f"{type(exc).__name__}: {exc}"}
        if bad is not None:
            return {**concrete, **_describe_claim(bad)}
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
    from . import layout
    # Keyed on the function objects too, so a patched layout is proven afresh.
    fns = tuple(getattr(layout, name) for name in layout.__all__)
    return _prove_real_layout(dcp, interleave_size, block_size, fns)


@functools.lru_cache(maxsize=64)
def _prove_real_layout(dcp, interleave_size, block_size, _fns) -> Certificate:
    from . import layout
    return _prove(dcp, interleave_size, block_size, layout)


def _prove(dcp, interleave_size, block_size, formulas) -> Certificate:
    start = time.perf_counter()
    ctx = _Ctx(W=dcp, I=interleave_size, B=block_size,
               k=sympy.Symbol("k", integer=True, nonnegative=True),
               m=sympy.Symbol("m", integer=True, positive=True),
               e=sympy.Symbol("e", integer=True, nonnegative=True))
    memo = _Memo(formulas)
    theorems = tuple(_prove_one(spec, memo, formulas, ctx) for spec in _THEOREMS)
    return Certificate(dcp, interleave_size, block_size, theorems,
                       seconds=time.perf_counter() - start)


def layout_config(dcp, interleave_size, block_size) -> DCPConfig:
    """The DCPConfig of a bare KV layout (tp = dcp); DCPConfigError names only these sizes."""
    try:
        return DCPConfig(tp=dcp, dcp=dcp, block_size=block_size,
                         interleave_size=interleave_size)
    except DCPConfigError as e:
        # tp is a stand-in here: its copy of dcp's complaint would only confuse.
        raise DCPConfigError([v for v in e.violations if not v.startswith("tp ")]
                             or e.violations) from None


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
    from . import layout
    spec = importlib.util.spec_from_file_location("dcp_compile._layout_copy", layout.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, fn in overrides.items():
        if name not in layout.__all__:
            raise AttributeError(f"layout has no formula {name!r}")
        setattr(module, name, fn)
    return module
