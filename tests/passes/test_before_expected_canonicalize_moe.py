"""canonicalize_moe, Before/Expected: each dcp.moe is tagged with its layer, normalised to
positional operands, and the router computing its routing is named (its linear runs whole on
every rank). The forms: routing weights applied to the experts' outputs (Mixtral, torchtitan),
and a routing score that scales the experts' input (Llama-4: one dcp.moe per choice, weight
1, input ``x * score``), where the router is found behind the score too; ungated experts
(Nemotron-H: the up projection alone). Refusals: experts narrower than the tokens (bf16
experts in an fp32 model), expert parallelism with fewer experts than ranks, and an ungated
layout with a gated shape or a gate activation."""

import pytest
import torch

from dcp_compile import DCPTransformError
from dcp_compile.passes.canonicalize_moe import CanonicalizeMoE
from dcp_compile.runtime.names import MOE_ROLE_META, MOE_ROUTER

from before_expected import aten, assert_code, before, call, context, run_alone

dcp = torch.ops.dcp
T, H, E, I = 6, 8, 4, 4


def _scaled_input(x, p_router, p_gate_up, p_down, rank):
    """Llama-4's form, top-2: per choice j, dcp.moe(x * sigmoid(top value j), id j, 1)."""
    logits = aten.linear.default(x, p_router)
    top = aten.topk.default(logits, 2, 1)
    scores = aten.sigmoid.default(top[0])
    parts = aten.split_with_sizes.default(scores, [1, 1], 1)
    ids = aten.split_with_sizes.default(top[1], [1, 1], 1)
    ones = aten.ones_like.default(parts[0])
    m0 = dcp.moe.default(aten.mul.Tensor(x, parts[0]), ids[0], ones, p_gate_up, p_down, rank,
                         layout="concatenated_transposed")
    m1 = dcp.moe.default(aten.mul.Tensor(x, parts[1]), ids[1], ones, p_gate_up, p_down, rank,
                         layout="concatenated_transposed")
    return (aten.add.Tensor(m0, m1),)


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(T, H, generator=g), p_router=torch.randn(E, H, generator=g),
                p_gate_up=(torch.randn(E, H, 2 * I, generator=g) * 0.3).to(dtype),
                p_down=(torch.randn(E, I, H, generator=g) * 0.3).to(dtype),
                rank=torch.zeros((), dtype=torch.int64))


def _before(dtype=torch.float32):
    return before(_scaled_input, **_inputs(dtype))


# The graph is the same but for dcp.moe's operands, all positional now (schema defaults
# filled in), and the tags: both dcp.moe a layer, the router linear named.
EXPECTED = """
    def forward(self, x, p_router, p_gate_up, p_down, rank):
        linear_default = aten.linear.default(x, p_router)
        topk_default = aten.topk.default(linear_default, 2, 1)
        getitem = topk_default[0]
        sigmoid_default = aten.sigmoid.default(getitem)
        split_with_sizes_default = aten.split_with_sizes.default(sigmoid_default, [1, 1], 1)
        getitem_1 = topk_default[1]
        split_with_sizes_default_1 = aten.split_with_sizes.default(getitem_1, [1, 1], 1)
        getitem_2 = split_with_sizes_default[0]
        ones_like_default = aten.ones_like.default(getitem_2)
        getitem_3 = split_with_sizes_default[0]
        mul_tensor = aten.mul.Tensor(x, getitem_3)
        getitem_4 = split_with_sizes_default_1[0]
        moe_default = dcp.moe.default(mul_tensor, getitem_4, ones_like_default, p_gate_up, p_down, rank, 'silu', None, None, None, 'concatenated_transposed', None, None)
        getitem_5 = split_with_sizes_default[1]
        mul_tensor_1 = aten.mul.Tensor(x, getitem_5)
        getitem_6 = split_with_sizes_default_1[1]
        moe_default_1 = dcp.moe.default(mul_tensor_1, getitem_6, ones_like_default, p_gate_up, p_down, rank, 'silu', None, None, None, 'concatenated_transposed', None, None)
        add_tensor = aten.add.Tensor(moe_default, moe_default_1)
        return (add_tensor,)
    """


