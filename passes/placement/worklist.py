"""The placement analysis' sweeps as worklists: a sweep visits only the nodes whose inputs'
placements, requirements or decisions changed since their last visit, in the order a full
sweep would (docs/benchmarks.md: Compile time)."""

from __future__ import annotations

import heapq

from torch.fx import Node


# Debug switch: sweep every node on every sweep (the original algorithm) instead of only the
# nodes whose inputs changed. Decisions and errors are the same either way (tested).
FULL_SWEEPS_ENV = "DCP_COMPILE_FULL_PLACEMENT_SWEEPS"


class Worklist:
    """The nodes one kind of sweep must revisit, visited in sweep order (``key``: position).

    A sweep of the original algorithm evaluated every node; evaluating a node whose inputs
    have not changed since its last evaluation changes nothing and raises nothing, so a sweep
    need only visit the nodes marked since. A node marked ahead of the cursor is visited in
    the running sweep (as the full sweep would reach it later), one marked at or behind it in
    the next sweep. ``full``: visit every node on every sweep (the original algorithm)."""

    def __init__(self, nodes: list[Node], key: dict[Node, int], full: bool):
        self.key = {n: key[n] for n in nodes}
        self.nodes = {k: n for n, k in self.key.items()}
        self.full = full
        self.later: set[int] = set(self.nodes)
        self.heap: list[int] | None = None
        self.pos = 0

    def mark(self, n: Node) -> None:
        k = self.key.get(n)
        if k is None:
            return
        if self.heap is not None and k > self.pos:
            heapq.heappush(self.heap, k)
        else:
            self.later.add(k)

    def sweep(self):
        self.heap = list(self.nodes) if self.full else list(self.later)
        heapq.heapify(self.heap)
        self.later, self.pos = set(), None
        try:
            while self.heap:
                k = heapq.heappop(self.heap)
                if self.pos is not None and k <= self.pos:
                    continue   # marked twice ahead of the cursor
                self.pos = k
                yield self.nodes[k]
        finally:
            self.heap = None
