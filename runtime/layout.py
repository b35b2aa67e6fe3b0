"""The DCP layout formulas, each written exactly once.

Every function here is one body of plain arithmetic (``//``, ``%``, ``*``, ``+``, ``-``) plus
the three helpers ``clamp``, ``indicator_eq`` and ``select``. The caller's values decide what
it computes:

* Python ints      -> host metadata (slot mapping, cache scatter/gather, transfer plans),
* torch tensors    -> the emitted graph (traceable, static shapes, no branch on a value),
* sympy integers   -> the proofs in :mod:`dcp_compile.passes.prove.theorems`, which therefore prove the
  very code that runs.

Notation of the specification: ``W`` = dcp (``cp_world_size``), ``I`` = ``interleave_size``,
``B`` = ``block_size``, ``vblock = B * W``, ``stride = I * W``, ``R`` = ``cp_rank``.
Positions are global token positions within one sequence; a *local slot* is the index of a
token inside one rank's shard of that sequence (dense: 0, 1, 2, ...).
"""

from __future__ import annotations

import builtins
import sys

import torch

__all__ = [
    "clamp",
    "indicator_eq",
    "select",
    "owner",
    "local_filled",
    "query_local_bound",
    "dcp_active_mask",
    "local_slot",
    "global_position",
    "physical_slot",
    "slot_mapping",
    "interleave_slice_index",
    "q_unshuffle_index",
]


# ----------------------------------------------------------------------------------------
# The three helpers that plain operators do not cover for all three kinds of values.
# ----------------------------------------------------------------------------------------


def _is_tensor(*xs) -> bool:
    return builtins.any(isinstance(x, torch.Tensor) for x in xs)


def _is_sympy(*xs) -> bool:
    # Only the proofs pass sympy values, and they import sympy first: a process that runs
    # programs (a rank) never pays for importing it.
    sympy = sys.modules.get("sympy")
    return sympy is not None and builtins.any(isinstance(x, sympy.Basic) for x in xs)


def clamp(x, lo=None, hi=None):
    """min(max(x, lo), hi) for ints, tensors and sympy expressions."""
    if _is_tensor(x):
        return torch.clamp(x, min=lo, max=hi)
    if _is_sympy(x, lo, hi):
        import sympy
        # Unevaluated: sympy's own Max/Min simplification queries its assumption system
        # (tens of ms a call); the prover decides them on its integer boxes instead.
        if lo is not None:
            x = sympy.Max(x, lo, evaluate=False)
        if hi is not None:
            x = sympy.Min(x, hi, evaluate=False)
        return x
    if lo is not None:
        x = builtins.max(x, lo)
    if hi is not None:
        x = builtins.min(x, hi)
    return x


def indicator_eq(a, b):
    """1 where a == b, else 0 (an int64 tensor inside graphs, never a Python bool branch)."""
    if _is_tensor(a, b):
        a_t = a if isinstance(a, torch.Tensor) else torch.as_tensor(a)
        return torch.eq(a_t, b).to(torch.int64)
    if _is_sympy(a, b):
        import sympy
        diff = sympy.sympify(a) - sympy.sympify(b)
        if diff.is_Number:
            return sympy.Integer(1 if diff == 0 else 0)
        # Left to the prover to decide on its integer boxes (no sympy.simplify: too slow).
        return sympy.Piecewise((1, sympy.Eq(diff, 0, evaluate=False)), (0, True))
    return int(a == b)


def select(mask01, if_one, if_zero):
    """``if_one`` where mask01 == 1, ``if_zero`` where it is 0 — pure arithmetic.

    Written as ``m * a + (1 - m) * b`` so that ints, tensors and sympy share it; callers pass
    finite values only (an inf would turn 0 * inf into NaN).
    """
    return mask01 * if_one + (1 - mask01) * if_zero


# ----------------------------------------------------------------------------------------
# Ownership (spec: "Active Token Handling and dcp_active_mask", "Slot Mapping and KV Cache")
# ----------------------------------------------------------------------------------------


