"""The DCP layout theorems, as a registry of data, and ``prove``.

``prove(dcp, interleave_size, block_size)`` proves, for every sequence length N >= 0, the
properties the rewritten graph relies on: exactly one rank owns each position, ``local_filled``
counts owned positions, local slots are dense and invert to global positions, the prefill
interleave slice partitions a chunk in order, and ``slot_mapping`` writes only on the owner.

Each theorem below is a name, a statement in the specification's words, the cases it
evaluates and a claim over one case, calling only the formulas of :mod:`dcp_compile.runtime.layout` (or
any object with the same functions, see :func:`layout_with`). How a claim is proven for every
N — positions in the mixed radix of the layout, residuals reduced piecewise by
:mod:`dcp_compile.passes.prove.integer_reduction`, counterexamples rechecked with ints — is
:mod:`dcp_compile.passes.prove.engine`; the outcome is a :class:`~dcp_compile.passes.prove.certificate.Certificate`.
"""

from __future__ import annotations

import functools
import importlib.util
import time
import types

from dcp_compile.runtime.config import DCPConfig, layout_config
from .certificate import Certificate, Theorem
from .engine import (Equal, InRange, Memo, TheoremSpec, domain, eq01, int_or_none,
                           prove_theorem)

__all__ = ["Theorem", "Certificate", "prove", "prove_config", "layout_config", "layout_with",
           "theorem_names"]

# The layout functions the theorems call (a ``formulas`` object must provide them).
_FORMULAS = ("owner", "local_filled", "query_local_bound", "dcp_active_mask", "local_slot", "global_position",
             "slot_mapping", "interleave_slice_index", "q_unshuffle_index")


# ----------------------------------------------------------------------------------------
# The theorems, in the order they are proven and reported. A claim receives the formulas
# ``f``, the domain ``c`` and one case ``x``, and returns one claim or a tuple of claims.
# ----------------------------------------------------------------------------------------

_THEOREMS: list[TheoremSpec] = []


def _theorem(name, statement, cases, method):
    def register(claim):
        _THEOREMS.append(TheoremSpec(name, statement, method, cases, claim))
        return claim
    return register


@_theorem("exactly_one_owner",
          "exactly one rank owns each position: sum_r dcp_active_mask(N, r) = 1",
          cases=lambda c: c.positions(with_rank=False),
          method=lambda c: c.position_method(with_rank=False))
def _exactly_one_owner(f, c, x):
    total = sum(f.dcp_active_mask(x["N"], r, **c.kw) for r in range(c.W))
    return Equal(total, 1)


@_theorem("active_mask_is_owner",
          "dcp_active_mask(N, r) = 1 exactly when owner(N) = floor(pos_in_vblock / "
          "interleave_size) % dcp_size equals r",
          cases=lambda c: c.positions(), method=lambda c: c.position_method())
def _active_mask_is_owner(f, c, x):
    return Equal(f.dcp_active_mask(x["N"], x["rank"], **c.kw),
               eq01(f.owner(x["N"], **c.kw), x["rank"]))


@_theorem("owner_stride_periodic",
          "ownership repeats every stride = interleave_size * dcp_size positions: "
          "owner(N + stride) = owner(N) (so a chunk starting at a multiple of the stride "
          "sees the same owners as one starting at 0)",
          cases=lambda c: c.positions(with_rank=False),
          method=lambda c: c.position_method(with_rank=False))
def _owner_stride_periodic(f, c, x):
    return Equal(f.owner(x["N"] + c.I * c.W, **c.kw), f.owner(x["N"], **c.kw))


@_theorem("local_filled_sum",
          "the shards hold every prior token once: sum_r local_filled(N, r) = N",
          cases=lambda c: c.positions(with_rank=False),
          method=lambda c: c.position_method(with_rank=False))
def _local_filled_sum(f, c, x):
    return Equal(sum(f.local_filled(x["N"], r, **c.kw) for r in range(c.W)), x["N"])


@_theorem("local_filled_empty",
          "an empty sequence fills no slot: local_filled(0, r) = 0",
          cases=lambda c: ({"N": 0, "rank": c.v("r")},),
          method=lambda c: f"N = 0, rank in [0, {c.W}) symbolic")
def _local_filled_empty(f, c, x):
    return Equal(f.local_filled(x["N"], x["rank"], **c.kw), 0)


@_theorem("local_filled_step",
          "local_filled(N + 1, r) = local_filled(N, r) + dcp_active_mask(N, r); with "
          "local_filled_empty, by induction local_filled(N, r) = #{p < N : owner(p) = r}",
          cases=lambda c: c.positions(), method=lambda c: c.position_method())
