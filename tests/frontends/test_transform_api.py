"""transform(): what a user gets, and the clear errors for inputs it cannot serve."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dcp_compile
from dcp_compile.runtime.errors import DCPConfigError, DCPInputError, DCPTransformError
from dcp_compile.models.demo import DemoConfig, DemoLlama, demo_model
from dcp_compile.passes.check_static_shapes import CheckStaticShapes
from dcp_compile.runtime.serving.engine import StepShapes

from passes_helpers import ctx_for

SMALL = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5)


def test_program_exposes_graphs_certificate_topology_history_and_shards():
    model = demo_model(DemoConfig(num_layers=1))
    prog = dcp_compile.transform(model, tp=4, dcp=2, mode="decode", shapes=SMALL)
    assert set(prog.graphs) == {"context", "decode"}
    assert prog.certificate.ok and prog.topology.groups["dcp"] == [[0, 1], [2, 3]]
    names = [(r.step, r.name) for r in prog.history]
    assert ("decode", "dcp_decode") in names and ("context", "dcp_context") in names
    assert all(r.seconds >= 0 for r in prog.history)
    sd = prog.state_dict_for(3)
    assert sd["tp_rank"].item() == 3
    q = sd["p_layers_0_self_attn_q_proj_weight"]
    full = model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, full[3 * 32:4 * 32])            # 16 heads * 8 / tp=4 rows per rank
    k = sd["p_layers_0_self_attn_k_proj_weight"]           # rank 3 holds KV head 1
    assert torch.equal(k, model.layers[0].self_attn.k_proj.weight[8:16])
    with pytest.raises(ValueError, match="rank out of range"):
        prog.state_dict_for(4)


def test_meta_device_model_transforms_without_weights():
    model = demo_model(DemoConfig(num_layers=2, hidden_size=512, num_q_heads=32,
                                  num_kv_heads=8, head_dim=16, intermediate_size=1024,
                                  vocab_size=1024), device="meta")
    prog = dcp_compile.transform(model, tp=16, dcp=2, mode="decode", shapes=SMALL)
    # weightless: a rank reads its shards from a checkpoint (tests/runtime/test_checkpoint.py)
    assert prog.weightless
    with pytest.raises(DCPInputError, match="holds no weights .*Pass the model's checkpoint"):
        prog.state_dict_for(5)
    assert prog.collectives_per_layer("decode") == {
        "all_gather_into_tensor@dcp": 2.0, "all_reduce@tp": 2.0,
        "reduce_scatter_tensor@dcp": 1.0}


def test_meta_device_model_transforms_in_prefill_mode():
    # The sequence-parallel slice index is made on the model's device (meta here), not the
    # default one: index_select(meta stream, cpu index) used to fail fake propagation.
    model = demo_model(DemoConfig(num_layers=2), device="meta")
    prog = dcp_compile.transform(model, tp=4, dcp=2, mode="prefill", shapes=SMALL)
    assert list(prog.graphs) == ["prefill"]
    assert prog.weightless


def test_dump_dir_gets_the_graph_after_every_pass(tmp_path):
    model = demo_model(DemoConfig(num_layers=1))
    prog = dcp_compile.transform(model, tp=4, dcp=2, shapes=SMALL, dump_dir=tmp_path)
    for step in ("context", "decode"):
        files = sorted(p.name for p in (tmp_path / step).glob("*.py"))
        passes = [r.name for r in prog.history if r.step == step]
        assert len(files) == len(passes) + 1          # + the captured graph
        assert any("dcp_decode" in f or "dcp_context" in f for f in files)


def test_head_counts_that_break_a_rule_are_a_config_error():
    model = demo_model(DemoConfig(num_layers=1))      # 16 q heads, 2 kv heads
    with pytest.raises(DCPConfigError, match=r"dcp <= tp // num_kv_heads: dcp=4, tp=4"):
        dcp_compile.transform(model, tp=4, dcp=4, shapes=SMALL)
    with pytest.raises(DCPConfigError, match="tp > num_kv_heads"):
        dcp_compile.transform(model, tp=2, dcp=2, shapes=SMALL)


def test_multi_head_decode_dcp_names_the_limit_and_dcp_1():
    """As many KV heads as query heads: query heads split over tp, so no tp exceeds the KV
    heads; the fix is dcp=1, not a larger tp (which would not split the query heads)."""
    from dcp_compile import DCPConfig
    with pytest.raises(DCPConfigError, match=r"multi-head attention .* num_q_heads=8, "
                                             r"num_kv_heads=8\. Use dcp=1") as e:
        DCPConfig(tp=4, dcp=2, mode="decode", num_q_heads=8, num_kv_heads=8)
    assert "tp=16" not in str(e.value)
    DCPConfig(tp=4, dcp=1, mode="decode", num_q_heads=8, num_kv_heads=8)     # no DCP: fine


class NoAttentionModel(DemoLlama):
    """Demo-shaped model whose layers skip attention entirely."""

    def forward(self, input_ids, positions, block_table, kv_caches):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x)), [c + 0 for c in kv_caches]


class SDPAModel(DemoLlama):
    """Attention over contiguous K/V with SDPA: there is no paged cache to shard."""

    def forward(self, input_ids, positions, block_table, kv_caches):
        x = self.embed_tokens(input_ids)
        b, s, _ = x.shape
        a = self.layers[0].self_attn
        q = a.q_proj(x).view(b, s, -1, 8).transpose(1, 2)
        k = a.k_proj(x).view(b, s, -1, 8).transpose(1, 2)
        v = a.v_proj(x).view(b, s, -1, 8).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.lm_head(a.o_proj(o.transpose(1, 2).reshape(b, s, -1))), kv_caches


def test_model_without_attention_is_a_clear_error():
    with pytest.raises(DCPTransformError, match="no attention"):
        dcp_compile.transform(NoAttentionModel(DemoConfig(num_layers=1)), tp=4, dcp=2,
                              shapes=SMALL)


def test_unknown_attention_names_the_node_and_source():
    with pytest.raises(DCPTransformError,
                       match=r"unrecognised attention form.*test_transform_api.py"):
        dcp_compile.transform(SDPAModel(DemoConfig(num_layers=1)), tp=4, dcp=2,
                              shapes=SMALL)


def test_model_that_does_not_describe_its_cache_is_rejected():
    with pytest.raises(DCPTransformError, match="kv_cache_shape"):
        dcp_compile.transform(nn.Linear(4, 4), tp=4, dcp=2, shapes=SMALL)


def test_dynamic_shapes_are_rejected():
    class M(nn.Module):
        def forward(self, x):
            return x * 2

    x = torch.randn(4, 3)
    ep = torch.export.export(M(), (x,), dynamic_shapes={"x": {0: torch.export.Dim("n")}})
    with pytest.raises(DCPTransformError, match="dynamic shape"):
        CheckStaticShapes(ctx_for(4, 2, "decode"))(ep.graph_module)


def test_progress_reports_every_capture_and_pass(capsys):
    model = demo_model(DemoConfig(num_layers=1))
    prog = dcp_compile.transform(model, tp=4, dcp=2, shapes=SMALL, progress=True)
    err = capsys.readouterr().err
    for record in prog.history:
        assert f"[{record.step}] {record.name}:" in err
    assert err.count("captured") == 2


def test_biased_lm_head_and_row_projection_are_sharded_correctly():
    """An LM head with a bias (vocab-sharded with its weight) and an O projection with a bias
    (added once, after the all-reduce) still match the single-device model."""
    from dcp_compile.verify import verify

    model = demo_model(DemoConfig(num_layers=1))
    g = torch.Generator().manual_seed(3)
    head = nn.Linear(128, 256, bias=True)
    o = nn.Linear(128, 128, bias=True)
    with torch.no_grad():
        for lin, old in ((head, model.lm_head), (o, model.layers[0].self_attn.o_proj)):
            lin.weight.copy_(old.weight)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g))
    model.lm_head, model.layers[0].self_attn.o_proj = head, o
    shapes = StepShapes(batch=2, context_len=20, max_blocks=2, num_blocks=5)
    prog = dcp_compile.transform(model, tp=4, dcp=2, shapes=shapes)
    assert prog.shards["p_lm_head_bias"].pieces == 4
    assert "p_layers_0_self_attn_o_proj_bias" not in prog.shards      # replicated, added once
    report = verify(model, prog, [[1, 2, 3], list(range(20))], 4)
    assert report.ok, report
