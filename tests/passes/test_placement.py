"""Placement rules on tiny hand-built graphs: before -> placements; refusals name op and source.

Each rule is data (dcp_compile.passes.placement.RULES); these tests call one rule at a time on a node of
a small traced function, then run the whole analysis on small attention graphs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from dcp_compile.capture import capture
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.passes.canonicalize_attention import CanonicalizeAttention
from dcp_compile.passes.drop_export_asserts import DropExportAsserts
from dcp_compile.passes.insert_rank import InsertRank
from dcp_compile.passes.placement import (R, Partial, Refusal, Seg, Shard, analyze, canon, rule_for,
                              show)
from dcp_compile.passes.validate_and_prove import ValidateAndProve

from passes_helpers import ctx_for, run

aten = torch.ops.aten


def node_of(fn, *shapes, target):
    """Trace ``fn`` on tensors of ``shapes`` (ATen graph with fake values); the node of
    ``target``."""
    gm = make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta.setdefault("val", n.meta.get("val"))
    n = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == target)
    return gm, n


def placed(n, placements):
    ins = [a for a in n.all_input_nodes]
    table = dict(zip(ins, placements))
    return rule_for(n.target).forward(n, lambda a: table.get(a, R))


HEADS = Shard(2, (Seg(8, 4),), "attn")                  # [B, S, 8 heads, D] over 4 ranks
QKV = Shard(2, (Seg(64, 4), Seg(16, 2, 2), Seg(16, 2, 2)), "attn")   # [q; k; v] features


# -- dim maps (DTensor's view ops) ---------------------------------------------------------

@pytest.mark.parametrize("fn,shape,target,before,after", [
    (lambda x: x.view(2, 3, 8, 8), (2, 3, 64), aten.view.default,
     Shard(2, (Seg(64, 4),), "attn"), HEADS),
    (lambda x: x.reshape(2, 3, 64), (2, 3, 8, 8), aten.view.default,
     HEADS, Shard(2, (Seg(64, 4),), "attn")),
    (lambda x: x.transpose(1, 2), (2, 3, 8, 8), aten.transpose.int,
     HEADS, Shard(1, (Seg(8, 4),), "attn")),
    # [3, h, d]: a shard of the middle factor is a segmented [q; k; v] of three equal parts
    (lambda x: x.view(2, 3, 3, 4, 8), (2, 3, 96), aten.view.default,
     Shard(2, (Seg(32, 4),) * 3, "attn"), Shard(3, (Seg(4, 4),), "attn")),
    # [q; k; v] features -> heads: segments keep their own pieces and replicas
    (lambda x: x.view(2, 3, 12, 8), (2, 3, 96), aten.view.default,
     QKV, Shard(2, (Seg(8, 4), Seg(2, 2, 2), Seg(2, 2, 2)), "attn")),
], ids=["split-heads", "merge-heads", "transpose", "3hd-view", "qkv-rows-view"])
def test_dim_map_rules(fn, shape, target, before, after):
    _, n = node_of(fn, shape, target=target)
    assert placed(n, [before]) == after


def test_view_that_cuts_a_head_is_refused():
    _, n = node_of(lambda x: x.view(2, 3, 4, 16), (2, 3, 64), target=aten.view.default)
    with pytest.raises(Refusal):          # 64 features over 8 pieces of 8: not 4 heads of 16
        placed(n, [Shard(2, (Seg(64, 8),), "attn")])


# -- segment-aware splitting ---------------------------------------------------------------

def test_split_at_segment_boundaries_gives_each_part_its_shard():
    _, n = node_of(lambda x: x.split([64, 16, 16], dim=-1), (2, 3, 96),
                   target=aten.split_with_sizes.default)
    q, k, v = placed(n, [QKV])
    assert q == Shard(2, (Seg(64, 4),), "attn") and k == v == Shard(2, (Seg(16, 2, 2),), "attn")


def test_split_inside_a_segment_is_refused():
    _, n = node_of(lambda x: x.chunk(2, dim=-1), (2, 3, 96), target=aten.split.Tensor)
    with pytest.raises(Refusal, match="cuts segment"):
        placed(n, [QKV])


def test_slice_of_whole_segments():
    _, n = node_of(lambda x: x[..., 64:80], (2, 3, 96), target=aten.slice.Tensor)
    assert placed(n, [QKV]) == Shard(2, (Seg(16, 2, 2),), "attn")


def test_a_shard_of_one_piece_is_replicated_data():
    assert canon(Shard(2, (Seg(1, 1, 4),), "attn")) == R


# -- pointwise, reductions ---------------------------------------------------------------

def test_pointwise_broadcast_over_heads_keeps_the_shard():
    _, n = node_of(lambda q, cos: q * cos, (2, 3, 8, 8), (2, 3, 1, 8), target=aten.mul.Tensor)
    assert placed(n, [HEADS, R]) == HEADS


def test_pointwise_with_a_replicated_operand_across_heads_is_refused():
    _, n = node_of(lambda q, c: q + c, (2, 3, 8, 8), (8, 8), target=aten.add.Tensor)
    with pytest.raises(Refusal, match="spans the sharded dim"):
        placed(n, [HEADS, R])


def test_mean_over_the_sharded_dim_is_a_scaled_partial_sum():
    _, n = node_of(lambda x: x.pow(2).mean(-1, keepdim=True), (2, 3, 64),
                   target=aten.mean.dim)
    # local mean * 16/64 summed over the 4 ranks = the global mean
    assert placed(n, [Shard(2, (Seg(64, 4),), "attn")]) == Partial("attn", 0.25)
    # a KV head replicated on 2 ranks would be summed twice: halve it
    assert placed(n, [Shard(2, (Seg(64, 2, 2),), "attn")]) == Partial("attn", 0.25)


def test_max_over_the_sharded_dim_is_refused():
    _, n = node_of(lambda x: x.amax(-1), (2, 3, 64), target=aten.amax.default)
    with pytest.raises(Refusal, match="not a sum"):
        placed(n, [Shard(2, (Seg(64, 4),), "attn")])


# -- the whole analysis on small attention graphs ------------------------------------------

class Tiny(nn.Module):
    """Embedding -> fused projection -> attention -> O -> LM head; ``variant`` picks how q,
    k, v come out of the fused projection."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.embed = nn.Embedding(64, 32)
        width = {"rows": 64 + 2 * 16, "gate": 2 * 64}.get(variant, 3 * 32)
        self.qkv = nn.Linear(32, width, bias=False)
        self.k = nn.Linear(32, 16, bias=False)
        self.v = nn.Linear(32, 16, bias=False)
        self.o = nn.Linear(64 if variant in ("rows", "gate") else 32, 32, bias=False)
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, ids, positions, table, caches):
        x = self.embed(ids)
        b, s, _ = x.shape
        gate = None
        if self.variant == "rows":          # 8 q heads, 2 kv heads of 8
            q, k, v = self.qkv(x).split([64, 16, 16], -1)
            q, k, v = q.view(b, s, 8, 8), k.view(b, s, 2, 8), v.view(b, s, 2, 8)
        elif self.variant == "gate":
            q, gate = self.qkv(x).chunk(2, -1)
            q, k, v = q.view(b, s, 8, 8), self.k(x).view(b, s, 2, 8), self.v(x).view(b, s, 2, 8)
        else:                               # [h, 3, d], 4 heads
            q, k, v = self.qkv(x).view(b, s, 4, 24).split(8, -1)
        out, kc, vc = torch.ops.dcp.paged_attention(q, k, v, caches[0], caches[1], positions,
                                                    table, 0.35)
        out = out.reshape(b, s, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.head(x + self.o(out)), [kc, vc]


def _analyze(variant, tp, dcp, model=Tiny):
    kv = 4 if variant == "h3d" else 2
    ex = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
          torch.zeros(1, 2, dtype=torch.long), [torch.zeros(3, 16, kv, 8)] * 2)
    cap = capture(model(variant), ex)
    ctx = ctx_for(tp, dcp, "decode")
    gm = run(cap.gm, [DropExportAsserts(ctx), CanonicalizeAttention(ctx), ValidateAndProve(ctx),
                      InsertRank(ctx, cap.user_inputs[0])])
    plan = analyze(gm, ctx.config)
    return {n.name: p for n, p in plan.placements.items()}, plan