def _local_filled_step(f, c, x):
    N, r = x["N"], x["rank"]
    return Equal(f.local_filled(N + 1, r, **c.kw),
               f.local_filled(N, r, **c.kw) + f.dcp_active_mask(N, r, **c.kw))


@_theorem("local_slot_dense",
          "the local slot of an owned position is the number of earlier positions the rank "
          "owns: dcp_active_mask(N, r) * (local_slot(N) - local_filled(N, r)) = 0 (so local "
          "slots are dense, distinct and in position order)",
          cases=lambda c: c.positions(), method=lambda c: c.position_method())
def _local_slot_dense(f, c, x):
    N, r = x["N"], x["rank"]
    mask = f.dcp_active_mask(N, r, **c.kw)
    return Equal(mask * f.local_slot(N, **c.kw), mask * f.local_filled(N, r, **c.kw))


@_theorem("global_position_inverts_local_slot",
          "the prior-slot -> global-position map inverts the local slot: for owned N, "
          "global_position(local_slot(N), r) = N",
          cases=lambda c: c.positions(), method=lambda c: c.position_method())
def _global_position_inverts(f, c, x):
    N, r = x["N"], x["rank"]
    mask = f.dcp_active_mask(N, r, **c.kw)
    return Equal(mask * f.global_position(f.local_slot(N, **c.kw), r, **c.kw_slice), mask * N)


@_theorem("local_slot_inverts_global_position",
          "every local slot s of rank r holds a position r owns, at slot s: "
          "owner(global_position(s, r)) = r and local_slot(global_position(s, r)) = s",
          cases=lambda c: c.slots(), method=lambda c: c.slot_method())
def _local_slot_inverts(f, c, x):
    s, r = x["slot"], x["rank"]
    p = f.global_position(s, r, **c.kw_slice)
    return (Equal(f.owner(p, **c.kw), r, "owner(global_position(s, r)) = r"),
            Equal(f.local_slot(p, **c.kw), s, "local_slot(global_position(s, r)) = s"))


@_theorem("interleave_slice_owned_in_order",
          "the prefill interleave slice keeps rank r's own tokens in order: the j-th kept "
          "chunk index p = interleave_slice_index(j, r) has owner(p) = r and local_slot(p) = j",
          cases=lambda c: c.slots("j"), method=lambda c: c.slot_method("j"))
def _interleave_slice_owned(f, c, x):
    j, r = x["j"], x["rank"]
    p = f.interleave_slice_index(j, r, **c.kw_slice)
    return (Equal(f.owner(p, **c.kw), r, "owner(interleave_slice_index(j, r)) = r"),
            Equal(f.local_slot(p, **c.kw), j, "local_slot(interleave_slice_index(j, r)) = j"))


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
    return Equal(f.interleave_slice_index(j, r, **c.kw_slice), expected)


@_theorem("q_unshuffle_inverts_slice",
          "Q unshuffle undoes the gather of the slices: q_unshuffle_index("
          "interleave_slice_index(j, r), S) = r*(S/dcp) + j, so the slices of all ranks "
          "partition the chunk [0, S) and the gathered Q returns to global order",
          cases=lambda c: ({**x, "S": c.chunk} for x in c.slots("j")),
          method=lambda c: f"{c.slot_method('j')}, S = m*{c.W * c.I}, m >= 1")