def owner(pos, *, dcp, interleave, block):
    """The cp_rank whose KV shard holds global position ``pos``.

    spec: pos_in_vblock = N - floor(N / vblock) * vblock;
          owner = floor(pos_in_vblock / interleave_size) % dcp_size
    """
    vblock = block * dcp
    pos_in_vblock = pos - (pos // vblock) * vblock
    return (pos_in_vblock // interleave) % dcp


def local_filled(n, rank, *, dcp, interleave, block):
    """How many of the first ``n`` positions live in ``rank``'s shard (spec: local_filled)."""
    vblock = block * dcp
    stride = interleave * dcp
    rank_start = rank * interleave
    full = n // vblock
    filled = full * block
    remaining = n - full * vblock
    filled = filled + (remaining // stride) * interleave
    leftover = remaining - (remaining // stride) * stride
    return filled + clamp(clamp(leftover - rank_start, lo=0), hi=interleave)


def query_local_bound(n, offset, rank, *, dcp, interleave, block):
    """Local slots of ``rank`` that the query at position ``n + offset`` attends (a width-K
    decode step: row positions n, n+1, ..., n+K-1; ``offset`` < K).

    After the step's owners wrote its tokens, the rank's shard holds, in its dense local
    slots, every position it owns up to the row's end; the query at ``n + offset`` may read
    exactly the owned positions at or below its own: the first ``local_filled(n + offset + 1)``
    slots. Counted from the query's own position, never from the row's end: local(G - k) is
    not local(G) - k when the k later tokens belong to other ranks (theorem
    query_local_bound_is_causal).
    """
    return local_filled(n + offset + 1, rank, dcp=dcp, interleave=interleave, block=block)


def dcp_active_mask(n, rank, *, dcp, interleave, block):
    """1 on the rank that owns position ``n`` (the active decode token), 0 elsewhere."""
    return indicator_eq(owner(n, dcp=dcp, interleave=interleave, block=block), rank)


def local_slot(pos, *, dcp, interleave, block):
    """Local slot of global position ``pos`` in its owner's shard.

    vLLM's CP slot mapping: block_table_index * block_size + block_offset with
    block_offset = (pos_in_vblock // (W*I)) * I + pos_in_vblock % I.
    """
    vblock = block * dcp
    stride = interleave * dcp
    block_index = pos // vblock
    pos_in_vblock = pos - block_index * vblock
    block_offset = (pos_in_vblock // stride) * interleave + pos_in_vblock % interleave
    return block_index * block + block_offset


def global_position(slot, rank, *, dcp, interleave):
    """Global position of local slot ``slot`` in ``rank``'s shard.

    spec (Segmented Attention CP): prior slot s -> (s // I) * (W * I) + R * I + (s % I).
    """
    return (slot // interleave) * (dcp * interleave) + rank * interleave + slot % interleave


def physical_slot(slot, block_table_entry, *, block):
    """Cache row of local slot ``slot``: the block the table names for it, plus the offset."""
    return block_table_entry * block + slot % block


def slot_mapping(pos, rank, block_table_entry, *, dcp, interleave, block):
    """Cache row this rank writes for position ``pos``; -1 where another rank owns it.

    ``block_table_entry`` is the block-table entry of ``local_slot(pos) // block`` (the same
    table on every rank: entry j covers global positions [j*vblock, (j+1)*vblock)).
    Arithmetic, not a branch: mask * (row + 1) - 1.
    """
    mask = dcp_active_mask(pos, rank, dcp=dcp, interleave=interleave, block=block)
    row = physical_slot(local_slot(pos, dcp=dcp, interleave=interleave, block=block),
                        block_table_entry, block=block)
    return mask * (row + 1) - 1


# ----------------------------------------------------------------------------------------
# Prefill DCP: interleave slice and Q unshuffle (spec: "Model Runner", "Compute Pattern")
# ----------------------------------------------------------------------------------------


def interleave_slice_index(j, rank, *, dcp, interleave):
    """Chunk index of the j-th token ``rank`` keeps after the interleave slice.

    The spec's ``x.view(S // (W*I), W, I)[:, R, :].reshape(-1)`` keeps, in order, the tokens
    whose (index // I) % W == R; its j-th element is this index. (Same arithmetic as
    ``global_position``: the slice is the slot map relative to the chunk start.)
    """
    return (j // interleave) * (dcp * interleave) + rank * interleave + j % interleave


def q_unshuffle_index(p, chunk_len, *, dcp, interleave):
    """Row of the cp_kv all-gathered Q (rank-major: [W, S/W]) that holds chunk index ``p``.

    Gathered row r * (S/W) + j holds chunk index interleave_slice_index(j, r); this is its
    inverse, so ``gathered[q_unshuffle_index(arange(S))]`` is in chunk order.
    """
    stride = dcp * interleave
    r = (p % stride) // interleave
    j = (p // stride) * interleave + p % interleave
    return r * (chunk_len // dcp) + j
