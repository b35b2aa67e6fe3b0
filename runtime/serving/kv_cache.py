"""Paged KV cache: tensor layout, block allocator and the reserved garbage block.

Layout. Per layer one key cache and one value cache, each
    [num_blocks, block_size, kv_heads, head_dim]
and a program takes them as a flat list [k_0, v_0, k_1, v_1, ...]. Row ``block * block_size
+ offset`` of the flattened cache is one token's K (or V) for all of this rank's KV heads.
One block is the garbage block: slot -1 writes (padding, positions another rank owns,
unallocated entries) land there, no block table may name it and attention never reads it. It
is the last block (``num_blocks - 1``) by default and the first with ``garbage_block=0``
(vLLM's null block); runtime/garbage_block.py is the one definition.

Block tables. One row per sequence, one entry per ``block_size * dcp`` global positions (a
vblock: each rank stores its ``block_size`` owned positions of that vblock in that block);
the same table on every rank of a DCP group; -1 marks an unallocated entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.garbage_block import (LAST, check_garbage_block, garbage_block_id,
                                               usable_blocks)

from dcp_compile.runtime.serving.step_contract import SLOT_MAPPING_RULES, StepContract


@dataclass(frozen=True)
class KVCacheGroup:
    """Caches of one layout: ``kv_heads`` (this rank's) x ``head_dim``, and which of the
    spec's caches (key/value pairs, by index) have it."""

    kv_heads: int
    head_dim: int
    caches: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheSpec:
    """One rank's KV caches. ``num_layers`` key/value cache pairs; with ``groups`` (per-layer
    KV layouts, Gemma 4) each pair has its group's (kv_heads, head_dim) and ``kv_heads`` /
    ``head_dim`` are the first cache's; ``reads[l]`` is the pair attention layer l reads (a
    layer sharing another layer's KV reads its cache: fewer pairs than layers)."""

    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    garbage: int = LAST                     # which block is the garbage block: -1 or 0
    groups: tuple[KVCacheGroup, ...] | None = None
    reads: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.groups is not None:
            covered = sorted(c for g in self.groups for c in g.caches)
            if covered != list(range(self.num_layers)):
                raise DCPInputError(f"KV cache groups must name every cache once: caches "
                                    f"{covered}, num_layers={self.num_layers}. Build the spec "
                                    f"with program.cache_spec().")

    @property
    def garbage_block(self) -> int:
        return garbage_block_id(self.num_blocks, self.garbage)

    @property
    def uniform(self) -> bool:
        return self.groups is None or len(self.groups) == 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The shape of every cache; per-layer layouts have several (``shapes``)."""
        if not self.uniform:
            raise DCPInputError(f"this program's KV caches have {len(self.groups)} layouts "
                                f"({[(g.kv_heads, g.head_dim) for g in self.groups]} as (kv "
                                f"heads, head_dim)): there is no one cache shape. Use "
                                f"spec.shapes() (one per cache tensor) or spec.allocate().")
        return (self.num_blocks, self.block_size, self.kv_heads, self.head_dim)

    def layout(self, cache: int) -> tuple[int, int]:
        """(kv_heads, head_dim) of key/value pair ``cache``."""
        if self.groups is None:
            return self.kv_heads, self.head_dim
        return next((g.kv_heads, g.head_dim) for g in self.groups if cache in g.caches)

    def shapes(self) -> list[tuple[int, int, int, int]]:
        """Every cache tensor's shape, flat [k_0, v_0, k_1, v_1, ...]."""
        return [(self.num_blocks, self.block_size, *self.layout(c))
                for c in range(self.num_layers) for _ in range(2)]

    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take in one rank's caches, every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(2 * h * d * elem for h, d in map(self.layout, range(self.num_layers)))

    def bytes_per_rank(self) -> int:
        """Bytes of every K and V cache of one rank (garbage block included)."""
        return self.num_blocks * self.block_size * self.bytes_per_token()

    def allocate(self, fill: float = 0.0, device="cpu") -> list[torch.Tensor]:
        """Fresh caches, flat [k_0, v_0, ...]. ``fill=nan`` poisons them for tests."""
        if self.num_blocks < 2:
            raise DCPInputError(f"a paged cache needs at least one usable block besides the "
                                f"garbage block: num_blocks={self.num_blocks}. "
                                f"Use num_blocks >= 2.")
        return [torch.full(shape, fill, dtype=self.dtype, device=device)
                for shape in self.shapes()]


class BlockAllocator:
    """Hands out blocks to sequences; never the garbage block (``garbage_block``: -1 the
    last, 0 the first; runtime/garbage_block.py).

    It prefers contiguous runs (a KV transfer then moves a run of blocks with one descriptor,
    runtime/transfer/nixl/descriptors.py): a sequence grows into the block after its last one when that
    is free, and new entries take the lowest free run long enough for all of them. When no
    such run is left it takes the lowest free blocks, fragmented; any block table is correct,
    a contiguous one is only cheaper to move.

    ``prefix_caching=True`` shares full vblocks (``tokens_per_block`` = block_size * dcp
    positions: one block per rank) between sequences whose token prefixes are identical, as
    vLLM does under DCP: each full vblock of a registered prompt is keyed by a hash chained
    over its tokens and every earlier vblock's, blocks carry reference counts, and a block
    no sequence holds stays cached until a new allocation evicts it (least recently used
    first). A shared block is never written: a prompt reuses whole vblocks only and
    computes its suffix into blocks of its own (the step contract refuses any other write).
    """

    def __init__(self, num_blocks: int, tokens_per_block: int, *,
                 prefix_caching: bool = False, garbage_block: int = LAST):
        if num_blocks < 2:
            raise DCPInputError(f"num_blocks must leave one usable block besides the garbage "
                                f"block: num_blocks={num_blocks}. Use num_blocks >= 2.")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.garbage_block = garbage_block_id(num_blocks, check_garbage_block(garbage_block))
        self.prefix_caching = prefix_caching
        self._free = set(usable_blocks(num_blocks, garbage_block))
        self._usable = frozenset(self._free)
        self._tables: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}             # block -> sequences holding it
        self._by_hash: dict[int, int] = {}          # vblock hash -> block
        self._hash_of: dict[int, int] = {}          # block -> its vblock hash
        self._idle: dict[int, None] = {}            # cached, unheld blocks, LRU first
        self.reused_tokens = 0                      # prompt tokens served from the cache

    def ensure(self, seq_id: int, num_tokens: int, groups: int = 1) -> list[int]:
        """Grow ``seq_id``'s table to cover positions [0, num_tokens).

        ``groups > 1`` orders a run of new entries by ``entry % groups``: the entries of one
        residue class get consecutive blocks. A KV transfer reads every ``groups``-th entry
        from one remote rank (``TransferPlan.decode_block_groups``), so that order makes the
        rows it writes one run.
        """
        if not isinstance(groups, int) or groups < 1:
            raise DCPInputError(f"groups must be an int >= 1: groups={groups!r}. Pass "
                                f"TransferPlan.decode_block_groups, or 1.")
        table = self._tables.setdefault(seq_id, [])
        need = -(-num_tokens // self.tokens_per_block)
        new = need - len(table)
        if new > len(self._free) + len(self._idle):
            raise DCPInputError(
                f"out of KV cache blocks: sequence {seq_id} needs {need} blocks for "
                f"{num_tokens} tokens, {len(table)} held, {len(self._free)} free. "
                f"Allocate more blocks (num_blocks) or shorten the sequences.")
        if new <= 0:
            return table
        self._evict(new - len(self._free))
        if table and new == 1 and table[-1] + 1 in self._free:
            blocks = [table[-1] + 1]  # growing in place keeps the run
        else:
            blocks = self._take(new)
        entries = list(range(len(table), need))
        order = sorted(entries, key=lambda e: (e % groups, e))
        placed = dict(zip(order, blocks))
        table.extend(placed[e] for e in entries)
        self._free.difference_update(blocks)
        self._refs.update((b, 1) for b in blocks)
        return table

    def _take(self, n: int) -> list[int]:
        """The lowest free run of ``n`` blocks, else the ``n`` lowest free blocks."""
        free = sorted(self._free)
        start = 0
        for i in range(1, len(free) + 1):
            if i - start == n:
                return free[start:i]
            if i < len(free) and free[i] != free[i - 1] + 1:
                start = i
        return free[:n]

    def _evict(self, n: int) -> None:
        """Return the ``n`` least recently used cached, unheld blocks to the free set."""
        for _ in range(max(n, 0)):
            block = next(iter(self._idle))
            del self._idle[block]
            del self._by_hash[self._hash_of.pop(block)]
            self._free.add(block)

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                del self._refs[block]
                if block in self._hash_of:
                    self._idle[block] = None         # cached: most recently used last
                else:
                    self._free.add(block)

    def shrink(self, seq_id: int, num_tokens: int) -> None:
        """Return ``seq_id``'s blocks past positions [0, num_tokens)."""
        table = self._tables.get(seq_id, [])
        keep = -(-num_tokens // self.tokens_per_block)
        if num_tokens % self.tokens_per_block and table[keep - 1:keep]:
            # the kept block is written again from inside: it no longer holds its hash's tokens
            h = self._hash_of.pop(table[keep - 1], None)
            if h is not None:
                del self._by_hash[h]
        self._release(table[keep:])
        del table[keep:]

    def free(self, seq_id: int) -> None:
        self._release(self._tables.pop(seq_id, []))

    # -- prefix caching ----------------------------------------------------------------------

    def _hashes(self, tokens: list[int]) -> list[int]:
        """Chained hash of each full vblock of ``tokens``."""
        V, out, h = self.tokens_per_block, [], 0
        for j in range(len(tokens) // V):
            h = hash((h, tuple(tokens[j * V:(j + 1) * V])))
            out.append(h)
        return out

    def share_prefix(self, seq_id: int, tokens: list[int]) -> int:
        """Start sequence ``seq_id`` on the cached vblocks of its prompt's longest cached
        prefix; returns the tokens reused (a multiple of the vblock, leaving at least the
        last token to compute: the prompt step needs its logits)."""
        if not self.prefix_caching or self._tables.get(seq_id):
            return 0
        table = self._tables.setdefault(seq_id, [])
        for h in self._hashes(tokens[:-1]):
            block = self._by_hash.get(h)
            if block is None:
                break
            self._idle.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
            table.append(block)
        reused = len(table) * self.tokens_per_block
        self.reused_tokens += reused
        return reused

    def register_prefix(self, seq_id: int, tokens: list[int]) -> None:
        """Make the full vblocks of ``tokens`` (written in ``seq_id``'s blocks) shareable."""
        if not self.prefix_caching:
            return
        table = self._tables.get(seq_id, [])
        for block, h in zip(table, self._hashes(tokens)):
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h

    def invariant_violations(self) -> list[str]:
        """What is wrong with the allocator's books (empty: sound): the garbage block handed
        out, a usable block leaked or in two states (free, cached and unheld, held), a block
        held by more table entries than its reference count says (shared without a count), a
        block twice in one table, or the prefix-cache hash maps not each other's inverse."""
        out = []
        held: dict[int, int] = {}
        for seq, table in self._tables.items():
            if len(set(table)) != len(table):
                out.append(f"sequence {seq} holds a block twice: {table}")
            for b in table:
                held[b] = held.get(b, 0) + 1
        states = {"free": self._free, "cached": set(self._idle), "held": set(held)}
        if any(self.garbage_block in blocks for blocks in states.values()):
            out.append(f"the garbage block {self.garbage_block} is handed out: "
                       + ", ".join(k for k, v in states.items() if self.garbage_block in v))
        for i, (a, x) in enumerate(states.items()):
            for b, y in list(states.items())[i + 1:]:
                if x & y:
                    out.append(f"blocks {sorted(x & y)} are both {a} and {b}")
        leaked = self._usable - set().union(*states.values())
        if leaked:
            out.append(f"blocks {sorted(leaked)} leaked: neither free, cached nor held")
        if held != self._refs:
            wrong = {b: (held.get(b, 0), self._refs.get(b, 0))
                     for b in set(held) | set(self._refs) if held.get(b) != self._refs.get(b)}
            out.append(f"reference counts differ from the table entries holding each block "
                       f"(block: (entries, count)): {wrong}")
        if {b: h for h, b in self._by_hash.items()} != self._hash_of:
            out.append("the prefix cache's hash -> block and block -> hash maps differ")
        if set(self._idle) - set(self._hash_of):
            out.append(f"cached blocks {sorted(set(self._idle) - set(self._hash_of))} have no "
                       f"prefix hash")
        if set(self._hash_of) & self._free:
            out.append(f"free blocks {sorted(set(self._hash_of) & self._free)} still serve a "
                       f"prefix hash")
        return out

    def table(self, seq_ids: list[int | None], max_blocks: int) -> torch.Tensor:
        """Block table rows for ``seq_ids`` (None = an empty batch slot), padded with -1."""
        out = torch.full((len(seq_ids), max_blocks), -1, dtype=torch.int64)
        for row, seq in enumerate(seq_ids):
            blocks = self._tables.get(seq, []) if seq is not None else []
            if len(blocks) > max_blocks:
                raise DCPInputError(
                    f"sequence {seq} holds {len(blocks)} blocks but the block table has room "
                    f"for max_blocks={max_blocks}. Build the program with a larger "
                    f"max_blocks (max context = max_blocks * block_size * dcp).")
            out[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        return out


def check_step_inputs(positions: torch.Tensor, block_table: torch.Tensor, *, num_blocks: int,
                      block_size: int, dcp: int) -> None:
    """Block ids and position placement only (``SLOT_MAPPING_RULES``); a step's full check is
    ``dcp_compile.runtime.serving.step_contract.StepContract.check``, which the Engine and programs run."""
    StepContract(num_blocks=num_blocks, block_size=block_size, dcp=dcp,
                 rules=SLOT_MAPPING_RULES).check(None, positions, block_table)
