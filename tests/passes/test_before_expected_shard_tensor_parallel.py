"""shard_tensor_parallel, Before/Expected: one attention block and a gated MLP (after
insert_rank, as the pipeline hands them over) become this rank's shard: q/k/v weights
column-parallel by heads, O and MLP-down row-parallel with an all-reduce, literal head
counts made local, the KV caches holding this rank's KV heads."""

import torch

from dcp_compile.passes.shard_tensor_parallel import ShardTensorParallel
from dcp_compile.runtime.program.shards import ShardSpec

from before_expected import aten, assert_code, attention_inputs, before, call, context, \
    run_alone, run_world

dcp = torch.ops.dcp
B, HIDDEN, HQ, HKV, D, FF = 2, 32, 4, 2, 8, 16


def _block(p_q, p_k, p_v, p_o, p_up, p_down, tp_rank, x, key_cache, value_cache, positions,
           block_table):
    q = aten.view.default(aten.linear.default(x, p_q), [2, 1, 4, 8])
    k = aten.view.default(aten.linear.default(x, p_k), [2, 1, 2, 8])
    v = aten.view.default(aten.linear.default(x, p_v), [2, 1, 2, 8])
    out, kc, vc = dcp.attention.default(q, k, v, key_cache, value_cache, positions,
                                        block_table, 0.5)
    h = aten.add.Tensor(x, aten.linear.default(aten.view.default(out, [2, 1, 32]), p_o))
    up = aten.relu.default(aten.linear.default(h, p_up))
    return aten.add.Tensor(h, aten.linear.default(up, p_down)), kc, vc


def _before():
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.1
    att = attention_inputs(batch=B, hq=HQ, hkv=HKV, dim=D)
    return before(_block, p_q=w(HQ * D, HIDDEN), p_k=w(HKV * D, HIDDEN),
                  p_v=w(HKV * D, HIDDEN), p_o=w(HIDDEN, HQ * D), p_up=w(FF, HIDDEN),
                  p_down=w(HIDDEN, FF), tp_rank=torch.tensor(0), x=torch.randn(B, 1, HIDDEN),
                  **{k: att[k] for k in ("key_cache", "value_cache", "positions",
                                         "block_table")})


def _ctx(tp, dcp_, mode="decode"):
    return context(tp, dcp_, "decode" if mode == "decode" else "prefill", mode=mode,
                   num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)


# decode, tp=4 dcp=2: 1 q head and 1 KV head (each of the 2 replicated on 2 ranks) per rank.
DECODE = """
    def forward(self, p_q, p_k, p_v, p_o, p_up, p_down, tp_rank, x, key_cache, value_cache, positions, block_table):
        linear_default = aten.linear.default(x, p_q)
        view_default = aten.view.default(linear_default, [2, 1, 1, 8])
        linear_default_1 = aten.linear.default(x, p_k)
        view_default_1 = aten.view.default(linear_default_1, [2, 1, 1, 8])
        linear_default_2 = aten.linear.default(x, p_v)
        view_default_2 = aten.view.default(linear_default_2, [2, 1, 1, 8])
        attention_default = dcp.attention.default(view_default, view_default_1, view_default_2, key_cache, value_cache, positions, block_table, 0.5)
        getitem = attention_default[0]
        getitem_1 = attention_default[1]
        getitem_2 = attention_default[2]
        view_default_3 = aten.view.default(getitem, [2, 1, 8])
        linear_default_3 = aten.linear.default(view_default_3, p_o)
        all_reduce_default = _c10d_functional.all_reduce.default(linear_default_3, 'sum', 'dcp_role:tp')
        wait_tensor_default = _c10d_functional.wait_tensor.default(all_reduce_default)
        add_tensor = aten.add.Tensor(x, wait_tensor_default)
        linear_default_4 = aten.linear.default(add_tensor, p_up)
        relu_default = aten.relu.default(linear_default_4)
        linear_default_5 = aten.linear.default(relu_default, p_down)
        all_reduce_default_1 = _c10d_functional.all_reduce.default(linear_default_5, 'sum', 'dcp_role:tp')
        wait_tensor_default_1 = _c10d_functional.wait_tensor.default(all_reduce_default_1)
        add_tensor_1 = aten.add.Tensor(add_tensor, wait_tensor_default_1)
        return (add_tensor_1, getitem_1, getitem_2)
    """


