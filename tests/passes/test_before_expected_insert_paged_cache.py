"""insert_paged_cache, Before/Expected: an ordinary causal LM graph (no cache, SDPA
attention with GQA) gets the step signature of a paged model: positions, block table and
one K/V cache pair per layer as inputs, the attention a `dcp.paged_attention` over them, the
new caches returned after the logits. On a first chunk with empty caches it computes the
model's logits. What the model computes from positions is left to lift_positions."""

import pytest
import torch

from dcp_compile.passes.insert_paged_cache import InsertPagedCache
from dcp_compile.runtime.errors import DCPTransformError

from before_expected import aten, assert_code, before, call, context, node, run_alone

S, HIDDEN, HQ, HKV, D, VOCAB = 4, 32, 4, 2, 8, 16


def _ordinary(p_embed, p_q, p_k, p_v, p_o, p_head, input_ids):
    h = aten.embedding.default(p_embed, input_ids)
    q = aten.transpose.int(aten.view.default(aten.linear.default(h, p_q), [1, 4, 4, 8]), 1, 2)
    k = aten.transpose.int(aten.view.default(aten.linear.default(h, p_k), [1, 4, 2, 8]), 1, 2)
    v = aten.transpose.int(aten.view.default(aten.linear.default(h, p_v), [1, 4, 2, 8]), 1, 2)
    a = aten.scaled_dot_product_attention.default(q, k, v, is_causal=True, enable_gqa=True)
    o = aten.reshape.default(aten.transpose.int(a, 1, 2), [1, 4, 32])
    h = aten.add.Tensor(h, aten.linear.default(o, p_o))
    return (aten.linear.default(h, p_head),)


def _before():
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.3
    return before(_ordinary, p_embed=w(VOCAB, HIDDEN), p_q=w(HQ * D, HIDDEN),
                  p_k=w(HKV * D, HIDDEN), p_v=w(HKV * D, HIDDEN), p_o=w(HIDDEN, HQ * D),
                  p_head=w(VOCAB, HIDDEN), input_ids=torch.tensor([[3, 1, 4, 1]]))


def _pass(num_blocks=3):
    ctx = context(2, 1, "context", block_size=4)
    return InsertPagedCache(ctx, token_input="input_ids", position_input=None,
                            num_blocks=num_blocks, max_blocks=2)


# The model's own transposes around SDPA are undone, not stacked: q/k/v reach the op as
# [B, S, H, D] and its output is read as such (scale: the SDPA default, D ** -0.5). Caches
# [num_blocks=3, block=4, kv_heads=2, D=8]. (clamp_min: padding's positions for position
# embeddings; this model has none, so nothing reads it.)
EXPECTED = """
    def forward(self, p_embed, p_q, p_k, p_v, p_o, p_head, input_ids, positions, block_table, kv_caches_0, kv_caches_1):
        clamp_min_default = aten.clamp_min.default(positions, 0)
        embedding_default = aten.embedding.default(p_embed, input_ids)
        linear_default = aten.linear.default(embedding_default, p_q)
        view_default = aten.view.default(linear_default, [1, 4, 4, 8])
        linear_default_1 = aten.linear.default(embedding_default, p_k)
        view_default_1 = aten.view.default(linear_default_1, [1, 4, 2, 8])
        linear_default_2 = aten.linear.default(embedding_default, p_v)
        view_default_2 = aten.view.default(linear_default_2, [1, 4, 2, 8])
        paged_attention_default = dcp.paged_attention.default(view_default, view_default_1, view_default_2, kv_caches_0, kv_caches_1, positions, block_table, 0.3535533905932738)
        getitem = paged_attention_default[0]
        getitem_1 = paged_attention_default[1]
        getitem_2 = paged_attention_default[2]
        reshape_default = aten.reshape.default(getitem, [1, 4, 32])
        linear_default_3 = aten.linear.default(reshape_default, p_o)
        add_tensor = aten.add.Tensor(embedding_default, linear_default_3)
        linear_default_4 = aten.linear.default(add_tensor, p_head)
        return (linear_default_4, getitem_1, getitem_2)
    """


