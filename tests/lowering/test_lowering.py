"""Lowering to StableHLO (dcp_compile.lowering): structure, bad input, CLI.

Structure: every step kind of the demo programs lowers to a module that parses back,
round-trips through the portable artifact, is pure StableHLO with static shapes, and has
exactly the specification's collectives on the specification's replica groups (read back from
the module, not from our own summary); bad input; the CLI. Numerics in the StableHLO
reference interpreter: tests/lowering/test_lowering_interpreter.py; the NxD collective backend:
tests/lowering/test_lowering_nxd.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir (pip install torch-mlir)")

from dcp_compile.lowering import collectives_in, deserialize, lower, op_counts  # noqa: E402
from dcp_compile.passes.collectives import role_of  # noqa: E402
from dcp_compile.runtime.errors import DCPLoweringError  # noqa: E402

from lowering_helpers import (LAYERS, SHAPES, XLA_SHAPES, lowered_for,  # noqa: E402
                              program_for)

# The specification's process groups ("Process Groups"), written out, not computed.
SPEC_GROUPS = {
    (8, 4, "decode"): {"tp": [list(range(8))], "dcp": [[0, 1, 2, 3], [4, 5, 6, 7]]},
    (4, 2, "decode"): {"tp": [list(range(4))], "dcp": [[0, 1], [2, 3]]},
    (8, 4, "prefill"): {"world": [list(range(8))], "cp_kv": [[0, 2, 4, 6], [1, 3, 5, 7]],
                        "dcp_tp": [[0, 1], [2, 3], [4, 5], [6, 7]]},
    (4, 2, "prefill"): {"world": [list(range(4))], "cp_kv": [[0, 2], [1, 3]],
                        "dcp_tp": [[0, 1], [2, 3]]},
}


def expected_collectives(step: str, L: int) -> dict[tuple[str, str], int] | None:
    """(kind, role) -> count in one module, by the specification's decode pattern: per layer
    Q all-gather, LSE all-gather, head reduce-scatter on the DCP group, O-projection and MLP
    all-reduce on TP; per model the vocab-parallel embedding all-reduce and LM-head
    all-gather. Prefill is checked against its graph and for the spec's per-layer ones."""
    if step == "decode":
        return {("all_gather", "dcp"): 2 * L, ("reduce_scatter", "dcp"): L,
                ("all_reduce", "tp"): 2 * L + 1, ("all_gather", "tp"): 1}
    if step == "context":
        return {("all_reduce", "tp"): 2 * L + 1, ("all_gather", "tp"): 1}
    return None


CONFIGS = [pytest.param(8, 4, "decode", id="tp8-dcp4-decode"),
           pytest.param(4, 2, "decode", id="tp4-dcp2-decode"),
           pytest.param(8, 4, "prefill", id="tp8-dcp4-prefill"),
           pytest.param(4, 2, "prefill", id="tp4-dcp2-prefill")]


KIND_OF = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
           "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}


def role_of_groups(groups, spec):
    roles = [r for r, gs in spec.items() if gs == groups]
    assert roles, f"replica groups {groups} are no role's full partition: {spec}"
    return roles[0]


# ------------------------------------------------------------------------------------------
# Structure
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp,dcp,mode", CONFIGS)
def test_every_step_lowers_with_the_specs_collectives_and_groups(tp, dcp, mode,
                                                                 tmp_path_factory):
    prog, result = lowered_for(tp, dcp, mode, tmp_path_factory)
    spec = SPEC_GROUPS[(tp, dcp, mode)]
    assert set(result.modules) == set(prog.graphs)
    for step, m in result.modules.items():
        found = collectives_in(m.text)                    # read back from the module itself
        assert found, f"{step}: no collectives in a tp={tp} module"
        for c in found:
            assert c["use_global_device_ids"], c
            assert sorted(sum(c["replica_groups"], [])) == list(range(tp)), c
        handles = [c["channel_handle"] for c in found]
        assert len(set(handles)) == len(handles) and min(handles) >= 1
        counts: dict = {}
        for c in found:
            key = (c["kind"], role_of_groups(c["replica_groups"], spec))
            counts[key] = counts.get(key, 0) + 1
        # The module has the graph's collectives, one to one, on the roles' full partitions.
        graph_counts: dict = {}
        for node in prog.graphs[step].graph.nodes:
            role = role_of(node)
            if role is not None:
                kind = KIND_OF[node.target._opname]
                graph_counts[(kind, role)] = graph_counts.get((kind, role), 0) + 1
        assert counts == graph_counts, step
        expected = expected_collectives(step, prog.num_layers)
        if expected is not None:
            assert counts == expected, f"{step}: {counts}"
        if step == "decode":
            for layer in range(prog.num_layers):
                mine = sorted((c.kind, c.role) for c in m.collectives
                              if c.layer == layer and c.role == "dcp")
                assert mine == [("all_gather", "dcp"), ("all_gather", "dcp"),
                                ("reduce_scatter", "dcp")], layer
            dims = {(c["kind"], c["dim"]) for c in found}
            assert dims <= {("all_gather", 0), ("reduce_scatter", 0), ("all_reduce", None)}
        if step == "prefill":   # the per-layer prefill collectives
            L = prog.num_layers
            assert counts.get(("all_gather", "cp_kv"), 0) >= L          # Q (and LSE)
            assert counts.get(("reduce_scatter", "cp_kv"), 0) >= L      # heads
            assert counts.get(("reduce_scatter", "dcp_tp"), 0) >= L     # O projection