class TinyCoefs(Tiny):
    """Tiny ("rows") with Gemma 3n's AltUp-style coefficients: a router to 2 features, a
    linear from those 2 (no tp of 4 divides them), and the router called again later."""

    def __init__(self, variant="rows"):
        super().__init__("rows")
        self.router = nn.Linear(32, 2, bias=False)
        self.coefs = nn.Linear(2, 32, bias=False)

    def forward(self, ids, positions, table, caches):
        x = self.embed(ids)
        b, s, _ = x.shape
        x = x * (1 + self.coefs(torch.tanh(self.router(x))))
        q, k, v = self.qkv(x).split([64, 16, 16], -1)
        q, k, v = q.view(b, s, 8, 8), k.view(b, s, 2, 8), v.view(b, s, 2, 8)
        out, kc, vc = torch.ops.dcp.paged_attention(q, k, v, caches[0], caches[1], positions,
                                                    table, 0.35)
        h = x + self.o(out.reshape(b, s, -1))
        h = h * self.router(h).sum(-1, keepdim=True)          # the router's second call
        return self.head(h), [kc, vc]


def test_a_linear_whose_input_features_do_not_split_runs_replicated():
    got, plan = _analyze("rows", 4, 2, model=TinyCoefs)
    assert got["p_coefs_weight"] == R and got["p_router_weight"] == R
    assert list(plan.roles.values()).count("replicated") == 3, plan.roles  # router twice