def test_sdpa_becomes_paged_attention_over_new_cache_inputs():
    p = _pass()
    gm = run_alone(p, _before())
    assert_code(gm, EXPECTED)
    shapes = {n.name: tuple(n.meta["val"].shape) for n in gm.graph.nodes
              if n.op == "placeholder"}
    assert {k: shapes[k] for k in ("positions", "block_table", "kv_caches_0",
                                   "kv_caches_1")} == {
        "positions": (1, S), "block_table": (1, 2), "kv_caches_0": (3, 4, HKV, D),
        "kv_caches_1": (3, 4, HKV, D)}
    facts = p.ctx.facts           # what the pass returned, merged by DCPPass.__call__
    assert (facts.num_layers, facts.windows, facts.mla) == (1, (0,), None)
    assert facts.cache_dtype == torch.float32
    assert (p.matched["kv_heads"], p.matched["head_dim"]) == (HKV, D)
    assert p.matched["forms"] == ["sdpa (is_causal)"]


def test_first_chunk_on_empty_caches_computes_the_model():
    gm = run_alone(_pass(), _before())
    caches = torch.zeros(3, 4, HKV, D)
    logits, kc, vc = call(gm, positions=torch.arange(S)[None],
                          block_table=torch.tensor([[0, 1]]), kv_caches_0=caches,
                          kv_caches_1=caches.clone())
    (want,) = call(_before())
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    # The step wrote this chunk's K/V into block 0 (positions 0..3) and nowhere else.
    assert kc[0].abs().sum() > 0 and kc[1:].abs().sum() == 0


def _eager(p_embed, p_pos, p_q, p_k, p_v, p_head, input_ids):
    # Positions from arange (no position_ids input); a boolean causal mask built from them;
    # GQA by repeat_interleave; a sliding window of 2 in the mask.
    i = node(input_ids, aten.arange.default, 4)
    h = aten.add.Tensor(aten.embedding.default(p_embed, input_ids),
                        aten.embedding.default(p_pos, aten.unsqueeze.default(i, 0)))
    q = aten.transpose.int(aten.view.default(aten.linear.default(h, p_q), [1, 4, 4, 8]), 1, 2)
    k = aten.transpose.int(aten.view.default(aten.linear.default(h, p_k), [1, 4, 2, 8]), 1, 2)
    v = aten.transpose.int(aten.view.default(aten.linear.default(h, p_v), [1, 4, 2, 8]), 1, 2)
    k = aten.repeat_interleave.self_int(k, 2, 1)
    v = aten.repeat_interleave.self_int(v, 2, 1)
    scores = aten.mul.Tensor(aten.matmul.default(q, aten.transpose.int(k, 2, 3)), 0.25)
    dist = aten.sub.Tensor(aten.unsqueeze.default(i, 1), aten.unsqueeze.default(i, 0))
    keep = aten.logical_and.default(aten.ge.Scalar(dist, 0), aten.lt.Scalar(dist, 2))
    scores = aten.where.ScalarOther(keep, scores, float("-inf"))
    a = aten.matmul.default(aten.softmax.int(scores, -1), v)
    o = aten.reshape.default(aten.transpose.int(a, 1, 2), [1, 4, 32])
    return (aten.linear.default(o, p_head),)


def _eager_before():
    g = torch.Generator().manual_seed(1)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.3
    return before(_eager, p_embed=w(VOCAB, HIDDEN), p_pos=w(8, HIDDEN),
                  p_q=w(HQ * D, HIDDEN), p_k=w(HKV * D, HIDDEN), p_v=w(HKV * D, HIDDEN),
                  p_head=w(VOCAB, HIDDEN), input_ids=torch.tensor([[3, 1, 4, 1]]))


