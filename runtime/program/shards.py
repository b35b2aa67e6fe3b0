"""ShardSpec: how a rank's shard of a weight is cut from the full weight (the program cuts
it when a rank loads; shard_tensor_parallel decides it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """How rank r's shard of a weight is cut along ``dim``: of each segment (size, pieces,
    replicas) — one segment of the whole dim unless ``segments`` is given (a fused weight) —
    piece ``(r % group) // replicas``, concatenated in segment order.

    ``perm``: the weight the program computes with is the checkpoint's with its indices
    along ``dim`` reordered (index i of the program's weight is index ``perm[i]`` of the
    checkpoint's; x-transformers' tiled K/V heads read as GQA with the query heads
    permuted: passes/untile_kv_heads.py); the cut is of that reordered weight, and the
    boxes say which of the checkpoint's rows it reads, in order."""

    dim: int
    pieces: int
    group: int
    replicas: int = 1
    segments: tuple[tuple[int, int, int], ...] = ()
    perm: tuple[int, ...] = ()

    def segments_of(self, size: int) -> tuple[tuple[int, int, int], ...]:
        """(size, pieces, replicas) of each segment of a dim of ``size``."""
        return self.segments or ((size, self.pieces, self.replicas),)

    def index(self, rank: int) -> int:
        return (rank % self.group) // self.replicas

    def boxes(self, full_shape, rank: int) -> list[tuple[tuple[int, int], ...]]:
        """Rank ``rank``'s shard as boxes of the full tensor (per dim ``(start, stop)``), one
        per segment, concatenated along ``dim``: what a checkpoint reader reads (only these
        slices) and what :meth:`shard` cuts."""
        out, offset = [], 0
        for size, pieces, replicas in self.segments_of(full_shape[self.dim]):
            n = size // pieces
            start = offset + ((rank % self.group) // replicas) * n
            for a, b in self._runs(start, start + n):
                out.append(tuple((a, b) if d == self.dim else (0, s)
                                 for d, s in enumerate(full_shape)))
            offset += size
        return out

    def _runs(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The checkpoint's index ranges that indices [start, stop) of the program's weight
        read (one range unless ``perm`` reorders them), in order."""
        if not self.perm:
            return [(start, stop)]
        runs: list[list[int]] = []
        for i in self.perm[start:stop]:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        return [(a, b) for a, b in runs]

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        parts = [full.narrow(self.dim, *_start_length(box[self.dim]))
                 for box in self.boxes(full.shape, rank)]
        return (torch.cat(parts, self.dim) if len(parts) > 1 else parts[0]).contiguous()

    def shape(self, full_shape) -> tuple[int, ...]:
        s = list(full_shape)
        s[self.dim] = sum(size // pieces for size, pieces, _ in self.segments_of(s[self.dim]))
        return tuple(s)


def _start_length(span: tuple[int, int]) -> tuple[int, int]:
    return span[0], span[1] - span[0]
