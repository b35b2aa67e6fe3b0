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
               for what, dim in (("conv channels", s.conv[0] if s.conv else None),
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
        conv = None if layer.conv is None else (slots, layer.conv[0] // self.tp, *layer.conv[1:])
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
    """Which state slot each live sequence holds (the engine's; docs/hybrid.md): a sequence
    gets the lowest free slot at its first step and keeps it until ``free`` (the request
    finished). A slot handed to a new sequence needs no clearing: its first step is fresh and
    reads a zero state."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise DCPConfigError(f"state slots: num_slots={num_slots}. Use num_slots >= 1.")
        self.num_slots = num_slots
        self.of: dict[int, int] = {}            # sequence -> slot

    def slot(self, seq: int) -> int:
        """``seq``'s slot, given at its first call."""
        if seq not in self.of:
            free = sorted(set(range(self.num_slots)) - set(self.of.values()))
            if not free:
                raise DCPConfigError(
                    f"no free recurrent-state slot for sequence {seq}: all {self.num_slots} "
                    f"are held by sequences {sorted(self.of)}. Finish a request first "
                    f"(Engine.finish), or build the program with a larger batch.")
            self.of[seq] = free[0]
        return self.of[seq]

    def free(self, seq: int) -> None:
        """``seq`` finished: its slot goes back (nothing is cleared)."""
        self.of.pop(seq, None)

    def step_slots(self, seqs: list[int | None], new_tokens: list[int]) -> torch.Tensor:
        """``state_slot [B]`` of a step: each row with tokens its sequence's slot, -1 for a
        row without tokens (padding, or a sequence that sits the step out)."""
        return torch.tensor([self.slot(s) if s is not None and k else -1
                             for s, k in zip(seqs, new_tokens)], dtype=torch.int64)
