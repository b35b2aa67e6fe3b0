"""sequence_parallel, Before/Expected: a prefill layer as shard_tensor_parallel leaves it
(tp=4, dcp=2: all-reduces over world after the embedding and the MLP, over dcp_tp after the
O projection) becomes sequence-parallel between layers: each all-reduce(world) a
reduce-scatter along tokens, the dcp_tp one followed by this rank's token slice, and an
all-gather along tokens before each projection that needs the whole sequence."""

import pytest
import torch

from dcp_compile import DCPTransformError
from dcp_compile.passes.sequence_parallel import SP_GATHER, SP_META, SP_SLICE, SPEC_STEP, \
    SequenceParallel
from dcp_compile.passes.shard_tensor_parallel import ROLE_META

from before_expected import aten, annotate, assert_code, attention_inputs, before, context, \
    run_alone, run_world

dcp = torch.ops.dcp
F = torch.ops._c10d_functional
ROLES = {"linear_default": "q_proj", "linear_default_1": "k_proj",
         "linear_default_2": "v_proj", "linear_default_3": "o_proj",
         "linear_default_4": "mlp_column", "linear_default_5": "mlp_row",
         "linear_default_6": "lm_head"}


def _attention_half(p_embed, p_q, p_k, p_v, p_o, input_ids, key_cache, value_cache,
                    positions, block_table):
    """The embedding and the attention block of this rank's shard: (h, new caches)."""
    e = aten.embedding.default(p_embed, input_ids)
    h = F.wait_tensor.default(F.all_reduce.default(e, "sum", "dcp_role:world"))
    q = aten.view.default(aten.linear.default(h, p_q), [2, 3, 2, 8])
    k = aten.view.default(aten.linear.default(h, p_k), [2, 3, 1, 8])
    v = aten.view.default(aten.linear.default(h, p_v), [2, 3, 1, 8])
    out, kc, vc = dcp.attention.default(q, k, v, key_cache, value_cache, positions,
                                        block_table, 0.5)
    o = aten.linear.default(aten.view.default(out, [2, 3, 16]), p_o)
    h = aten.add.Tensor(h, F.wait_tensor.default(F.all_reduce.default(o, "sum",
                                                                      "dcp_role:dcp_tp")))
    return h, kc, vc


def _sharded(p_embed, p_q, p_k, p_v, p_o, p_up, p_down, p_head, tp_rank, input_ids,
             key_cache, value_cache, positions, block_table):
    # This rank's shard: 2 q heads and 1 KV head of 8 (dcp_tp), 4 of 16 MLP and vocab rows.
    h, kc, vc = _attention_half(p_embed, p_q, p_k, p_v, p_o, input_ids, key_cache,
                                value_cache, positions, block_table)
    d = aten.linear.default(aten.relu.default(aten.linear.default(h, p_up)), p_down)
    h = aten.add.Tensor(h, F.wait_tensor.default(F.all_reduce.default(d, "sum",
                                                                      "dcp_role:world")))
    return aten.linear.default(h, p_head), kc, vc


def _before(tokens=3):
    att = attention_inputs(tokens=tokens, hq=2, hkv=1, start=0)
    gm = before(_sharded, p_embed=torch.randn(4, 32), p_q=torch.randn(16, 32),
                p_k=torch.randn(8, 32), p_v=torch.randn(8, 32), p_o=torch.randn(32, 16),
                p_up=torch.randn(4, 32), p_down=torch.randn(32, 4), p_head=torch.randn(4, 32),
                tp_rank=torch.tensor(0), input_ids=torch.zeros(2, tokens, dtype=torch.long),
                **{k: att[k] for k in ("key_cache", "value_cache", "positions",
                                       "block_table")})
    return annotate(gm, ROLE_META, ROLES)


def _ctx():
    return context(4, 2, "prefill", num_q_heads=4, num_kv_heads=2, head_dim=8)


