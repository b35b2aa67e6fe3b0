"""The one collectives table (dcp_compile.runtime.distributed.roles.COLLECTIVES) against torch's own ops, and the one
role-binding helper (dcp_compile.runtime.distributed.roles.bound_collectives) as its three users call it."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule

from dcp_compile.runtime.errors import DCPLoweringError, DCPNeuronError, DCPWorldError
from dcp_compile.runtime.distributed.roles import (COLLECTIVES, KINDS, REDUCTIONS, WAIT_TARGET, bound_collectives,
                           role_name, role_of, uneven_splits)

F = torch.ops._c10d_functional
# Per collective: its arguments after the input, on a group of 4 ranks named "g".
ARGS = {"all_gather": (4, "g"), "reduce_scatter": ("sum", 4, "g"), "all_reduce": ("sum", "g"),
        "all_to_all": ([2, 2, 2, 2], [2, 2, 2, 2], "g")}


@pytest.mark.parametrize("target", list(COLLECTIVES), ids=lambda t: COLLECTIVES[t].name)
def test_argument_positions_are_the_ops_schema(target):
    kind = COLLECTIVES[target]
    names = [a.name for a in target._schema.arguments]
    assert names[kind.group_arg] == "group_name"
    assert kind.size_arg is None and "group_size" not in names or \
        names[kind.size_arg] == "group_size"
    assert kind.reduce_arg is None and "reduce_op" not in names or \
        names[kind.reduce_arg] == "reduce_op"
    assert [names[i] for i in kind.split_args] == \
        [n for n in names if n.endswith("split_sizes")]
    assert kind.stablehlo == f"stablehlo.{kind.name}"


@pytest.mark.parametrize("name", list(KINDS))
def test_result_shape_is_torchs(name):
    """result_shape (the lowering's marker shape) equals the op's own fake kernel's."""
    target = next(t for t, k in COLLECTIVES.items() if k.name == name)
    with FakeTensorMode():
        x = torch.empty(8, 3)
        expected = list(target(x, *ARGS[name]).shape)
    assert KINDS[name].result_shape(x.shape, 4) == expected


def test_reductions_cover_every_backend():
    assert set(REDUCTIONS) == {"sum", "max", "min", "product"}
    assert all(r.stablehlo.startswith("stablehlo.") and r.xla.startswith("REDUCE_")
               for r in REDUCTIONS.values())


def _graph(role: str, kind: str = "all_gather", args=None) -> GraphModule:
    """x -> one collective on ``role`` -> wait -> output, with fake shapes."""
    g = Graph()
    x = g.placeholder("x")
    target = next(t for t, k in COLLECTIVES.items() if k.name == kind)
    call_args = list(args or ARGS[kind])
    call_args[-1] = role_name(role)
    c = g.call_function(target, (x, *call_args))
    g.output(g.call_function(WAIT_TARGET, (c,)))
    gm = GraphModule(torch.nn.Module(), g)
    with FakeTensorMode():
        x.meta["val"] = torch.empty(8, 3)
        c.meta["val"] = target(x.meta["val"], *call_args)
    return gm


def test_bound_collectives_binds_and_refuses_an_unbound_role():
    gm = _graph("dcp")
    [c] = bound_collectives(gm.graph, {"dcp": "the group"}, error=ValueError, fix="Do it")
    assert (c.kind.name, c.role, c.binding, role_of(c.node)) == \
        ("all_gather", "dcp", "the group", "dcp")
    with pytest.raises(ValueError, match=r"^collective all_gather at node "
                                         r"all_gather_into_tensor_default runs on role 'dcp', "
                                         r"which the topology does not have: roles are "
                                         r"\['tp'\]. Do it.$"):
        bound_collectives(gm.graph, {"tp": "x"}, error=ValueError, fix="Do it")


def test_uneven_splits():
    kind = KINDS["all_to_all"]
    assert uneven_splits(_graph("dcp", "all_to_all").graph.find_nodes(
        op="call_function", target=F.all_to_all_single.default)[0], kind) is None
    gm = _graph("dcp", "all_to_all", ([3, 1], [2, 2], "g"))
    node = gm.graph.find_nodes(op="call_function", target=F.all_to_all_single.default)[0]
    assert uneven_splits(node, kind) == [[3, 1], [2, 2]]


def test_each_user_raises_its_own_error_for_an_unbound_role():
    """The three binders (lowering, NxD backend, RankProgram) refuse a role the topology or
    the rank's groups lack, each with its own exception type."""
    from dcp_compile.runtime.distributed.neuron import bind_xla_collectives
    gm = _graph("cp_kv")
    groups = {"tp": [[0, 1, 2, 3]], "dcp": [[0, 1], [2, 3]]}
    with pytest.raises(DCPNeuronError, match="role 'cp_kv', which the topology does not have"):
        bind_xla_collectives(gm, groups)
    pytest.importorskip("torch_mlir")
    from dcp_compile.lowering import mark_collectives
    with pytest.raises(DCPLoweringError, match=r"introduced by pass capture, step 'decode'\) "
                                               r"runs on role 'cp_kv'"):
        mark_collectives(gm, "decode", groups)


def test_rank_program_refuses_an_unbound_role():
    import dcp_compile
    from dcp_compile.models.demo import DemoConfig, demo_model
    from dcp_compile.runtime.serving.engine import StepShapes
    prog = dcp_compile.transform(demo_model(DemoConfig(num_layers=1)), tp=4, dcp=2,
                                 mode="decode", shapes=StepShapes(batch=2, context_len=8,
                                                                  max_blocks=2, num_blocks=4))
    with pytest.raises(DCPWorldError, match=r"runs on role 'dcp', which rank 0's process "
                                            r"groups does not have: roles are \['tp'\]"):
        prog.load(0, {"tp": "group_tp"})
