"""canonicalize_attention: one dcp.attention per layer; unknown forms are named errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile.capture import capture
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.passes.canonicalize_attention import CanonicalizeAttention

from passes_helpers import ctx_for, run, tiny_graph
from dcp_compile.models.demo import DemoConfig


def test_one_canonical_node_per_layer():
    _, cap = tiny_graph(cfg=DemoConfig(num_layers=3))
    p = CanonicalizeAttention(ctx_for(4, 2, "decode"))
    gm = run(cap.gm, [p])
    nodes = [n for n in gm.graph.nodes if n.target == torch.ops.dcp.attention.default]
    assert [n.meta["dcp_layer"] for n in nodes] == [0, 1, 2]
    assert p.matched == {"layers": 3}


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


def test_sdpa_is_an_error_naming_node_and_source():
    cap = capture(SDPAModel(), (torch.randn(1, 4, 16),))
    with pytest.raises(DCPTransformError,
                       match=r"unrecognised attention form .*scaled_dot_product.* at node "
                             r"scaled_dot_product_attention \(.*test_pass_canonicalize"):
        CanonicalizeAttention(ctx_for(4, 2, "decode"))(cap.gm)


def test_model_without_attention_is_an_error():
    cap = capture(NoAttention(), (torch.randn(1, 4, 16),))
    with pytest.raises(DCPTransformError, match="no attention"):
        CanonicalizeAttention(ctx_for(4, 2, "decode"))(cap.gm)
