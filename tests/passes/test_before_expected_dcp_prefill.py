"""dcp_prefill, Before/Expected: a prefill layer as sequence_parallel leaves it (tp=4,
dcp=2, S=6 tokens padded to S_pad=8, 2 per rank; interleave = block = 2) becomes the spec's
nine-step DCP prefill pattern: interleave slice of the gathered hidden state (2), q/k/v on
the C=4 owned tokens (3), owner-only cache write (4), Q all-gather over cp_kv (5), unshuffle
to chunk order (6), partial attention + LSE all-gather and correction (7), reduce-scatter
over cp_kv (8), and the O projection's reduce-scatter over dcp_tp (9)."""

import pytest
import torch

from dcp_compile import DCPTransformError
from dcp_compile.passes.dcp_prefill import DCPPrefill
from dcp_compile.passes.sequence_parallel import SP_GATHER, SP_META, SP_SLICE, SPEC_STEP
from dcp_compile.passes.shard_tensor_parallel import PROJECTIONS_META

from before_expected import aten, annotate, assert_code, attention_inputs, before, \
    context, node, run_alone, run_world

dcp = torch.ops.dcp
F = torch.ops._c10d_functional


def _sequence_parallel(p_q, p_k, p_v, p_o, tp_rank, h, key_cache, value_cache, positions,
                       block_table):
    # h: this rank's 2 of the 8 (padded) tokens of the residual stream.
    sp_index = aten.add.Tensor(node(tp_rank, aten.arange.default, 2, dtype=torch.int64),
                               aten.mul.Tensor(tp_rank, 2))
    # 1. all-gather over world along tokens, pad rows dropped: [2, 6, 32]
    w = F.wait_tensor.default(F.all_gather_into_tensor.default(h, 4, "dcp_role:world"))
    full = aten.reshape.default(aten.permute.default(aten.view.default(w, [4, 2, 2, 32]),
                                                     [1, 0, 2, 3]), [2, 8, 32])
    full = aten.slice.Tensor(full, 1, 0, 6)
    q = aten.view.default(aten.linear.default(full, p_q), [2, 6, 2, 8])
    k = aten.view.default(aten.linear.default(full, p_k), [2, 6, 1, 8])
    v = aten.view.default(aten.linear.default(full, p_v), [2, 6, 1, 8])
    out, kc, vc = dcp.attention.default(q, k, v, key_cache, value_cache, positions,
                                        block_table, 0.5)
    o = aten.linear.default(aten.view.default(out, [2, 6, 16]), p_o)
    r = F.wait_tensor.default(F.all_reduce.default(o, "sum", "dcp_role:dcp_tp"))
    mine = aten.index_select.default(aten.constant_pad_nd.default(r, [0, 0, 0, 2], 0.0), 1,
                                     sp_index)
    return aten.add.Tensor(h, mine), kc, vc


def _before():
    att = attention_inputs(tokens=6, hq=2, hkv=1, block=2, start=0)
    gm = before(_sequence_parallel, p_q=torch.randn(16, 32), p_k=torch.randn(8, 32),
                p_v=torch.randn(8, 32), p_o=torch.randn(32, 16), tp_rank=torch.tensor(0),
                h=torch.randn(2, 2, 32), **{k: att[k] for k in (
                    "key_cache", "value_cache", "positions", "block_table")})
    next(n for n in gm.graph.nodes if n.name == "add_tensor").name = "sp_index"
    gm.meta[SP_META] = {"tokens": 6, "padded": 8, "tokens_per_rank": 2, "batch": 2}
    annotate(gm, SP_GATHER, {"slice_tensor": True})
    annotate(gm, SPEC_STEP, {"all_gather_into_tensor_default": 1})
    annotate(gm, SP_SLICE, {"index_select_default": True})
    return annotate(gm, PROJECTIONS_META, {"attention_default": {
        "q": ["linear_default"], "k": ["linear_default_1"], "v": ["linear_default_2"],
        "o": "linear_default_3"}})


