"""canonicalize_attention, Before/Expected: each `dcp.paged_attention` becomes the canonical
`dcp.attention` (same arguments, same values), tagged with its layer."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile import DCPTransformError
from dcp_compile.capture import capture
from dcp_compile.passes.canonicalize_attention import CanonicalizeAttention

from before_expected import aten, assert_code, attention_inputs, before, call, context, \
    run_alone

dcp = torch.ops.dcp


def _two_layers(q, k, v, key_cache, value_cache, positions, block_table, kc1, vc1):
    a0 = dcp.paged_attention.default(q, k, v, key_cache, value_cache, positions, block_table,
                                     0.5)
    h = aten.add.Tensor(q, a0[0])
    a1 = dcp.paged_attention.default(h, k, v, kc1, vc1, positions, block_table, 0.5, window=4)
    return a1[0], a0[1], a0[2], a1[1], a1[2]


def _before():
    inputs = attention_inputs(hq=2, tokens=3)
    return before(_two_layers, **inputs, kc1=inputs["key_cache"].flip(0),
                  vc1=inputs["value_cache"].flip(0))


# Only the target changes: the node keeps its name and arguments (window too).
EXPECTED = """
    def forward(self, q, k, v, key_cache, value_cache, positions, block_table, kc1, vc1):
        paged_attention_default = dcp.attention.default(q, k, v, key_cache, value_cache, positions, block_table, 0.5)
        getitem = paged_attention_default[0]
        add_tensor = aten.add.Tensor(q, getitem)
        paged_attention_default_1 = dcp.attention.default(add_tensor, k, v, kc1, vc1, positions, block_table, 0.5, window = 4)
        getitem_1 = paged_attention_default_1[0]
        getitem_2 = paged_attention_default[1]
        getitem_3 = paged_attention_default[2]
        getitem_4 = paged_attention_default_1[1]
        getitem_5 = paged_attention_default_1[2]
        return (getitem_1, getitem_2, getitem_3, getitem_4, getitem_5)
    """


def test_paged_attention_becomes_dcp_attention_per_layer():
    p = CanonicalizeAttention(context(4, 2, "decode"))
    gm = run_alone(p, _before())
    assert_code(gm, EXPECTED)
    attn = [n for n in gm.graph.nodes if n.target == dcp.attention.default]
    assert [(n.meta["dcp_layer"], n.meta["dcp_kind"]) for n in attn] == [
        (0, "attention"), (1, "attention")]
    assert p.matched == {"layers": 2}


def test_same_values_as_before():
    gm = run_alone(CanonicalizeAttention(context(4, 2, "decode")), _before())
    for got, want in zip(call(gm), call(_before())):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_cache_that_is_not_an_input_is_refused():
    def f(q, k, v, key_cache, value_cache, positions, block_table):
        kc = aten.mul.Tensor(key_cache, 1.0)
        return dcp.paged_attention.default(q, k, v, kc, value_cache, positions,
                                           block_table, 0.5)[0]
    gm = before(f, **attention_inputs())
    with pytest.raises(DCPTransformError, match="reads a key_cache that is not a program "
                                                "input \\(mul_tensor\\)"):
        run_alone(CanonicalizeAttention(context(4, 2, "decode")), gm)


def test_contiguous_sdpa_is_refused_naming_the_node():
    def f(q):
        return aten.scaled_dot_product_attention.default(q, q, q, is_causal=True)
    gm = before(f, q=torch.randn(1, 2, 4, 8))
    with pytest.raises(DCPTransformError, match="unrecognised attention form .* at node "
                                                "scaled_dot_product_attention_default"):
        run_alone(CanonicalizeAttention(context(4, 2, "decode")), gm)


# -- refusals on captured models: the error names the node and the model's source line ------


class SDPAModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        q = self.proj(x).view(1, 2, 4, 8)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


class NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(x)


def test_captured_sdpa_is_refused_naming_node_and_source():
    cap = capture(SDPAModel(), (torch.randn(1, 4, 16),))
    with pytest.raises(DCPTransformError,
                       match=r"unrecognised attention form .*scaled_dot_product.* at node "
                             r"scaled_dot_product_attention \(.*test_before_expected_canon"):
        CanonicalizeAttention(context(4, 2, "decode"))(cap.gm)


def test_model_without_attention_is_refused():
    cap = capture(NoAttention(), (torch.randn(1, 4, 16),))
    with pytest.raises(DCPTransformError, match="no attention"):
        CanonicalizeAttention(context(4, 2, "decode"))(cap.gm)
