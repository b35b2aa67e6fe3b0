"""Lowering cost that does not grow with repeated work (dcp_compile.lowering.decompose_by_op).

The layers of a model make the same op calls on inputs of the same shapes, so the lowering
traces each distinct op call once and copies its decomposition for the others. Checked here:
the structural fact (how many calls are traced does not depend on the number of layers), that
the module is exactly the one the whole-graph make_fx retrace gives, and numerics of a
4-layer program in the StableHLO interpreter against the eager single-device model.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir (pip install torch-mlir)")

import dcp_compile  # noqa: E402
from dcp_compile import lowering  # noqa: E402
from dcp_compile.models.demo import DemoConfig, demo_model  # noqa: E402
from dcp_compile.runtime.engine import StepShapes  # noqa: E402

from helpers import assert_close_report  # noqa: E402

SHAPES = StepShapes(batch=2, context_len=16, max_blocks=4, num_blocks=8)


def _program(layers: int, tp: int, dcp: int, mode: str, shapes=SHAPES):
    model = demo_model(DemoConfig(num_layers=layers))
    return model, dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, shapes=shapes)


def _decompose_counting(prog, step: str) -> lowering.DecompositionCache:
    gm = prog.graphs[step]
    marked, _, _ = lowering.mark_collectives(gm, step, prog.topology.groups)
    shapes = lowering._rank_input_shapes(prog, step)
    specs = [shapes.get(n.name, (tuple(n.meta["val"].shape), n.meta["val"].dtype))
             for n in marked.graph.nodes if n.op == "placeholder"]
    cache = lowering.DecompositionCache()
    lowering.decompose_by_op(marked, specs, cache=cache)
    return cache


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_op_calls_traced_do_not_grow_with_layers(mode):
    """2 and 5 layers trace the same number of distinct op calls; the 3 extra layers are
    copies only (and every call of the 2-layer graph past the first layer is a copy too)."""
    two = {s: _decompose_counting(p, s) for p in [_program(2, 4, 2, mode)[1]] for s in p.graphs}
    five = {s: _decompose_counting(p, s) for p in [_program(5, 4, 2, mode)[1]] for s in p.graphs}
    assert set(two) == set(five)
    for step in two:
        assert two[step].traced == five[step].traced > 0, step
        per_layer = (five[step].copied - two[step].copied) / 3
        assert per_layer == int(per_layer) > 0, step
        assert two[step].copied >= per_layer, step     # layer 1 of 2 was copied


@pytest.mark.parametrize("tp,dcp,mode", [(4, 2, "decode"), (4, 2, "prefill")])
def test_reused_decomposition_lowers_to_the_same_module_as_the_whole_retrace(tp, dcp, mode,
                                                                           monkeypatch):
    _, prog = _program(3, tp, dcp, mode)
    reused = lowering.lower(prog)
    whole_decompose = lowering.decompose
    monkeypatch.setattr(lowering, "decompose",
                        lambda *a, **k: whole_decompose(*a, **{**k, "reuse": False}))
    whole = lowering.lower(prog)
    assert set(reused.modules) == set(whole.modules) == set(prog.graphs)
    for step in prog.graphs:
        assert reused[step].text == whole[step].text, step
        assert [c.to_json() for c in reused[step].collectives] == \
            [c.to_json() for c in whole[step].collectives]


def test_reuse_keys_tell_int_float_and_bool_arguments_apart():
    """A cached decomposition is only reused for the same non-tensor arguments: 1, 1.0 and
    True are different keys (they compare equal in Python)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3)
    keys = {lowering.op_call_key(torch.ops.aten.add.Tensor, (x, v), {})[0]
            for v in (1, 1.0, True)}
    assert len(keys) == 3
    y = g.placeholder("y")
    y.meta["val"] = torch.empty(3, 2).t()          # same shape as x, other strides
    assert lowering.op_call_key(torch.ops.aten.add.Tensor, (x, 1), {})[0] != \
        lowering.op_call_key(torch.ops.aten.add.Tensor, (y, 1), {})[0]


@pytest.mark.skipif(not lowering.interpreter_available()[0], reason="no StableHLO interpreter")
def test_four_layer_program_in_the_interpreter_matches_the_eager_model():
    """The reused decompositions compute the model: a 4-layer tp=1 program (every layer's
    body but the first copied) in the StableHLO interpreter against the eager forward."""
    shapes = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=4)
    model, prog = _program(4, 1, 1, "decode", shapes)
    result = lowering.lower(prog)
    spec = prog.cache_spec(torch.float32)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(spec.shape, generator=g) for _ in range(2 * 4)]
    state = prog.state_dict_for(0)
    prefix = [state[n] for n in prog.weight_inputs] + [state["tp_rank"]]
    for kind in prog.graphs:
        if kind == "decode":    # row 0 decodes position 20 (blocks 1, 2); row 1 is padding
            ids, pos, table = (torch.tensor([[5], [0]]), torch.tensor([[20], [-1]]),
                               torch.tensor([[1, 2], [-1, -1]]))
        else:
            S = shapes.context_len
            ids = torch.randint(0, 256, (shapes.batch, S), generator=g)
            pos = torch.full((shapes.batch, S), -1)
            pos[0], pos[1, :3] = torch.arange(S), torch.arange(3)
            table = torch.tensor([[0, -1], [1, -1]])
        got = lowering.run_interpreter(result[kind], prefix + [ids, pos, table] + caches)
        with torch.no_grad():
            ref_logits, ref_caches = model(ids, pos, table, [c.clone() for c in caches])
        assert_close_report(got[0], ref_logits, atol=1e-4, what=f"{kind} logits")
        for i, (a, b) in enumerate(zip(got[1:], ref_caches)):
            assert_close_report(a[:spec.garbage_block], b[:spec.garbage_block], atol=1e-4,
                                what=f"{kind} cache {i}")


def test_repeated_calls_are_merged_but_not_random_ones_or_other_arguments():
    """eliminate_common_calls: the same deterministic op on the same arguments is computed
    once; a seeded random op, or the same op on another argument value, is kept."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    aten = torch.ops.aten
    same = [g.call_function(aten.add.Tensor, (x, 1)) for _ in range(3)]
    other = g.call_function(aten.add.Tensor, (x, 1.0))
    rand = [g.call_function(aten.rand_like.default, (x,)) for _ in range(2)]
    g.output((*same, other, *rand))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert lowering.eliminate_common_calls(gm.graph) == 2
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert outs[0] is outs[1] is outs[2] is same[0]
    assert len({outs[3], outs[4], outs[5], outs[0]}) == 4
    gm.recompile()
    x = torch.randn(3)
    got = gm(x)
    assert torch.equal(got[0], x + 1) and not torch.equal(got[4], got[5])
