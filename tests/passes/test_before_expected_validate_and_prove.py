"""validate_and_prove, Before/Expected: the graph is unchanged; the config takes the
attention's real head counts and the layout's certificate is attached; a layout the graph
contradicts is refused."""

import pytest
import torch

from dcp_compile import DCPConfigError, DCPTransformError
from dcp_compile.passes.validate_and_prove import ValidateAndProve

from before_expected import assert_code, attention_inputs, before, context, run_alone

dcp = torch.ops.dcp


def _attention(q, k, v, key_cache, value_cache, positions, block_table):
    return dcp.attention.default(q, k, v, key_cache, value_cache, positions, block_table,
                                 0.5)[0]


def _before(**shape):
    return before(_attention, **attention_inputs(**shape))


def test_graph_unchanged_config_gets_head_counts_and_certificate():
    ctx = context(8, 2, "decode")
    p = ValidateAndProve(ctx)
    gm = run_alone(p, _before(hq=16, hkv=2, dim=8))
    assert_code(gm, """
        def forward(self, q, k, v, key_cache, value_cache, positions, block_table):
            attention_default = dcp.attention.default(q, k, v, key_cache, value_cache, positions, block_table, 0.5)
            getitem = attention_default[0]
            return getitem
        """)
    cfg = ctx.config
    assert (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (16, 2, 8)
    assert ctx.certificate.ok and gm.meta["dcp_certificate"] is ctx.certificate
    assert p.matched["theorems"] == len(ctx.certificate.theorems) > 0


def test_heads_the_layout_cannot_hold_are_refused():
    # decode DCP needs tp > num_kv_heads: 4 KV heads on tp=4.
    with pytest.raises(DCPConfigError, match="tp > num_kv_heads"):
        run_alone(ValidateAndProve(context(4, 2, "decode")), _before(hq=8, hkv=4))


def test_cache_block_size_must_match_the_config():
    with pytest.raises(DCPTransformError, match="cache block=8, block_size=16"):
        run_alone(ValidateAndProve(context(8, 2, "decode")), _before(hq=16, block=8))
