"""The eager live-span kernel (runtime/kernels/live_attention.py) equals ``dcp.partial_attention``.

The static op's body is the reference (it is also the StableHLO decomposition). Inputs hit
the edge cases of the kernel's two segments and in-place masks: empty priors, priors ending
mid-block and at block edges, mixed-length rows, unallocated (-1) and out-of-range table
entries, a NaN-poisoned garbage block and NaN in stale rows past a row's prior, padding
queries (position -1), owner and non-owner current keys, GQA groups, dcp ranks with
interleave 1 and = block, sliding windows, soft-capping, MLA's shared K = V halves, per-query
bounds of a width-K decode row, and bf16.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime import layout

dcp_ops = torch.ops.dcp
BLOCK, NUM_BLOCKS, MAX_BLOCKS = 4, 12, 5
GARBAGE = NUM_BLOCKS - 1


def inputs(*, seed, dcp, interleave, rank, q_len, per_query, kv_shared, dtype, hq=4, hkv=2,
           dim=8):
    g = torch.Generator().manual_seed(seed)
    kw = dict(dcp=dcp, interleave=interleave, block=BLOCK)
    width = dim // 2 if kv_shared else dim
    kc = torch.randn(NUM_BLOCKS, BLOCK, hkv, width, generator=g).to(dtype)
    vc = torch.randn(NUM_BLOCKS, BLOCK, hkv, width, generator=g).to(dtype)
    kc[GARBAGE] = vc[GARBAGE] = float("nan")                  # read unmasked -> NaN out
    # Row 0: long prior; row 1: empty prior; row 2: mid-block with -1 / bad ids after it;
    # row 3: a padding row.
    starts = [13 * dcp, 0, 5, -1]
    table = torch.tensor([[3, 1, 5, 7, 9], [0, -1, -1, -1, -1], [2, 4, -1, GARBAGE, 40],
                          [-1, -1, -1, -1, -1]])
    b = len(starts)
    q_pos = torch.tensor([[s + t if s >= 0 else -1 for t in range(q_len)] for s in starts])
    n = q_pos[:, 0].clamp(min=0)
    if per_query:
        prior = layout.query_local_bound(n[:, None], torch.arange(q_len)[None], torch.tensor(
            rank), **kw) * (q_pos >= 0)
    else:
        prior = layout.local_filled(n, torch.tensor(rank), **kw) * (q_pos[:, 0] >= 0)
    # Stale rows past each row's prior in its allocated blocks: NaN must not leak.
    for row in range(b):
        bound = int(prior[row].max())
        for slot in range(bound, MAX_BLOCKS * BLOCK):
            entry = int(table[row, slot // BLOCK])
            if 0 <= entry < GARBAGE:
                kc[entry, slot % BLOCK] = vc[entry, slot % BLOCK] = float("nan")
    q = torch.randn(b, q_len, hq, 2 * width if kv_shared else dim, generator=g).to(dtype)
    k = torch.randn(b, q_len, hkv, width, generator=g).to(dtype)
    v = torch.randn(b, q_len, hkv, width, generator=g).to(dtype)
    if per_query:
        k_pos = torch.full_like(q_pos, -1)
    else:   # the owner's current key only (dcp_active_mask), -1 elsewhere
        owned = layout.dcp_active_mask(q_pos.clamp(min=0), torch.tensor(rank), **kw) == 1
        k_pos = torch.where(owned & (q_pos >= 0), q_pos, -1)
    return (q, q_pos, k, v, k_pos, kc, vc, table, prior, torch.tensor(rank), dcp, interleave,
            0.35)


CASES = [dict(dcp=d, interleave=i, rank=r, q_len=ql, per_query=pq, kv_shared=kvs)
         for (d, i, r), (ql, pq), kvs in itertools.product(
             [(1, BLOCK, 0), (2, 1, 1), (2, BLOCK, 0), (4, 2, 3)],
             [(1, False), (3, True), (5, False)], [False, True])]


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (6, 0.0), (0, 2.5), (3, 1.5)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{int(v)}"
                                                               for k, v in c.items()))
def test_live_kernel_equals_the_static_op(case, window, softcap):
    args = inputs(seed=len(str(case)) + window, dtype=torch.float32, **case)
    kwargs = dict(window=window, softcap=softcap, kv_shared=case["kv_shared"])
    ref_out, ref_lse = dcp_ops.partial_attention(*args, **kwargs)
    out, lse = dcp_ops.partial_attention_live(*args, **kwargs)
    assert not out.isnan().any() and not lse.isnan().any()
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    # -inf where a query sees no key (padding, empty shard), equal elsewhere
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.isinf(ref_lse).any(), "the cases must include a query with no key"


def test_live_kernel_in_bf16():
    for case in CASES[:6]:
        args = inputs(seed=7, dtype=torch.bfloat16, **case)
        ref = dcp_ops.partial_attention(*args, kv_shared=case["kv_shared"])
        got = dcp_ops.partial_attention_live(*args, kv_shared=case["kv_shared"])
        assert got[0].dtype == torch.bfloat16
        torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


def test_live_kernel_copies_no_key_segment():
    """No cat / where over the gathered span: the only tensors as large as the prior's keys
    are the two gathers (the scores are per key, not per key x head_dim)."""
    from torch.profiler import ProfilerActivity, profile
    args = inputs(seed=1, dtype=torch.float32, dcp=1, interleave=BLOCK, rank=0, q_len=1,
                  per_query=False, kv_shared=False)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        dcp_ops.partial_attention_live(*args)
    names = {e.name for e in p.events()}
    assert "aten::cat" not in names
    assert "aten::index" in names        # the gathers of the live blocks
