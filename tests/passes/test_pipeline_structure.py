"""The passes in sequence on captured models (the demo model, small fused-projection
models): the structure one-layer Before/Expected graphs cannot show — layers sharing the
per-step metadata, the embedding and LM head, GQA replication over 8 ranks, fused q/k/v
projections, the bytes of every prefill collective, refusals naming the model's source line.

The prefill picture per layer (W = dcp, S_pad = S rounded up to TP, C = the owned capacity,
S/W when W*I divides S):
  1 all_gather world  [B, S_pad/TP, H] -> full     5 all_gather cp_kv  Q [B, C, hq, D]
  2 interleave slice  S -> C                        6 unshuffle         [B, W*C] -> [B, S]
  3 q/k/v projections on C tokens                   7 partial attention, LSE all_gather cp_kv
  4 cache write of owned slots                      8 reduce_scatter cp_kv  S_pad -> S_pad/W
                                                    9 O projection, reduce_scatter dcp_tp
plus the MLP's all_gather / reduce_scatter over world (sequence parallelism between layers).
"""

import functools

import pytest
import torch
from torch import nn

import dcp_compile
from dcp_compile.capture import capture
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.kernels.ops import owned_capacity
from dcp_compile.passes.canonicalize_attention import CanonicalizeAttention
from dcp_compile.passes.collectives import collective_summary
from dcp_compile.passes.dcp_prefill import DCPPrefill
from dcp_compile.passes.drop_export_asserts import DropExportAsserts
from dcp_compile.passes.infra import TransformContext
from dcp_compile.passes.insert_rank import InsertRank
from dcp_compile.passes.sequence_parallel import SPEC_STEP, SequenceParallel
from dcp_compile.passes.shard_tensor_parallel import ShardTensorParallel
from dcp_compile.runtime.program.shards import ShardSpec
from dcp_compile.passes.validate_and_prove import ValidateAndProve

from passes_helpers import ctx_for, op_counts, run, tiny_graph

AG, RS = "all_gather_into_tensor", "reduce_scatter_tensor"
BATCH, H, HQ, D = 2, 128, 16, 8


def _sharded(tp, dcp, tokens, interleave, layers=1, model=None):
    if model is None:
        model, cap = tiny_graph(tokens=tokens, batch=BATCH, block=interleave,
                                cfg=DemoConfig(num_layers=layers))
    else:
        from dcp_compile.capture import capture, example_step_inputs
        cap = capture(model, example_step_inputs(
            BATCH, tokens, 2, model.kv_cache_shape(5, interleave), model.num_layers,
            device="cpu", dtype=torch.float32))
    ctx = TransformContext(config=DCPConfig(tp=tp, dcp=dcp, mode="prefill",
                                            block_size=interleave), step="prefill")
    gm = run(cap.gm, [DropExportAsserts(ctx), CanonicalizeAttention(ctx), ValidateAndProve(ctx),
                      InsertRank(ctx, cap.user_inputs[0]), ShardTensorParallel(ctx)])
    return ctx, gm


@functools.lru_cache(maxsize=None)
def _prefill(tp, dcp, tokens, interleave, layers=1):
    """(ctx, rewritten graph, the two passes); cached: tests only read the result."""
    ctx, gm = _sharded(tp, dcp, tokens, interleave, layers)
    sp, p = SequenceParallel(ctx), DCPPrefill(ctx)
    return ctx, run(gm, [sp, p]), sp, p


CASES = [  # tp, dcp, S, I
    pytest.param(4, 2, 32, 8, id="tp4-dcp2-S32-I8-aligned"),
    pytest.param(8, 4, 64, 16, id="tp8-dcp4-S64-I16-aligned"),
    pytest.param(8, 4, 30, 8, id="tp8-dcp4-S30-I8-padded-S_pad32"),
]


