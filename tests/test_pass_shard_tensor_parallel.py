"""shard_tensor_parallel: roles found from structure, shard shapes, inserted collectives."""

import pytest
import torch
from torch import nn

from dcp_compile.capture import capture
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.passes.canonicalize_attention import CanonicalizeAttention
from dcp_compile.passes.collectives import collective_summary
from dcp_compile.passes.drop_export_asserts import DropExportAsserts
from dcp_compile.passes.insert_rank import InsertRank
from dcp_compile.passes.shard_tensor_parallel import ShardTensorParallel
from dcp_compile.runtime.shards import ShardSpec
from dcp_compile.passes.validate_and_prove import ValidateAndProve

from passes_helpers import ctx_for, run, tiny_graph


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


def test_prefill_mode_shards_attention_over_dcp_tp():
    _, cap = tiny_graph(tokens=8)
    ctx, _, _ = _shard(8, 4, cap, mode="prefill")
    # dcp_tp_group has size tp/dcp = 2: q heads split in 2, the rank's piece is rank % 2.
    q = ctx.shards["p_layers_0_self_attn_q_proj_weight"]
    assert q == ShardSpec(0, 2, 2) and [q.index(r) for r in range(8)] == [0, 1] * 4
    assert ctx.shards["p_layers_0_mlp_gate_proj_weight"] == ShardSpec(0, 8, 8)


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
                                                r"test_pass_shard_tensor_parallel.py"):
        _shard(4, 1, cap)


def test_cache_inputs_take_the_per_rank_kv_head_shape():
    _, cap = tiny_graph()
    _, _, gm = _shard(8, 4, cap)                      # 2 KV heads over 8 ranks: 1 per rank
    caches = [n for n in gm.graph.nodes if n.op == "placeholder" and "kv_caches" in n.name]
    assert caches and all(n.meta["val"].shape[2] == 1 for n in caches)
