"""Context buckets: the static context lengths a program is compiled for.

A static-shape backend (XLA, Neuron) reads every cache slot its block table can address, so a
program built for the longest context makes a short request pay for the longest one. A
*bucket* is a context length in tokens; the program holds one graph per (step kind, bucket)
over one set of weights, each with a block table of ``bucket / (block_size * dcp)`` entries
(one entry per vblock), and a step runs in the smallest bucket that holds every sequence of
its batch after the step. The program's full capacity (``max_blocks`` vblocks) is always the
last bucket, so a program without buckets is the one-bucket case.

Executors tell the bucket of a step by its block table's width (``bucket_of_width``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from dcp_compile.runtime.errors import DCPConfigError, DCPInputError


def vblock_tokens(block_size: int, dcp: int) -> int:
    """Tokens one block-table entry covers (a virtual block: one block on each DCP rank)."""
    return block_size * dcp


def bucket_width(bucket: int, *, block_size: int, dcp: int) -> int:
    """Block-table entries of a bucket of ``bucket`` tokens."""
    return bucket // vblock_tokens(block_size, dcp)


def bucket_of_width(width: int, *, block_size: int, dcp: int) -> int:
    """The bucket (tokens) whose block table has ``width`` entries."""
    return width * vblock_tokens(block_size, dcp)


def check_buckets(buckets: Iterable[int] | None, *, block_size: int, dcp: int,
                  max_blocks: int) -> tuple[int, ...]:
    """The sorted, distinct buckets with the full capacity (``max_blocks`` vblocks) last.

    Raises DCPConfigError for a bucket that is not a positive multiple of the vblock
    (``block_size * dcp`` tokens: a block table has whole entries) or exceeds the capacity
    (the cache and the largest block table are built for ``max_blocks`` vblocks)."""
    vblock = vblock_tokens(block_size, dcp)
    capacity = max_blocks * vblock
    given = list(buckets or [])
    bad = [b for b in given if not (isinstance(b, int) and not isinstance(b, bool)
                                    and b > 0 and b % vblock == 0)]
    if bad:
        raise DCPConfigError(
            f"context buckets must be positive multiples of the vblock (block_size * dcp = "
            f"{block_size} * {dcp} = {vblock} tokens): got {bad} in {given}. Round each up "
            f"to a multiple of {vblock}, e.g. {[_round_up(b, vblock) for b in bad]}.")
    over = [b for b in given if b > capacity]
    if over:
        raise DCPConfigError(
            f"context buckets exceed the program's capacity (max_blocks * block_size * dcp "
            f"= {max_blocks} * {vblock} = {capacity} tokens): got {over}. Drop them or build "
            f"with StepShapes(max_blocks >= {max(over) // vblock}).")
    return tuple(sorted(set(given) | {capacity}))


def smallest_bucket(buckets: Sequence[int], tokens: int) -> int:
    """The smallest bucket holding ``tokens`` context tokens (``buckets`` sorted)."""
    for b in buckets:
        if tokens <= b:
            return b
    raise DCPInputError(
        f"a sequence of this step reaches {tokens} tokens, more than the largest context "
        f"bucket {buckets[-1]}: buckets {list(buckets)}. Build the program with a larger "
        f"max_blocks (StepShapes) or finish the sequence earlier.")


def _round_up(x, m):
    return -(-x // m) * m if isinstance(x, int) and x > 0 else m