def _shapes(gm):
    return {n.name: tuple(n.meta["val"].shape) for n in gm.graph.nodes
            if n.op == "placeholder" and n.name != "tp_rank"}


def test_decode_shards_over_full_tp():
    ctx = _ctx(4, 2)
    p = ShardTensorParallel(ctx)
    gm = run_alone(p, _before())
    assert_code(gm, DECODE)
    assert ctx.shards == {
        "p_q": ShardSpec(0, 4, 4),                 # 4 q heads over 4 ranks
        "p_k": ShardSpec(0, 2, 4, 2),              # 2 KV heads, each on 2 ranks
        "p_v": ShardSpec(0, 2, 4, 2),
        "p_o": ShardSpec(1, 4, 4),                 # row-parallel: input dim
        "p_up": ShardSpec(0, 4, 4),
        "p_down": ShardSpec(1, 4, 4)}
    assert _shapes(gm) == {
        "p_q": (8, 32), "p_k": (8, 32), "p_v": (8, 32), "p_o": (32, 8), "p_up": (4, 32),
        "p_down": (32, 4), "x": (2, 1, 32), "key_cache": (5, 16, 1, 8),
        "value_cache": (5, 16, 1, 8), "positions": (2, 1), "block_table": (2, 2)}
    assert p.matched == {"projections": {
        "linear_default": "q_proj", "linear_default_1": "k_proj", "linear_default_2": "v_proj",
        "linear_default_3": "o_proj", "linear_default_4": "mlp_column",
        "linear_default_5": "mlp_row"}}


def test_prefill_shards_attention_over_dcp_tp_and_the_mlp_over_world():
    """prefill, tp=4 dcp=2: attention over dcp_tp_group (2 ranks: 2 q heads, 1 KV head
    each), the MLP over all 4 ranks; the same graph otherwise."""
    ctx = _ctx(4, 2, "prefill")
    gm = run_alone(ShardTensorParallel(ctx), _before())
    want = (DECODE.replace("[2, 1, 1, 8])\n        linear_default_1",
                           "[2, 1, 2, 8])\n        linear_default_1")
            .replace("(getitem, [2, 1, 8])", "(getitem, [2, 1, 16])")
            .replace("'dcp_role:tp')\n        wait_tensor_default = ",
                     "'dcp_role:dcp_tp')\n        wait_tensor_default = ")
            .replace("'dcp_role:tp')", "'dcp_role:world')"))
    assert_code(gm, want)
    assert ctx.shards["p_q"] == ShardSpec(0, 2, 2) and ctx.shards["p_o"] == ShardSpec(1, 2, 2)
    assert ctx.shards["p_k"] == ShardSpec(0, 2, 2) and ctx.shards["p_up"] == ShardSpec(0, 4, 4)


def test_every_rank_computes_the_block_from_its_shards():
    """Run the sharded graph on the 4 ranks (threaded world): each rank, given its weight
    shards (ctx.shards) and its KV head's caches, returns the unsharded block's output and
    its KV head's slice of the written caches."""
    ctx = _ctx(4, 2)
    full = _before()
    want_out, want_kc, want_vc = call(full)
    gm = run_alone(ShardTensorParallel(ctx), _before())
    inputs = full.meta["example_inputs"]

    def shard_of(rank):
        mine = {k: (ctx.shards[k].shard(t, rank) if k in ctx.shards else t)
                for k, t in inputs.items()}
        head = ctx.shards["p_k"].index(rank)
        for k in ("key_cache", "value_cache"):
            mine[k] = inputs[k][:, :, head:head + 1]
        return {**mine, "tp_rank": torch.tensor(rank)}

    for rank, (out, kc, vc) in enumerate(run_world(gm, ctx.config, shard_of)):
        head = ctx.shards["p_k"].index(rank)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        torch.testing.assert_close(kc, want_kc[:, :, head:head + 1], rtol=0, atol=0)
        torch.testing.assert_close(vc, want_vc[:, :, head:head + 1], rtol=0, atol=0)
