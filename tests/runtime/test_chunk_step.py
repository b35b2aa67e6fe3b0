"""The chunk step (``StepShapes.chunk_len``): a decode program's prompt chunk after prior
context in ONE step — a width-``chunk_len`` decode step, every query over the prior's cached
KV (its rank's owned slots below its own position) and causally within the chunk.

Compared against the ordinary model's own plain forward over the whole prompt (fp32, 1e-4)
on the threaded DCP world: GQA, priors of 1..vblock+1 tokens, chunks around the interleave
period, an empty row and an unused row, and the prefix cache's suffixes in one step each.
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