# S=3 tokens, tp=4: S_pad=4, one token per rank (sp_index = tp_rank * 1 + arange(1)).
EXPECTED = """
    def forward(self, p_embed, p_q, p_k, p_v, p_o, p_up, p_down, p_head, tp_rank, input_ids, key_cache, value_cache, positions, block_table):
        mul_tensor = aten.mul.Tensor(tp_rank, 1)
        arange_default = aten.arange.default(1, dtype = torch.int64, device = device(type='cpu'))
        sp_index = aten.add.Tensor(arange_default, mul_tensor)
        embedding_default = aten.embedding.default(p_embed, input_ids)
        constant_pad_nd_default = aten.constant_pad_nd.default(embedding_default, [0, 0, 0, 1], 0.0)
        view_default = aten.view.default(constant_pad_nd_default, [2, 4, 1, 32])
        permute_default = aten.permute.default(view_default, [1, 0, 2, 3])
        reshape_default = aten.reshape.default(permute_default, [8, 1, 32])
        reduce_scatter_tensor_default = _c10d_functional.reduce_scatter_tensor.default(reshape_default, 'sum', 4, 'dcp_role:world')
        wait_tensor_default = _c10d_functional.wait_tensor.default(reduce_scatter_tensor_default)
        all_gather_into_tensor_default = _c10d_functional.all_gather_into_tensor.default(wait_tensor_default, 4, 'dcp_role:world')
        wait_tensor_default_1 = _c10d_functional.wait_tensor.default(all_gather_into_tensor_default)
        view_default_1 = aten.view.default(wait_tensor_default_1, [4, 2, 1, 32])
        permute_default_1 = aten.permute.default(view_default_1, [1, 0, 2, 3])
        reshape_default_1 = aten.reshape.default(permute_default_1, [2, 4, 32])
        slice_tensor = aten.slice.Tensor(reshape_default_1, 1, 0, 3)
        linear_default = aten.linear.default(slice_tensor, p_q)
        view_default_2 = aten.view.default(linear_default, [2, 3, 2, 8])
        linear_default_1 = aten.linear.default(slice_tensor, p_k)
        view_default_3 = aten.view.default(linear_default_1, [2, 3, 1, 8])
        linear_default_2 = aten.linear.default(slice_tensor, p_v)
        view_default_4 = aten.view.default(linear_default_2, [2, 3, 1, 8])
        attention_default = dcp.attention.default(view_default_2, view_default_3, view_default_4, key_cache, value_cache, positions, block_table, 0.5)
        getitem = attention_default[0]
        getitem_1 = attention_default[1]
        getitem_2 = attention_default[2]
        view_default_5 = aten.view.default(getitem, [2, 3, 16])
        linear_default_3 = aten.linear.default(view_default_5, p_o)
        all_reduce_default = _c10d_functional.all_reduce.default(linear_default_3, 'sum', 'dcp_role:dcp_tp')
        wait_tensor_default_2 = _c10d_functional.wait_tensor.default(all_reduce_default)
        constant_pad_nd_default_1 = aten.constant_pad_nd.default(wait_tensor_default_2, [0, 0, 0, 1], 0.0)
        index_select_default = aten.index_select.default(constant_pad_nd_default_1, 1, sp_index)
        add_tensor = aten.add.Tensor(wait_tensor_default, index_select_default)
        all_gather_into_tensor_default_1 = _c10d_functional.all_gather_into_tensor.default(add_tensor, 4, 'dcp_role:world')
        wait_tensor_default_3 = _c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1)
        view_default_6 = aten.view.default(wait_tensor_default_3, [4, 2, 1, 32])
        permute_default_2 = aten.permute.default(view_default_6, [1, 0, 2, 3])
        reshape_default_2 = aten.reshape.default(permute_default_2, [2, 4, 32])
        slice_tensor_1 = aten.slice.Tensor(reshape_default_2, 1, 0, 3)
        linear_default_4 = aten.linear.default(slice_tensor_1, p_up)
        relu_default = aten.relu.default(linear_default_4)
        linear_default_5 = aten.linear.default(relu_default, p_down)
        constant_pad_nd_default_2 = aten.constant_pad_nd.default(linear_default_5, [0, 0, 0, 1], 0.0)
        view_default_7 = aten.view.default(constant_pad_nd_default_2, [2, 4, 1, 32])
        permute_default_3 = aten.permute.default(view_default_7, [1, 0, 2, 3])
        reshape_default_3 = aten.reshape.default(permute_default_3, [8, 1, 32])
        reduce_scatter_tensor_default_1 = _c10d_functional.reduce_scatter_tensor.default(reshape_default_3, 'sum', 4, 'dcp_role:world')
        wait_tensor_default_4 = _c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_1)
        add_tensor_1 = aten.add.Tensor(add_tensor, wait_tensor_default_4)
        all_gather_into_tensor_default_2 = _c10d_functional.all_gather_into_tensor.default(add_tensor_1, 4, 'dcp_role:world')
        wait_tensor_default_5 = _c10d_functional.wait_tensor.default(all_gather_into_tensor_default_2)
        view_default_8 = aten.view.default(wait_tensor_default_5, [4, 2, 1, 32])
        permute_default_4 = aten.permute.default(view_default_8, [1, 0, 2, 3])
        reshape_default_4 = aten.reshape.default(permute_default_4, [2, 4, 32])
        slice_tensor_2 = aten.slice.Tensor(reshape_default_4, 1, 0, 3)
        linear_default_6 = aten.linear.default(slice_tensor_2, p_head)
        return (linear_default_6, getitem_1, getitem_2)
    """


