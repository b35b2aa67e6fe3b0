"""Nemotron-H's ungated experts and DeepSeek-V4's clamped gate as ``dcp.moe``
(runtime/kernels/moe.py; docs/moe-mla.md, Mixture of experts).

- the op (reference and eager kernel) against transformers' own ``NemotronHExperts``
  (``down(relu²(up x))``, no gate projection: layout ``ungated``, activation ``relu2``) and
  ``DeepseekV4Experts`` (``silu(min(gate, limit)) * clamp(up, ±limit)``: ``clamped_silu``),
  and the corpus's HY-V4 (``clamped_silu`` too) and MiniMax-M3 (gpt-oss's clamped SwiGLU
  over concatenated [gate; up]) experts, with a limit small enough that the clamps bite;
- tensor-parallel shards (the up projection's I dim in one segment) and expert-parallel
  shards summing to the whole;
- the refusals: a gate with an ungated layout, a parameter the activation does not read;
- the structure of a transformed Nemotron-H with MoE blocks (the up projection cut to I/tp
  by TP, E/tp experts by EP, one all-reduce per MoE block) and, behind ``DCP_HYBRID_FULL``,
  its expert-parallel decode and prefill against the model's own forward (the TP cells are
  tests/frontends/test_hybrid_mamba.py's, whose tiny Nemotron-H has MoE blocks).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import dcp_compile  # noqa: E402
from dcp_compile.frontends import huggingface as hf  # noqa: E402
from dcp_compile.runtime.errors import DCPTransformError  # noqa: E402
from dcp_compile.passes.infra import ancestors  # noqa: E402
from full_runs import full  # noqa: E402

T, K, E, H, I = 11, 2, 8, 16, 12
LIMIT = 0.5                  # DeepSeek-V4's clamps bite (gate and up values reach beyond it)
RANK0 = torch.zeros((), dtype=torch.int64)
FULL = full("DCP_HYBRID_FULL")


def _nemotron_experts():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
    config = transformers.NemotronHConfig(hidden_size=H, moe_intermediate_size=I,
                                          n_routed_experts=E, mlp_hidden_act="relu2")
    return NemotronHExperts(config)


def _deepseek_v4_experts():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
    config = transformers.DeepseekV4Config(hidden_size=H, intermediate_size=I,
                                           n_routed_experts=E, swiglu_limit=LIMIT)
    return DeepseekV4Experts(config)


EXPERTS = {"nemotron_h": _nemotron_experts, "deepseek_v4": _deepseek_v4_experts}
FORMS = {"nemotron_h": {"activation": "relu2", "layout": "ungated"},
         "deepseek_v4": {"activation": "clamped_silu", "layout": "concatenated",
                         "limit": LIMIT}}


def _inputs(kind: str, seed=0):
    experts = EXPERTS[kind]()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)   # 1/sqrt(in)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return experts, x, ids, w


def _first(experts):
    return experts.gate_up_proj if experts.has_gate else experts.up_proj


def _op(op, experts, x, ids, w, **overrides):
    """dcp.moe's arguments as the HF frontend builds them (hf.experts_form), overridable."""
    args = dict(gate_up_proj=_first(experts), down_proj=experts.down_proj, expert_rank=RANK0,
                **hf.experts_form(experts))
    args.update(overrides)
    return getattr(torch.ops.dcp, op)(x, ids, w, **args)


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
@pytest.mark.parametrize("op", ["moe", "moe_grouped"])
@pytest.mark.parametrize("kind", list(EXPERTS))
def test_op_equals_the_models_own_experts(kind, op, impl):
    experts, x, ids, w = _inputs(kind)
    assert hf.experts_form(experts) == FORMS[kind]
    if kind == "deepseek_v4":     # the clamps bite: both gate and up values beyond the limit
        pre = torch.einsum("th,tih->ti", x, experts.gate_up_proj[ids[:, 0]].detach())
        assert (pre[:, :I] > LIMIT).any() and (pre[:, I:].abs() > LIMIT).any()
    else:                         # relu² sees negative pre-activations (zeros) and positive
        pre = torch.einsum("th,tih->ti", x, experts.up_proj[ids[:, 0]].detach())
        assert (pre < 0).any() and (pre > 0).any()
    experts.config._experts_implementation = impl
    with torch.no_grad():
        want = experts(x, ids, w)
        got = _op(op, experts, x, ids, w)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("op", ["moe", "moe_grouped"])
def test_ungated_tp_and_ep_shards_sum_to_the_whole(op, tp):
    """TP: rows [r n, (r+1) n) of every expert's up projection and columns of its down
    projection (one segment: no gate to cut beside it); EP: experts [r m, (r+1) m)."""
    experts, x, ids, w = _inputs("nemotron_h", 1)
    n, m = I // tp, E // tp
    with torch.no_grad():
        whole = _op(op, experts, x, ids, w)
        tp_sum = sum(_op(op, experts, x, ids, w,
                         gate_up_proj=experts.up_proj[:, r * n:(r + 1) * n],
                         down_proj=experts.down_proj[:, :, r * n:(r + 1) * n])
                     for r in range(tp))
        ep_sum = sum(_op(op, experts, x, ids, w, expert_rank=torch.tensor(r),
                         gate_up_proj=experts.up_proj[r * m:(r + 1) * m],
                         down_proj=experts.down_proj[r * m:(r + 1) * m])
                     for r in range(tp))
    torch.testing.assert_close(tp_sum, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ep_sum, whole, atol=1e-5, rtol=1e-5)


