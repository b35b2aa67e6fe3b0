"""gpt-oss's experts as ``dcp.moe`` (runtime/kernels/moe.py): biased, gate/up interleaved and
transposed, clamped SwiGLU.

- the op against transformers' own ``GptOssExperts`` (its eager loop and batched_mm), with a
  limit small enough that the clamps bite;
- tensor-parallel shards (contiguous blocks of the interleaved 2I dim: whole gate/up pairs)
  and expert-parallel shards summing to the whole, the down bias added by one rank: adding it
  on every rank is off by (tp - 1) x the bias term, shown;
- the whole model with the down bias added per rank (the shard pass's ``inner_rank`` left
  unset) no longer matches its own forward;
- the structure of a transformed gpt-oss (shard shapes, ``inner_rank`` / ``expert_rank`` the
  rank input, one all-reduce per MoE layer) and the refusals (an unknown gate by class, bad
  op data by node and source line).
The whole-model matrix rows are ``tests/frontends/test_moe.py`` (``gpt_oss``).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dcp_compile  # noqa: E402
from dcp_compile.frontends import huggingface as hf  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402
from dcp_compile.runtime.errors import DCPTransformError  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402

import test_moe  # noqa: E402

T, K, E, H, I = 11, 2, 8, 16, 12
LIMIT = 0.5                  # the clamps bite (gate and up values reach beyond it)
RANK0 = torch.zeros((), dtype=torch.int64)
SMALL = StepShapes(batch=2, context_len=4, max_blocks=2, num_blocks=4)


def _experts(seed=0):
    config = transformers.GptOssConfig(hidden_size=H, intermediate_size=I,
                                       num_local_experts=E, swiglu_limit=LIMIT)
    experts = GptOssExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return experts, x, ids, w


def _op(op, experts, x, ids, w, **overrides):
    """dcp.moe's arguments as the HF frontend builds them (hf.experts_form), overridable."""
    args = dict(gate_up_proj=experts.gate_up_proj, down_proj=experts.down_proj,
                expert_rank=RANK0, gate_up_bias=experts.gate_up_proj_bias,
                down_bias=experts.down_proj_bias, **hf.experts_form(experts))
    args.update(overrides)
    return getattr(torch.ops.dcp, op)(x, ids, w, **args)


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
@pytest.mark.parametrize("op", ["moe", "moe_grouped"])
def test_op_equals_transformers_gpt_oss_experts(op, impl):
    experts, x, ids, w = _experts()
    assert hf.experts_form(experts) == {"activation": "clamped_swiglu",
                                        "layout": "interleaved_transposed",
                                        "alpha": experts.alpha, "limit": LIMIT}
    pre = torch.einsum("th,thi->ti", x, experts.gate_up_proj[ids[:, 0]])
    assert (pre[:, 0::2] > LIMIT).any() and (pre[:, 1::2].abs() > LIMIT).any()   # clamps bite
    experts.config._experts_implementation = impl
    with torch.no_grad():
        want = experts(x, ids, w)
        got = _op(op, experts, x, ids, w)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _tp_shard(experts, r, tp):
    """Rank r's tensor-parallel shard, cut here independently of the placement: columns
    [2r n, 2(r+1) n) of the interleaved 2I dim (gate/up pairs r n .. (r+1) n - 1) and rows
    [r n, (r+1) n) of down_proj's I dim (transposed: [E, I, H]); the down bias whole."""
    n = I // tp
    cols = slice(2 * r * n, 2 * (r + 1) * n)
    return dict(gate_up_proj=experts.gate_up_proj[:, :, cols],
                gate_up_bias=experts.gate_up_proj_bias[:, cols],
                down_proj=experts.down_proj[:, r * n:(r + 1) * n])


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("op", ["moe", "moe_grouped"])
def test_tp_and_ep_shards_sum_to_the_whole_and_the_down_bias_counts_once(op, tp):
    experts, x, ids, w = _experts(1)
    with torch.no_grad():
        whole = _op(op, experts, x, ids, w)
        tp_sum = sum(_op(op, experts, x, ids, w, **_tp_shard(experts, r, tp),
                         inner_rank=torch.tensor(r)) for r in range(tp))
        per_rank_bias = sum(_op(op, experts, x, ids, w, **_tp_shard(experts, r, tp))
                            for r in range(tp))          # inner_rank unset: slice 0 each
        m = E // tp
        ep_sum = sum(_op(op, experts, x, ids, w, expert_rank=torch.tensor(r),
                         gate_up_proj=experts.gate_up_proj[r * m:(r + 1) * m],
                         gate_up_bias=experts.gate_up_proj_bias[r * m:(r + 1) * m],
                         down_proj=experts.down_proj[r * m:(r + 1) * m],
                         down_bias=experts.down_proj_bias[r * m:(r + 1) * m])
                     for r in range(tp))
        bias_term = torch.einsum("tk,tkh->th", w, experts.down_proj_bias[ids])
    torch.testing.assert_close(tp_sum, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ep_sum, whole, atol=1e-5, rtol=1e-5)
    # The bias added on every rank: off by (tp - 1) times its term, far beyond the tolerance.
    torch.testing.assert_close(per_rank_bias - whole, (tp - 1) * bias_term, atol=1e-4,
                               rtol=1e-4)
    assert bias_term.abs().max() > 0.1


