"""A soak of the block allocator under a serving stream (issue 39, item 4, the allocator's
part): requests arrive with prompts of 1 token to the capacity, many sharing prefixes
(prefix caching), decode with speculative rows (blocks for K tokens, then a rewind to what
was accepted), and the blocks run out (the youngest running request is preempted: its blocks
freed, and it is queued again from its prompt plus its generated tokens).

The cache is a token-id cache: every step writes each new token's id at its slot through the
block table (block ``table[pos // V]``, offset ``pos % V``), as a program writes K and V.
After every step the allocator's books are sound (``BlockAllocator.invariant_violations``:
no block leaked, none shared without a reference count, the garbage block never handed out)
and no step writes a block another sequence holds; a finished request reads its whole
sequence back from the cache through its table and its tokens equal a run without the
allocator (the "model" is a hash of the tokens so far: greedy and deterministic).

What this does not do: run a model. The numerics of prefix sharing, speculative rows and
mixed batches on a threaded DCP world are covered by tests/runtime/test_prefix_cache.py and
test_speculative.py; a threaded world serving this stream is not built yet.
The slice: 2,000 steps; ``DCP_SOAK_FULL=1``: 50,000 steps over more seeds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.serving.kv_cache import BlockAllocator

from full_runs import full

V = 8                 # tokens per vblock (block_size * dcp)
MAX_BLOCKS = 6        # per sequence: capacity 48 tokens
BATCH = 4
SPEC_K = 3            # speculative row width


def next_token(tokens: list[int]) -> int:
    """The stand-in model: greedy, a function of every token so far."""
    return hash(tuple(tokens)) % 251


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


@dataclass
class Req:
    rid: int
    prompt: list[int]
    max_new: int
    generated: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


class Soak:
    def __init__(self, seed: int, num_blocks: int, garbage_block: int):
        self.rng = random.Random(seed)
        self.alloc = BlockAllocator(num_blocks, V, prefix_caching=True,
                                    garbage_block=garbage_block)
        self.cache = [[None] * V for _ in range(num_blocks)]
        self.prefixes = [[self.rng.randrange(251) for _ in range(self.rng.randrange(1, 30))]
                         for _ in range(4)]
        self.queue: list[Req] = []
        self.running: dict[int, Req] = {}        # seq id -> request (admission order)
        self.lengths: dict[int, int] = {}        # seq id -> tokens in the cache
        self.next_rid = self.next_seq = 0
        self.stats = dict(steps=0, finished=0, preemptions=0, shared_tokens=0,
                          rejected_drafts=0, out_of_blocks=0)

    # -- the stream -------------------------------------------------------------------------

    def new_request(self) -> Req:
        cap = MAX_BLOCKS * V
        n = self.rng.randrange(1, cap)                       # 1 .. capacity - 1 tokens
        if self.rng.random() < 0.6:                          # a shared prefix
            base = self.rng.choice(self.prefixes)[:n]
            prompt = base + [self.rng.randrange(251) for _ in range(n - len(base))]
        else:
            prompt = [self.rng.randrange(251) for _ in range(n)]
        req = Req(self.next_rid, prompt, self.rng.randrange(1, cap - n + 1))
        self.next_rid += 1
        return req

    def write(self, seq: int, start: int, tokens: list[int]) -> None:
        """Write ``tokens`` at positions start.. of ``seq`` through its block table; a block
        another sequence also holds is never written."""
        table = self.alloc._tables[seq]
        for i, t in enumerate(tokens):
            block = table[(start + i) // V]
            assert self.alloc._refs[block] == 1, \
                f"step {self.stats['steps']}: sequence {seq} writes block {block}, which " \
                f"{self.alloc._refs[block]} sequences hold"
            self.cache[block][(start + i) % V] = t

    def read(self, seq: int, n: int) -> list[int]:
        table = self.alloc._tables[seq]
        return [self.cache[table[p // V]][p % V] for p in range(n)]

    def preempt_youngest(self, but: int) -> bool:
        victims = [s for s in self.running if s != but]
        if not victims:
            return False
        seq = victims[-1]
        req = self.running.pop(seq)
        self.alloc.free(seq)
        del self.lengths[seq]
        self.queue.insert(0, req)                           # resumes from prompt + generated
        self.stats["preemptions"] += 1
        return True

    def admit(self) -> None:
        while len(self.running) < BATCH and self.queue:
            req = self.queue[0]
            seq = self.next_seq
            context = req.tokens
            reused = self.alloc.share_prefix(seq, context)
            try:
                self.alloc.ensure(seq, len(context))
            except DCPInputError:
                self.alloc.free(seq)
                self.stats["out_of_blocks"] += 1
                return
            self.queue.pop(0)
            self.next_seq += 1
            assert self.read(seq, reused) == context[:reused]   # the shared vblocks' tokens
            self.stats["shared_tokens"] += reused
            self.write(seq, reused, context[reused:])
            self.alloc.register_prefix(seq, context)
            self.running[seq] = req
            self.lengths[seq] = len(context)

    def decode(self) -> None:
        for seq in list(self.running):
            if seq not in self.running:                     # preempted in this step
                continue
            req, n = self.running[seq], self.lengths[seq]
            k = min(self.rng.randrange(1, SPEC_K + 1), MAX_BLOCKS * V - n)
            while True:
                try:
                    self.alloc.ensure(seq, n + k)
                    break
                except DCPInputError:
                    self.stats["out_of_blocks"] += 1
                    assert self.preempt_youngest(but=seq), "one sequence must always fit"
            # The row: the next token, then drafts (each right or wrong); the verify accepts
            # the next token and every leading right draft, and rewinds the rest.
            true = reference(req.tokens, k)
            row = true[:1] + [t if self.rng.random() < 0.7 else (t + 1) % 251
                              for t in true[1:]]
            self.write(seq, n, row)
            accepted = 1
            while accepted < k and row[accepted] == true[accepted]:
                accepted += 1
            accepted = min(accepted, req.max_new - len(req.generated))
            self.stats["rejected_drafts"] += k - accepted
            req.generated += true[:accepted]
            self.lengths[seq] = n + accepted
            self.alloc.shrink(seq, n + accepted)
            if len(req.generated) >= req.max_new:
                self.finish(seq)

    def finish(self, seq: int) -> None:
        req = self.running.pop(seq)
        n = self.lengths.pop(seq)
        assert self.read(seq, n) == req.tokens, f"request {req.rid}: its cache differs"
        assert req.generated == reference(req.prompt, req.max_new), f"request {req.rid}"
        self.alloc.free(seq)
        self.stats["finished"] += 1

    def step(self) -> None:
        if self.rng.random() < 0.5 or not (self.queue or self.running):
            self.queue.append(self.new_request())
        self.admit()
        self.decode()
        self.stats["steps"] += 1
        bad = self.alloc.invariant_violations()
        assert not bad, f"step {self.stats['steps']}: {bad}"
        held = {seq: len(self.alloc._tables[seq]) for seq in self.running}
        assert held == {seq: -(-n // V) for seq, n in self.lengths.items()}, \
            f"step {self.stats['steps']}: blocks held past a sequence's length (a rewind " \
            f"kept them): {held}"


@pytest.mark.parametrize("seed,garbage_block", [(0, -1), (1, 0)])
def test_allocator_soak(seed, garbage_block):
    steps = 50_000 if full("DCP_SOAK_FULL") else 2_000
    # Tight: two sequences at capacity and a few blocks, so blocks run out and requests
    # are preempted; one sequence always fits.
    soak = Soak(seed, num_blocks=2 * MAX_BLOCKS + 3, garbage_block=garbage_block)
    for _ in range(steps):
        soak.step()
    s = soak.stats
    print(f"seed {seed}: {s}")
    assert s["finished"] > steps // 20 and s["preemptions"] > 0 and s["shared_tokens"] > 0
    assert s["rejected_drafts"] > 0


def test_invariant_violations_name_what_is_wrong():
    a = BlockAllocator(6, V, prefix_caching=True)
    a.ensure(0, 2 * V)
    assert a.invariant_violations() == []
    a._refs[a._tables[0][0]] = 2
    assert "reference counts differ" in a.invariant_violations()[0]
    a._refs[a._tables[0][0]] = 1
    a._free.discard(4)
    assert a.invariant_violations() == ["blocks [4] leaked: neither free, cached nor held"]
    a._free.add(5)   # the garbage block (the last)
    assert "the garbage block 5 is handed out: free" in a.invariant_violations()[0]
