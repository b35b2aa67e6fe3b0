"""The chunk step (``StepShapes.chunk_len``): a decode program's prompt chunk after prior
context in ONE step — a width-``chunk_len`` decode step, every query over the prior's cached
KV (its rank's owned slots below its own position) and causally within the chunk.

Compared against the ordinary model's own plain forward over the whole prompt (fp32, 1e-4)
on the threaded DCP world: GQA, priors of 1..vblock+1 tokens, chunks around the interleave
period, an empty row and an unused row, the prefix cache's suffixes in one step each, and
the vLLM plugin's host side (flat ragged batches cut into calls, context buckets, the
garbage block first) without vLLM.
"""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.models.demo import DemoConfig
from dcp_compile.models.plain import plain_llama
from dcp_compile.runtime.distributed.world import run_threaded
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.names import StepKind
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.serving.rank_engine import rank_engine

ATOL = 1e-4
BLOCK = 4
CHUNK = 16


def _model():
    return plain_llama(DemoConfig(vocab_size=64, hidden_size=64, num_layers=2, num_q_heads=8,
                                  num_kv_heads=2, head_dim=8, intermediate_size=96),
                       attention="sdpa")


@pytest.fixture(scope="module")
def chunked():
    """(model, program): tp=4, dcp=2 (GQA 8:2), interleave 1, chunk step of 16 tokens."""
    model = _model()
    shapes = StepShapes(batch=4, context_len=12, max_blocks=5, num_blocks=24, decode_len=1,
                        chunk_len=CHUNK)
    program = dcp_compile.transform(model, tp=4, dcp=2, block_size=BLOCK, interleave_size=1,
                                    shapes=shapes, check=False)
    return model, program


def test_a_decode_program_with_chunk_len_holds_a_chunk_step(chunked):
    _, program = chunked
    assert set(program.graphs) == {StepKind.CONTEXT, StepKind.DECODE, StepKind.CHUNK}
    ids = next(n for n in program.graphs[StepKind.CHUNK].graph.nodes
               if n.op == "placeholder" and n.name == "input_ids")
    assert tuple(ids.meta["val"].shape) == (4, CHUNK)


def test_chunk_after_prior_context_equals_the_plain_forward(chunked):
    """Row b: a first chunk by the context step, then the rest in one chunk step. Priors 1,
    7, 8 (a vblock), 9 tokens; chunks of 16 (full), 0 (the row sits out), 1 and 9; every
    chunk token's logits against the plain forward over the whole prompt."""
    model, program = chunked
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (17, 7, 9, 18)]
    prior = [1, 7, 8, 9]

    def rank_main(rank):
        engine = rank_engine(program, rank, shared_names=True, fill=float("nan"),
                             poison=True)
        with torch.no_grad():
            engine.prefill([p[:k] for p, k in zip(prompts, prior)])
            return engine.chunk_rows([p[k:] for p, k in zip(prompts, prior)])

    outs = run_threaded(program.config.tp, rank_main, timeout=300)
    with torch.no_grad():
        for b, (p, k) in enumerate(zip(prompts, prior)):
            want = model(torch.tensor([p]))[0, k:]
            for got in outs:
                assert torch.allclose(got[b, :len(p) - k], want, atol=ATOL), \
                    (b, float((got[b, :len(p) - k] - want).abs().max()))


def test_prefix_cache_suffixes_run_in_one_chunk_step_each(chunked):
    """A decode engine with prefix caching: each follower's suffix after the cached vblocks
    runs as one chunk step (not ceil(n / decode_len) decode steps); tokens equal greedy
    decoding of the plain forward."""
    model, program = chunked
    shared = list(range(1, 10))                     # 1 full vblock of 8 + 1
    prompts = [shared + [30, 31], shared + [40, 41, 42, 43, 44], [7, 8]]

    def rank_main(rank):
        engine = rank_engine(program, rank, shared_names=True, prefix_caching=True,
                             record=True)
        with torch.no_grad():
            result = engine.generate(prompts, 4)
        return result.tokens, engine.executor.kinds, engine.allocator.reused_tokens

    tokens, kinds, reused = run_threaded(program.config.tp, rank_main, timeout=300)[0]
    assert reused == 8
    # leaders' context step, the follower's suffix in one chunk step, 3 decode steps
    assert kinds == [StepKind.CONTEXT, StepKind.CHUNK] + [StepKind.DECODE] * 3
    with torch.no_grad():
        for p, got in zip(prompts, tokens):
            seq = list(p)
            for _ in range(4):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
            assert got == seq[len(p):]


