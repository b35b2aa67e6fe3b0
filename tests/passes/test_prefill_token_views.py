"""The DCP prefill rewrite follows the token dim along the q/k/v path
(``dcp_prefill.trace_token_dim``): a view may add or drop size-1 dims before it (GPT-BigCode's
multi-query ``unsqueeze(1)`` then ``view(B, S, H, D)``), never fold or move it."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dcp_compile.passes.dcp_prefill import trace_token_dim
from dcp_compile.runtime.errors import DCPTransformError

aten = torch.ops.aten


def _view(shape_in, shape_out):
    gm = make_fx(lambda x: x.view(*shape_out), tracing_mode="fake")(torch.randn(shape_in))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    v = next(n for n in gm.graph.nodes if n.target == aten.view.default)
    return x, v


def test_a_view_dropping_a_size_one_dim_before_the_tokens_keeps_them():
    x, v = _view((4, 1, 16, 32), (4, 16, 4, 8))      # [B, 1, S, E] -> [B, S, H, D]
    td, _ = trace_token_dim([v], {x: 2}, 16, "q")
    assert td[v] == 1


@pytest.mark.parametrize("shape_out", [(64, 32), (4, 4, 4, 32)], ids=["folds-batch", "splits-tokens"])
def test_a_view_folding_or_splitting_the_tokens_is_refused(shape_out):
    x, v = _view((4, 1, 16, 32), shape_out)
    with pytest.raises(DCPTransformError, match="must stay as they are"):
        trace_token_dim([v], {x: 2}, 16, "q")
