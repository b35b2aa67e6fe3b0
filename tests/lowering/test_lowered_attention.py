"""The lowering's decode attention kernel (dcp_compile/lowering/paged_attention.py) equals
the reference ``dcp.partial_attention`` (runtime/kernels/ops.py) on the edge cases: unallocated (-1)
and out-of-range table entries, poisoned (NaN) unwritten rows, padding queries, rows with no
key at all (lse = -inf, output 0), empty shards, per-query bounds (width-K decode), sliding
window, soft-capping, GQA and the shared latent cache (MLA). The lowered path itself is
compared with the model's forward by tests/lowering/test_xla.py and tests/lowering/test_memory_floor.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from dcp_compile.lowering.paged_attention import MAX_QUERIES, _fused_decode_attention
from dcp_compile.runtime.kernels.ops import _partial_attention_impl

BLOCK, NUM_BLOCKS, DCP, INTERLEAVE = 4, 7, 2, 1


def _inputs(seed, *, q_len, q_heads, kv_heads, dim, per_query, kv_shared=False):
    g = torch.Generator().manual_seed(seed)
    batch, max_blocks = 4, 3
    key_cache = torch.randn(NUM_BLOCKS, BLOCK, kv_heads, dim, generator=g)
    value_cache = torch.randn(NUM_BLOCKS, BLOCK, kv_heads, dim, generator=g)
    # Unwritten rows are poisoned: slots at or past each row's prior and the garbage block.
    key_cache[NUM_BLOCKS - 1] = float("nan")
    value_cache[NUM_BLOCKS - 1] = float("nan")
    key_cache[2, 3:] = float("nan")
    value_cache[2, 3:] = float("nan")
    # Row 0: full; row 1: an unallocated entry and one past the cache; row 2: nothing
    # allocated (an empty shard); row 3: reads block 2 up to its poisoned tail.
    block_table = torch.tensor([[0, 1, 3], [4, -1, 99], [-1, -1, -1], [5, 2, -1]])
    prior_len = torch.tensor([12, 3, 0, 7])
    # Row 0's prior reaches past its queries (causal on global positions, equality kept).
    q_pos = torch.tensor([[21], [7], [-1], [14]]) + torch.arange(q_len)
    q_pos[2] = -1                                   # a padding row
    k_pos = q_pos.clone()
    k_pos[:, 1::2] = -1                             # this rank owns every other current key
    if per_query:   # query i of row b reads up to a bound of its own
        prior_len = (prior_len[:, None] - torch.arange(q_len).flip(0)).clamp(min=0)
    # Shared (MLA): the key and the value are [k ; v], twice the cache's dim.
    q = torch.randn(batch, q_len, q_heads, 2 * dim if kv_shared else dim, generator=g)
    k_cur = torch.randn(batch, q_len, kv_heads, dim, generator=g)
    v_cur = torch.randn(batch, q_len, kv_heads, dim, generator=g)
    return (q, q_pos, k_cur, v_cur, k_pos, key_cache, value_cache, block_table, prior_len,
            torch.tensor(1))


CASES = list(itertools.product(
    [1, 3],                                          # queries per row
    [(8, 2), (4, 4)],                                # q heads, kv heads (GQA, MHA)
    [dict(), dict(window=5), dict(softcap=2.0), dict(kv_shared=True)],
    [False, True]))                                  # per-query bounds


@pytest.mark.parametrize("q_len,heads,options,per_query", CASES)
def test_fused_decode_attention_equals_the_reference(q_len, heads, options, per_query):
    args = _inputs(q_len * 10 + heads[0], q_len=q_len, q_heads=heads[0], kv_heads=heads[1],
                   dim=4, per_query=per_query,
                  kv_shared=options.get("kv_shared", False))
    common = (*args, DCP, INTERLEAVE, 0.5)
    expected_out, expected_lse = _partial_attention_impl(*common, **options)
    out, lse = _fused_decode_attention(*common, **options)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
    assert torch.isinf(lse[2]).all() and (out[2] == 0).all()     # the padding row
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


def test_prompt_width_queries_use_the_reference():
    args = _inputs(0, q_len=MAX_QUERIES + 1, q_heads=4, kv_heads=2, dim=4, per_query=False)
    common = (*args, DCP, INTERLEAVE, 0.5)
    for got, expected in zip(_fused_decode_attention(*common),
                             _partial_attention_impl(*common)):
        assert torch.equal(got, expected)