def test_chunk_rows_refuses_without_a_chunk_step_or_too_wide():
    model = _model()
    program = dcp_compile.transform(model, tp=2, dcp=1, block_size=BLOCK, check=False,
                                    shapes=StepShapes(batch=2, context_len=8, max_blocks=4,
                                                      num_blocks=10))
    assert StepKind.CHUNK not in program.graphs

    def rank_main(rank):
        engine = rank_engine(program, rank, shared_names=True)
        with pytest.raises(DCPInputError, match=r"no chunk step \(StepShapes.chunk_len = 0\)"):
            engine.chunk_rows([[1, 2]])
    run_threaded(2, rank_main, timeout=300)


def test_the_vllm_plugins_calls_with_buckets_equal_the_plain_forward():
    """The plugin's host side (dcp_compile/vllm/batch.py) on the threaded world, without
    vLLM: two flat ragged "vLLM steps" — prompts of 12 and 5 tokens, then a 16-token chunk
    after the first one's prior and a decode token for the second — cut into calls, each run
    in its smallest context bucket (8, 16 or the full 40 tokens), the garbage block first
    as under vLLM. Every token's logits equal the plain forward."""
    from dcp_compile.runtime.serving.rank_engine import load_rank
    from dcp_compile.runtime.distributed.world import bind_roles
    from dcp_compile.vllm.batch import ProgramShapes, at_bucket, calls_of, scatter_logits, \
        table_rows

    model = _model()
    program = dcp_compile.transform(
        model, tp=4, dcp=2, block_size=BLOCK, interleave_size=1, check=False,
        garbage_block=0, buckets=[8, 16],
        shapes=StepShapes(batch=2, context_len=12, max_blocks=5, num_blocks=12,
                          decode_len=2, chunk_len=CHUNK))
    assert program.buckets == (8, 16, 40)
    shapes = ProgramShapes(batch=2, context_len=12, decode_len=2, chunk_len=CHUNK,
                           max_blocks=5, vblock=8)
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(0, 64, (28,), generator=gen).tolist()
    b = torch.randint(0, 64, (6,), generator=gen).tolist()
    vllm_table = torch.tensor([[1, 2, 3, 4, 0], [5, 0, 0, 0, 0]])      # 0: vLLM's null block
    steps = [  # (request -> (first position, tokens)), seq lens after the step
        ({0: (0, a[:12]), 1: (0, b[:5])}, [12, 5]),
        ({0: (12, a[12:28]), 1: (5, b[5:6])}, [28, 6]),
    ]

    def rank_main(rank):
        loaded = load_rank(program, rank, bind_roles(program.topology, rank, aliases=True))
        caches = program.cache_spec().allocate(fill=float("nan"))
        out, widths = [], []
        for runs, seq_lens in steps:
            ids = torch.tensor([t for r in sorted(runs) for t in runs[r][1]])
            pos = torch.tensor([p for r in sorted(runs)
                                for p in range(runs[r][0], runs[r][0] + len(runs[r][1]))])
            starts = [0]
            for r in sorted(runs):
                starts.append(starts[-1] + len(runs[r][1]))
            table = table_rows(vllm_table, seq_lens, shapes)
            done = []
            for call in calls_of(ids, pos, starts, table, shapes):
                call = at_bucket(call, program.buckets, shapes)
                widths.append((str(call.kind), call.block_table.shape[1]))
                logits, caches = loaded.run(call.kind, call.input_ids, call.positions,
                                            call.block_table, caches)
                done.append((call, logits))
            out.append(scatter_logits(done, len(ids), 64))
        return out, widths

    results = run_threaded(program.config.tp, rank_main, timeout=300)
    # step 1: both prompts in one context call (16-token bucket); step 2: the chunk in one
    # chunk call (the full 40-token bucket), the decode token in one decode call (8 tokens).
    assert results[0][1] == [("context", 2), ("chunk", 5), ("decode", 1)]
    with torch.no_grad():
        want_a, want_b = model(torch.tensor([a]))[0], model(torch.tensor([b]))[0]
    for out, _ in results:
        assert torch.allclose(out[0], torch.cat([want_a[:12], want_b[:5]]), atol=ATOL)
        assert torch.allclose(out[1], torch.cat([want_a[12:28], want_b[5:6]]), atol=ATOL)
