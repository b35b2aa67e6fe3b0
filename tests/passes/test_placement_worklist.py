"""The placement analysis's worklist sweeps decide exactly what full sweeps decide, in work
linear in the layers.

``Analysis(full_sweeps=True)`` (env DCP_COMPILE_FULL_PLACEMENT_SWEEPS=1) is the original
algorithm: every sweep evaluates every node, one fixpoint per MLP down projection, so its work
grows with the square of the layers. The default visits only the nodes whose inputs changed.
Here ``analyze`` is wrapped to run both on every graph a transform analyses (demo, Hugging
Face, refused models) and compare the whole plan: every node's placement, sharded
parameters, linear kinds and roles, attention projections; or the refusal and its message.
The tests that transform models anyway wrap it the same way (:func:`compare_both`): the
named cases of tests/support/model_grammar.py in tests/frontends/test_sharding_models.py,
and every model the sharding fuzz draws from the same grammar
(tests/corpora/test_fuzz_sharding.py, 500 models), instead of capturing them again here.
"""

from __future__ import annotations

import pytest

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.errors import DCPError, DCPTransformError
import dcp_compile.passes.shard_tensor_parallel as stp
from dcp_compile.passes.placement.analysis import Analysis



def summary(plan) -> dict:
    """Everything a PlacementPlan says, by node name (comparable across two analyses)."""
    names = lambda ns: [n.name for n in ns]   # noqa: E731
    return dict(
        placements={n.name: p for n, p in plan.placements.items()},
        params={n.name: p for n, p in plan.params.items()},
        linears={n.name: k for n, k in plan.linears.items()},
        roles=dict(plan.roles), embeddings=names(plan.embeddings), kv_shard=plan.kv_shard,
        attention={at.name: {k: (names(v) if isinstance(v, list) else getattr(v, "name", v))
                             for k, v in sites.items()} for at, sites in plan.attention.items()})


def outcome(gm, config, full: bool):
    """((kind, plan summary or refusal message), the analysis, the plan or the refusal)."""
    a = Analysis(gm, config, full_sweeps=full)
    try:
        plan = a.run()
    except DCPTransformError as e:
        return ("refused", str(e)), a, e
    return ("plan", summary(plan)), a, plan


def compare_both(monkeypatch) -> list:
    """Wrap ``analyze`` in shard_tensor_parallel: both algorithms on each graph, asserted
    equal; the transform goes on with the worklist's plan (or its refusal, re-raised), as
    it would unwrapped. Returns the list of (outcome kind, worklist evaluations, full
    evaluations)."""
    seen = []

    def both(gm, config):
        full, fa, _ = outcome(gm, config, True)
        fast, wa, result = outcome(gm, config, False)
        assert fast == full, f"worklist and full sweeps differ: {fast} vs {full}"
        seen.append((fast[0], wa.evaluations, fa.evaluations))
        if isinstance(result, DCPTransformError):
            raise result
        return result

    monkeypatch.setattr(stp, "analyze", both)
    return seen


@pytest.fixture
def compared(monkeypatch):
    return compare_both(monkeypatch)


def transform(model, **kw):
    # No source lines: a refusal is then compiled once, so each graph is compared once.
    try:
        dcp_compile.transform(model, check=False, stack_traces=False, **kw)
    except DCPError:
        pass     # a refusal by placement is compared above; later passes may refuse too


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_demo_model_same_plan(compared, mode):
    model = demo_model(DemoConfig(num_layers=3))
    transform(model, tp=4, dcp=2, mode=mode)
    assert compared and all(k == "plan" for k, _, _ in compared)


def test_refused_models_same_refusal(compared):
    """The refusals of test_sharding_models (amax over heads, a full-width add)."""
    from test_sharding_models import AmaxAcrossHeads, ReplicatedSpanningHeads
    shapes = StepShapes.fitting(2, 12, 21, block_size=16, dcp=2)
    for cls in (AmaxAcrossHeads, ReplicatedSpanningHeads):
        transform(cls(), tp=4, dcp=2, mode="decode", shapes=shapes)
    assert [k for k, _, _ in compared] == ["refused", "refused"]


HF = ["llama-gqa-8to2", "qwen2-qkv-bias", "qwen3-per-head-qk-norm", "qwen2-tied-embeddings"]


@pytest.mark.parametrize("model_id", HF)
def test_hf_models_same_plan(compared, model_id):
    pytest.importorskip("transformers")
    from test_hf import MODELS, SHAPES, build
    config_name, model_name, overrides, prepare = MODELS[model_id]
    model = build(config_name, model_name, overrides)
    transform(model, tp=4, dcp=2, mode="decode", shapes=SHAPES)
    assert compared


def test_hf_deepseek_mla_same_plan(compared):
    pytest.importorskip("transformers")
    from test_mla import hf_deepseek
    shapes = StepShapes.fitting(2, 8, 16, block_size=8, dcp=2)
    transform(hf_deepseek("V3", q_lora_rank=24), tp=4, dcp=2, mode="decode", block_size=8,
              shapes=shapes)
    assert compared


def test_rule_evaluations_grow_linearly_with_layers(monkeypatch):
    """2x layers -> at most 2.2x rule evaluations; the full sweeps (the old algorithm) grow
    faster than that, so this test tells the two apart. One graph per size (a prefill
    program: a decode program's context and decode graphs count the same)."""
    seen = compare_both(monkeypatch)
    shapes = StepShapes(batch=2, context_len=16, max_blocks=4, num_blocks=16)
    counts = {}
    for layers in (4, 8, 16):
        seen.clear()
        dcp_compile.transform(demo_model(DemoConfig(num_layers=layers), device="meta"),
                              tp=4, dcp=2, mode="prefill", shapes=shapes, check=False)
        counts[layers] = (sum(w for _, w, _ in seen), sum(f for _, _, f in seen))
    fast = {k: w for k, (w, _) in counts.items()}
    full = {k: f for k, (_, f) in counts.items()}
    assert fast[8] <= 2.2 * fast[4] and fast[16] <= 2.2 * fast[8], counts
    assert full[16] > 2.2 * full[8], counts