@pytest.mark.parametrize("tp,dcp,S,I", CASES)
def test_nine_steps_per_layer_in_spec_order(tp, dcp, S, I):
    _, gm, _, _ = _prefill(tp, dcp, S, I, layers=2)
    for layer in range(2):
        steps = [n.meta[SPEC_STEP] for n in gm.graph.nodes
                 if SPEC_STEP in n.meta and n.meta.get("dcp_layer") == layer]
        assert sorted(set(steps)) == list(range(1, 10)), f"layer {layer}: {steps}"
        firsts = [steps.index(s) for s in range(1, 10)]
        assert firsts == sorted(firsts), f"layer {layer} steps out of order: {steps}"
    ops = op_counts(gm)
    assert ops["dcp.attention.default"] == 0 and ops["_c10d_functional.all_reduce.default"] == 0
    for op in ("cache_write", "partial_attention", "lse_correct"):
        assert ops[f"dcp.{op}.default"] == 2, op
    # Per-step index metadata is built once per graph and shared by the layers.
    for op in ("interleave_slice_index", "q_unshuffle_index", "slot_mapping", "local_filled"):
        assert ops[f"dcp.{op}.default"] == 1, op


@pytest.mark.parametrize("tp,dcp,S,I", CASES)
def test_collectives_roles_and_bytes(tp, dcp, S, I):
    _, gm, _, _ = _prefill(tp, dcp, S, I)
    s_pad = -(-S // tp) * tp
    hq = HQ // (tp // dcp)                    # q heads per rank: sharded over dcp_tp_group
    C = owned_capacity(S, dcp=dcp, interleave=I)
    if S % (dcp * I) == 0:
        assert C == S // dcp                  # the spec's S/DCP
    f32 = 4
    got = [(c["op"], c["role"], c["layer"], c["bytes_in"], c["bytes_out"])
           for c in collective_summary(gm)]
    expected = [
        (RS, "world", None, BATCH * s_pad * H * f32, BATCH * s_pad // tp * H * f32),  # embed
        # 1. SP all-gather over world: S/TP -> S
        (AG, "world", 0, BATCH * s_pad // tp * H * f32, BATCH * s_pad * H * f32),
        # 5. Q all-gather over cp_kv: C -> W*C tokens of this rank's q heads
        (AG, "cp_kv", 0, BATCH * C * hq * D * f32, dcp * BATCH * C * hq * D * f32),
        # 7. LSE all-gather over cp_kv (float32)
        (AG, "cp_kv", 0, BATCH * S * hq * f32, dcp * BATCH * S * hq * f32),
        # 8. reduce-scatter over cp_kv: S_pad -> S_pad/W (corrected partials, float32)
        (RS, "cp_kv", 0, BATCH * s_pad * hq * D * f32, BATCH * s_pad // dcp * hq * D * f32),
        # 9. O projection output, reduce-scatter over dcp_tp: S_pad/W -> S_pad/TP
        (RS, "dcp_tp", 0, BATCH * s_pad // dcp * H * f32, BATCH * s_pad // tp * H * f32),
        # MLP: sequence parallelism over world
        (AG, "world", 0, BATCH * s_pad // tp * H * f32, BATCH * s_pad * H * f32),
        (RS, "world", 0, BATCH * s_pad * H * f32, BATCH * s_pad // tp * H * f32),
        # final norm on S/TP, gather, vocab-parallel LM head, gather the vocab shards
        (AG, "world", None, BATCH * s_pad // tp * H * f32, BATCH * s_pad * H * f32),
        (AG, "world", None, BATCH * S * 256 // tp * f32, BATCH * S * 256 * f32),
    ]
    assert got == expected


def test_padding_nodes_only_when_S_does_not_split_over_tp():
    _, gm, sp, p = _prefill(8, 4, 30, 8)
    assert sp.matched["padded_tokens"] == 32 and sp.matched["tokens_per_rank"] == 4
    assert op_counts(gm)["aten.constant_pad_nd.default"] == 3   # embed RS, cp_kv RS, MLP RS
    _, gm, sp, _ = _prefill(8, 4, 32, 8)
    assert op_counts(gm)["aten.constant_pad_nd.default"] == 0


def test_inserted_nodes_are_tagged_by_kind():
    _, gm, sp, p = _prefill(4, 2, 32, 8, layers=2)
    assert p.inserted["cache_write"] == 2 and p.inserted["lse_combine"] == 2
    assert p.inserted["attention"] == 2
    assert p.inserted["collective"] == 2 * 4              # steps 5, 7 (LSE), 8, 9 per layer
    assert sp.inserted["collective"] == 1 + 2 * 3 + 1     # embed RS, per layer 3, LM head AG
    kinds = {n.meta.get("dcp_kind") for n in gm.graph.nodes}
    assert {"collective", "slice", "mask", "cache_write", "lse_combine"} <= kinds
    # RoPE's cos and sin are sliced once for every layer.
    assert p.matched["side_inputs_sliced"] == 2


def test_transform_runs_sequence_parallel_right_before_dcp_prefill():
    model = demo_model(DemoConfig(num_layers=1))
    from dcp_compile.runtime.serving.engine import StepShapes
    prog = dcp_compile.transform(model, tp=4, dcp=2, mode="prefill", block_size=8,
                                 shapes=StepShapes(batch=2, context_len=24, max_blocks=2,
                                                   num_blocks=5))
    names = [r.name for r in prog.history]
    assert names.index("sequence_parallel") + 1 == names.index("dcp_prefill")
    sp = next(r for r in prog.history if r.name == "sequence_parallel")
    assert sp.matched["tokens_per_rank"] == 6
    rec = next(r for r in prog.history if r.name == "dcp_prefill")
    assert rec.matched["owned_capacity"] == 8 + min(24 % 16, 8)
    assert list(prog.graphs) == ["prefill"]
    per_layer = prog.collectives_per_layer("prefill")
    assert per_layer["all_gather_into_tensor@cp_kv"] == 2
    assert per_layer["reduce_scatter_tensor@dcp_tp"] == 1


def test_token_mixing_in_the_residual_stream_is_refused():
    model = demo_model(DemoConfig(num_layers=1))
    layer = model.layers[0]
    plain = layer.forward

    def mixing(x, *args):
        x = x + x.cumsum(1)          # mixes tokens: cannot run on S/TP shards
        return plain(x, *args)

    layer.forward = mixing
    ctx, gm = _sharded(4, 2, 16, 8, model=model)
    with pytest.raises(DCPTransformError, match=r"cumsum.*not token-wise"):
        SequenceParallel(ctx)(gm)


def test_token_mixing_on_the_qkv_path_is_refused(monkeypatch):
    """An op that moves tokens between the projections and attention (here a roll along the
    token dim inside RoPE) cannot follow the interleave slice: named error."""
    from dcp_compile.models import demo as models
    plain = models.rotate_half
    monkeypatch.setattr(models, "rotate_half", lambda x: plain(x).roll(1, dims=1))
    ctx, gm = _sharded(4, 2, 16, 8, model=demo_model(DemoConfig(num_layers=1)))
    gm = run(gm, [SequenceParallel(ctx)])
    with pytest.raises(DCPTransformError, match=r"node roll .* on the q/k/v \(layer 0\) path"):
        DCPPrefill(ctx)(gm)



# -- shard_tensor_parallel on captured models ---------------------------------------------


def _shard(tp, dcp, cap, mode="decode"):
    ctx = ctx_for(tp, dcp, "decode", mode=mode)
    p = ShardTensorParallel(ctx)
    gm = run(cap.gm, [DropExportAsserts(ctx), CanonicalizeAttention(ctx), ValidateAndProve(ctx),
                      InsertRank(ctx, cap.user_inputs[0]), p])
    return ctx, p, gm


def test_roles_and_shard_specs_decode_tp8():
    _, cap = tiny_graph()
    ctx, p, gm = _shard(8, 4, cap)
    roles = p.matched["projections"]
    assert sorted(roles.values()) == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                             "mlp_column", "mlp_column", "mlp_row",
                                             "lm_head", "embedding"])
    s = ctx.shards
    assert s["p_layers_0_self_attn_q_proj_weight"] == ShardSpec(0, 8, 8)
    # 2 KV heads over 8 ranks: each head replicated on 4 consecutive ranks.
    kv = s["p_layers_0_self_attn_k_proj_weight"]
    assert kv == ShardSpec(0, 2, 8, 4) and [kv.index(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert s["p_layers_0_self_attn_o_proj_weight"] == ShardSpec(1, 8, 8)
    assert s["p_layers_0_mlp_down_proj_weight"] == ShardSpec(1, 8, 8)
    assert s["p_embed_tokens_weight"] == ShardSpec(0, 8, 8)
    ph = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    assert tuple(ph["p_layers_0_self_attn_q_proj_weight"].meta["val"].shape) == (16, 128)
    assert tuple(ph["p_layers_0_self_attn_k_proj_weight"].meta["val"].shape) == (8, 128)


def test_collectives_inserted_per_layer_decode():
    _, cap = tiny_graph()
    _, _, gm = _shard(4, 2, cap)
    got = [(c["op"], c["role"]) for c in collective_summary(gm)]
    assert got == [("all_reduce", "tp"),                 # vocab-parallel embedding
                   ("all_reduce", "tp"),                 # o_proj
                   ("all_reduce", "tp"),                 # mlp down
                   ("all_gather_into_tensor", "tp")]     # lm head


class FusedQKV(nn.Module):
    """Attention whose q, k and v come out of one fused projection laid out [3, h, d]."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.qkv = nn.Linear(32, 3 * 32, bias=False)
        self.o = nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, ids, positions, table, caches):
        x = self.embed(ids)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, -1, 8).unbind(2)
        out, kc, vc = torch.ops.dcp.paged_attention(q, k, v, caches[0], caches[1], positions,
                                                    table, 0.35)
        return self.head(x + self.o(out.reshape(b, s, -1))), [kc, vc]


def test_fused_qkv_is_cut_segment_by_segment():
    m = FusedQKV()
    ex = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
          torch.zeros(1, 2, dtype=torch.long), [torch.zeros(3, 16, 4, 8)] * 2)
    cap = capture(m, ex)
    ctx, p, gm = _shard(4, 1, cap)
    spec = ctx.shards["p_qkv_weight"]
    # [3, h, d] rows: rank r holds heads r of q, of k and of v (one 8-row piece of each).
    assert spec == ShardSpec(0, 4, 4, 1, segments=((32, 4, 1),) * 3)
    full = torch.arange(96.0)[:, None].expand(96, 32)
    assert spec.shard(full, 1)[:, 0].tolist() == list(range(8, 16)) + list(range(40, 48)) \
        + list(range(72, 80))
    assert p.matched["projections"]["linear"] == "qkv_proj"


class MeanOverHeads(FusedQKV):
    """A statistic over every head of q (amax) has no sharded form: refused by name."""

    def forward(self, ids, positions, table, caches):
        x = self.embed(ids)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, -1, 8).unbind(2)
        q = q / q.amax(dim=(2, 3), keepdim=True)
        out, kc, vc = torch.ops.dcp.paged_attention(q, k, v, caches[0], caches[1], positions,
                                                    table, 0.35)
        return self.head(x + self.o(out.reshape(b, s, -1))), [kc, vc]


def test_reduction_over_heads_without_sharded_form_is_refused_with_source():
    m = MeanOverHeads()
    ex = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
          torch.zeros(1, 2, dtype=torch.long), [torch.zeros(3, 16, 4, 8)] * 2)
    cap = capture(m, ex)
    with pytest.raises(DCPTransformError, match=r"aten.amax.default.*sharded dim.*"
                                                r"test_pipeline_structure.py"):
        _shard(4, 1, cap)