def test_fused_rows_weight_is_cut_segment_by_segment():
    got, plan = _analyze("rows", 4, 2)
    assert got["p_qkv_weight"] == Shard(0, (Seg(64, 4), Seg(16, 2, 2), Seg(16, 2, 2)), "attn")
    assert got["p_o_weight"] == Shard(1, (Seg(64, 4),), "attn")
    assert got["p_head_weight"] == Shard(0, (Seg(64, 4),), "mlp")
    assert plan.roles["linear"] == "qkv_proj" and plan.roles["linear_1"] == "o_proj"


def test_per_head_interleaved_qkv_is_a_plain_row_shard():
    got, _ = _analyze("h3d", 4, 1)
    assert got["p_qkv_weight"] == Shard(0, (Seg(96, 4),), "attn")   # heads hold q, k, v


def test_output_gate_rides_in_the_q_projection():
    got, _ = _analyze("gate", 4, 2)
    assert got["p_qkv_weight"] == Shard(0, (Seg(64, 4), Seg(64, 4)), "attn")
    assert got["sigmoid"] == Shard(2, (Seg(64, 4),), "attn")


def test_refusal_names_op_placements_and_source():
    class Bad(Tiny):
        def forward(self, ids, positions, table, caches):
            x = self.embed(ids)
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 4, 24).split(8, -1)
            q = torch.cumsum(q, dim=2)          # mixes heads: no rule
            out, kc, vc = torch.ops.dcp.paged_attention(q, k, v, caches[0], caches[1],
                                                        positions, table, 0.35)
            return self.head(x + self.o(out.reshape(b, s, -1))), [kc, vc]

    ex = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
          torch.zeros(1, 2, dtype=torch.long), [torch.zeros(3, 16, 4, 8)] * 2)
    m = Bad("h3d")
    cap = capture(m, ex)
    ctx = ctx_for(4, 1, "decode")
    gm = run(cap.gm, [DropExportAsserts(ctx), CanonicalizeAttention(ctx), ValidateAndProve(ctx),
                      InsertRank(ctx, cap.user_inputs[0])])
    with pytest.raises(DCPTransformError, match=r"aten\.cumsum\.default.*test_placement\.py"):
        analyze(gm, ctx.config)


def test_show_reads_like_the_docs():
    assert show(QKV) == "Segmented(dim=2, [64/4, 16/2x2, 16/2x2], attn)"
    assert show(None) == "unknown" and show(R) == "Replicate"
    assert DCPConfig(tp=4, dcp=2).attention_shard == 4


# -- token-wise (prefill) from the same rules ----------------------------------------------

@pytest.mark.parametrize("fn,shape,target,dim", [
    (lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)), (2, 6, 16),
     aten.rsqrt.default, 1),
    (lambda x: x.transpose(1, 2), (2, 6, 4, 8), aten.transpose.int, 2),
    (lambda x: x.mean(-1, keepdim=True), (2, 6, 16), aten.mean.dim, 1),
    (lambda x: torch.stack((x, -x), dim=-1), (2, 6, 16), aten.stack.default, 1),
], ids=["rms-statistic-over-hidden", "transpose-around-rope", "mean-over-hidden",
        "stack-for-interleaved-rope"])
def test_token_wise_ops_keep_the_token_dim(fn, shape, target, dim):
    from dcp_compile.passes.placement import token_dim
    _, n = node_of(fn, shape, target=target)
    assert token_dim(n, {n.all_input_nodes[0]: 1}, 6) == dim


