"""Host-side attention metadata for a batch: the CP-aware slot mapping.

spec (Slot Mapping and KV Cache): ``_compute_slot_mapping_cpu`` with cp_world_size = dcp,
cp_rank and cp_kv_cache_interleave_size. Block-table entry j of a sequence covers the global
positions [j * vblock, (j + 1) * vblock) with vblock = block_size * dcp; every rank of the DCP
group gets the same block table and keeps, in that block, the block_size positions it owns.
A position another rank owns maps to -1 (the cache write then goes to the garbage block), and
so does a padding position (given as -1).

The arithmetic is :func:`dcp_compile.runtime.layout.slot_mapping` / ``local_slot`` evaluated on
tensors — the same functions the graph runs and the proofs prove. This module only adds the
input checks (block ids and position placement are the step contract's rules,
``dcp_compile.runtime.serving.step_contract.SLOT_MAPPING_RULES``): everything is validated before anything is
computed, so a bad input raises ``DCPInputError`` and never yields a partly filled mapping.
"""

from __future__ import annotations

import torch

from dcp_compile.runtime import layout
from dcp_compile.runtime.config import layout_config
from dcp_compile.runtime.errors import DCPConfigError, DCPInputError
from dcp_compile.runtime.garbage_block import LAST
from dcp_compile.runtime.serving.step_contract import SLOT_MAPPING_RULES, StepContract

__all__ = ["compute_slot_mapping"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def compute_slot_mapping(block_table, positions, cp_rank, dcp, block_size, interleave_size,
                         *, num_blocks=None, garbage_block=LAST) -> torch.Tensor:
    """Cache row this rank writes for each token of a batch; -1 where it writes nothing.

    Args:
        block_table: ``[batch, max_blocks]`` ints (tensor, or lists — rows may be ragged and
            are padded with -1); entry j covers positions [j*block_size*dcp,
            (j+1)*block_size*dcp); -1 marks an unallocated entry. A 1-D table with 1-D
            positions is one sequence.
        positions: ``[batch, tokens]`` global positions; -1 marks padding.
        cp_rank: this rank's index in the DCP group, 0 <= cp_rank < dcp.
        num_blocks: cache size; when given, entries must be block ids of the cache other
            than the garbage block (no block table may reference it).
        garbage_block: -1 (the last block, the default) or 0 (the first, vLLM's null block).

    Returns:
        int64 tensor shaped like ``positions``: ``block * block_size + offset`` for the
        positions ``cp_rank`` owns, -1 for the others and for padding.
    """
    _check_sizes(dcp, block_size, interleave_size, num_blocks)
    rank = _check_rank(cp_rank, dcp)
    table = _as_int_tensor(block_table, "block_table", ragged_pad=-1)
    pos = _as_int_tensor(positions, "positions")
    squeeze = table.dim() == 1 and pos.dim() == 1
    if squeeze:
        table, pos = table.unsqueeze(0), pos.unsqueeze(0)
    _check_shapes(table, pos)
    table, pos = table.to(torch.int64), pos.to(torch.int64).to(table.device)

    # Block ids and position placement: the step contract's rules, checked in one place.
    StepContract(num_blocks=num_blocks, block_size=block_size, dcp=dcp,
                 rules=SLOT_MAPPING_RULES, garbage_block=garbage_block).check(None, pos, table)

    kw = dict(dcp=dcp, interleave=interleave_size, block=block_size)
    valid = pos >= 0
    safe_pos = torch.where(valid, pos, torch.zeros_like(pos))
    # Block-table index of each position: its local slot's block (spec: one entry per vblock).
    entry_index = layout.local_slot(safe_pos, **kw) // block_size

    max_blocks = table.shape[1]
    if max_blocks == 0:  # every position is padding (checked above)
        out = torch.full_like(pos, -1)
    else:
        entry = torch.gather(table, 1, entry_index.clamp(max=max_blocks - 1))
        slots = layout.slot_mapping(safe_pos, rank, entry, **kw)
        out = torch.where(valid, slots, torch.full_like(slots, -1))
    return out.squeeze(0) if squeeze else out


# ----------------------------------------------------------------------------------------
# Validation: each check names what is wrong, the values and the fix.
# ----------------------------------------------------------------------------------------


def _check_sizes(dcp, block_size, interleave_size, num_blocks):
    try:
        layout_config(dcp, interleave_size, block_size)
    except DCPConfigError as e:
        raise DCPInputError(str(e)) from e
    if num_blocks is not None and not (_is_int(num_blocks) and num_blocks >= 2):
        raise DCPInputError(f"num_blocks must be an int >= 2 (one usable block besides the "
                            f"garbage block): num_blocks={num_blocks!r}. Pass the number of "
                            f"blocks of the KV cache, or None to skip the block-range check.")


def _check_rank(cp_rank, dcp) -> int:
    if isinstance(cp_rank, torch.Tensor) and cp_rank.dim() == 0 \
            and cp_rank.dtype in _INT_DTYPES:
        cp_rank = int(cp_rank)
    if not _is_int(cp_rank) or not 0 <= cp_rank < dcp:
        raise DCPInputError(f"cp_rank must be an int in [0, dcp): cp_rank={cp_rank!r}, "
                            f"dcp={dcp}. Pass this rank's index in its DCP group "
                            f"(decode: tp_rank % dcp; prefill: tp_rank // (tp // dcp)).")
    return cp_rank


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _as_int_tensor(x, name, ragged_pad=None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x
    else:
        rows = list(x)
        if ragged_pad is not None and rows and all(isinstance(r, (list, tuple))
                                                   for r in rows):
            width = max(len(r) for r in rows)
            rows = [list(r) + [ragged_pad] * (width - len(r)) for r in rows]
        try:
            t = torch.tensor(rows)
        except (TypeError, ValueError, RuntimeError) as e:
            raise DCPInputError(f"{name} must be a rectangular array of ints: {e}. Pass a "
                                f"torch int tensor or equal-length lists of ints.") from e
    if t.numel() == 0 and not t.dtype.is_complex and t.dtype != torch.bool:
        t = t.to(torch.int64)  # an empty list has no element type to check
    if t.dtype not in _INT_DTYPES:
        raise DCPInputError(f"{name} must hold integers: dtype={t.dtype}. Pass an int32/int64 "
                            f"tensor or lists of Python ints.")
    if t.dim() not in (1, 2):
        raise DCPInputError(f"{name} must be 2-D [batch, ...] (or 1-D for one sequence): "
                            f"shape={tuple(t.shape)}. Reshape it.")
    return t


def _check_shapes(table, pos):
    if table.dim() != 2 or pos.dim() != 2 or table.shape[0] != pos.shape[0]:
        raise DCPInputError(f"block_table and positions must both be [batch, ...] with the "
                            f"same batch: block_table shape={tuple(table.shape)}, positions "
                            f"shape={tuple(pos.shape)}. Pass one block-table row per "
                            f"sequence (or 1-D for both).")
