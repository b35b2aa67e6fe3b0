"""Routing in bf16 (dcp_compile/routing.py): every rank of a MoE program picks the same
experts for every token, bit for bit, including at exact ties between experts, in both
sharding modes. (How many choices differ from the single-device bf16 model, and how close to
a tie they were, is measured by benchmarks/bench_moe_routing.py: README "Mixture of
experts".)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dcp_compile  # noqa: E402
from dcp_compile import hf  # noqa: E402
from dcp_compile.routing import compare_routing, model_routing, trace_routing  # noqa: E402
from dcp_compile.runtime.engine import StepShapes  # noqa: E402
from dcp_compile.verify import run_threaded_program  # noqa: E402

from helpers import prompts_of  # noqa: E402
from test_moe import build  # noqa: E402

TP, DCP, BLOCK, STEPS, LENGTHS = 4, 2, 4, 6, (1, 7, 12, 5)
SHAPES = StepShapes(batch=4, context_len=12, max_blocks=6, num_blocks=24)


@pytest.mark.parametrize("ep", [False, True], ids=["tp_experts", "expert_parallel"])
def test_every_rank_picks_the_same_experts_in_bf16_at_exact_ties(ep):
    model = build("mixtral", ties=True).to(torch.bfloat16)
    program = dcp_compile.transform(hf.prepare(model), tp=TP, dcp=DCP, mode="decode",
                                    block_size=BLOCK, interleave_size=2, shapes=SHAPES,
                                    check=False, expert_parallel=ep)
    traced, trace = trace_routing(program)
    prompts = prompts_of(LENGTHS, vocab=model.config.vocab_size)
    runs = run_threaded_program(traced, prompts, STEPS, poison_garbage=True)
    assert sorted(trace.calls) == list(range(TP))
    first = trace.calls[0]
    # 2 MoE layers x (1 context step + STEPS - 1 decode steps)
    assert len(first) == model.config.num_hidden_layers * STEPS
    for rank in range(1, TP):
        calls = trace.calls[rank]
        assert len(calls) == len(first)
        for (layer, pos, ids), (layer0, pos0, ids0) in zip(calls, first):
            assert layer == layer0 and torch.equal(pos, pos0)
            assert torch.equal(ids, ids0), f"rank {rank} layer {layer}: {ids} vs {ids0}"
    # The ties are real: the model's own router scores tie exactly between the chosen
    # expert and one it did not choose, at most of the (layer, token) decisions.
    reference = {}
    with model_routing(model) as routing, torch.no_grad():
        for b, (p, toks) in enumerate(zip(prompts, runs[0].result.tokens)):
            model(torch.tensor([p + toks[:-1]]))
            reference[b] = type(routing)(list(routing.ids), list(routing.scores))
    got = trace.choices(0)
    assert len(got) == sum(len(p) + STEPS - 1 for p in prompts) * 2
    report = compare_routing(got, reference)
    assert report.near_ties(1e-30) > report.decisions // 2, report.margins[:10]
