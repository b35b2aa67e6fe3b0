"""Lowering cost that does not grow with repeated work (dcp_compile.lowering.decompose_by_op).

The layers of a model make the same op calls on inputs of the same shapes, so the lowering
traces each distinct op call once and copies its decomposition for the others. Checked here:
the structural fact (how many calls are traced does not depend on the number of layers), that
the module is exactly the one the whole-graph make_fx retrace gives. Numerics of a program
whose second layer is lowered from copies, in the StableHLO interpreter against the eager
single-device model: tests/lowering/test_lowering_interpreter.py (the tp=1 program).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir (pip install torch-mlir)")

from dcp_compile import lowering  # noqa: E402

from lowering_helpers import lowered_for, program_for  # noqa: E402


def _program(layers: int, tp: int, dcp: int, mode: str):
    """The demo program lowering_helpers shares (transformed once per process)."""
    return program_for(tp, dcp, mode, layers=layers)


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
    """2 and 3 layers trace the same number of distinct op calls; the extra layer is copies
    only (and every call of the 2-layer graph past the first layer is a copy too)."""
    two = {s: _decompose_counting(p, s) for p in [_program(2, 4, 2, mode)[1]] for s in p.graphs}
    three = {s: _decompose_counting(p, s) for p in [_program(3, 4, 2, mode)[1]] for s in p.graphs}
    assert set(two) == set(three)
    for step in two:
        assert two[step].traced == three[step].traced > 0, step
        per_layer = three[step].copied - two[step].copied
        assert per_layer > 0, step
        assert two[step].copied >= per_layer, step     # layer 1 of 2 was copied


@pytest.mark.parametrize("tp,dcp,mode", [(4, 2, "decode"), (4, 2, "prefill")])
def test_reused_decomposition_lowers_to_the_same_module_as_the_whole_retrace(tp, dcp, mode,
                                                                           monkeypatch):
    prog, reused = lowered_for(tp, dcp, mode)        # 2 layers: layer 1 lowered from copies
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


def test_a_later_lowering_takes_the_traces_of_earlier_ones(monkeypatch):
    """The process remembers each decomposed op call (decompose._TRACES): lowering the same
    calls again traces none of them and gives the same module as a process that traced
    everything."""
    import sys
    decompose = sys.modules["dcp_compile.lowering.decompose"]
    caches = []

    class Recorded(lowering.DecompositionCache):
        def __init__(self):
            super().__init__()
            caches.append(self)

    def f(a, b):
        return a // b, a % b, torch.where(a > b, a, b) * 3

    inputs = [torch.tensor([[-7, 7, 0, 33]]), torch.tensor([[2, -2, 3, 4]])]
    monkeypatch.setattr(decompose, "DecompositionCache", Recorded)
    monkeypatch.setattr(decompose, "_TRACES", {})          # a fresh process's memo
    first = lowering.lower_function(f, inputs, name="f")
    again = lowering.lower_function(f, inputs, name="f")
    assert caches[0].traced > 0 and caches[0].remembered == 0, caches[0]
    assert caches[1].remembered == caches[1].traced == caches[0].traced, caches[1]
    assert again.text == first.text