@pytest.mark.parametrize("tp,dcp,mode", CONFIGS)
def test_modules_parse_back_round_trip_and_keep_the_contract(tp, dcp, mode, tmp_path_factory):
    from torch_mlir import ir

    prog, result = lowered_for(tp, dcp, mode, tmp_path_factory)
    spec = prog.cache_spec()
    for step, m in result.modules.items():
        text = open(m.paths["text"]).read()
        artifact = open(m.paths["artifact"], "rb").read()
        assert text == m.text and artifact == m.artifact and artifact[:4] == b"ML\xefR"
        module = m.parse()
        counts = op_counts(text)
        assert all(name.split(".")[0] in ("stablehlo", "func") for name in counts), counts
        assert "stablehlo.custom_call" not in text and "?" not in text.split("{", 1)[0]
        assert not any(t in text for t in ("tensor<?", "x?x", "<*x"))
        assert "f64" not in text          # torch-mlir's f64 scalars are folded (no f64 on Neuron)
        # Portable artifact: deserialize, serialize again, deserialize: a fixpoint, with the
        # same ops and the same collectives (VHLO keeps a collective's channel id, not the
        # channel type, which XLA ignores for collectives).
        once = deserialize(artifact).operation.get_asm(large_elements_limit=None)
        from dcp_compile.lowering import serialize
        twice = deserialize(serialize(once, m.target_version)).operation.get_asm(
            large_elements_limit=None)
        assert once == twice
        assert op_counts(once) == counts
        strip = [{k: c[k] for k in ("kind", "dim", "replica_groups", "channel_handle")}
                 for c in collectives_in(text)]
        assert [{k: c[k] for k in ("kind", "dim", "replica_groups", "channel_handle")}
                for c in collectives_in(once)] == strip
        # One module for every rank: the rank and the caches are inputs, caches come back.
        func = next(op for op in module.body.operations if op.operation.name == "func.func")
        ftype = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
        assert m.input_names[-(4 + 2 * LAYERS):-2 * LAYERS] == [
            "tp_rank", "input_ids", "positions", "block_table"]
        rank_type = ftype.inputs[m.input_names.index("tp_rank")]
        assert str(rank_type) == "tensor<i64>"
        cache_type = f"tensor<{'x'.join(map(str, spec.shape))}xf32>"
        caches = [i for i, n in enumerate(m.input_names) if n.startswith("kv_caches")]
        assert len(caches) == 2 * LAYERS
        assert all(str(ftype.inputs[i]) == cache_type for i in caches)
        assert m.output_names == ["logits"] + [f"new_kv_caches_{k}" for k in range(2 * LAYERS)]
        assert all(str(t) == cache_type for t in ftype.results[1:])
        for k, i in enumerate(caches):
            assert f'dcp.name = "kv_caches_{k}", tf.aliasing_output = {k + 1} : i32' in text
        assert f"mhlo.num_replicas = {tp} : i32" in text
    summary = json.loads(open(f"{result.out_dir}/lowering.json").read())
    assert set(summary["steps"]) == set(prog.graphs)
    for step, s in summary["steps"].items():
        for c in s["collectives"]:
            assert c["replica_groups"] == SPEC_GROUPS[(tp, dcp, mode)][c["role"]]
            assert c["channel_handle"] >= 1 and c["kind"] in ("all_gather", "reduce_scatter",
                                                               "all_reduce", "all_to_all")