@pytest.mark.parametrize("fn,shape,target", [
    (lambda x: x.mean(1), (2, 6, 16), aten.mean.dim),
    (lambda x: x.reshape(12, 16), (2, 6, 16), aten.view.default),
    (lambda x: x.roll(1, 1), (2, 6, 16), aten.roll.default),
    (lambda x: torch.cumsum(x, 1), (2, 6, 16), aten.cumsum.default),
], ids=["mean-over-tokens", "view-merging-batch-and-tokens", "roll-tokens", "cumsum-tokens"])
def test_token_mixing_ops_are_not_token_wise(fn, shape, target):
    from dcp_compile.passes.placement import token_dim
    _, n = node_of(fn, shape, target=target)
    with pytest.raises(Refusal):
        token_dim(n, {n.all_input_nodes[0]: 1}, 6)


# -- batched matmul: the head dim as a batch dim (MLA's absorbed W_UK / W_UV) ---------------

HEADS0 = Shard(0, (Seg(8, 4),), "attn")                  # [8 heads, S, D] over 4 ranks


def _bmm():
    return node_of(torch.bmm, (8, 6, 4), (8, 4, 5), target=aten.bmm.default)[1]


def test_bmm_sharded_alike_on_the_batch_dim_stays_sharded():
    n = _bmm()
    assert placed(n, [HEADS0, HEADS0]) == HEADS0
    assert placed(n, [Shard(1, (Seg(6, 2),), "attn"), R]) == Shard(1, (Seg(6, 2),), "attn")
    assert rule_for(n.target).backward(n, HEADS0) == dict(zip(n.all_input_nodes,
                                                              [HEADS0, HEADS0]))


@pytest.mark.parametrize("placements,why", [
    ([HEADS0, R], "whole there"),
    ([Shard(2, (Seg(4, 2),), "attn"), Shard(1, (Seg(4, 2),), "attn")], "contracts"),
    ([HEADS0, Shard(0, (Seg(8, 2, 2),), "attn")], "cut differently"),
], ids=["batch-shard-meets-whole-operand", "contracted-dim", "different-cuts"])
def test_bmm_refusals_name_the_reason(placements, why):
    with pytest.raises(Refusal, match=why):
        placed(_bmm(), placements)


def test_bmm_right_operand_is_not_a_per_token_side_input():
    """Tokens at the left operand's rows: the right operand's dim that happens to line up
    (its contracted dim, here also 6 long) is not indexed by token."""
    from dcp_compile.passes.placement import token_dim
    _, n = node_of(torch.bmm, (8, 6, 6), (8, 6, 5), target=aten.bmm.default)
    assert token_dim(n, {n.all_input_nodes[0]: 1}, 6) == 1


class HeadMatmul(Tiny):
    """q per head through its own [d, d] block of a [h*d, d] parameter, as one matmul batched
    over heads against a view of it; the parameter takes the heads' cut."""

    def __init__(self):
        super().__init__("h3d")
        self.per_head = nn.Parameter(torch.randn(4 * 8, 8))

    def forward(self, ids, positions, table, caches):
        x = self.embed(ids)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 4, 24).split(8, -1)
        q = torch.matmul(q.transpose(1, 2), self.per_head.view(4, 8, 8)).transpose(1, 2)
        out, kc, vc = torch.ops.dcp.paged_attention(q, k, v, caches[0], caches[1], positions,
                                                    table, 0.35)
        return self.head(x + self.o(out.reshape(b, s, -1))), [kc, vc]


def test_a_parameter_viewed_per_head_in_a_batched_matmul_takes_the_heads_cut():
    ex = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
          torch.zeros(1, 2, dtype=torch.long), [torch.zeros(3, 16, 4, 8)] * 2)
    cap = capture(HeadMatmul(), ex)
    ctx = ctx_for(4, 1, "decode")
    gm = run(cap.gm, [DropExportAsserts(ctx), CanonicalizeAttention(ctx), ValidateAndProve(ctx),
                      InsertRank(ctx, cap.user_inputs[0])])
    got = {n.name: p for n, p in analyze(gm, ctx.config).placements.items()}
    assert got["p_per_head"] == Shard(0, (Seg(32, 4),), "attn")
    assert got["matmul"] == Shard(1, (Seg(4, 4),), "attn")


@pytest.mark.parametrize("target", [aten._softmax.default, aten._safe_softmax.default,
                                    aten._log_softmax.default], ids=lambda t: t._opname)
def test_every_softmax_keeps_a_shard_off_its_dim_and_refuses_one_on_it(target):
    # op_classes.SOFTMAX | LOG_SOFTMAX: placement once had its own set without _safe_softmax.
    args = (-1,) if target == aten._safe_softmax.default else (-1, False)
    _, n = node_of(lambda x: target(x, *args), (2, 8, 3, 3), target=target)
    heads = Shard(1, (Seg(8, 4),), "attn")
    assert placed(n, [heads]) == heads
    with pytest.raises(Refusal, match="softmax over the sharded dim"):
        placed(n, [Shard(3, (Seg(3, 3),), "attn")])


