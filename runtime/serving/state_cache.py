"""The recurrent-state cache of a hybrid model: per recurrent layer, one conv state and (but
for a short conv) one recurrent state per sequence slot, plus the garbage slot
(runtime/kernels/recurrent.py). Beside the paged KV cache, laid out the anchors' way
(docs/hybrid.md): replicated over the DCP group (its size does not depend on dcp: the
state is O(1) in the context) and cut by the layer's heads over TP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcp_compile.runtime.errors import DCPConfigError


@dataclass(frozen=True)
class StateLayer:
    """One recurrent layer's state per sequence, unsharded: ``conv`` ``[C, K-1]`` (channels
    first) or None (no convolution: MiniMax's lightning attention), ``rec`` ``[heads, ...]``
    (heads first) or None (a convolution only)."""

    layer: int
    conv: tuple[int, ...] | None
    rec: tuple[int, ...] | None = None
    # conv channels every rank holds whole when the layer is cut (a one-group Mamba2's B
    # and C: passes/placement/recurrent.py); the others are cut tp ways
    conv_whole: int = 0


@dataclass(frozen=True)
class StateCacheSpec:
    """Every recurrent layer's state cache of one rank: ``num_slots`` sequences + the
    garbage slot; channels and heads cut ``tp`` ways (1: replicated weights)."""

    layers: tuple[StateLayer, ...]
    num_slots: int
    tp: int = 1
    conv_dtype: torch.dtype = torch.float32
    rec_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        bad = [f"layer {s.layer}: {what} {dim}" for s in self.layers
               for what, dim in (("conv channels", s.conv[0] - s.conv_whole if s.conv else None),
                                 ("heads", s.rec[0] if s.rec else None))
               if dim is not None and dim % self.tp]
        if self.num_slots < 1 or bad:
            raise DCPConfigError(
                f"recurrent state cache: num_slots={self.num_slots}, tp={self.tp}"
                f"{' does not divide ' + ', '.join(bad) if bad else ''}. Use num_slots >= 1 "
                f"and a tp dividing every recurrent layer's heads (or tp=1: replicated).")

    def shapes(self, layer: StateLayer) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(conv cache shape, recurrent cache shape or None) of one rank."""
        slots = self.num_slots + 1
        conv = None if layer.conv is None else (
            slots, (layer.conv[0] - layer.conv_whole) // self.tp + layer.conv_whole,
            *layer.conv[1:])
        rec = None if layer.rec is None else (slots, layer.rec[0] // self.tp, *layer.rec[1:])
        return conv, rec

    def bytes_per_rank(self) -> int:
        """Bytes of every state cache of one rank (garbage slot included); the same for
        every dcp."""
        total = 0
        for layer in self.layers:
            conv, rec = self.shapes(layer)
            total += _numel(conv) * _elem(self.conv_dtype) if conv is not None else 0
            total += _numel(rec) * _elem(self.rec_dtype) if rec is not None else 0
        return total

    def input_order(self) -> list[tuple[int, str]]:
        """(layer, "conv" | "rec") of each state cache in a program's calling convention:
        every layer's conv cache in layer order, then every recurrence cache."""
        return [(s.layer, "conv") for s in self.layers if s.conv is not None] + \
            [(s.layer, "rec") for s in self.layers if s.rec is not None]

    def allocate_inputs(self, device=None) -> list[torch.Tensor]:
        """Zeroed caches in the program's input order (``input_order``)."""
        caches = self.allocate(device)
        return [caches[layer][0 if kind == "conv" else 1] for layer, kind in self.input_order()]

    def allocate(self, device=None) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """Zeroed caches: layer -> (conv state, recurrent state or None)."""
        out = {}
        for layer in self.layers:
            conv, rec = self.shapes(layer)
            out[layer.layer] = (
                None if conv is None else torch.zeros(conv, dtype=self.conv_dtype, device=device),
                None if rec is None else torch.zeros(rec, dtype=self.rec_dtype, device=device))
        return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def state_rows(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fresh [B] bool, lengths [B] int64) of a step's left-packed rows, from its positions:
    a row starts its sequence when its first position is 0, and holds as many tokens as it
    has positions >= 0 (padding is -1). What a hybrid step's ``state_fresh`` and
    ``state_lengths`` inputs are (the recurrent ops read them; step contract: state-fresh)."""
    return positions[:, 0] == 0, (positions >= 0).sum(-1).to(torch.int64)


class StateSlots:
    """Which state slots each live sequence holds (the engine's; docs/hybrid.md): a sequence
    gets the ``width`` lowest free slots at its first step and keeps them until ``free`` (the
    request finished). One is its live slot (its state after its last token); with
    ``width`` K > 1 (speculative width-K steps) the other K-1 are spares, where a width-K
    step keeps the state after each of the row's tokens but its last
    (``snapshot_slots``); a rejected draft then rolls back by making the accepted token's
    snapshot the live slot (``roll_back``: no copy, no recomputation). A slot handed to a new
    sequence needs no clearing: its first step is fresh and reads a zero state."""

    def __init__(self, num_slots: int, width: int = 1):
        if num_slots < 1 or width < 1 or num_slots < width:
            raise DCPConfigError(f"state slots: num_slots={num_slots}, width={width}. Use "
                                 f"num_slots >= width >= 1.")
        self.num_slots, self.width = num_slots, width
        self.of: dict[int, int] = {}            # sequence -> live slot
        self.spares: dict[int, list[int]] = {}  # sequence -> its width - 1 spare slots
        # sequence -> {length: slot holding its state after `length` tokens}, kept by its
        # last width-K step
        self.snapshots: dict[int, dict[int, int]] = {}

    def slot(self, seq: int) -> int:
        """``seq``'s live slot; its ``width`` slots are given at its first call."""
        if seq not in self.of:
            held = set(self.of.values()) | {x for sp in self.spares.values() for x in sp}
            free = sorted(set(range(self.num_slots)) - held)
            if len(free) < self.width:
                raise DCPConfigError(
                    f"no free recurrent-state slot for sequence {seq}: all {self.num_slots} "
                    f"are held by sequences {sorted(self.of)} ({self.width} each). Finish a "
                    f"request first (Engine.finish), or build the program with a larger "
                    f"batch.")
            self.of[seq], self.spares[seq] = free[0], free[1:self.width]
        return self.of[seq]

    def free(self, seq: int) -> None:
        """``seq`` finished: its slots go back (nothing is cleared)."""
        self.of.pop(seq, None)
        self.spares.pop(seq, None)
        self.snapshots.pop(seq, None)

    def step_slots(self, seqs: list[int | None], new_tokens: list[int]) -> torch.Tensor:
        """``state_slot [B]`` of a step: each row with tokens its sequence's slot, -1 for a
        row without tokens (padding, or a sequence that sits the step out)."""
        return torch.tensor([self.slot(s) if s is not None and k else -1
                             for s, k in zip(seqs, new_tokens)], dtype=torch.int64)

    def snapshot_slots(self, seqs: list[int | None], starts: list[int],
                       new_tokens: list[int], width: int) -> torch.Tensor:
        """``state_snapshot_slot [B, width]`` of a width-K step: row b's token t (but its
        last, whose state goes to the live slot) keeps its state in its sequence's spare
        ``t``; -1 elsewhere. Records them: ``roll_back(seq, starts[b] + t + 1)`` may follow."""
        snap = torch.full((len(seqs), width), -1, dtype=torch.int64)
        for b, (s, start, k) in enumerate(zip(seqs, starts, new_tokens)):
            if s is None or not k:
                continue
            self.slot(s)
            if k > self.width:
                raise DCPConfigError(
                    f"sequence {s}: a step of {k} tokens keeps {k - 1} state snapshots, its "
                    f"sequence holds {self.width - 1} spare slots. Build the program with "
                    f"StepShapes(decode_len >= {k}).")
            spares = self.spares[s]
            snap[b, :k - 1] = torch.tensor(spares[:k - 1], dtype=torch.int64)
            self.snapshots[s] = {start + t + 1: spares[t] for t in range(k - 1)}
        return snap

    def roll_back(self, seq: int, length: int) -> bool:
        """Continue ``seq`` from its state after ``length`` tokens, kept by its last width-K
        step: that snapshot's slot becomes live and the old live slot a spare. False: no
        snapshot of that length is kept."""
        kept = self.snapshots.pop(seq, {})
        if length not in kept:
            return False
        slot = kept[length]
        spares = self.spares[seq]
        spares[spares.index(slot)] = self.of[seq]
        self.of[seq] = slot
        return True


class StateCheckpoints:
    """Prefix caching's recurrent-state checkpoints (the engine's; docs/hybrid.md): the slots
    ``[first, first + count)`` of the state cache, each holding the state after a full vblock
    prefix of some prompt, keyed by that vblock's chained hash (the prefix cache's key,
    ``BlockAllocator._hashes``). A checkpoint lives while the prefix cache holds its vblock:
    ``sync`` frees those whose hash it no longer holds (evicted, or written again)."""

    def __init__(self, first: int, count: int):
        self.first, self.count = first, count
        self.of_hash: dict[int, int] = {}       # vblock hash -> slot
        self.taken = 0                          # checkpoints written
        self.used = 0                           # checkpoints a request resumed from

    def sync(self, cached) -> None:
        """Free the checkpoints of vblocks the prefix cache no longer holds (``cached``: its
        hashes)."""
        for h in [h for h in self.of_hash if h not in cached]:
            del self.of_hash[h]

    def plan(self, hashes_per_row: list[list[int]], vblock: int,
             width: int) -> tuple[torch.Tensor, dict[int, int]]:
        """``state_snapshot_slot [B, width]`` of a context step whose row b starts a prompt
        with full vblocks ``hashes_per_row[b]``: the state after vblock j's last token (index
        ``(j + 1) * vblock - 1``) goes to a free checkpoint slot, once per hash not already
        kept; and the new hash -> slot entries (``keep`` them once the step ran). No free
        slot: that vblock gets no checkpoint (a later request reuses a shorter prefix)."""
        snap = torch.full((len(hashes_per_row), width), -1, dtype=torch.int64)
        new: dict[int, int] = {}
        free = sorted(set(range(self.first, self.first + self.count)) -
                      set(self.of_hash.values()))
        for b, hashes in enumerate(hashes_per_row):
            for j, h in enumerate(hashes):
                if h in self.of_hash or h in new or not free:
                    continue
                new[h] = free.pop(0)
                snap[b, (j + 1) * vblock - 1] = new[h]
        return snap, new

    def keep(self, new: dict[int, int]) -> None:
        self.of_hash.update(new)
        self.taken += len(new)

    def longest(self, hashes: list[int], cached) -> int:
        """Vblocks of the longest prefix of ``hashes`` (a prompt's vblocks) the prefix cache
        holds whole (``cached``: its hashes) and whose last vblock has a checkpoint."""
        m = 0
        for j, h in enumerate(hashes):
            if h not in cached:
                break
            if h in self.of_hash:
                m = j + 1
        return m