def test_a_score_scaling_the_input_is_read_as_router():
    p = CanonicalizeMoE(context(4, 2, "decode"))
    gm = run_alone(p, _before())
    assert_code(gm, EXPECTED)
    moes = [n for n in gm.graph.nodes if n.target == dcp.moe.default]
    assert [(n.meta["dcp_layer"], n.meta["dcp_kind"]) for n in moes] == [(0, "moe"),
                                                                          (1, "moe")]
    routers = [n.name for n in gm.graph.nodes if n.meta.get(MOE_ROLE_META) == MOE_ROUTER]
    assert routers == ["linear_default"]
    assert p.matched["router_linears"] == 1 and p.matched["experts"] == [E]


def test_same_values_as_before():
    gm = run_alone(CanonicalizeMoE(context(4, 2, "decode")), _before())
    for got, want in zip(call(gm), call(_before())):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_experts_narrower_than_the_tokens_are_refused(ep):
    with pytest.raises(DCPTransformError, match=r"experts compute in torch.bfloat16 inside a "
                                                r"torch.float32 model.*round by the shape of "
                                                r"the batch.*model\.to\(torch\.bfloat16\)"):
        run_alone(CanonicalizeMoE(context(4, 2, "decode", expert_parallel=ep)),
                  _before(torch.bfloat16))


def test_expert_parallel_with_fewer_experts_than_ranks_names_the_limit():
    with pytest.raises(DCPTransformError, match=r"fewer experts than ranks: experts=4, tp=8"
                                                r".*expert_parallel=False"):
        run_alone(CanonicalizeMoE(context(8, 4, "decode", expert_parallel=True)), _before())


# -- ungated experts (Nemotron-H): the up projection alone, [E, I, H] ----------------------------

def _ungated(x, p_router, p_up, p_down, rank):
    """Routing weights on the outputs; experts ``down(relu²(up x))``, no gate projection."""
    top = aten.topk.default(aten.linear.default(x, p_router), 2, 1)
    weights = aten.softmax.int(top[0], 1)
    return (dcp.moe.default(x, top[1], weights, p_up, p_down, rank, "relu2",
                            layout="ungated"),)


def _ungated_inputs(up_rows=I):
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(T, H, generator=g), p_router=torch.randn(E, H, generator=g),
                p_up=torch.randn(E, up_rows, H, generator=g) * 0.3,
                p_down=torch.randn(E, H, I, generator=g) * 0.3,
                rank=torch.zeros((), dtype=torch.int64))


def test_ungated_experts_keep_their_data_and_values():
    """An up projection [E, I, H] beside down [E, H, I] is the ungated layout's shape (a
    gated one would need [E, 2I, H]); the node keeps relu2 / ungated, the values too."""
    gm = run_alone(CanonicalizeMoE(context(4, 2, "decode")),
                   before(_ungated, **_ungated_inputs()))
    moe, = [n for n in gm.graph.nodes if n.target == dcp.moe.default]
    assert (moe.args[6], moe.args[10]) == ("relu2", "ungated")
    for got, want in zip(call(gm), call(before(_ungated, **_ungated_inputs()))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_ungated_experts_with_a_gated_shape_or_a_gate_are_refused_by_node():
    with pytest.raises(DCPTransformError, match=r"dcp.moe shapes do not agree \(ungated "
                                                r"layout\).*down_proj"):
        run_alone(CanonicalizeMoE(context(4, 2, "decode")),
                  before(_ungated, **_ungated_inputs(up_rows=2 * I)))
    with pytest.raises(DCPTransformError, match=r"activation clamped_silu is a gate, and "
                                                r"layout ungated has no gate projection: "
                                                r"node \w+ at"):
        gm = before(_ungated, **_ungated_inputs())
        moe, = [n for n in gm.graph.nodes if n.target == dcp.moe.default]
        moe.args = (*moe.args[:6], "clamped_silu")
        moe.kwargs = {**moe.kwargs, "limit": 1.0}
        run_alone(CanonicalizeMoE(context(4, 2, "decode")), gm)