# -- refusals that name the form -----------------------------------------------------------

def test_a_cat_of_per_head_parts_names_per_head_modules():
    """StableLM's qk_layernorm: one module per head over split + cat; heads cut 8/4."""
    _, n = node_of(lambda x: torch.cat(list(x.split(1, dim=1)), dim=1), (2, 8, 3, 4),
                   target=aten.cat.default)
    with pytest.raises(Refusal, match="per-head modules with their own parameters"):
        rule_for(n.target).backward(n, Shard(1, (Seg(8, 4),), "attn"))


def test_a_view_merging_groups_cut_finer_than_the_groups_names_them():
    """CodeGen / torchtitan: [B, S, 4 groups, 16] viewed [B, S, 8 heads, 8], heads cut 8/8."""
    _, n = node_of(lambda x: x.reshape(2, 3, 8, 8), (2, 3, 4, 16), target=aten.view.default)
    with pytest.raises(Refusal, match="finer than the 4 groups of 16"):
        rule_for(n.target).backward(n, Shard(2, (Seg(8, 8),), "attn"))


# -- view scatters: an in-place write into a slice, made a value (Gemma 3n's AltUp) --------

SLICE_SCATTER = (lambda x, y: torch.slice_scatter(x, y, 0, 1), (2, 3, 8), (1, 3, 8),
                 aten.slice_scatter.default)
SELECT_SCATTER = (lambda x, y: torch.select_scatter(x, y, 0, 1), (2, 3, 8), (3, 8),
                  aten.select_scatter.default)


@pytest.mark.parametrize("fn,x,y,target", [SLICE_SCATTER, SELECT_SCATTER],
                         ids=["slice-scatter", "select-scatter"])
def test_a_write_into_a_slice_of_another_dim_keeps_the_shard(fn, x, y, target):
    _, n = node_of(fn, x, y, target=target)
    cut = Shard(2, (Seg(8, 4),), "attn")
    src = cut if target == aten.slice_scatter.default else replace(cut, dim=1)
    assert placed(n, [cut, src]) == cut
    assert placed(n, [R, R]) == R


@pytest.mark.parametrize("fn,x,y,target,placements,why", [
    (lambda x, y: torch.slice_scatter(x, y, 2, 0, 4), (2, 3, 8), (2, 3, 4),
     aten.slice_scatter.default, [Shard(2, (Seg(8, 4),), "attn")] * 2,
     "writes into the sharded dim 2"),
    (*SLICE_SCATTER, [Shard(2, (Seg(8, 4),), "attn"), R], "writes Replicate into"),
    (*SLICE_SCATTER, [R, Shard(2, (Seg(8, 4),), "attn")], "into Replicate"),
], ids=["into-the-sharded-dim", "replicated-into-sharded", "sharded-into-replicated"])
def test_view_scatter_refusals_name_the_reason(fn, x, y, target, placements, why):
    _, n = node_of(fn, x, y, target=target)
    with pytest.raises(Refusal, match=why):
        placed(n, placements)


@pytest.mark.parametrize("fn,x,y,target", [
    (lambda x, y: torch.slice_scatter(x, y, 0, 1), (2, 4, 6, 8), (1, 4, 6, 8),
     aten.slice_scatter.default),
    (lambda x, y: torch.select_scatter(x, y, 0, 1), (2, 4, 6, 8), (4, 6, 8),
     aten.select_scatter.default),
    (lambda x, y: torch.select_scatter(x, y, 3, 1), (4, 6, 8, 2), (4, 6, 8),
     aten.select_scatter.default),
], ids=["altup-slice-of-streams", "select-of-streams", "select-after-the-token-dim"])
def test_a_write_into_a_slice_of_the_streams_is_token_wise(fn, x, y, target):
    from dcp_compile.passes.placement import token_dim
    _, n = node_of(fn, x, y, target=target)
    dim = 2 if x[0] == 2 else 1
    assert token_dim(n, {n.args[0]: dim}, 6) == dim


def test_a_write_along_the_tokens_is_not_token_wise():
    from dcp_compile.passes.placement import token_dim
    _, n = node_of(lambda x, y: torch.slice_scatter(x, y, 1, 0, 3), (4, 6, 8), (4, 3, 8),
                   target=aten.slice_scatter.default)
    with pytest.raises(Refusal):
        token_dim(n, {n.args[0]: 1}, 6)
