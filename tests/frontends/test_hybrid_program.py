"""DCP programs of hybrid models (docs/hybrid.md): ``transform()`` on the tiny hybrids of
tests/support/hybrid_configs.py gives a program whose decode (the prompt through the context
step, then decode steps, a batch of mixed lengths) and, for the Mamba2 / short-conv hybrids,
whose prefill under sequence parallelism (one and two chunks) match the model's own forward
(fp32, 1e-4, greedy tokens equal), on a threaded world.

The slice (default run): LFM2 decode and Bamba prefill at tp=4/dcp=2, the collectives of a
recurrent layer, the engine's state slots and the named refusals. ``DCP_HYBRID_FULL=1``: every
family x tp=4/dcp=2 and tp=8/dcp=4, decode, and prefill where it is built.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import dcp_compile  # noqa: E402
from dcp_compile.frontends.ordinary import FullForwardReference  # noqa: E402
from dcp_compile.passes.infra import ancestors  # noqa: E402
from dcp_compile.passes.op_classes import RECURRENT_OPS  # noqa: E402
from dcp_compile.runtime.errors import DCPHybridError  # noqa: E402
from dcp_compile.runtime.names import STATE_FRESH, STATE_LENGTHS, STATE_SLOT  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402
from dcp_compile.runtime.serving.state_cache import StateSlots, state_rows  # noqa: E402
from hybrid_configs import build_hybrid  # noqa: E402
from full_runs import full  # noqa: E402
from hybrid_runs import (BLOCK, SHAPES, TOL, assert_decode_matches,  # noqa: E402
                         assert_prefill_matches, cases as _cases, collectives as _collectives,
                         program as _program, prompts as _prompts)

FULL = full("DCP_HYBRID_FULL")


# Families whose prefill program is tested here (Mamba2, short conv); the Qwen ones in
# tests/frontends/test_hybrid_lin.py.
PREFILL_TYPES = ("bamba", "granitemoehybrid", "lfm2")
# Every family the hybrid program serves (LFM2-MoE stops at its experts: below).
DECODE_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "bamba",
                "granitemoehybrid", "lfm2")


@pytest.mark.parametrize("model_type,tp,dcp", _cases(DECODE_TYPES, {("lfm2", 4, 2)}, FULL))
def test_decode_matches_the_models_own_forward(model_type, tp, dcp):
    """The prompts (1, 5, 8 tokens) through the context step, then 6 greedy decode steps:
    every step's logits within 1e-4 of the model's own forward over the whole sequence,
    greedy tokens equal, on every rank."""
    assert_decode_matches(*_program(model_type, tp, dcp, "decode"),
                          f"{model_type} tp={tp} dcp={dcp}")


@pytest.mark.parametrize("model_type,tp,dcp", _cases(PREFILL_TYPES, {("bamba", 4, 2)}, FULL))
@pytest.mark.parametrize("chunks", [1, 2], ids=["one-chunk", "two-chunks"])
def test_prefill_under_sequence_parallelism_matches(model_type, tp, dcp, chunks):
    """Prefill (the chunk's tokens split over the ranks): every real token's logits within
    1e-4 of the model's own forward; with two chunks the second continues each row's state
    from its slot (cut at unaligned places, verify.chunk_plan_of)."""
    assert_prefill_matches(*_program(model_type, tp, dcp, "prefill"), chunks,
                           f"{model_type} tp={tp} dcp={dcp}")


# -- the graph: inputs, collectives per recurrent layer ------------------------------------

def _mixer_collectives(gm) -> list[tuple[list[str], list[str]]]:
    """Per recurrent op: (the collectives its inputs come through since the previous layer's
    output, the collectives between it and the mixer's residual add)."""
    from dcp_compile.passes.infra import linears_reached
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    ops = [n for n in nodes if n.op == "call_function" and n.target in RECURRENT_OPS]
    out = []
    for op in ops:
        path = next(reversed(op.meta["nn_module_stack"].values()))[0]
        layer = path.rsplit(".", 1)[0]          # model.layers.<i>
        first = next(n for n in nodes if any(p == layer or p.startswith(layer + ".")
                                             for p, _ in (n.meta.get("nn_module_stack")
                                                          or {}).values()))
        before = [n for n in ancestors(op) if order[n] >= order[first]]
        out_proj, = linears_reached(list(op.users), lambda x: list(x.users))
        add = next(n for n in nodes[order[out_proj]:] if n.target == torch.ops.aten.add.Tensor
                   and out_proj in ancestors(n) | {n})
        after = [n for n in ancestors(add) if order[n] > order[op]]
        out.append((_collectives(before), _collectives(after)))
    return out


def test_a_recurrent_layer_costs_one_gather_in_prefill_and_nothing_in_decode():
    """Decode: the op runs on every rank on replicated rows and weights (no collective in the
    mixer). Prefill: one all-gather of the layer's input over the sequence-parallel group
    (every rank), the op on the whole chunk, the rank's own tokens kept (a slice, no
    collective); the end state written by every rank into its own replica, the same bytes.
    The tiny Bamba (2 Mamba2 groups: replicated at tp=4; LFM2's short conv is cut by its
    channels since, test_hybrid_headcut.py)."""
    for mode, want in (("decode", ([], [])),
                       ("prefill", (["all_gather_into_tensor@world"], []))):
        _, program = _program("bamba", 4, 2, mode)
        assert program.state_spec().tp == 1
        gm = program.graphs[mode]
        per_layer = _mixer_collectives(gm)
        assert len(per_layer) == 2, per_layer
        assert all(got == want for got in per_layer), (mode, per_layer)


def test_the_program_lists_its_state_caches_and_takes_them_as_inputs():
    _, program = _program("lfm2", 4, 2, "decode")
    spec = program.state_spec()
    assert [s.layer for s in spec.layers] == [0, 2] and spec.num_slots == SHAPES.batch
    assert program.cache_spec().num_layers == 2           # attention layers only
    for kind, gm in program.graphs.items():
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        tail = names[names.index(STATE_SLOT):]
        assert tail == [STATE_SLOT, STATE_FRESH, STATE_LENGTHS, "state_caches_0",
                        "state_caches_1"], (kind, tail)
        ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in RECURRENT_OPS]
        assert len(ops) == 2, kind
    out = next(n for n in program.graphs["decode"].graph.nodes if n.op == "output").args[0]
    assert len(out) == 1 + 2 * 2 + 2                      # logits, 4 KV caches, 2 states
    assert dcp_compile.transform  # the program came from the public API


def test_a_non_hybrid_model_has_no_state():
    """Every other frontend lists no state caches (the driver puts None in the program)."""
    from dcp_compile.frontends import frontend_for
    from dcp_compile.models.demo import demo_model
    from dcp_compile.models.plain import plain_llama
    for model in (demo_model(), plain_llama(attention="sdpa")):
        assert frontend_for(model).state_cache(4) is None


# -- state slots: the engine's ---------------------------------------------------------------

def test_state_rows_are_the_rows_fresh_flags_and_lengths():
    positions = torch.tensor([[0, 1, 2, -1], [7, -1, -1, -1], [-1, -1, -1, -1]])
    fresh, lengths = state_rows(positions)
    assert fresh.tolist() == [True, False, False]
    assert lengths.tolist() == [3, 1, 0]


def test_state_slots_are_given_per_sequence_and_freed_when_it_finishes():
    slots = StateSlots(2)
    assert slots.step_slots([0, 1, None], [3, 0, 0]).tolist() == [0, -1, -1]
    assert slots.step_slots([0, 1, None], [1, 2, 0]).tolist() == [0, 1, -1]
    with pytest.raises(Exception, match="no free recurrent-state slot for sequence 2"):
        slots.slot(2)
    slots.free(0)
    assert slots.slot(2) == 0           # reused: its first step is fresh (reads zeros)


def test_engine_finish_frees_the_slot_and_a_new_request_starts_fresh():
    """A finished sequence's slot goes to the next request, whose context step is fresh: its
    decode equals the model's own forward though the slot held another sequence's state."""
    from dcp_compile.runtime.distributed.world import run_threaded
    from dcp_compile.runtime.serving.rank_engine import rank_engine
    model, program = _program("lfm2", 4, 2, "decode")
    first, second = _prompts()[2], _prompts()[1]

    def rank_main(rank):
        engine = rank_engine(program, rank, shared_names=True)
        with torch.no_grad():
            engine.generate([first], 2)
            held = dict(engine.state_slots.of)
            engine.finish(0)
            freed = dict(engine.state_slots.of)
            result = engine.generate([second], 3)
        return held, freed, result.tokens[0], torch.stack(result.logits)[:, 0]

    runs = run_threaded(program.config.tp, rank_main)
    ref = FullForwardReference(model)
    seq = list(second)
    for held, freed, tokens, logits in runs:
        assert held == {0: 0} and freed == {}
        for t, got in zip(tokens, logits):
            want = ref.step(torch.tensor([seq]))[0, -1]
            assert (got - want).abs().max() < TOL
            assert int(want.argmax()) == t
            seq.append(t)
        seq = list(second)


# -- refusals, by name -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lfm2():
    return build_hybrid("lfm2")


@pytest.mark.parametrize("shapes,match", [
    (StepShapes(chunk_len=4), r"chunk step \(StepShapes.chunk_len=4\) is not built"),
], ids=["chunk-step"])
def test_what_is_not_built_is_refused_by_name(lfm2, shapes, match):
    with pytest.raises(DCPHybridError, match=match):
        dcp_compile.transform(lfm2, tp=4, dcp=2, mode="decode", shapes=shapes)


@pytest.mark.parametrize("model_type,mixer", [("olmo_hybrid", "OlmoHybridGatedDeltaNet")])
def test_a_hybrid_without_a_swap_rule_is_refused_by_name(model_type, mixer, monkeypatch):
    """A hybrid by its config whose mixer no rule names (OLMo-hybrid with its rule taken out
    of RULES): DCPHybridError naming its modules, at the frontend (not the token-wise
    check's feature diagnosis)."""
    from dcp_compile.frontends import module_recurrent
    from hf_corpus import build
    monkeypatch.setattr(module_recurrent, "RULES", tuple(
        r for r in module_recurrent.RULES if r.cls != mixer))
    with pytest.raises(DCPHybridError, match=rf"no swap rule runs its recurrent layers as a "
                                             rf"dcp op \(modules \[.*'{mixer}'"):
        dcp_compile.transform(build(model_type, "sdpa"), tp=4, dcp=2, mode="decode")


@pytest.mark.parametrize("model_type,mixer", [
    ("qwen3_5_text", "Qwen3_5GatedDeltaNet"), ("bamba", "BambaMixer"), ("lfm2", "Lfm2ShortConv"),
    ("granitemoehybrid", "GraniteMoeHybridMambaLayer")])
def test_hf_prepare_refuses_a_hybrid_and_points_to_transform(model_type, mixer):
    """hf.prepare carries KV caches only (its wrapper's step is the paged attention's): a
    hybrid is refused naming its mixers and pointing to transform(), which serves the same
    model (Qwen3.5 and Bamba used to be refused as "no AttentionInterface", since
    transformers leaves ``_supports_attention_backend`` False on them; LFM2 and Granite-4-H
    at their mixers' missing attention calls)."""
    from dcp_compile import hf
    with pytest.raises(DCPHybridError, match=rf"model_type='{model_type}': 2 recurrent layer"
                                             rf"\(s\), \['{mixer}'\].*hf.prepare carries no "
                                             rf"recurrent state, by design.*Pass the model "
                                             rf"itself to dcp_compile.transform"):
        hf.prepare(build_hybrid(model_type))


def test_hf_prepare_refuses_a_hybrid_without_a_swap_rule_as_transform_does(monkeypatch):
    """LFM2 with its rule taken out of RULES: transform()'s refusal, naming its mixer."""
    from dcp_compile import hf
    from dcp_compile.frontends import module_recurrent
    monkeypatch.setattr(module_recurrent, "RULES", tuple(
        r for r in module_recurrent.RULES if r.cls != "Lfm2ShortConv"))
    with pytest.raises(DCPHybridError, match=r"no swap rule runs its recurrent layers as a "
                                             r"dcp op \(modules \[.*'Lfm2ShortConv'"):
        hf.prepare(build_hybrid("lfm2"))


def test_engine_refuses_prefix_caching_and_rewind_of_a_hybrid():
    from dcp_compile.runtime.serving.engine import Engine, LocalExecutor
    with pytest.raises(DCPHybridError, match="prefix caching with a hybrid program"):
        Engine(LocalExecutor(None, []), SHAPES, block_size=BLOCK, prefix_caching=True,
               state_slots=3)
    engine = Engine(LocalExecutor(None, []), SHAPES, block_size=BLOCK, state_slots=3)
    engine.lengths = [5]
    with pytest.raises(DCPHybridError, match="rewinding sequence 0 of a hybrid program"):
        engine.rewind(0, 3)


def test_a_sharded_input_of_a_recurrent_op_is_refused_naming_it():
    """The rule places the op only with every input replicated (the head cut is not built):
    anything else is a refusal naming the input and its placement."""
    from torch.fx import Graph

    from dcp_compile.passes.placement import R, Refusal, Seg, Shard, rule_for
    g = Graph()
    ins = {}
    for name, shape, dtype in (("x", (2, 4, 8), torch.float32), ("w", (8, 4), torch.float32),
                               ("conv", (4, 8, 3), torch.float32), ("slot", (2,), torch.int64),
                               ("fresh", (2,), torch.bool), ("lengths", (2,), torch.int64)):
        ins[name] = g.placeholder(name)
        ins[name].meta["val"] = torch.empty(shape, dtype=dtype)
    op = torch.ops.dcp.short_conv.default
    node = g.call_function(op, (ins["x"], ins["w"], None, ins["conv"], ins["slot"],
                                ins["fresh"], ins["lengths"]))
    node.meta["val"] = (torch.empty(2, 4, 8), torch.empty(4, 8, 3))
    rule = rule_for(op)
    assert rule.forward(node, lambda a: R) == (R, R)
    cut = Shard(2, (Seg(8, 4),), "mlp")
    with pytest.raises(Refusal, match=r"runs whole on every rank.*its inputs x is"):
        rule.forward(node, lambda a: cut if a is ins["x"] else R)
    assert set(rule.backward(node, cut).values()) == {R}


def test_the_vllm_plugin_refuses_a_hybrid_by_name():
    from types import SimpleNamespace

    from dcp_compile.vllm.model import refuse_unserved

    def config(**hf):
        return SimpleNamespace(
            parallel_config=SimpleNamespace(pipeline_parallel_size=1,
                                            prefill_context_parallel_size=1),
            speculative_config=None, model_config=SimpleNamespace(
                hf_config=SimpleNamespace(**hf)))
    refuse_unserved(config(model_type="llama"))
    with pytest.raises(DCPHybridError, match=r"hybrid model \(model_type='qwen3_next'\)"):
        refuse_unserved(config(model_type="qwen3_next"))
    with pytest.raises(DCPHybridError, match=r"layer_types with \['mamba'\]"):
        refuse_unserved(config(model_type="new", layer_types=["mamba", "attention"]))