def _q_unshuffle_inverts(f, c, x):
    j, r, S = x["j"], x["rank"], x["S"]
    p = f.interleave_slice_index(j, r, **c.kw_slice)
    return Equal(f.q_unshuffle_index(p, S, **c.kw_slice), r * (S // c.W) + j)


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
    owned = int_or_none(mask)
    if owned == 1:
        return InRange(slot, e * c.B, (e + 1) * c.B, "owner writes inside block e")
    if owned == 0:
        return Equal(slot, -1, "non-owner writes -1")
    if owned is not None:
        return InRange(mask, 0, 2, "dcp_active_mask is 0 or 1")
    # A symbolic mask: the same three statements, weighted by it (decided piece by piece).
    return (InRange(mask, 0, 2, "dcp_active_mask is 0 or 1"),
            InRange(mask * (slot - e * c.B), 0, c.B, "owner writes inside block e"),
            Equal((1 - mask) * (slot + 1), 0, "non-owner writes -1"))


# Widest decode step the per-query bound is proven for (offsets 0..MAX_DECODE_LEN-1); the
# decode rewrite refuses a wider step (dcp_compile.passes.dcp_decode). Speculative verify
# steps are up to 8 wide; a decode program's chunk step (a prompt chunk after prior context,
# StepShapes.chunk_len) up to 64. The 56 more offsets cost ~0.4 s of proof per layout.
MAX_DECODE_LEN = 64
MAX_SPECULATIVE_LEN = 8         # drafts per verify step the command line accepts


@_theorem("query_local_bound_is_causal",
          f"in a decode step of width K <= {MAX_DECODE_LEN} (row positions N..N+K-1), the "
          "query at offset t < K reads exactly the rank's owned positions at or below its "
          "own: query_local_bound(N, t, r) = local_filled(N, r) + sum_{i <= t} "
          "dcp_active_mask(N + i, r) (with local_slot_dense: slot s < bound iff "
          "global_position(s, r) <= N + t; never local_filled(N + K, r) - (K - 1 - t))",
          cases=lambda c: ({**x, "offset": t} for x in c.positions()
                           for t in range(MAX_DECODE_LEN)),
          method=lambda c: c.position_method() + f", offset t = 0..{MAX_DECODE_LEN - 1} each")
def _query_local_bound_is_causal(f, c, x):
    N, r, t = x["N"], x["rank"], x["offset"]
    # By induction on t: the base counts N itself, each step adds position N + t.
    below = (f.local_filled(N, r, **c.kw) if t == 0
             else f.query_local_bound(N, t - 1, r, **c.kw))
    return Equal(f.query_local_bound(N, t, r, **c.kw),
                 below + f.dcp_active_mask(N + t, r, **c.kw))


# ----------------------------------------------------------------------------------------
# Proving
# ----------------------------------------------------------------------------------------


def prove(dcp: int, interleave_size: int, block_size: int, *, formulas=None) -> Certificate:
    """Prove the layout theorems for every sequence length N >= 0 (see module docstring).

    ``formulas`` defaults to :mod:`dcp_compile.runtime.layout`; pass any object with the same
    function names (e.g. :func:`layout_with`) to prove — or refute — other formulas.
    Invalid sizes raise ``DCPConfigError``.
    """
    layout_config(dcp, interleave_size, block_size)
    if formulas is not None:
        missing = [n for n in _FORMULAS if not callable(getattr(formulas, n, None))]
        if missing:
            raise TypeError(f"formulas lacks layout functions: {missing}. Pass an object "
                            f"with every function of dcp_compile.runtime.layout (see layout_with).")
        return _prove(dcp, interleave_size, block_size, formulas)
    from dcp_compile.runtime import layout
    # Keyed on the function objects too, so a patched layout is proven afresh.
    fns = tuple(getattr(layout, name) for name in layout.__all__)
    return _prove_real_layout(dcp, interleave_size, block_size, fns)


@functools.lru_cache(maxsize=64)
def _prove_real_layout(dcp, interleave_size, block_size, _fns) -> Certificate:
    from dcp_compile.runtime import layout
    return _prove(dcp, interleave_size, block_size, layout)


def _prove(dcp, interleave_size, block_size, formulas) -> Certificate:
    start = time.perf_counter()
    ctx = domain(dcp, interleave_size, block_size)
    memo = Memo(formulas)
    theorems = tuple(prove_theorem(spec, memo, formulas, ctx) for spec in _THEOREMS)
    return Certificate(dcp, interleave_size, block_size, theorems,
                       seconds=time.perf_counter() - start)


def prove_config(config: DCPConfig, *, formulas=None) -> Certificate:
    """``prove`` for the KV layout of a validated DCPConfig."""
    return prove(config.dcp, config.interleave_size, config.block_size, formulas=formulas)


def theorem_names() -> list[str]:
    return [spec.name for spec in _THEOREMS]


def layout_with(**overrides) -> types.ModuleType:
    """A fresh copy of :mod:`dcp_compile.runtime.layout` with some functions replaced.

    The copy has its own globals, so a replaced ``owner`` is also what its
    ``dcp_active_mask`` and ``slot_mapping`` call — the way to test the prover on a
    deliberately broken formula. The real module is untouched.
    """
    from dcp_compile.runtime import layout
    spec = importlib.util.spec_from_file_location("dcp_compile.runtime._layout_copy", layout.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, fn in overrides.items():
        if name not in layout.__all__:
            raise AttributeError(f"layout has no formula {name!r}")
        setattr(module, name, fn)
    return module
