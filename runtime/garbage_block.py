"""Which cache block is the garbage block: the one definition every user of it reads.

Every masked cache write (padding, positions another rank owns, unallocated entries) lands in
one reserved block that no block table names and attention never reads. Where it sits is a
setting, ``garbage_block``, read as a Python index into the cache's blocks:

  -1  the last block, ``num_blocks - 1`` (the project's own engine, the default);
   0  the first block (vLLM, whose block 0 is its null block: its allocator never hands it
      out, and it hands out the last one).

The functions below are plain arithmetic, so the same body serves host ints (the allocator,
the step contract) and tensors (the write op, the attention kernels, the lowering).
"""

from __future__ import annotations

from dcp_compile.runtime.errors import DCPConfigError

LAST = -1
FIRST = 0
GARBAGE_BLOCKS = (LAST, FIRST)


def check_garbage_block(garbage_block) -> int:
    """``garbage_block`` itself, or DCPConfigError naming the allowed values."""
    if isinstance(garbage_block, bool) or garbage_block not in GARBAGE_BLOCKS:
        raise DCPConfigError(
            f"garbage_block must be -1 (the last cache block, dcp_compile's engine) or 0 (the "
            f"first, vLLM's null block): garbage_block={garbage_block!r}. Pass -1 or 0.")
    return garbage_block


def garbage_block_id(num_blocks, garbage_block: int = LAST):
    """The garbage block's id in a cache of ``num_blocks`` blocks."""
    return garbage_block % num_blocks


def usable_block(entry, num_blocks, garbage_block: int = LAST):
    """Whether a block-table entry names a block a sequence may hold: an id in the cache
    that is not the garbage block (-1, the garbage block and ids past the cache are not)."""
    return (entry >= 0) & (entry < num_blocks) \
        & (entry != garbage_block_id(num_blocks, garbage_block))


def usable_blocks(num_blocks: int, garbage_block: int = LAST) -> list[int]:
    """Every block id an allocator may hand out, lowest first."""
    garbage = garbage_block_id(num_blocks, garbage_block)
    return [b for b in range(num_blocks) if b != garbage]
