"""How a recurrent op reads and writes each row's state slot (runtime/kernels/recurrent.py's
module doc; docs/hybrid.md): the garbage slot, the slot each row touches, a fresh row's zero
state and the writes of the end states and of a speculative step's snapshots. Shared by the
recurrent ops' modules (recurrent.py, rg_lru.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def garbage_state_slot(state_cache: Tensor) -> int:
    """The garbage slot of a state cache: its last entry."""
    return state_cache.shape[0] - 1


def state_rows(state_cache: Tensor, state_slot: Tensor) -> Tensor:
    """The cache entry each row reads and writes: its slot, or the garbage slot for -1 and
    any slot outside the usable entries."""
    garbage = garbage_state_slot(state_cache)
    usable = (state_slot >= 0) & (state_slot < garbage)
    return torch.where(usable, state_slot, torch.full_like(state_slot, garbage)).long()


def _read_state(cache: Tensor, rows: Tensor, fresh: Tensor, usable: Tensor) -> Tensor:
    """Each row's incoming state: zeros for a fresh sequence or a padding row."""
    state = cache[rows]
    keep = (usable & ~fresh.bool()).view(-1, *([1] * (state.dim() - 1)))
    return torch.where(keep, state, torch.zeros_like(state))


def _write_states(cache: Tensor, rows: Tensor, end: Tensor, snapshot_slot: Tensor | None,
                  per_token: Tensor | None) -> Tensor:
    """``cache`` with each row's end state at its row, then (speculative steps) the state
    after token t of row b at ``snapshot_slot[b, t]`` (-1: none; the garbage slot)."""
    cache = cache.index_put((rows,), end.to(cache.dtype))
    if snapshot_slot is None:
        return cache
    at = state_rows(cache, snapshot_slot.reshape(-1))
    return cache.index_put((at,), per_token.reshape(-1, *per_token.shape[2:]).to(cache.dtype))
