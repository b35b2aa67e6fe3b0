"""Placement through a weight's casts and transposes (``WEIGHT_VIEWS``): a linear whose
weight is read as ``w.t()`` (transformers' Conv1D, stored ``[in, out]``) cuts ``w`` with the
dims swapped; a norm weight read as ``w.float()`` next to a tensor sharded over all heads
(OLMo-2's q/k norm) takes the heads' cut, as the weight itself does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile.capture import capture
from dcp_compile.passes.canonicalize_attention import CanonicalizeAttention
from dcp_compile.passes.drop_export_asserts import DropExportAsserts
from dcp_compile.passes.insert_rank import InsertRank
from dcp_compile.passes.placement import Seg, Shard, analyze
from dcp_compile.passes.validate_and_prove import ValidateAndProve
from dcp_compile.runtime.errors import DCPTransformError

from passes_helpers import ctx_for, run


class WeightViews(nn.Module):
    """8 q heads and 2 kv heads of 8 from one fused [q; k; v] projection; ``variant``:
    "conv1d": q/k/v and O weights stored [in, out], read as ``w.t()``; "norm-float": an
    RMSNorm over all q heads whose weight is read as ``weight.float()``; "computed": the
    O weight is ``w * 2`` (computed, not a view of a weight)."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.embed = nn.Embedding(64, 32)
        self.qkv = nn.Parameter(torch.randn(32, 96))      # [in, out]
        self.o = nn.Parameter(torch.randn(64, 32))        # [in, out]
        self.q_norm = nn.Parameter(torch.randn(64))
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, ids, positions, table, caches):
        x = self.embed(ids)
        b, s, _ = x.shape
        q, k, v = F.linear(x, self.qkv.t()).split([64, 16, 16], -1)
        if self.variant == "norm-float":
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * self.q_norm.float()
        q, k, v = q.view(b, s, 8, 8), k.view(b, s, 2, 8), v.view(b, s, 2, 8)
        out, kc, vc = torch.ops.dcp.paged_attention(q, k, v, caches[0], caches[1], positions,
                                                    table, 0.35)
        o = self.o * 2 if self.variant == "computed" else self.o
        return self.head(x + F.linear(out.reshape(b, s, -1), o.t())), [kc, vc]


def _analyze(variant, tp=4, dcp=2):
    ex = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
          torch.zeros(1, 2, dtype=torch.long), [torch.zeros(3, 16, 2, 8)] * 2)
    cap = capture(WeightViews(variant), ex)
    ctx = ctx_for(tp, dcp, "decode")
    gm = run(cap.gm, [DropExportAsserts(ctx), CanonicalizeAttention(ctx), ValidateAndProve(ctx),
                      InsertRank(ctx, cap.user_inputs[0])])
    plan = analyze(gm, ctx.config)
    return {n.name: p for n, p in plan.placements.items()}, plan


QKV_ROWS = (Seg(64, 4), Seg(16, 2, 2), Seg(16, 2, 2))


def test_a_transposed_weight_is_cut_on_its_own_dims():
    """Column-parallel [in, out] weight: cut along dim 1 (its out features) segment by
    segment; the row-parallel O stored [in, out]: along dim 0 (its in features)."""
    got, plan = _analyze("conv1d")
    assert got["p_qkv"] == Shard(1, QKV_ROWS, "attn")
    assert got["p_o"] == Shard(0, (Seg(64, 4),), "attn")
    assert got["t"] == Shard(0, QKV_ROWS, "attn")           # as the linear reads it
    assert sorted(plan.roles.values()) == ["lm_head", "o_proj", "qkv_proj"]


def test_a_cast_norm_weight_over_all_heads_takes_the_heads_cut():
    got, _ = _analyze("norm-float")
    assert got["p_q_norm"] == Shard(0, (Seg(64, 4),), "attn")
    assert got["p_qkv"] == Shard(1, QKV_ROWS, "attn")


def test_a_computed_weight_is_still_refused():
    with pytest.raises(DCPTransformError, match="weight Replicate has no tensor-parallel form"):
        _analyze("computed")


class ProjectInOut(nn.Module):
    """OPT's word_embed_proj_dim: embeddings of 16 projected in to 32 and back out to 16
    before an LM head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.project_in = nn.Linear(16, 32, bias=False)
        self.q, self.k, self.v = (nn.Linear(32, n, bias=False) for n in (64, 16, 16))
        self.o = nn.Linear(64, 32, bias=False)
        self.project_out = nn.Linear(32, 16, bias=False)

    def forward(self, input_ids, positions, table, caches):
        x = self.project_in(self.embed(input_ids))
        b, s, _ = x.shape
        q, k, v = self.q(x).view(b, s, 8, 8), self.k(x).view(b, s, 2, 8), self.v(x).view(b, s, 2, 8)
        out, kc, vc = torch.ops.dcp.paged_attention(q, k, v, caches[0], caches[1], positions,
                                                    table, 0.35)
        x = x + self.o(out.reshape(b, s, -1))
        return F.linear(self.project_out(x), self.embed.weight), [kc, vc]


def test_linears_of_no_role_before_a_tied_lm_head_run_whole():
    """project_in / project_out are no q/k/v/o, MLP or LM head: whole on every rank (vLLM's
    ReplicatedLinear); the LM head tied to the embedding is vocab-parallel like it."""
    ex = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
          torch.zeros(1, 2, dtype=torch.long), [torch.zeros(3, 16, 2, 8)] * 2)
    cap = capture(ProjectInOut(), ex)
    ctx = ctx_for(4, 2, "decode")
    gm = run(cap.gm, [DropExportAsserts(ctx), CanonicalizeAttention(ctx), ValidateAndProve(ctx),
                      InsertRank(ctx, cap.user_inputs[0])])
    plan = analyze(gm, ctx.config)
    roles = {plan.roles[n.name] for n in plan.linears}
    kinds = {n.args[1].name: k for n, k in plan.linears.items()}
    assert kinds["p_project_in_weight"] == kinds["p_project_out_weight"] == "replicated"
    assert plan.params[next(p for p in plan.params if p.name == "p_embed_weight")] == \
        Shard(0, (Seg(64, 4),), "mlp")
    assert "lm_head" in roles