def test_bf16_program_lowers_with_bf16_collectives():
    # A collective's dtype is the same in every layer: the one-layer bf16 program that
    # test_xla runs on XLA and compares with the model every step (shared, lowering_helpers).
    prog, result = lowered_for(8, 4, "decode", None, torch.bfloat16, XLA_SHAPES, layers=1,
                               check=False)
    for step, m in result.modules.items():
        assert "xbf16>" in m.text.split("\n", 2)[1]              # bf16 weights and caches
        assert "f64" not in m.text
        assert deserialize(m.artifact) is not None
        by_kind: dict = {}
        for c in collectives_in(m.text):
            groups = c["replica_groups"]
            by_kind.setdefault((c["kind"], len(groups)), set()).add((len(c["shape"]),
                                                                     c["dtype"]))
        # Hidden states, Q and logits move in bf16 on TP (one group) and DCP (two groups);
        # the LSE all-gather stays float32 (spec: LSE in float32), and so does the LSE-
        # corrected partial output that the head reduce-scatter sums.
        assert by_kind[("all_reduce", 1)] == {(3, "bf16")}
        assert by_kind[("all_gather", 1)] == {(3, "bf16")}
        if step == "decode":
            assert by_kind[("all_gather", 2)] == {(4, "bf16"), (3, "f32")}
            assert by_kind[("reduce_scatter", 2)] == {(4, "f32")}


def test_every_collective_kind_and_reduction_lowers_on_its_roles_groups():
    from torch.fx.experimental.proxy_tensor import make_fx

    from dcp_compile.lowering import lower_graph
    F = torch.ops._c10d_functional

    def f(x, y):
        a = F.wait_tensor(F.all_to_all_single(x, [2, 2], [2, 2], "dcp_role:dcp"))
        b = F.wait_tensor(F.all_reduce(y, "max", "dcp_role:tp"))
        c = F.wait_tensor(F.reduce_scatter_tensor(a, "sum", 2, "dcp_role:dcp"))
        d = F.wait_tensor(F.all_gather_into_tensor(c.to(torch.bfloat16), 2, "dcp_role:dcp"))
        return a, b, c, d

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 3), torch.randn(5))
    groups = {"dcp": [[0, 1], [2, 3]], "tp": [[0, 1, 2, 3]]}
    m = lower_graph(gm, step="synthetic", groups=groups, tp=4)
    got = [(c["kind"], c["dim"], c["replica_groups"], c["channel_handle"],
            c["use_global_device_ids"], c["shape"], c["dtype"]) for c in collectives_in(m.text)]
    assert got == [
        # all_to_all has no use_global_device_ids in StableHLO, and a channel would make its
        # groups partition ids: without one they are replica ids (= tp ranks).
        ("all_to_all", 0, [[0, 1], [2, 3]], None, False, (4, 3), "f32"),
        ("all_reduce", None, [[0, 1, 2, 3]], 2, True, (5,), "f32"),
        ("reduce_scatter", 0, [[0, 1], [2, 3]], 3, True, (4, 3), "f32"),
        ("all_gather", 0, [[0, 1], [2, 3]], 4, True, (2, 3), "bf16")]
    assert "stablehlo.maximum" in m.text and "split_count = 2" in m.text
    assert [c.role for c in m.collectives] == ["dcp", "tp", "dcp", "dcp"]


def test_passes_run_by_a_foreign_pass_manager_then_lower_like_transform():
    """A Neuron plugin's own pass manager (here torch's) runs our passes as plain FX passes
    in pipeline.passes_for's order, re-propagating meta['val'] between them as our manager
    does; the graph it gets lowers to the same module as transform()'s."""
    from torch.fx.passes.infra.pass_base import PassResult
    from torch.fx.passes.infra.pass_manager import PassManager

    from dcp_compile.capture import capture, example_step_inputs
    from dcp_compile.runtime.config import DCPConfig
    from dcp_compile.lowering import lower_graph
    from dcp_compile.driver import passes_for
    from dcp_compile.frontends.protocol import PAGED_STEP
    from dcp_compile.passes.infra import TransformContext
    from dcp_compile.passes.propagation import repropagate
    from dcp_compile.runtime.program.facts import ModelFacts

    model, prog = program_for(8, 4, "decode")
    example = example_step_inputs(SHAPES.batch, 1, SHAPES.max_blocks,
                                  model.kv_cache_shape(SHAPES.num_blocks, 16), LAYERS,
                                  device="cpu", dtype=torch.float32)
    captured = capture(model, example)
    ctx = TransformContext(config=DCPConfig(tp=8, dcp=4, mode="decode", block_size=16),
                           step="decode", facts=ModelFacts(num_layers=LAYERS))
    ours = passes_for(ctx, captured.user_inputs[0], given=PAGED_STEP)   # a paged model
    assert all(callable(p) and isinstance(p.name, str) for p in ours)

    def reprop(gm):
        gm.graph.lint()
        gm.recompile()
        repropagate(gm)
        return PassResult(gm, False)

    pm = PassManager(passes=[f for p in ours for f in (p, reprop)])
    gm = pm(captured.gm).graph_module
    mine = lower_graph(gm, step="decode", groups=prog.topology.groups, tp=8,
                       input_shapes={n: (tuple(prog.cache_spec().shape), torch.float32)
                                     for n in captured.user_inputs if n.startswith("kv")})
    reference = lowered_for(8, 4, "decode")[1]["decode"]        # transform()'s, lowered
    strip = lambda m: [(c.kind, c.dim, c.replica_groups, c.channel_handle, c.role)  # noqa: E731
                       for c in m.collectives]
    assert strip(mine) == strip(reference)
    assert mine.op_counts() == reference.op_counts()


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------


