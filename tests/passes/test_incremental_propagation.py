"""Incremental shape propagation in the pass manager equals a full re-propagation.

After every pass of every step (decode: context + decode; prefill) of the demo model and of
a tiny Hugging Face Llama, the manager's check mode re-propagates the whole graph and
compares each node's meta['val'] (shape, dtype, stride, device) with what the incremental
propagation left there. The check itself is shown to catch a pass whose changes are not
propagated.
"""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.models.demo import demo_model
from dcp_compile.passes import propagation
from dcp_compile.runtime.serving.engine import StepShapes

SHAPES = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5)


@pytest.fixture
def checked(monkeypatch):
    """Turn the full comparison on and record, per pass, the nodes compared and mismatches."""
    seen = []
    full = propagation.propagation_mismatches

    def spy(gm):
        bad = full(gm)
        seen.append((len(gm.graph.nodes), bad))
        return bad

    monkeypatch.setattr(propagation, "propagation_mismatches", spy)
    monkeypatch.setenv(propagation.FULL_PROPAGATION_ENV, "1")
    return seen


def _tiny_hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    from dcp_compile import hf
    return hf.prepare(transformers.LlamaForCausalLM(config).eval())


MODELS = {"demo": lambda: demo_model(), "hf-llama": _tiny_hf_llama}


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("model_id", list(MODELS))
def test_incremental_equals_full_after_every_pass(checked, model_id, mode):
    program = dcp_compile.transform(MODELS[model_id](), tp=4, dcp=2, mode=mode,
                                    block_size=4, shapes=SHAPES, check=False)  # shapes only
    passes = [r for r in program.history if r.name != "capture"]
    assert len(checked) == len(passes) > 0
    for record, (nodes, bad) in zip(passes, checked):
        assert bad == [], (record.step, record.name, bad)
    steps = {r.step for r in passes}
    assert steps == ({"context", "decode"} if mode == "decode" else {"prefill"})
    # Incremental: no pass recomputed every node, and unmodified passes none at all.
    assert all(r.propagated < nodes for r, (nodes, _) in zip(passes, checked))
    assert all(r.propagated == 0 for r in passes if not r.modified)
    assert any(r.propagated > 0 for r in passes)


def test_check_catches_a_pass_whose_changes_are_not_propagated(checked, monkeypatch):
    """A manager that skipped propagation after the pass that shards weights and caches."""
    real = propagation.propagate_changed

    def skip_after_sharding(gm, changed, before=None):
        if any(n.op == "placeholder" and "dcp_full_shape" in n.meta for n in changed):
            return 0
        return real(gm, changed, before)

    monkeypatch.setattr(propagation, "propagate_changed", skip_after_sharding)
    with pytest.raises(DCPTransformError, match="after pass shard_tensor_parallel .* "
                                                "differs from a full one"):
        dcp_compile.transform(demo_model(), tp=4, dcp=2, mode="decode", block_size=4,
                              shapes=SHAPES)


def test_changed_nodes_sees_new_nodes_new_args_and_replaced_values():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x + 1) * 2

    gm = torch.export.export(M(), (torch.zeros(2, 3),)).graph_module
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert propagation.changed_nodes(gm, propagation.snapshot(gm)) == [out]  # export left no val
    propagation.repropagate(gm)
    before = propagation.snapshot(gm)
    assert propagation.changed_nodes(gm, before) == []
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    mode = propagation.fake_mode(gm)
    with mode:
        x.meta["val"] = torch.empty(4, 3)                   # a sharded input
    with gm.graph.inserting_after(add):
        neg = gm.graph.call_function(torch.ops.aten.neg.default, (add,))
    relu.args = (neg,)                                       # rewired user
    assert set(propagation.changed_nodes(gm, before)) == {x, neg, relu}
    n = propagation.propagate_changed(gm, propagation.changed_nodes(gm, before))
    assert n == len(gm.graph.nodes) - 1  # every node depends on x
    assert tuple(out.meta["val"][0].shape) == (4, 3)
    assert propagation.propagation_mismatches(gm) == []


def test_a_value_the_pass_set_itself_still_reaches_the_users():
    """A pass that rewires a node and writes its new meta['val'] itself: the users saw the
    value from before the pass, so they must be recomputed too."""
    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.relu(x + 1) * 2 + y.sum()

    gm = torch.export.export(M(), (torch.zeros(2, 3), torch.zeros(4, 3))).graph_module
    propagation.repropagate(gm)
    before = propagation.snapshot(gm)
    y = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    add.args = (y, 1)
    with propagation.fake_mode(gm):
        add.meta["val"] = torch.empty(4, 3)  # what the pass knows the new value is
    propagation.propagate_changed(gm, propagation.changed_nodes(gm, before), before)
    assert propagation.propagation_mismatches(gm) == []