# q @ k^T * 0.25 -> where(window mask) -> softmax -> @ v becomes one op with scale 0.25 and
# window=2 (the mask and the repeats are gone). The position embedding still reads
# arange(4): lift_positions, the next pass, rewrites it over the positions input
# (test_before_expected_lift_positions.py).
EAGER = """
    def forward(self, p_embed, p_pos, p_q, p_k, p_v, p_head, input_ids, positions, block_table, kv_caches_0, kv_caches_1):
        clamp_min_default = aten.clamp_min.default(positions, 0)
        arange_default = aten.arange.default(4)
        embedding_default = aten.embedding.default(p_embed, input_ids)
        unsqueeze_default = aten.unsqueeze.default(arange_default, 0)
        embedding_default_1 = aten.embedding.default(p_pos, unsqueeze_default)
        add_tensor = aten.add.Tensor(embedding_default, embedding_default_1)
        linear_default = aten.linear.default(add_tensor, p_q)
        view_default = aten.view.default(linear_default, [1, 4, 4, 8])
        linear_default_1 = aten.linear.default(add_tensor, p_k)
        view_default_1 = aten.view.default(linear_default_1, [1, 4, 2, 8])
        linear_default_2 = aten.linear.default(add_tensor, p_v)
        view_default_2 = aten.view.default(linear_default_2, [1, 4, 2, 8])
        paged_attention_default = dcp.paged_attention.default(view_default, view_default_1, view_default_2, kv_caches_0, kv_caches_1, positions, block_table, 0.25, window = 2)
        getitem = paged_attention_default[0]
        getitem_1 = paged_attention_default[1]
        getitem_2 = paged_attention_default[2]
        reshape_default = aten.reshape.default(getitem, [1, 4, 32])
        linear_default_3 = aten.linear.default(reshape_default, p_head)
        return (linear_default_3, getitem_1, getitem_2)
    """


def test_eager_attention_with_window_mask_becomes_paged_attention():
    p = _pass()
    gm = run_alone(p, _eager_before())
    assert_code(gm, EAGER)
    assert p.matched["forms"] == ["eager (keep mask, window)"]
    assert p.matched["positions"] == "arange" and p.ctx.facts.windows == (2,)


def test_eager_first_chunk_on_empty_caches_computes_the_model():
    gm = run_alone(_pass(), _eager_before())
    caches = torch.zeros(3, 4, HKV, D)
    logits, _, _ = call(gm, positions=torch.arange(S)[None],
                        block_table=torch.tensor([[0, 1]]), kv_caches_0=caches,
                        kv_caches_1=caches.clone())
    (want,) = call(_eager_before())
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def _encoder(p_embed, p_q, p_k, p_v, p_head, input_ids):
    h = aten.embedding.default(p_embed, input_ids)
    q = aten.transpose.int(aten.view.default(aten.linear.default(h, p_q), [1, 4, 4, 8]), 1, 2)
    k = aten.transpose.int(aten.view.default(aten.linear.default(h, p_k), [1, 4, 2, 8]), 1, 2)
    v = aten.transpose.int(aten.view.default(aten.linear.default(h, p_v), [1, 4, 2, 8]), 1, 2)
    a = aten.scaled_dot_product_attention.default(q, k, v, enable_gqa=True)
    return (aten.linear.default(aten.reshape.default(aten.transpose.int(a, 1, 2), [1, 4, 32]),
                                p_head),)


def test_non_causal_attention_is_refused_naming_the_node():
    """An encoder (no mask, is_causal=False): every token sees later ones, nothing to cache."""
    gm = before(_encoder, p_embed=torch.randn(VOCAB, HIDDEN), p_q=torch.randn(HQ * D, HIDDEN),
                p_k=torch.randn(HKV * D, HIDDEN), p_v=torch.randn(HKV * D, HIDDEN),
                p_head=torch.randn(VOCAB, HIDDEN), input_ids=torch.tensor([[3, 1, 4, 1]]))
    with pytest.raises(DCPTransformError, match=r"non-causal attention \(is_causal=False, no "
                                                r"mask\) over 4 tokens.*at node "
                                                r"scaled_dot_product_attention"):
        run_alone(_pass(), gm)
