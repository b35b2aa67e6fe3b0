"""Placements: what rank r holds of a tensor (see :mod:`dcp_compile.passes.placement`), and segments."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Seg:
    """A segment of ``size`` elements cut in ``pieces``; each piece on ``replicas`` ranks."""

    size: int
    pieces: int
    replicas: int = 1

    @property
    def local(self) -> int:
        return self.size // self.pieces

    def scaled(self, num: int, den: int = 1) -> "Seg":
        return Seg(self.size * num // den, self.pieces, self.replicas)

    def __str__(self):
        return f"{self.size}/{self.pieces}" + (f"x{self.replicas}" if self.replicas > 1 else "")


@dataclass(frozen=True)
class Replicate:
    def __str__(self):
        return "Replicate"


@dataclass(frozen=True)
class Shard:
    dim: int
    segs: tuple[Seg, ...]
    axis: str = "attn"

    @property
    def full(self) -> int:
        return sum(s.size for s in self.segs)

    @property
    def local(self) -> int:
        return sum(s.local for s in self.segs)

    def __str__(self):
        kind = "Shard" if len(self.segs) == 1 else "Segmented"
        return f"{kind}(dim={self.dim}, [{', '.join(map(str, self.segs))}], {self.axis})"


@dataclass(frozen=True)
class Partial:
    axis: str
    scale: float = 1.0        # multiply the local value by this before the sum
    # A mixture-of-experts block's sum (dcp.moe): carried through the block's linear tail
    # (views, sums of pending sums, gating by a replicated factor) to one all-reduce.
    experts: bool = False

    def __str__(self):
        return f"Partial({self.axis})"


R = Replicate()
Placement = object  # Replicate | Shard | Partial | tuple of those (multi-output ops)


def canon(p):
    """A shard whose every segment is whole on several ranks (pieces 1, replicas > 1: an MQA
    KV head) is replicated data, and so is a single head on a group of one rank. (Pieces 1 of
    wider segments on a group of 1 stay a shard: the O projection of a dcp_tp group of one
    rank is still row-parallel, with a trivial sum.)"""
    if isinstance(p, Shard) and all(s.pieces == 1 and (s.replicas > 1 or s.size == 1)
                                    for s in p.segs):
        return R
    return p


def show(p) -> str:
    if isinstance(p, tuple):
        return "(" + ", ".join(show(x) for x in p) + ")"
    return "unknown" if p is None else str(p)


class Refusal(Exception):
    """A rule cannot place this op; the analysis turns it into a DCPTransformError."""


def scale_segs(segs, num, den=1):
    """Each segment's size times num / den (a view regrouping the dim); Refusal unless every
    size and piece stays whole."""
    out = []
    for s in segs:
        if (s.size * num) % den or (s.local * num) % den:
            raise Refusal(f"segment {s} does not divide by {den}")
        out.append(s.scaled(num, den))
    return tuple(out)