def _ctx():
    return context(4, 2, "prefill", block_size=2, num_q_heads=4, num_kv_heads=2, head_dim=8)


# Per-step index tensors first (cp_rank = tp_rank // (TP/DCP)), then the nine steps; the SP
# slice index is gone with the slice it fed.
EXPECTED = """
    def forward(self, p_q, p_k, p_v, p_o, tp_rank, h, key_cache, value_cache, positions, block_table):
        cp_rank = aten.floor_divide.default(tp_rank, 2)
        interleave_index = dcp.interleave_slice_index.default(positions, cp_rank, 4, 2, 2, 2)
        ge_scalar = aten.ge.Scalar(interleave_index, 0)
        owned_index = aten.clamp.default(interleave_index, 0)
        gather_default = aten.gather.default(positions, 1, owned_index)
        owned_positions = aten.where.ScalarOther(ge_scalar, gather_default, -1)
        unshuffle_index = dcp.q_unshuffle_index.default(positions, 4, 2, 2, 2)
        slot_mapping_default = dcp.slot_mapping.default(positions, block_table, cp_rank, 2, 2, 2)
        gather_default_1 = aten.gather.default(slot_mapping_default, 1, owned_index)
        owned_slot_mapping = aten.where.ScalarOther(ge_scalar, gather_default_1, -1)
        select_int = aten.select.int(positions, 1, 0)
        prior_local = dcp.local_filled.default(select_int, cp_rank, 2, 2, 2)
        all_gather_into_tensor_default = _c10d_functional.all_gather_into_tensor.default(h, 4, 'dcp_role:world')
        wait_tensor_default = _c10d_functional.wait_tensor.default(all_gather_into_tensor_default)
        view_default = aten.view.default(wait_tensor_default, [4, 2, 2, 32])
        permute_default = aten.permute.default(view_default, [1, 0, 2, 3])
        reshape_default = aten.reshape.default(permute_default, [2, 8, 32])
        slice_tensor = aten.slice.Tensor(reshape_default, 1, 0, 6)
        view_default_1 = aten.view.default(owned_index, [2, 4, 1])
        expand_default = aten.expand.default(view_default_1, [2, 4, 32])
        gather_default_2 = aten.gather.default(slice_tensor, 1, expand_default)
        linear_default = aten.linear.default(gather_default_2, p_q)
        view_default_2 = aten.view.default(linear_default, [2, 4, 2, 8])
        linear_default_1 = aten.linear.default(gather_default_2, p_k)
        view_default_3 = aten.view.default(linear_default_1, [2, 4, 1, 8])
        linear_default_2 = aten.linear.default(gather_default_2, p_v)
        view_default_4 = aten.view.default(linear_default_2, [2, 4, 1, 8])
        cache_write_default = dcp.cache_write.default(key_cache, value_cache, view_default_3, view_default_4, owned_slot_mapping)
        getitem = cache_write_default[0]
        getitem_1 = cache_write_default[1]
        all_gather_into_tensor_default_1 = _c10d_functional.all_gather_into_tensor.default(view_default_2, 2, 'dcp_role:cp_kv')
        wait_tensor_default_1 = _c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1)
        view_default_5 = aten.view.default(wait_tensor_default_1, [2, 2, 4, 2, 8])
        permute_default_1 = aten.permute.default(view_default_5, [1, 0, 2, 3, 4])
        reshape_default_1 = aten.reshape.default(permute_default_1, [2, 8, 2, 8])
        view_default_6 = aten.view.default(unshuffle_index, [2, 6, 1, 1])
        expand_default_1 = aten.expand.default(view_default_6, [2, 6, 2, 8])
        gather_default_3 = aten.gather.default(reshape_default_1, 1, expand_default_1)
        partial_attention_default = dcp.partial_attention.default(gather_default_3, positions, view_default_3, view_default_4, owned_positions, getitem, getitem_1, block_table, prior_local, cp_rank, 2, 2, 0.5)
        getitem_2 = partial_attention_default[0]
        getitem_3 = partial_attention_default[1]
        all_gather_into_tensor_default_2 = _c10d_functional.all_gather_into_tensor.default(getitem_3, 2, 'dcp_role:cp_kv')
        wait_tensor_default_2 = _c10d_functional.wait_tensor.default(all_gather_into_tensor_default_2)
        view_default_7 = aten.view.default(wait_tensor_default_2, [2, 2, 6, 2])
        lse_correct_default = dcp.lse_correct.default(getitem_2, getitem_3, view_default_7)
        constant_pad_nd_default = aten.constant_pad_nd.default(lse_correct_default, [0, 0, 0, 0, 0, 2], 0.0)
        view_default_8 = aten.view.default(constant_pad_nd_default, [2, 2, 4, 2, 8])
        permute_default_2 = aten.permute.default(view_default_8, [1, 0, 2, 3, 4])
        reshape_default_2 = aten.reshape.default(permute_default_2, [4, 4, 2, 8])
        reduce_scatter_tensor_default = _c10d_functional.reduce_scatter_tensor.default(reshape_default_2, 'sum', 2, 'dcp_role:cp_kv')
        wait_tensor_default_3 = _c10d_functional.wait_tensor.default(reduce_scatter_tensor_default)
        to_dtype = aten.to.dtype(wait_tensor_default_3, torch.float32)
        view_default_9 = aten.view.default(to_dtype, [2, 4, 16])
        linear_default_3 = aten.linear.default(view_default_9, p_o)
        view_default_10 = aten.view.default(linear_default_3, [2, 2, 2, 32])
        permute_default_3 = aten.permute.default(view_default_10, [1, 0, 2, 3])
        reshape_default_3 = aten.reshape.default(permute_default_3, [4, 2, 32])
        reduce_scatter_tensor_default_1 = _c10d_functional.reduce_scatter_tensor.default(reshape_default_3, 'sum', 2, 'dcp_role:dcp_tp')
        wait_tensor_default_4 = _c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_1)
        add_tensor = aten.add.Tensor(h, wait_tensor_default_4)
        return (add_tensor, getitem, getitem_1)
    """


