"""Routing in bf16 (dcp_compile/routing.py): every rank of a MoE program picks the same
experts for every token, bit for bit, including at exact ties between experts, in both
sharding modes. (How many choices differ from the single-device bf16 model, and how close to
a tie they were, is measured by benchmarks/bench_moe_routing.py: docs/benchmarks.md "MoE
routing in bf16".)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dcp_compile  # noqa: E402
from dcp_compile import hf  # noqa: E402
from dcp_compile.routing import compare_routing, model_routing, trace_routing  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402
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
            reference[b] = type(routing)(list(routing.ids), list(routing.scores),
                                      list(routing.groups))
    got = trace.choices(0)
    assert len(got) == sum(len(p) + STEPS - 1 for p in prompts) * 2
    report = compare_routing(got, reference)
    assert report.near_ties(1e-30) > report.decisions // 2, report.margins[:10]


def test_compare_routing_counts_flips_gaps_and_cascades():
    """Synthetic routing, 2 layers x 6 positions, 4 experts, top-2: a flip in layer 1 at or
    after a layer-0 flip's position is a cascade; one before it, or in another sequence, is
    a first flip whose gap is the model's score difference of the swapped experts."""
    from dcp_compile.routing import ModelRouting
    scores = torch.tensor([4.0, 3.0, 2.5, 1.0]).expand(6, 4)
    ids = torch.tensor([[0, 1]]).expand(6, 2)
    reference = {s: ModelRouting([ids, ids], [scores, scores]) for s in (0, 1)}
    got = {(layer, s, p): (0, 1) for layer in (0, 1) for s in (0, 1) for p in range(6)}
    got[0, 0, 3] = (0, 2)        # first flip: lost 1 (3.0), gained 2 (2.5): gap 0.5
    got[1, 0, 2] = (0, 3)        # before it: a first flip, gap |3.0 - 1.0| = 2.0
    got[1, 0, 4] = (0, 3)        # after it in the same sequence: a cascade
    got[1, 1, 4] = (0, 2)        # another sequence: a first flip, gap 0.5
    report = compare_routing(got, reference)
    assert (report.decisions, report.choices, report.flips, report.cascades) == (24, 48, 4, 1)
    assert sorted(report.flip_gaps) == [0.5, 0.5, 2.0]
    assert report.flips_below(1.0) == 2 and report.near_ties(0.6) == 24


def test_a_swap_across_expert_groups_is_as_close_as_the_group_pick():
    """Group-limited routing (DeepSeek-V3): when the swapped experts sit in different groups
    the flip is as near a tie as the two groups' scores were (if nearer than the experts')."""
    from dcp_compile.routing import ModelRouting
    scores = torch.tensor([[4.0, 3.0, 2.0, 3.9, 1.0, 0.5]])   # groups {0, 1, 2}, {3, 4, 5}
    groups = torch.tensor([[7.0, 6.8]])                       # the model picked group 0
    reference = {0: ModelRouting([torch.tensor([[0, 1]])], [scores], [groups])}
    same_group = compare_routing({(0, 0, 0): (0, 2)}, reference)
    assert same_group.flip_gaps == [pytest.approx(1.0)]       # lost 1 (3.0), gained 2 (2.0)
    other_group = compare_routing({(0, 0, 0): (3, 4)}, reference)
    assert other_group.flip_gaps == [pytest.approx(0.2)]      # group gap 0.2 < experts' 0.9
