"""dcp.moe (runtime/kernels/moe.py) on its own, the MoE recogniser's refusals, and the structure of a
transformed MoE program: expert shards per rank and one all-reduce per MoE layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dcp_compile.runtime.kernels.ops  # noqa: F401
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.kernels.moe import DECOMPOSITIONS

T, K, E, H, I = 9, 3, 8, 16, 12


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    down = torch.randn(E, H, I, generator=g) * I ** -0.5
    return [t.to(dtype) if t.is_floating_point() else t for t in (x, ids, w, gate_up, down)]


def loop_reference(x, ids, w, gate_up, down):
    """The definition, token by token (transformers' experts compute this)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


RANK0 = torch.zeros((), dtype=torch.int64)


@pytest.mark.parametrize("op", ["moe", "moe_grouped"])
def test_op_equals_its_definition(op):
    x, ids, w, gate_up, down = _inputs()
    got = getattr(torch.ops.dcp, op)(x, ids, w, gate_up, down, RANK0, "silu")
    torch.testing.assert_close(got, loop_reference(x, ids, w, gate_up, down),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("op", ["moe", "moe_grouped"])
def test_tp_and_ep_shards_sum_to_the_whole(op, tp):
    """TP: each rank's [gate; up] rows and down columns of every expert; EP: each rank's
    experts. Summing the ranks' outputs (the all-reduce) gives the single-device output."""
    x, ids, w, gate_up, down = _inputs(1)
    fn = getattr(torch.ops.dcp, op)
    whole = fn(x, ids, w, gate_up, down, RANK0, "silu")
    n = I // tp
    tp_sum = sum(fn(x, ids, w, torch.cat([gate_up[:, r * n:(r + 1) * n],
                                          gate_up[:, I + r * n:I + (r + 1) * n]], 1),
                    down[:, :, r * n:(r + 1) * n], RANK0, "silu") for r in range(tp))
    m = E // tp
    ep_sum = sum(fn(x, ids, w, gate_up[r * m:(r + 1) * m], down[r * m:(r + 1) * m],
                    torch.tensor(r), "silu") for r in range(tp))
    torch.testing.assert_close(tp_sum, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ep_sum, whole, atol=1e-5, rtol=1e-5)


def test_decomposition_is_static_aten():
    """The decomposition (what the lowering uses) traces to ATen with static shapes: no
    nonzero, no data-dependent sizes."""
    from torch.fx.experimental.proxy_tensor import make_fx
    args = _inputs() + [RANK0]
    gm = make_fx(lambda *a: torch.ops.dcp.moe(*a, "silu"),
                 decomposition_table=DECOMPOSITIONS)(*args)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("dcp." in t or "nonzero" in t for t in targets), targets
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            assert all(isinstance(s, int) for s in v.shape), n


# -- the recogniser and the frontend refuse by name ------------------------------------------

transformers = pytest.importorskip("transformers")


def _mixtral(**overrides):
    from test_moe import build
    return build("mixtral", **overrides)


def test_expert_parallel_needs_tp_to_divide_the_experts(monkeypatch):
    import dcp_compile
    from dcp_compile.runtime.serving.engine import StepShapes
    import test_moe
    monkeypatch.setitem(test_moe.MODELS, "mixtral6", (
        "MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2)))
    model = test_moe.build("mixtral6")
    with pytest.raises(DCPTransformError, match=r"experts=6, tp=4.*expert_parallel=False"):
        dcp_compile.transform(model, tp=4, dcp=2, mode="decode", block_size=4,
                              shapes=StepShapes(batch=1, context_len=4, max_blocks=2,
                                                num_blocks=4),
                              check=False, expert_parallel=True)


def test_unrouted_batched_mm_experts_are_refused_with_node_and_line(monkeypatch):
    """Captured in transformers' batched_mm form (the frontend's switch to dcp.moe undone),
    the experts are refused by the recogniser, naming the gather and its source line."""
    import dcp_compile
    from dcp_compile import hf
    from dcp_compile.runtime.serving.engine import StepShapes
    monkeypatch.setitem(hf.EXPERTS_SWITCH, "_experts_implementation_internal", "batched_mm")
    with pytest.raises(DCPTransformError,
                       match=r"unrecognised experts form, batched_mm's gather.*moe\.py"):
        dcp_compile.transform(_mixtral(), tp=4, dcp=2, mode="decode", block_size=4,
                              shapes=StepShapes(batch=1, context_len=4, max_blocks=2,
                                                num_blocks=4), check=False)


def test_experts_layout_dcp_moe_does_not_compute_is_refused_by_class():
    from dcp_compile import hf
    model = _mixtral()
    model.model.layers[0].mlp.experts.has_bias = True
    with pytest.raises(DCPTransformError, match=r"MixtralExperts has an experts form .*"
                                                r"has_bias"):
        hf.prepare(model)


# -- structure: expert shards per rank, one all-reduce per MoE layer ----------------------------

@pytest.mark.parametrize("ep", [False, True], ids=["tp_experts", "expert_parallel"])
def test_expert_shards_and_one_all_reduce_per_moe_layer(ep):
    import dcp_compile
    from dcp_compile.runtime.serving.engine import StepShapes
    from dcp_compile.runtime.names import ROLE_PREFIX
    import test_moe
    model = test_moe.build("qwen2_moe")       # routed + shared expert behind a sigmoid gate
    tp = 4
    program = dcp_compile.transform(model, tp=tp, dcp=2, mode="decode", block_size=4,
                                    shapes=StepShapes(batch=2, context_len=4, max_blocks=2,
                                                      num_blocks=4),
                                    check=False, expert_parallel=ep)
    gm = program.graphs["decode"]
    moe = [n for n in gm.graph.nodes if n.target == torch.ops.dcp.moe.default]
    assert len(moe) == 2
    cfg = model.config
    for n in moe:
        gate_up, down = (a.meta["val"].shape for a in n.args[3:5])
        if ep:
            assert gate_up == (cfg.num_experts // tp, 2 * cfg.moe_intermediate_size, 64)
            assert n.args[5].name == "tp_rank"
        else:
            assert gate_up == (cfg.num_experts, 2 * cfg.moe_intermediate_size // tp, 64)
            assert down == (cfg.num_experts, 64, cfg.moe_intermediate_size // tp)
    # All-reduces: the embedding's, then per layer the O projection's and the MoE block's
    # one (routed experts + the gated shared expert summed first).
    reduces = [m for m in gm.graph.nodes
               if m.target == torch.ops._c10d_functional.all_reduce.default]
    assert len(reduces) == 1 + 2 * len(moe), [m.name for m in reduces]
    assert all(m.args[2] == ROLE_PREFIX + "tp" for m in reduces)
    record = next(r for r in program.history if r.name == "canonicalize_moe")
    assert record.matched["router_linears"] == 2
    assert record.matched["shared_expert_gates"] == 2
