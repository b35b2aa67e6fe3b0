"""dcp_decode / dcp_context: the picture of the rewrite for one layer, and bytes moved."""

import pytest
import torch

from dcp_compile.capture import capture, example_step_inputs
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.passes.canonicalize_attention import CanonicalizeAttention
from dcp_compile.passes.collectives import collective_summary
from dcp_compile.passes.dcp_decode import DCPContext, DCPDecode
from dcp_compile.passes.drop_export_asserts import DropExportAsserts
from dcp_compile.passes.insert_rank import InsertRank
from dcp_compile.passes.shard_tensor_parallel import ShardTensorParallel
from dcp_compile.passes.validate_and_prove import ValidateAndProve

from passes_helpers import ctx_for, op_counts, run, tiny_graph


def _before(tp, dcp, step, tokens, interleave=None, **config):
    model, cap = tiny_graph(tokens=tokens)
    ctx = ctx_for(tp, dcp, step, interleave=interleave)
    ctx.config = ctx.config.replace(**config)
    gm = run(cap.gm, [DropExportAsserts(ctx), CanonicalizeAttention(ctx), ValidateAndProve(ctx),
                      InsertRank(ctx, cap.user_inputs[0]), ShardTensorParallel(ctx)])
    return ctx, gm


@pytest.mark.parametrize("tp,dcp", [(4, 2), (8, 4)])
def test_decode_rewrite_structure_and_bytes(tp, dcp):
    ctx, gm = _before(tp, dcp, "decode", tokens=1)
    p = DCPDecode(ctx)
    gm = run(gm, [p])
    ops = op_counts(gm)
    # Exactly the spec's pattern for one layer.
    assert ops["dcp.attention.default"] == 0
    assert ops["dcp.slot_mapping.default"] == 1
    assert ops["dcp.cache_write.default"] == 1
    assert ops["dcp.local_filled.default"] == 1
    assert ops["dcp.active_mask.default"] == 1
    assert ops["dcp.partial_attention.default"] == 1
    assert ops["dcp.lse_correct.default"] == 1
    on_dcp = [c for c in collective_summary(gm) if c["role"] == "dcp"]
    assert [(c["op"], c["layer"]) for c in on_dcp] == [
        ("all_gather_into_tensor", 0), ("all_gather_into_tensor", 0),
        ("reduce_scatter_tensor", 0)]
    cfg = ctx.config
    batch, hq, d = 2, cfg.num_q_heads // tp, cfg.head_dim
    q_gather, lse_gather, heads_rs = on_dcp
    assert q_gather["bytes_in"] == batch * hq * d * 4               # this rank's q heads
    assert q_gather["bytes_out"] == dcp * batch * hq * d * 4        # the replica set's
    assert lse_gather["bytes_in"] == batch * dcp * hq * 4           # float32 LSE
    assert heads_rs["bytes_in"] == dcp * batch * hq * d * 4         # corrected partials, f32
    assert heads_rs["bytes_out"] == batch * hq * d * 4
    assert p.inserted["collective"] == 3 and p.inserted["lse_combine"] == 1


@pytest.mark.parametrize("tp,dcp", [(4, 2), (8, 4)])
def test_decode_all_to_all_combine_structure_and_bytes(tp, dcp):
    """combine='all_to_all': Q all-gather, then one all-to-all of the partial outputs packed
    with their float32 LSEs, merged locally: 2 DCP collectives per layer instead of 3."""
    ctx, gm = _before(tp, dcp, "decode", tokens=1, combine="all_to_all")
    p = DCPDecode(ctx)
    gm = run(gm, [p])
    ops = op_counts(gm)
    assert ops["dcp.partial_attention.default"] == 1 and ops["dcp.lse_merge.default"] == 1
    assert ops["dcp.lse_correct.default"] == 0
    on_dcp = [c for c in collective_summary(gm) if c["role"] == "dcp"]
    assert [(c["op"], c["layer"]) for c in on_dcp] == [
        ("all_gather_into_tensor", 0), ("all_to_all_single", 0)]
    cfg = ctx.config
    batch, hq, d = 2, cfg.num_q_heads // tp, cfg.head_dim
    _, a2a = on_dcp
    # Every rank's W*hq partial heads (d floats + 1 LSE each) out; as many in, W sources.
    assert a2a["shape_in"] == (dcp * batch, 1, hq, d + 1)
    assert a2a["bytes_in"] == a2a["bytes_out"] == dcp * batch * hq * (d + 1) * 4
    assert p.inserted["collective"] == 2 and p.inserted["lse_combine"] == 1


