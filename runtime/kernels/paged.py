"""Paged-cache addressing, shared by every writer and reader of a paged cache.

The flat row a token's write lands in (``write_rows``: the attention's cache write and the
DSA indexer's), and the local slots a rank reads with their global positions
(``prior_slots``: partial_attention and the DSA indexer's scores), so that their key axes
agree.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dcp_compile.runtime import layout
from dcp_compile.runtime.garbage_block import LAST, garbage_block_id
from dcp_compile.runtime.kernels.live_attention import readable_table


def write_rows(key_cache: Tensor, slots: Tensor, garbage_block: int = LAST) -> Tensor:
    """Flat cache row each token is written to (shared by cache_write and cache_write_)."""
    num_blocks, block = key_cache.shape[:2]
    garbage = garbage_block_id(num_blocks, garbage_block)
    garbage_row = garbage * block
    # Slot -1, and any slot outside the usable blocks (a block id the cache does not have, or
    # the garbage block itself), lands in the garbage block: a write never reaches a block
    # its table does not name, whatever the inputs.
    usable = (slots >= 0) & (slots < num_blocks * block) & (slots // block != garbage)
    return torch.where(usable, slots, torch.full_like(slots, garbage_row)).reshape(-1)


def prior_slots(block_table: Tensor, num_blocks: int, block: int, prior_len: Tensor,
                rank: Tensor, dcp: int, interleave: int,
                garbage_block: int = LAST) -> tuple[Tensor, Tensor, Tensor]:
    """(local, table, prior_pos): this rank's local slots ``[0, max_blocks * block)``, the
    block table with unusable entries pointing at the garbage block (readable_table), and
    each row's prior slot's global position, -1 where the slot is not a readable prior key.

    Prior keys are the local slots [0, prior_len) of each sequence, read from the paged cache
    with a static shape (every slot the block table can address), validity masked. Only
    entries naming a usable block are read; -1 (unallocated), the garbage block and ids
    beyond the cache read the garbage block instead and are masked out, never block 0.
    ``prior_len`` [b]: one bound per row; [b, i]: one per query (the row's widest bound
    here, each query's own applied by the reader). Shared by every reader of a paged cache
    (partial_attention, the DSA indexer's index_scores), so their key axes agree."""
    batch, max_blocks = block_table.shape
    local = torch.arange(max_blocks * block, device=block_table.device)
    usable, table = readable_table(block_table, num_blocks, garbage_block)
    allocated = usable[:, local // block]
    prior_global = layout.global_position(local, rank, dcp=dcp, interleave=interleave)
    row_len = prior_len.amax(dim=1) if prior_len.dim() == 2 else prior_len
    prior_valid = (local.unsqueeze(0) < row_len.unsqueeze(1)) & allocated
    prior_pos = torch.where(prior_valid, prior_global.unsqueeze(0).expand(batch, -1),
                            torch.full_like(allocated, -1, dtype=torch.int64))
    return local, table, prior_pos