def test_a_gate_with_an_ungated_layout_and_a_stray_parameter_are_refused():
    experts, x, ids, w = _inputs("nemotron_h")
    with torch.no_grad():
        with pytest.raises(Exception, match=r"clamped_swiglu is a gate.*ungated"):
            _op("moe", experts, x, ids, w, activation="clamped_swiglu", alpha=1.0,
                limit=1.0)
        with pytest.raises(Exception, match=r"relu2 with alpha=None, limit=1.0"):
            _op("moe", experts, x, ids, w, limit=1.0)


# Other clamped gates the same two activations compute: the corpus's tiny models' experts.
CORPUS_GATES = {"hy_v4": ("HYV4Experts", {"activation": "clamped_silu",
                                          "layout": "concatenated"}),
                "minimax_m3_vl_text": ("MiniMaxM3VLExperts",
                                       {"activation": "clamped_swiglu",
                                        "layout": "concatenated"})}


@pytest.mark.parametrize("op", ["moe", "moe_grouped"])
@pytest.mark.parametrize("model_type", list(CORPUS_GATES))
def test_corpus_clamped_gates_equal_their_own_experts(model_type, op):
    """HY-V4's silu(min(gate, l)) * clamp(up, ±l) and MiniMax-M3's gpt-oss SwiGLU over
    concatenated [gate; up], with a limit small enough that the clamps bite."""
    from hf_corpus import build
    cls, form = CORPUS_GATES[model_type]
    experts = next(m for m in build(model_type).modules() if type(m).__name__ == cls)
    experts.swiglu_limit = LIMIT
    got_form = hf.experts_form(experts)
    assert {k: got_form[k] for k in form} == form and got_form["limit"] == LIMIT
    e, two_i, h = experts.gate_up_proj.shape
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    pre = torch.einsum("th,tih->ti", x, experts.gate_up_proj[ids[:, 0]].detach())
    assert (pre[:, :two_i // 2] > LIMIT).any() and (pre[:, two_i // 2:].abs() > LIMIT).any()
    with torch.no_grad():
        want = experts(x, ids, w)
        got = _op(op, experts, x, ids, w)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_deepseek_v4_gate_needs_silu():
    experts, *_ = _inputs("deepseek_v4")
    experts.act_fn = torch.nn.GELU()
    with pytest.raises(DCPTransformError, match=r"DeepseekV4Experts: its gate is "
                                                r"act\(min\(gate, limit\)\)"):
        hf.experts_form(experts)


# -- a transformed Nemotron-H with MoE blocks ---------------------------------------------------

def test_nemotron_h_experts_are_cut_by_tp_with_one_all_reduce_per_moe_block():
    """The tiny hybrid Nemotron-H (two MoE blocks) at tp=4/dcp=2, decode (the program of
    test_hybrid_mamba's default cell, built once per session): each dcp.moe reads the up
    projection [E, I/4, H] and down [E, H, I/4] as data ``ungated`` / ``relu2``."""
    from dcp_compile.runtime.names import ROLE_PREFIX
    from hybrid_runs import program
    model, prog = program("nemotron_h", 4, 2, "decode")
    cfg = model.config
    gm = prog.graphs["decode"]
    moe = [n for n in gm.graph.nodes if n.target == torch.ops.dcp.moe.default]
    assert len(moe) == cfg.layers_block_type.count("moe") == 2
    for n in moe:
        up, down = (a.meta["val"].shape for a in n.args[3:5])
        assert up == (cfg.n_routed_experts, cfg.moe_intermediate_size // 4, cfg.hidden_size)
        assert down == (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size // 4)
        assert (n.args[6], n.args[10]) == ("relu2", "ungated")
        # the routed experts' pending sum and the shared expert's: one all-reduce after
        users = [u for u in gm.graph.nodes
                 if u.target == torch.ops._c10d_functional.all_reduce.default
                 and u.args[2] == ROLE_PREFIX + "tp" and n in ancestors(u)]
        assert users


@pytest.mark.skipif(not FULL, reason="DCP_HYBRID_FULL=1 runs it")
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("tp,dcp", [(4, 2), (8, 4)], ids=["tp4-dcp2", "tp8-dcp4"])
def test_nemotron_h_expert_parallel_matches_its_own_forward(tp, dcp, mode):
    """Expert parallel: E=4 experts over tp=4 ranks (one each; tp=8 is refused by name: more
    ranks than experts). Prefill in two chunks."""
    from hybrid_runs import BLOCK, SHAPES, assert_decode_matches, assert_prefill_matches, \
        model_of
    model = model_of("nemotron_h")
    kwargs = dict(tp=tp, dcp=dcp, mode=mode, block_size=BLOCK, shapes=SHAPES, check=False,
                  expert_parallel=True)
    if tp > model.config.n_routed_experts:
        with pytest.raises(DCPTransformError, match=r"fewer experts than ranks"):
            dcp_compile.transform(model, **kwargs)
        return
    program = dcp_compile.transform(model, **kwargs)
    label = f"nemotron_h EP tp={tp} dcp={dcp}"
    if mode == "decode":
        assert_decode_matches(model, program, label)
    else:
        assert_prefill_matches(model, program, 2, label)