@pytest.mark.parametrize("combine,collective", [("all_gather", "reduce_scatter_tensor"),
                                                ("all_to_all", "all_to_all_single")])
def test_combine_dtype_model_sends_the_partial_outputs_in_the_model_dtype(combine, collective):
    """combine_dtype='model' on a bf16 graph: the partial outputs travel as bf16 (half the
    bytes); the all-to-all carries each float32 LSE as two bf16 words."""
    model = demo_model(DemoConfig(num_layers=1), dtype=torch.bfloat16)
    cap = capture(model, example_step_inputs(2, 1, 2, model.kv_cache_shape(5, 16), 1,
                                             device="cpu", dtype=torch.bfloat16))
    ctx = ctx_for(4, 2, "decode")
    ctx.config = ctx.config.replace(combine=combine, combine_dtype="model")
    gm = run(cap.gm, [DropExportAsserts(ctx), CanonicalizeAttention(ctx), ValidateAndProve(ctx),
                  InsertRank(ctx, cap.user_inputs[0]), ShardTensorParallel(ctx),
                  DCPDecode(ctx)])
    cfg = ctx.config
    hq, d = cfg.num_q_heads // 4, cfg.head_dim
    combine_op = next(c for c in collective_summary(gm) if c["op"] == collective)
    width = d + 2 if combine == "all_to_all" else d
    assert combine_op["bytes_in"] == 2 * 2 * hq * width * 2             # bf16 elements


def test_decode_with_dcp1_emits_no_dcp_collectives():
    ctx, gm = _before(4, 1, "decode", tokens=1)
    gm = run(gm, [DCPDecode(ctx)])
    assert not [c for c in collective_summary(gm) if c["role"] == "dcp"]
    assert op_counts(gm)["dcp.partial_attention.default"] == 1


def test_context_rewrite_is_plain_tp_with_owner_only_writes():
    ctx, gm = _before(4, 2, "context", tokens=8)
    gm = run(gm, [DCPContext(ctx)])
    ops = op_counts(gm)
    assert ops["dcp.slot_mapping.default"] == 1 and ops["dcp.cache_write.default"] == 1
    assert not [c for c in collective_summary(gm) if c["role"] == "dcp"]


def test_decode_rewrite_refuses_a_width_beyond_the_proof():
    ctx, gm = _before(4, 2, "decode", tokens=9)
    with pytest.raises(DCPTransformError, match="proven for widths 1..8"):
        DCPDecode(ctx)(gm)


def test_width_k_decode_reads_every_key_through_the_query_bound():
    ctx, gm = _before(4, 2, "decode", tokens=3)
    gm = run(gm, [DCPDecode(ctx)])
    ops = op_counts(gm)
    layers = ops["dcp.partial_attention.default"]
    assert ops["dcp.query_bound.default"] == layers and "dcp.active_mask.default" not in ops
    assert ops["dcp.slot_mapping.default"] == layers


def test_cp_rank_is_arithmetic_on_the_rank_input():
    ctx, gm = _before(4, 2, "decode", tokens=1)
    gm = run(gm, [DCPDecode(ctx)])
    cp = next(n for n in gm.graph.nodes if n.name == "cp_rank")
    assert cp.target == torch.ops.aten.remainder.Scalar and cp.args[0].name == "tp_rank"
