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
    first), ``rec`` ``[heads, ...]`` (heads first) or None (a convolution only)."""

    layer: int
    conv: tuple[int, ...]
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
               for what, dim in (("conv channels", s.conv[0]),
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
        conv = (slots, layer.conv[0] // self.tp, *layer.conv[1:])
        rec = None if layer.rec is None else (slots, layer.rec[0] // self.tp, *layer.rec[1:])
        return conv, rec

    def bytes_per_rank(self) -> int:
        """Bytes of every state cache of one rank (garbage slot included); the same for
        every dcp."""
        total = 0
        for layer in self.layers:
            conv, rec = self.shapes(layer)
            total += _numel(conv) * _elem(self.conv_dtype)
            total += _numel(rec) * _elem(self.rec_dtype) if rec is not None else 0
        return total

    def allocate(self, device=None) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """Zeroed caches: layer -> (conv state, recurrent state or None)."""
        out = {}
        for layer in self.layers:
            conv, rec = self.shapes(layer)
            out[layer.layer] = (
                torch.zeros(conv, dtype=self.conv_dtype, device=device),
                None if rec is None else torch.zeros(rec, dtype=self.rec_dtype, device=device))
        return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
