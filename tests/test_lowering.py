"""Lowering to StableHLO (dcp_compile.lowering) and the NxD collective backend (dcp_compile.runtime.neuron).

Structure: every step kind of the demo programs lowers to a module that parses back,
round-trips through the portable artifact, is pure StableHLO with static shapes, and has
exactly the specification's collectives on the specification's replica groups (read back from
the module, not from our own summary). Numerics: the StableHLO reference interpreter (it
ships in torch-mlir's bindings) runs the tp=1 program against the eager model, and the DCP
primitives standalone against their eager reference on the edge cases.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir (pip install torch-mlir)")

import dcp_compile  # noqa: E402
from dcp_compile.runtime import layout  # noqa: E402
from dcp_compile.lowering import (COLLECTIVE_OPS, collectives_in, deserialize,  # noqa: E402
                                  interpreter_available, lower, lower_function, op_counts,
                                  run_interpreter)
from dcp_compile.models.demo import DemoConfig, demo_model  # noqa: E402
from dcp_compile.passes.collectives import role_of  # noqa: E402
from dcp_compile.runtime.engine import StepShapes  # noqa: E402
from dcp_compile.runtime.errors import DCPLoweringError  # noqa: E402

from helpers import assert_close_report  # noqa: E402

SHAPES = StepShapes(batch=2, context_len=16, max_blocks=4, num_blocks=8)
LAYERS = 2

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


_programs: dict = {}
_lowered: dict = {}


def program_for(tp, dcp, mode, dtype=torch.float32, shapes=SHAPES):
    key = (tp, dcp, mode, dtype, shapes)
    if key not in _programs:
        model = demo_model(DemoConfig(num_layers=LAYERS), dtype=dtype)
        _programs[key] = (model, dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode,
                                                       shapes=shapes))
    return _programs[key]


def lowered_for(tp, dcp, mode, tmp_path_factory, dtype=torch.float32):
    key = (tp, dcp, mode, dtype)
    if key not in _lowered:
        _, prog = program_for(tp, dcp, mode, dtype)
        out = tmp_path_factory.mktemp(f"lower_tp{tp}_dcp{dcp}_{mode}")
        _lowered[key] = (prog, lower(prog, target="stablehlo", out_dir=out))
    return _lowered[key]


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


def test_bf16_program_lowers_with_bf16_collectives(tmp_path_factory):
    prog, result = lowered_for(8, 4, "decode", tmp_path_factory, dtype=torch.bfloat16)
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
    from dcp_compile.passes.infra import TransformContext
    from dcp_compile.passes.manager import repropagate
    from dcp_compile.runtime.facts import ModelFacts

    model, prog = program_for(8, 4, "decode")
    example = example_step_inputs(SHAPES.batch, 1, SHAPES.max_blocks,
                                  model.kv_cache_shape(SHAPES.num_blocks, 16), LAYERS,
                                  device="cpu", dtype=torch.float32)
    captured = capture(model, example)
    ctx = TransformContext(config=DCPConfig(tp=8, dcp=4, mode="decode", block_size=16),
                           step="decode", facts=ModelFacts(num_layers=LAYERS))
    ours = passes_for(ctx, captured.user_inputs[0])
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
    reference = lower(prog, steps=["decode"])["decode"]
    strip = lambda m: [(c.kind, c.dim, c.replica_groups, c.channel_handle, c.role)  # noqa: E731
                       for c in m.collectives]
    assert strip(mine) == strip(reference)
    assert mine.op_counts() == reference.op_counts()


# ------------------------------------------------------------------------------------------
# Numerics in the StableHLO reference interpreter
# ------------------------------------------------------------------------------------------

needs_interpreter = pytest.mark.skipif(not interpreter_available()[0],
                                       reason=interpreter_available()[1])


# The reference interpreter is slow on scatters into large operands (cache writes): keep the
# tp=1 program's cache small. Block 3 is the garbage block.
TP1_SHAPES = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=4)


def _step_inputs(kind, g):
    if kind == "decode":
        # Row 0 decodes position 20 (blocks 1, 2 hold its 20 prior tokens); row 1 is padding.
        return (torch.tensor([[5], [0]]), torch.tensor([[20], [-1]]),
                torch.tensor([[1, 2], [-1, -1]]))
    S = TP1_SHAPES.context_len
    ids = torch.randint(0, 256, (TP1_SHAPES.batch, S), generator=g)
    pos = torch.full((TP1_SHAPES.batch, S), -1)
    pos[0] = torch.arange(S)
    pos[1, :3] = torch.arange(3)
    return ids, pos, torch.tensor([[0, -1], [1, -1]])


@needs_interpreter
@pytest.mark.parametrize("dtype,atol", [pytest.param(torch.float32, 1e-4, id="fp32"),
                                        pytest.param(torch.bfloat16, None, id="bf16")])
def test_tp1_program_in_the_interpreter_matches_the_eager_model(dtype, atol):
    model, prog = program_for(1, 1, "decode", dtype, TP1_SHAPES)
    result = lower(prog)
    for m in result.modules.values():
        assert not collectives_in(m.text) and len(m.elided) == 2 * LAYERS + 2
    spec = prog.cache_spec(dtype)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(spec.shape, generator=g).to(dtype) for _ in range(2 * LAYERS)]
    state = prog.state_dict_for(0)
    prefix = [state[n] for n in prog.weight_inputs] + [state["tp_rank"]]
    for kind in prog.graphs:
        ids, pos, table = _step_inputs(kind, g)
        got = run_interpreter(result[kind], prefix + [ids, pos, table] + caches)
        with torch.no_grad():
            ref_logits, ref_caches = model(ids, pos, table, [c.clone() for c in caches])
        if atol is None:
            # The reference interpreter computes bf16 dot products and sums in bf16 (eager
            # accumulates in f32): allow a few bf16 ulps of the logits' scale.
            atol = 0.1 * float(ref_logits.float().abs().max())
        assert_close_report(got[0], ref_logits, atol=atol, what=f"{kind} logits")
        garbage = spec.garbage_block
        for i, (a, b) in enumerate(zip(got[1:], ref_caches)):
            assert_close_report(a[:garbage], b[:garbage], atol=atol, what=f"{kind} cache {i}")


# Standalone DCP primitives: W = 4 ranks, interleave 4, block 8 (vblock 32).
W, I, B = 4, 4, 8
POSITIONS = torch.tensor([[5], [0], [33], [-1]])     # decode token of each sequence
TABLE = torch.tensor([[1, 2], [3, -1], [4, 5], [-1, -1]])
SCALE = 0.35


def dcp_decode_piece(q, k, v, key_cache, value_cache, positions, block_table, rank):
    """One rank's share of a decode attention, as the dcp_decode pass emits it: masked cache
    write, local_filled prior, dcp_active_mask on the current key, partial attention + LSE."""
    slots = torch.ops.dcp.slot_mapping(positions, block_table, rank, W, I, B)
    kc, vc = torch.ops.dcp.cache_write(key_cache, value_cache, k, v, slots)
    prior = torch.ops.dcp.local_filled(positions[:, 0], rank, W, I, B)
    active = torch.ops.dcp.active_mask(positions, rank, W, I, B)
    k_pos = torch.where(active == 1, positions, torch.full_like(positions, -1))
    out, lse = torch.ops.dcp.partial_attention(q, positions, k, v, k_pos, kc, vc, block_table,
                                               prior, rank, W, I, SCALE)
    return out, lse, kc, vc


def lse_combine_piece(out, lse, lse_all):
    return torch.ops.dcp.lse_correct(out, lse, lse_all)


def _piece_inputs():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 1, 4, 8, generator=g)
    k, v = torch.randn(4, 1, 2, 8, generator=g), torch.randn(4, 1, 2, 8, generator=g)
    # Every cache row holds data (also rows beyond local_filled): masks must hide them.
    # Blocks 0..5 are usable, block 6 is the garbage block (no block table names it).
    kc, vc = torch.randn(7, B, 2, 8, generator=g), torch.randn(7, B, 2, 8, generator=g)
    return q, k, v, kc, vc


@pytest.fixture(scope="module")
def lowered_pieces():
    q, k, v, kc, vc = _piece_inputs()
    rank = torch.tensor(0)
    attn = lower_function(dcp_decode_piece, [q, k, v, kc, vc, POSITIONS, TABLE, rank],
                          name="dcp_decode_piece")
    lse_all = torch.zeros(W, 4, 1, 4)
    combine = lower_function(lse_combine_piece, [q, torch.zeros(4, 1, 4), lse_all],
                             name="lse_combine_piece")
    return attn, combine


def _equal_with_inf(a, b, what):
    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), f"{what}: -inf pattern differs"
    fin = torch.isfinite(b)
    assert_close_report(a[fin], b[fin], atol=1e-5, what=what)


@needs_interpreter
@pytest.mark.parametrize("rank", range(W), ids=[f"rank={r}" for r in range(W)])
def test_dcp_decode_piece_in_the_interpreter_matches_eager_on_edge_cases(rank,
                                                                         lowered_pieces):
    attn, _ = lowered_pieces
    assert not any(op in attn.text for op in COLLECTIVE_OPS + ("custom_call",))
    q, k, v, kc, vc = _piece_inputs()
    r = torch.tensor(rank)
    got = run_interpreter(attn, [q, k, v, kc, vc, POSITIONS, TABLE, r])
    ref = dcp_decode_piece(q, k, v, kc.clone(), vc.clone(), POSITIONS, TABLE, r)
    _equal_with_inf(got[1], ref[1], "lse")
    assert_close_report(got[0], ref[0], atol=1e-5, what="partial out")
    for a, b in ((got[2], ref[2]), (got[3], ref[3])):
        assert torch.equal(a[:-1], b[:-1])          # garbage block: whichever write lands
    kw = dict(dcp=W, interleave=I, block=B)
    for row, p in enumerate(POSITIONS[:, 0].tolist()):
        owned = p >= 0 and layout.owner(p, **kw) == rank
        empty = p < 0 or layout.local_filled(p, rank, **kw) == 0
        if empty and not owned:       # edge case "empty shard": contributes exactly nothing
            assert torch.isneginf(got[1][row]).all() and not got[0][row].any(), (rank, p)
        else:
            assert torch.isfinite(got[1][row]).all(), (rank, p)
        # Edge case "active token not owned": the non-owner writes only the garbage block.
        changed = (got[2][:-1] != kc[:-1]).flatten(1).any(1).nonzero().flatten().tolist()
        slot_blocks = {TABLE[b, (layout.local_slot(pp, **kw)) // B].item()
                       for b, pp in enumerate(POSITIONS[:, 0].tolist())
                       if pp >= 0 and layout.owner(pp, **kw) == rank}
        assert set(changed) == slot_blocks, (rank, changed, slot_blocks)


@needs_interpreter
def test_lse_combination_in_the_interpreter_matches_eager_and_never_nans(lowered_pieces):
    attn, combine = lowered_pieces
    q, k, v, kc, vc = _piece_inputs()
    parts = [run_interpreter(attn, [q, k, v, kc, vc, POSITIONS, TABLE, torch.tensor(r)])
             for r in range(W)]
    lse_all = torch.stack([p[1] for p in parts])             # what the LSE all-gather gives
    assert torch.isneginf(lse_all).any()                      # some shard is empty
    assert torch.isneginf(lse_all[:, 3]).all()                # padding: no rank sees a key
    total = 0
    for r, (out, lse, _, _) in enumerate(parts):
        got = run_interpreter(combine, [out, lse, lse_all])[0]
        ref = lse_combine_piece(out, lse, lse_all)
        assert_close_report(got, ref, atol=1e-5, what=f"corrected out rank {r}")
        total = total + got
    assert torch.isfinite(total).all() and not total[3].any()
    # The combination is exact attention over the union of the shards' keys: a row whose
    # keys all sit on one rank equals that rank's partial output.
    kw = dict(dcp=W, interleave=I, block=B)
    row = 1                                                   # position 0: only its owner
    owner = layout.owner(0, **kw)
    assert_close_report(total[row], parts[owner][0][row], atol=1e-5, what="single-owner row")


@needs_interpreter
def test_integer_floor_division_and_remainder_are_exact_for_negative_operands():
    # torch-mlir alone lowers integer remainder to a truncating stablehlo.remainder
    # (-7 % 4 -> -3, torch says 1) and floor division through f64.
    def f(a, b):
        return a // b, a % b, a // 4, a % 4, torch.remainder(a, -3)

    a = torch.tensor([[-7, 7, 0, 33, -32, -1]])
    b = torch.tensor([[2, -2, 3, 4, 8, 5]])
    m = lower_function(f, [a, b], name="int_division")
    assert "f64" not in m.text
    for got, ref in zip(run_interpreter(m, [a, b]), f(a, b)):
        assert torch.equal(got, ref), (got, ref)


# The whole DCP program, lowered, on interpreter replicas with real StableHLO collectives.
# The interpreter runs replicas on one thread per CPU and aborts a collective after 3 s, so:
# two ranks (this machine has two CPUs), tiny shapes, one child process per run.
SPMD_SHAPES = StepShapes(batch=2, context_len=8, max_blocks=1, num_blocks=3)


def _interpreter_world(tp: int, dcp: int, mode: str, out: str, model_kind: str = "demo"
                       ) -> None:
    """Child process: serve prompts with the lowered modules on the interpreter's replicas,
    and with the single-device model (an ordinary model: its own full forward); save both."""
    from dcp_compile.lowering import InterpreterExecutor
    from dcp_compile.verify import prompt_kind, run_reference
    from dcp_compile.runtime.engine import Engine

    from helpers import prompts_of
    if model_kind == "mla":               # one latent head, absorbed (README: MLA)
        from dcp_compile.models.mla import plain_mla
        from dcp_compile.frontends.ordinary import FullForwardReference
        model = plain_mla(num_layers=1)
        vocab = model.config.vocab_size
        prog = dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, shapes=SPMD_SHAPES,
                                     check=False)
        model = FullForwardReference(model)
    else:
        model = demo_model(DemoConfig(num_layers=1, num_kv_heads=1))  # tp=2 > kv heads
        vocab = model.config.vocab_size
        prog = dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, shapes=SPMD_SHAPES)
    lowered = lower(prog)
    prompts, steps = prompts_of((3, 7), vocab=vocab), 3
    engine = Engine(InterpreterExecutor(prog, lowered), SPMD_SHAPES,
                    block_size=prog.config.block_size, dcp=prog.config.dcp,
                    prompt_kind=prompt_kind(prog))
    ref, _ = run_reference(model, prog, prompts, steps if mode == "decode" else 1)
    if mode == "decode":
        got = engine.generate(prompts, steps)
        result = {"tokens": got.tokens, "logits": got.logits}
    else:                      # a prefill program has no decode step: the prompt's logits
        result = {"logits": [engine.prefill(prompts)]}
    collectives = {step: [(c.kind, c.role, c.replica_groups) for c in m.collectives]
                   for step, m in lowered.modules.items()}
    torch.save({"result": result, "ref_tokens": ref.tokens, "ref_logits": ref.logits,
                "collectives": collectives}, out)


@needs_interpreter
@pytest.mark.parametrize("mode,model_kind", [("decode", "demo"), ("prefill", "demo"),
                                             ("decode", "mla"), ("prefill", "mla")])
def test_lowered_program_on_interpreter_replicas_matches_the_single_device_model(
        mode, model_kind, tmp_path):
    # tp=2/dcp=2: the interpreter runs one replica per CPU (two here); the MLA program at
    # tp=8/dcp=8 runs on XLA:CPU replicas instead (tests/test_mla_xla.py).
    import os
    import subprocess
    import sys
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the interpreter needs one CPU per rank (2)")
    out = tmp_path / "world.pt"
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import test_lowering as t; "
            f"t._interpreter_world(2, 2, {mode!r}, {str(out)!r}, {model_kind!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = torch.load(out)
    kinds = {(kind, role) for coll in r["collectives"].values() for kind, role, _ in coll}
    if mode == "decode":     # the spec's decode collectives ran, on real data
        assert {("all_gather", "dcp"), ("reduce_scatter", "dcp"), ("all_reduce", "tp")} <= kinds
        assert r["result"]["tokens"] == r["ref_tokens"]
    else:
        assert {("all_gather", "cp_kv"), ("reduce_scatter", "cp_kv")} <= kinds
    for t, (got, exp) in enumerate(zip(r["result"]["logits"], r["ref_logits"])):
        assert_close_report(got, exp, atol=1e-4, what=f"{mode} step {t} logits")


def test_interpreter_refuses_what_would_abort_it(tmp_path_factory):
    import os
    from dcp_compile.lowering import run_interpreter_spmd
    _, result = lowered_for(8, 4, "decode", tmp_path_factory)
    with pytest.raises(DCPLoweringError, match=r"collectives span replicas \[0, 1, .*7\], "
                                               r"but 1 rank"):
        run_interpreter(result["decode"], [])
    if len(os.sched_getaffinity(0)) < 8:
        with pytest.raises(DCPLoweringError, match="8 ranks would deadlock"):
            run_interpreter_spmd(result["decode"], [[]] * 8)


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
    from dcp_compile.runtime.rank_program import copy_graph_module
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


# ------------------------------------------------------------------------------------------
# NxD's traced route: the torch_xla collective backend
# ------------------------------------------------------------------------------------------


class ThreadedXM:
    """Stands in for torch_xla.core.xla_model on CPU threads (one thread per rank): the same
    call signatures NxD uses, with real data exchanged inside each replica group."""

    REDUCE_SUM, REDUCE_MAX, REDUCE_MIN, REDUCE_MUL = "sum", "max", "min", "mul"

    def __init__(self):
        self.local = threading.local()
        self.lock = threading.Lock()
        self.slots: dict = {}
        self.calls: list = []

    def _exchange(self, x, groups):
        rank, i = self.local.rank, self.local.count
        self.local.count += 1
        group = next(g for g in groups if rank in g)
        if rank == 0:
            self.calls.append((i, [list(g) for g in groups]))
        with self.lock:
            slot = self.slots.setdefault((i, tuple(group)),
                                         {"vals": {}, "barrier": threading.Barrier(len(group))})
        slot["vals"][rank] = x
        slot["barrier"].wait(timeout=60)
        return [slot["vals"][r] for r in group], group.index(rank)

    def all_gather(self, x, dim=0, groups=None, output=None, pin_layout=True):
        assert pin_layout is False and groups is not None
        vals, _ = self._exchange(x, groups)
        return torch.cat(vals, dim)

    def reduce_scatter(self, reduce_type, x, scale, scatter_dim, shard_count, groups=None,
                       output=None, pin_layout=True):
        assert reduce_type == self.REDUCE_SUM and shard_count == len(groups[0])
        vals, index = self._exchange(x, groups)
        return (sum(vals) * scale).chunk(shard_count, scatter_dim)[index]

    def all_reduce(self, reduce_type, x, scale=1.0, groups=None, pin_layout=True):
        assert reduce_type == self.REDUCE_SUM
        vals, _ = self._exchange(x, groups)
        return sum(vals) * scale


def test_nxd_backend_binds_explicit_full_replica_groups():
    from dcp_compile.runtime.neuron import bind_xla_collectives, collective_calls
    _, prog = program_for(8, 4, "decode")
    bound = bind_xla_collectives(prog.graphs["decode"], prog.topology.groups)
    calls = collective_calls(bound)
    assert not [n for n in bound.graph.nodes if "_c10d_functional" in str(n.target)]
    dcp_calls = [c for c in calls if c[1][-1] == [[0, 1, 2, 3], [4, 5, 6, 7]]]
    tp_calls = [c for c in calls if c[1][-1] == [list(range(8))]]
    assert len(dcp_calls) + len(tp_calls) == len(calls)
    assert sorted(name for name, _ in dcp_calls) == (["all_gather"] * 2 * LAYERS
                                                     + ["reduce_scatter"] * LAYERS)
    assert sorted(name for name, _ in tp_calls) == ["all_gather"] + ["all_reduce"] * (
        2 * LAYERS + 1)


def test_nxd_backend_decodes_like_the_single_device_model_with_a_threaded_xm():
    """The NxD-bound program on 4 rank threads, with a CPU stand-in for torch_xla's
    collectives, generates the single-device model's tokens and logits."""
    from dcp_compile.verify import prompt_kind, run_reference
    from dcp_compile.runtime.engine import Engine, LocalExecutor
    from dcp_compile.runtime.neuron import NeuronStepModule, use_xla_module

    from helpers import prompts_of
    model, prog = program_for(4, 2, "decode")
    prompts, steps = prompts_of((3, 14)), 3
    ref, _ = run_reference(model, prog, prompts, steps)
    xm = ThreadedXM()
    results, errors = {}, {}

    def rank_main(rank):
        try:
            xm.local.rank, xm.local.count = rank, 0
            fns = {}
            for kind in prog.graphs:
                mod = NeuronStepModule(prog, kind, rank)
                fns[kind] = (lambda m: lambda ids, pos, table, caches: (
                    lambda out: (out[0], list(out[1:])))(m(ids, pos, table, *caches)))(mod)
            engine = Engine(LocalExecutor(fns, prog.cache_spec().allocate()), prog.shapes,
                            block_size=prog.config.block_size, dcp=prog.config.dcp,
                            prompt_kind=prompt_kind(prog))
            with torch.no_grad():
                results[rank] = engine.generate(prompts, steps)
        except BaseException as e:  # reported below, per rank
            errors[rank] = e

    with use_xla_module(xm):
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    groups_used = {json.dumps(g) for _, g in xm.calls}
    assert groups_used == {json.dumps([[0, 1, 2, 3]]), json.dumps([[0, 1], [2, 3]])}
    for rank, res in results.items():
        assert res.tokens == ref.tokens, rank
        for t, (got, exp) in enumerate(zip(res.logits, ref.logits)):
            assert_close_report(got, exp, atol=1e-4, what=f"rank {rank} step {t}")


def test_nxd_backend_on_real_torch_xla():
    from dcp_compile.runtime.neuron import neuron_available
    ok, reason = neuron_available()
    if not ok:
        pytest.skip(reason)
    import torch_xla.core.xla_model as xm  # noqa: F401  (the real module, on a Neuron host)

    from dcp_compile.runtime.neuron import NeuronStepModule
    _, prog = program_for(4, 2, "decode")
    mod = NeuronStepModule(prog, "decode", 0)
    assert mod.input_output_aliases == {3 + k: 1 + k for k in range(2 * LAYERS)}