@torch.library.custom_op("dcp_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_opaque.register_fake
def _(x):
    return torch.empty_like(x)


def _with_graph(prog, step, edit):
    from dcp_compile.runtime.serving.rank_program import copy_graph_module
    gm = copy_graph_module(prog.graphs[step])
    edit(gm)
    gm.recompile()
    return dataclasses.replace(prog, graphs={step: gm})


def _first(gm, name):
    return next(n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


def test_op_without_decomposition_names_the_op_and_the_pass():
    _, prog = program_for(4, 2, "decode")

    def edit(gm):
        x = _first(gm, "aten.mul.Tensor")
        with gm.graph.inserting_after(x):
            y = gm.graph.call_function(torch.ops.dcp_test.opaque.default, (x,))
        x.replace_all_uses_with(y, delete_user_cb=lambda u: u is not y)
        y.meta.update(val=x.meta["val"], dcp_pass="insert_opaque")

    with pytest.raises(DCPLoweringError, match=r"op dcp_test::opaque at node opaque_default .*"
                                               r"pass insert_opaque.*step 'decode'"):
        lower(_with_graph(prog, "decode", edit))


def test_op_torch_mlir_cannot_lower_names_the_op_and_the_pass():
    import operator
    _, prog = program_for(4, 2, "decode")
    aten = torch.ops.aten

    def edit(gm):
        x = _first(gm, "aten.rsqrt")
        with gm.graph.inserting_after(x):
            k = gm.graph.call_function(aten.kthvalue.default, (x, 1, -1, True))
        with gm.graph.inserting_after(k):
            v = gm.graph.call_function(operator.getitem, (k, 0))
        with gm.graph.inserting_after(v):
            y = gm.graph.call_function(aten.add.Tensor, (x, v))
        x.replace_all_uses_with(y, delete_user_cb=lambda u: u not in (k, y))
        for n in (k, v, y):
            n.meta["dcp_pass"] = "insert_kthvalue"

    with pytest.raises(DCPLoweringError, match=r"torch-mlir's .* pipeline failed on step "
                                               r"'decode'.*Not lowered: torch.aten.kthvalue from "
                                               r"node kthvalue_default \(introduced by pass "
                                               r"insert_kthvalue\)"):
        lower(_with_graph(prog, "decode", edit))


def test_dynamic_shape_names_the_node_and_the_pass():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    _, prog = program_for(4, 2, "decode")
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        dynamic = torch.empty(env.create_unbacked_symint(), 128)

    def edit(gm):
        node = _first(gm, "aten.mul.Tensor")
        node.meta.update(val=dynamic, dcp_pass="make_it_dynamic")

    with pytest.raises(DCPLoweringError, match=r"dynamic shape: node mul.* aten::mul.Tensor, "
                                               r"introduced by pass make_it_dynamic"):
        lower(_with_graph(prog, "decode", edit))


def test_unknown_target_and_step_are_errors():
    _, prog = program_for(4, 2, "decode")
    with pytest.raises(DCPLoweringError, match="unknown lowering target"):
        lower(prog, target="tosa")
    with pytest.raises(DCPLoweringError, match="no step"):
        lower(prog, steps=["prefill"])


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------


def test_cli_writes_modules_and_prints_the_summary(tmp_path, capsys):
    from dcp_compile.cli import main
    out = tmp_path / "lowered"
    rc = main(["lower", "--tp", "8", "--dcp", "4", "--mode", "decode", "--out", str(out),
               "--layers", "1", "--batch", "2", "--context-len", "16", "--max-blocks", "4",
               "--num-blocks", "8", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["steps"]) == {"context", "decode"}
    for step in ("context", "decode"):
        assert (out / f"{step}.stablehlo.mlir").is_file()
        assert (out / f"{step}.stablehlo.mlirbc").is_file()
    dec = summary["steps"]["decode"]["collectives"]
    assert [(c["kind"], c["replica_groups"]) for c in dec if c["role"] == "dcp"] == [
        ("all_gather", [[0, 1, 2, 3], [4, 5, 6, 7]])] * 2 + [
        ("reduce_scatter", [[0, 1, 2, 3], [4, 5, 6, 7]])]
    assert all(c["dim"] == 0 for c in dec if c["kind"] != "all_reduce")
    assert [c["channel_handle"] for c in dec] == list(range(1, len(dec) + 1))