def test_prefill_layer_becomes_the_nine_step_pattern():
    p = DCPPrefill(_ctx())
    gm = run_alone(p, _before())
    assert_code(gm, EXPECTED)
    steps = [n.meta[SPEC_STEP] for n in gm.graph.nodes if SPEC_STEP in n.meta]
    assert steps == [1, 2, 3, 3, 3, 4, 5, 6, 7, 7, 7, 8, 9, 9]
    assert p.matched["owned_capacity"] == 4 and p.matched["padded_tokens"] == 8
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert tuple(out.meta["val"].shape) == (2, 2, 32)         # S_pad/TP tokens, as before


def test_decode_mode_is_refused():
    ctx = context(4, 2, "decode", num_q_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(DCPTransformError, match="dcp_prefill rewrites prefill programs"):
        run_alone(DCPPrefill(ctx), _before())


ATTENTION = {"p_q", "p_k", "p_v", "p_o", "key_cache", "value_cache"}


def test_every_rank_computes_what_it_did_before():
    """Both graphs on the 4 ranks (threaded world): on a first chunk every rank's residual
    stream after the layer is what plain sequence-parallel TP attention gave."""
    residual = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(7))
    shapes = _before().meta["example_inputs"]

    def inputs_of(rank):
        # q/k/v/o pieces and the KV head by dcp_tp index (rank % 2), shared by replica sets.
        piece = torch.Generator().manual_seed(rank % 2)
        mine = {k: torch.randn(shapes[k].shape, generator=piece) * 0.3 for k in ATTENTION}
        return {**shapes, **mine, "tp_rank": torch.tensor(rank),
                "h": residual[:, 2 * rank:2 * rank + 2]}

    config = _ctx().config
    want = run_world(_before(), config, inputs_of)
    got = run_world(run_alone(DCPPrefill(_ctx()), _before()), config, inputs_of)
    for rank, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g[0], w[0], rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