def test_whole_model_with_the_down_bias_added_per_rank_does_not_match(monkeypatch):
    """The shard pass sets inner_rank to the rank input (TP experts); without it every rank
    adds the down bias, and the model no longer matches its own forward."""
    from dcp_compile.passes.shard_tensor_parallel import ShardTensorParallel
    monkeypatch.setattr(ShardTensorParallel, "_expert_shard_rank",
                        lambda self, g, rank, expert_parallel: None)
    with pytest.raises(AssertionError, match="max abs error|rank"):
        test_moe.check_matches_own_forward("gpt_oss", "prefill", 4, 2, False, direct=True)


@pytest.mark.parametrize("ep", [False, True], ids=["tp_experts", "expert_parallel"])
def test_shards_rank_operands_and_one_all_reduce_per_moe_layer(ep):
    from dcp_compile.runtime.kernels.moe import ARG
    from dcp_compile.runtime.names import RANK_INPUT
    model = test_moe.build("gpt_oss")
    cfg, tp = model.config, 4
    program = dcp_compile.transform(model, tp=tp, dcp=2, mode="decode", block_size=4,
                                    shapes=SMALL, check=False, expert_parallel=ep)
    gm = program.graphs["decode"]
    moe = [n for n in gm.graph.nodes if n.target == torch.ops.dcp.moe.default]
    assert len(moe) == cfg.num_hidden_layers
    e, i, h = cfg.num_local_experts, cfg.intermediate_size, cfg.hidden_size
    want = ({"gate_up_proj": (e // tp, h, 2 * i), "gate_up_bias": (e // tp, 2 * i),
             "down_proj": (e // tp, i, h), "down_bias": (e // tp, h)} if ep else
            {"gate_up_proj": (e, h, 2 * i // tp), "gate_up_bias": (e, 2 * i // tp),
             "down_proj": (e, i // tp, h), "down_bias": (e, h)})
    for n in moe:
        assert {w: tuple(n.args[ARG[w]].meta["val"].shape) for w in want} == want
        assert n.args[ARG["layout"]] == "interleaved_transposed"
        assert n.args[ARG["activation"]] == "clamped_swiglu"
        rank_operand, unset = ("expert_rank", "inner_rank") if ep else \
            ("inner_rank", "expert_rank")
        assert n.args[ARG[rank_operand]].name == RANK_INPUT
        assert n.args[ARG[unset]] is None or n.args[ARG[unset]].name != RANK_INPUT
    reduces = [m for m in gm.graph.nodes
               if m.target == torch.ops._c10d_functional.all_reduce.default]
    assert len(reduces) == 1 + 2 * len(moe), [m.name for m in reduces]


def test_an_unknown_gate_is_refused_by_class(monkeypatch):
    monkeypatch.setattr(GptOssExperts, "_apply_gate", lambda self, gate_up: gate_up[..., ::2])
    with pytest.raises(DCPTransformError, match=r"GptOssExperts has an experts form .*"
                                                r"_apply_gate.*custom, unknown"):
        hf.prepare(test_moe.build("gpt_oss"), max_model_len=64)


def test_bad_op_data_is_refused_by_node_and_line(monkeypatch):
    """The frontend's data for the clamped gate without its limit: canonicalize_moe names
    the dcp.moe node and the source line that built it."""
    monkeypatch.setitem(hf._GATES, GptOssExperts._apply_gate,
                        lambda experts: (hf._gpt_oss_gate(experts)[0], True, {"alpha": 1.0}))
    with pytest.raises(DCPTransformError, match=r"clamped_swiglu with alpha=1.0, limit=None: "
                                                r"node \w+ at .*line \d+"):
        dcp_compile.transform(test_moe.build("gpt_oss"), tp=4, dcp=2, mode="decode",
                              block_size=4, shapes=SMALL, check=False)


def test_whole_gpt_oss_expert_parallel_matches_own_forward():
    """The default slice's whole-model row with expert-parallel experts (tp=8: one expert per
    rank; dcp=4, the largest the heads allow); TP experts run whole in tests/frontends/test_sinks.py
    (prepare and direct), every other row in the matrix (tests/frontends/test_moe.py, gpt_oss)."""
    model = test_moe.build("gpt_oss")
    assert test_moe.largest_dcp(model, 8) == 4
    assert test_moe.check_matches_own_forward("gpt_oss", "decode", 8, 4, True) <= 1e-4
