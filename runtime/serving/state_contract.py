"""The step contract's recurrent-state rules (``state-*`` rows of
``dcp_compile.runtime.serving.step_contract.RULES``): a hybrid model's step hands each row
its recurrent-state slot and whether it starts its sequence (runtime/kernels/recurrent.py);
these rules keep every row to its own sequence's state. Each returns None, or
(index, message) for its first violation; none runs on a step without ``state_slot``."""

from __future__ import annotations

import torch

from dcp_compile.runtime.names import STATE_FRESH, STATE_SLOT, STATE_SNAPSHOT_SLOT
from dcp_compile.runtime.serving.contract_text import _el, _first, _more, _msg


def _state_slot_range(c, s):
    if s.state_slot is None:
        return None
    slot = s.state_slot
    if not isinstance(slot, torch.Tensor) or slot.dtype != torch.int64 or \
            tuple(slot.shape) != (s.positions.shape[0],):
        got = (f"{slot.dtype} {list(slot.shape)}" if isinstance(slot, torch.Tensor)
               else type(slot).__name__)
        return (STATE_SLOT,), _msg(f"{STATE_SLOT} is {got}", "a hybrid step's state_slot is "
                                   "an int64 tensor [batch]",
                                   "Pass torch.as_tensor(slots, dtype=torch.int64), one per row")
    top = c.num_state_slots
    hit = _first((slot < -1) | (slot >= top) if top is not None else slot < -1)
    if hit is None:
        return None
    (b,), n = hit
    return (b,), _msg(
        f"{_el(STATE_SLOT, (b,))} = {int(slot[b])}{_more(n)} is outside the state cache",
        f"a row's state slot is in [0, {top if top is not None else 'num_state_slots'}) or "
        f"-1 for a padding row (the last entry is the garbage slot, which no row names)",
        "Give each sequence a slot when it starts and free it when it ends")


def _shared_state_slot(c, s):
    if s.state_slot is None or s.state_slot.numel() < 2:
        return None
    slot = s.state_slot
    same = (slot[:, None] == slot[None, :]) & (slot[:, None] >= 0)
    same &= torch.arange(slot.numel())[:, None] > torch.arange(slot.numel())[None, :]
    hit = _first(same)
    if hit is None:
        return None
    (b, a), n = hit
    return (b,), _msg(
        f"{_el(STATE_SLOT, (b,))} = {int(slot[b])} is also {_el(STATE_SLOT, (a,))}",
        "a recurrent state belongs to one sequence: two rows of a step never share a slot "
        "(each would overwrite the other's state)", f"Give row {b} its own slot")


def _state_slot_of_rows(c, s):
    if s.state_slot is None:
        return None
    real = (s.positions >= 0).any(dim=1)
    hit = _first(real != (s.state_slot >= 0))
    if hit is None:
        return None
    (b,), n = hit
    what = ("has tokens and no state slot (its state would go to the garbage slot and be "
            "lost)" if bool(real[b]) else "is padding (no tokens) and names a state slot")
    return (b,), _msg(f"row {b} ({_el(STATE_SLOT, (b,))} = {int(s.state_slot[b])}){_more(n)} "
                      f"{what}", "a row with tokens has its sequence's slot; a padding row "
                      "has -1", "Set the row's slot, or -1 for a padding row")


def _state_fresh(c, s):
    if s.state_slot is None or s.fresh is None:
        return None
    first = s.positions[:, 0]
    starts = first == 0
    bad = (first >= 0) & (s.fresh.bool() != starts)
    hit = _first(bad)
    if hit is None:
        return None
    (b,), n = hit
    return (b,), _msg(
        f"{_el(STATE_FRESH, (b,))} = {bool(s.fresh[b])}{_more(n)} for a row starting at "
        f"position {int(first[b])}",
        "a row reads a zero state exactly when it starts its sequence (position 0): fresh "
        "later would drop the state, not fresh at 0 would read a finished sequence's state",
        "Set fresh = (positions[:, 0] == 0)")


def _snapshot_slots(c, s):
    if s.snapshot_slot is None:
        return None
    snap, pos = s.snapshot_slot, s.positions
    if not isinstance(snap, torch.Tensor) or snap.dtype != torch.int64 or snap.shape != pos.shape:
        got = (f"{snap.dtype} {list(snap.shape)}" if isinstance(snap, torch.Tensor)
               else type(snap).__name__)
        return (STATE_SNAPSHOT_SLOT,), _msg(
            f"{STATE_SNAPSHOT_SLOT} is {got}", f"a width-K step's snapshot slots are an int64 "
            f"tensor shaped like positions {list(pos.shape)}", "Pass one slot per token, -1 "
            "where no snapshot is kept")
    top = c.num_state_slots
    named = snap >= 0
    bad = (snap < -1) | (named & (pos < 0))
    if top is not None:
        bad |= snap >= top
    hit = _first(bad)
    if hit is not None:
        (b, t), n = hit
        why = "names a padding token" if int(snap[b, t]) >= 0 and int(pos[b, t]) < 0 else \
            "is outside the state cache"
        return (b, t), _msg(f"{_el(STATE_SNAPSHOT_SLOT, (b, t))} = {int(snap[b, t])}{_more(n)} "
                            f"{why}", "a snapshot slot is a slot of the cache, or -1 (and -1 "
                            "on padding)", "Give each draft position of a real row a free slot")
    taken = snap[named]
    if s.state_slot is not None:
        taken = torch.cat([s.state_slot[s.state_slot >= 0], taken])
    if taken.numel() != torch.unique(taken).numel():
        values, counts = torch.unique(taken, return_counts=True)
        dup = int(values[counts > 1][0])
        where = _first(snap == dup)
        return where[0], _msg(
            f"{_el(STATE_SNAPSHOT_SLOT, where[0])} = {dup} is named twice in the step (by "
            f"another snapshot or as a row's state slot)", "each snapshot keeps one "
            "position's state: it never shares a slot with another snapshot or a live "
            "sequence", "Give each snapshot its own free slot")
    return None
