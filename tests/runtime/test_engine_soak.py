"""A soak of the engine on a threaded tp=4/dcp=2 world (issue 39, item 4): one engine per rank
serves a randomized stream of batches of the demo model -- prompt lengths 1 to the context
step's capacity, prompts sharing prefixes (prefix caching across batches: cached vblocks
outlive their batch), every other batch speculative (an n-gram drafter, decode rows of 2),
and a cache too small for four long sequences, so blocks run out: the batch is then
preempted (its sequences freed) and served again without its last request, which goes back
to the queue. After every step the allocator's books are sound
(``BlockAllocator.invariant_violations``), and every finished request equals the
single-device model's greedy tokens.

The slice: 8 batches; ``DCP_SOAK_FULL=1``: 300 batches.
"""

from __future__ import annotations

import functools
import random

import torch

import dcp_compile
from dcp_compile.models.demo import demo_model
from dcp_compile.runtime.distributed.world import run_threaded
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes
from dcp_compile.runtime.serving.kv_cache import KVCacheSpec
from dcp_compile.runtime.serving.rank_engine import rank_engine
from dcp_compile.runtime.serving.speculative import NgramDrafter

from full_runs import full

WORLD, DCP, BLOCK = 4, 2, 16
CONTEXT, CAPACITY, K = 40, 64, 2     # prompt step, tokens per sequence (2 vblocks), row width
# 6 usable blocks per rank: four sequences past one vblock (8 blocks) do not fit.
SHAPES = StepShapes(batch=4, context_len=CONTEXT, max_blocks=CAPACITY // (BLOCK * DCP),
                    num_blocks=7, decode_len=K)


def stream(seed: int, batches: int):
    """``batches`` batches of (prompt, steps) requests, and whether each is speculative."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(rng.randrange(32, CONTEXT))]
                for _ in range(3)]
    out = []
    for i in range(batches):
        reqs = []
        for _ in range(rng.randrange(2, SHAPES.batch + 1)):
            # Half of them past one vblock (32 tokens): shareable, and two blocks each.
            n = rng.randrange(33, CONTEXT + 1) if rng.random() < 0.5 else \
                rng.randrange(1, CONTEXT + 1)
            base = rng.choice(prefixes)[:n] if rng.random() < 0.6 else []
            prompt = base + [rng.randrange(256) for _ in range(n - len(base))]
            reqs.append((prompt, rng.randrange(1, min(8, CAPACITY - n - K + 1) + 1)))
        out.append((reqs, i % 2 == 1))
    return out


@functools.cache
def single_device_model():
    return demo_model()


def reference(prompt, steps) -> list[int]:
    model = single_device_model()
    shapes = StepShapes.fitting(1, CONTEXT, CAPACITY, block_size=BLOCK, dcp=1)
    c = model.config
    spec = KVCacheSpec(c.num_layers, shapes.num_blocks, BLOCK, c.num_kv_heads, c.head_dim)
    with torch.no_grad():
        return Engine(LocalExecutor(model, spec.allocate()), shapes,
                      block_size=BLOCK).generate([prompt], steps).tokens[0]


class CheckingExecutor:
    """Checks the engine's allocator after every step."""

    def __init__(self, inner):
        self.inner, self.engine, self.steps = inner, None, 0

    @property
    def caches(self):
        return self.inner.caches

    def step(self, *args):
        logits = self.inner.step(*args)
        bad = self.engine.allocator.invariant_violations()
        assert not bad, f"step {self.steps}: {bad}"
        self.steps += 1
        return logits


def serve(rank: int, program, batches):
    engine = rank_engine(program, rank, shared_names=True, prefix_caching=True,
                         wrap=CheckingExecutor)
    engine.executor.engine = engine
    done, preemptions, queue = [], 0, []
    for reqs, speculative in batches:
        queue = queue + list(reqs)
        batch, queue = queue[:SHAPES.batch], queue[SHAPES.batch:]
        while batch:
            steps = max(s for _, s in batch)
            try:
                result = engine.generate([p for p, _ in batch], steps,
                                         drafter=NgramDrafter() if speculative else None)
            except DCPInputError as e:
                if "out of KV cache blocks" not in str(e):
                    raise
                preemptions += 1
                queue.insert(0, batch.pop())       # the last request waits for a later batch
                result = None
            for b in range(len(engine.lengths)):
                engine.allocator.free(b)
            engine.lengths = []
            if result is not None:
                done += [(p, s, result.tokens[b][:s]) for b, (p, s) in enumerate(batch)]
                batch = []
    while queue:                                  # what is left, one request at a time
        (p, s), queue = queue[0], queue[1:]
        done.append((p, s, engine.generate([p], s).tokens[0][:s]))
        engine.allocator.free(0)
        engine.lengths = []
    return done, preemptions, engine.executor.steps, engine.allocator.reused_tokens


def test_engine_soak_on_a_threaded_world():
    batches = stream(0, 300 if full("DCP_SOAK_FULL") else 8)
    program = dcp_compile.transform(demo_model(), tp=WORLD, dcp=DCP, mode="decode",
                                    shapes=SHAPES, check=False)
    with torch.no_grad():
        results = run_threaded(WORLD, serve, program, batches, timeout=3600)
    done, preemptions, steps, reused = results[0]
    assert all(r == results[0] for r in results[1:])    # every rank saw the same stream
    assert len(done) == sum(len(reqs) for reqs, _ in batches)
    for prompt, s, tokens in done:
        assert tokens == reference(prompt, s)[:s], (len(prompt), s)
    print(f"engine soak: {len(batches)} batches, {len(done)} requests, {steps} steps, "
          f"{preemptions} preemptions, {reused} prompt tokens from the prefix cache")
    assert preemptions > 0 and reused > 0
