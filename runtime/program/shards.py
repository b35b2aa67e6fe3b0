"""ShardSpec: how a rank's shard of a weight is cut from the full weight (the program cuts
it when a rank loads; shard_tensor_parallel decides it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """How rank r's shard of a weight is cut along ``dim``: of each segment (size, pieces,
    replicas) — one segment of the whole dim unless ``segments`` is given (a fused weight) —
    piece ``(r % group) // replicas``, concatenated in segment order."""

    dim: int
    pieces: int
    group: int
    replicas: int = 1
    segments: tuple[tuple[int, int, int], ...] = ()

    def segments_of(self, size: int) -> tuple[tuple[int, int, int], ...]:
        """(size, pieces, replicas) of each segment of a dim of ``size``."""
        return self.segments or ((size, self.pieces, self.replicas),)

    def index(self, rank: int) -> int:
        return (rank % self.group) // self.replicas

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        parts, offset = [], 0
        for size, pieces, replicas in self.segments_of(full.shape[self.dim]):
            n = size // pieces
            i = (rank % self.group) // replicas
            parts.append(full.narrow(self.dim, offset + i * n, n))
            offset += size
        return (torch.cat(parts, self.dim) if len(parts) > 1 else parts[0]).contiguous()

    def shape(self, full_shape) -> tuple[int, ...]:
        s = list(full_shape)
        s[self.dim] = sum(size // pieces for size, pieces, _ in self.segments_of(s[self.dim]))
        return tuple(s)