def test_prefill_layer_becomes_sequence_parallel():
    p = SequenceParallel(_ctx())
    gm = run_alone(p, _before())
    assert_code(gm, EXPECTED)
    assert gm.meta[SP_META] == {"tokens": 3, "padded": 4, "tokens_per_rank": 1, "batch": 2}
    nodes = {n.name: n for n in gm.graph.nodes}
    # The full-sequence tensors the projections read; q/k/v's gather is the spec's step 1.
    assert [n.name for n in gm.graph.nodes if n.meta.get(SP_GATHER)] == [
        "slice_tensor_2", "slice_tensor_1", "slice_tensor"]
    assert nodes["all_gather_into_tensor_default_2"].meta[SPEC_STEP] == 1
    assert [n.name for n in gm.graph.nodes if n.meta.get(SP_SLICE)] == ["index_select_default"]
    assert tuple(nodes["add_tensor_1"].meta["val"].shape) == (2, 1, 32)   # S_pad/TP tokens
    assert p.matched["gathers"] == {"qkv": 1, "mlp": 1, "lm_head": 1, "moe": 0}


def test_decode_mode_is_refused():
    ctx = context(4, 2, "decode", num_q_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(DCPTransformError, match="sequence parallelism is the prefill layout"):
        run_alone(SequenceParallel(ctx), _before())


ATTENTION = {"p_q", "p_k", "p_v", "p_o", "key_cache", "value_cache"}


def test_every_rank_computes_what_it_did_before():
    """Both graphs on the 4 ranks (threaded world), each rank with its own weight shards:
    the sequence-parallel layer returns each rank's logits shard and caches as before."""
    shapes = _before().meta["example_inputs"]

    def inputs_of(rank):
        # Attention is sharded over dcp_tp (piece rank % 2) and replicated across the
        # replica sets: ranks 0 and 2 hold the same q/k/v/o pieces and KV head.
        g, piece = torch.Generator().manual_seed(rank), torch.Generator().manual_seed(rank % 2)
        mine = {k: torch.randn(t.shape, generator=piece if k in ATTENTION else g) * 0.3
                for k, t in shapes.items()}
        mine["input_ids"] = torch.randint(0, 4, (2, 3), generator=g)   # local vocab rows
        return {**mine, "tp_rank": torch.tensor(rank),
                **{k: attention_inputs(tokens=3, hq=2, hkv=1, start=0)[k]
                   for k in ("positions", "block_table")}}

    config = _ctx().config
    want = run_world(_before(), config, inputs_of)
    got = run_world(run_alone(SequenceParallel(_ctx()), _before()), config, inputs_of)
    for rank, (g, w) in enumerate(zip(got, want)):
        for what, a, b in zip(("logits", "key_cache", "value_cache"), g, w):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {what}")


# -- a norm's statistic over features cut over the ranks (META_NORM_REDUCE) ------------------
# A one-group Mamba2's gated norm under the head cut (docs/hybrid.md): each rank holds its
# heads' features of every token, the mean of squares over them is a pending sum, all-reduced.
# Under sequence parallelism that is exact only where every rank holds the same tokens in the
# same order: a projection's output on the gathered chunk. Here the MLP's column output
# stands for it (4 of 16 features per rank, every token).

def _norm_layer(p_embed, p_q, p_k, p_v, p_o, p_up, p_down, p_head, input_ids, key_cache,
                value_cache, positions, block_table, on_stream: bool):
    h, kc, vc = _attention_half(p_embed, p_q, p_k, p_v, p_o, input_ids, key_cache,
                                value_cache, positions, block_table)
    x = h if on_stream else aten.linear.default(h, p_up)
    ms = aten.mul.Tensor(aten.mean.dim(aten.mul.Tensor(x, x), [-1], True), 0.25)
    ms = F.wait_tensor.default(F.all_reduce.default(ms, "sum", "dcp_role:world"))
    x = aten.mul.Tensor(x, aten.rsqrt.default(aten.add.Tensor(ms, 1e-6)))
    u = aten.linear.default(x, p_up) if on_stream else x
    d = aten.linear.default(aten.relu.default(u), p_down)
    h = aten.add.Tensor(h, F.wait_tensor.default(F.all_reduce.default(d, "sum",
                                                                      "dcp_role:world")))
    return aten.linear.default(h, p_head), kc, vc


def _sharded_norm(p_embed, p_q, p_k, p_v, p_o, p_up, p_down, p_head, tp_rank, input_ids,
                  key_cache, value_cache, positions, block_table):
    return _norm_layer(p_embed, p_q, p_k, p_v, p_o, p_up, p_down, p_head, input_ids,
                       key_cache, value_cache, positions, block_table, False)


def _sharded_norm_on_stream(p_embed, p_q, p_k, p_v, p_o, p_up, p_down, p_head, tp_rank,
                            input_ids, key_cache, value_cache, positions, block_table):
    return _norm_layer(p_embed, p_q, p_k, p_v, p_o, p_up, p_down, p_head, input_ids,
                       key_cache, value_cache, positions, block_table, True)


def _before_norm(on_stream=False):
    from dcp_compile.runtime.names import META_NORM_REDUCE
    att = attention_inputs(tokens=3, hq=2, hkv=1, start=0)
    fn = _sharded_norm_on_stream if on_stream else _sharded_norm
    gm = before(fn, p_embed=torch.randn(4, 32), p_q=torch.randn(16, 32),
                p_k=torch.randn(8, 32), p_v=torch.randn(8, 32), p_o=torch.randn(32, 16),
                p_up=torch.randn(4, 32), p_down=torch.randn(32, 4), p_head=torch.randn(4, 32),
                tp_rank=torch.tensor(0), input_ids=torch.zeros(2, 3, dtype=torch.long),
                **{k: att[k] for k in ("key_cache", "value_cache", "positions",
                                       "block_table")})
    annotate(gm, META_NORM_REDUCE, {"all_reduce_default_2": True})
    return annotate(gm, ROLE_META, ROLES)


def _norm_reduces(gm):
    return [n for n in gm.graph.nodes if n.target == F.all_reduce.default
            and n.args[2] == "dcp_role:world"]


def test_a_norm_statistic_over_a_projections_output_stays_an_all_reduce():
    """The statistic of the gathered chunk: every rank holds the same 3 tokens in order, so
    the all-reduce sums each token's features over the ranks, never two tokens; it stays an
    all-reduce of [B, S=3, 1] (the whole chunk, not the stream's S_pad/TP = 1 token) and
    every rank computes what it did before."""
    gm = run_alone(SequenceParallel(_ctx()), _before_norm())
    norm, = _norm_reduces(gm)
    assert tuple(norm.args[0].meta["val"].shape) == (2, 3, 1)
    shapes = _before_norm().meta["example_inputs"]

    def inputs_of(rank):
        g, piece = torch.Generator().manual_seed(rank), torch.Generator().manual_seed(rank % 2)
        mine = {k: torch.randn(t.shape, generator=piece if k in ATTENTION else g) * 0.3
                for k, t in shapes.items()}
        mine["input_ids"] = torch.randint(0, 4, (2, 3), generator=g)
        return {**mine, "tp_rank": torch.tensor(rank),
                **{k: attention_inputs(tokens=3, hq=2, hkv=1, start=0)[k]
                   for k in ("positions", "block_table")}}

    config = _ctx().config
    want = run_world(_before_norm(), config, inputs_of)
    got = run_world(gm, config, inputs_of)
    for rank, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g[0], w[0], rtol=1e-5, atol=1e-5, msg=f"rank {rank}")


def test_a_norm_statistic_on_the_sequence_parallel_stream_is_refused():
    """The same statistic taken of the residual stream, where each rank holds other tokens
    after the rewrite: its all-reduce would add token t of one rank to token t' of another.
    Refused by name."""
    with pytest.raises(DCPTransformError, match=r"computed from the sequence-parallel residual stream.*would mix them"):
        run_alone(SequenceParallel(_ctx()), _before_norm(on_stream=True))
