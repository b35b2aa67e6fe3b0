"""dcp.partial_attention's distance table and memory key/values, split over DCP ranks.

Each rank holds the keys the interleave gives it (``active_mask``) and rank 0 alone adds
the memory key/values; the LSE combine of every rank's partial must equal one softmax over
[memory keys ; the sequence's causal keys] with ``table[h, q_pos - k_pos]`` added to each
sequence key's score (x-transformers' semantics: memory keys get no bias). Both kernels
(the reference body and the eager live kernel) are checked, and the mutation that adds the
memory on every rank is shown to be caught.
"""

from __future__ import annotations

import pytest
import torch

import dcp_compile.runtime.kernels.ops as O
from dcp_compile.runtime.kernels.live_attention import distance_bias, live_partial_attention

B, S, HQ, HKV, D, BLOCK, I, M, L = 2, 9, 4, 2, 8, 4, 2, 3, 32
SCALE = 0.3


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    pos = torch.stack([torch.arange(S) + 3, torch.arange(S)])
    pos[1, -2:] = -1                                  # a padded row
    return dict(q=r(B, S, HQ, D), k=r(B, S, HKV, D), v=r(B, S, HKV, D), mem_k=r(1, M, HKV, D),
                mem_v=r(1, M, HKV, D), table=r(HQ, L), pos=pos)


def _reference(x):
    """One softmax per query and head over [memory ; causal keys + table bias]."""
    out = torch.zeros(B, S, HQ, D)
    for b in range(B):
        keys = torch.cat([x["mem_k"][0], x["k"][b]])
        values = torch.cat([x["mem_v"][0], x["v"][b]])
        for i in range(S):
            qp = int(x["pos"][b, i])
            if qp < 0:
                continue
            for h in range(HQ):
                kh = h // (HQ // HKV)
                bias = torch.zeros(M + S)
                for j in range(S):
                    kp = int(x["pos"][b, j])
                    bias[M + j] = float("-inf") if kp < 0 or kp > qp else x["table"][h, qp - kp]
                p = torch.softmax(keys[:, kh] @ x["q"][b, i, h] * SCALE + bias, 0)
                out[b, i, h] = p @ values[:, kh]
    return out


def _combined(kernel, x, dcp, mem_split=True):
    """Every rank's partial over its own keys, combined by the LSE."""
    table = torch.arange(B * 4).reshape(B, 4)
    parts = []
    for r in range(dcp):
        rank = torch.tensor(r)
        owned = O._active_mask_impl(x["pos"], rank, dcp, I, BLOCK).bool()
        caches = torch.zeros(B * 4 + 1, BLOCK, HKV, D)
        parts.append(kernel(x["q"], x["pos"], x["k"], x["v"], torch.where(owned, x["pos"], -1),
                            caches, caches.clone(), table, torch.zeros(B, dtype=torch.int64),
                            rank, dcp, I, SCALE, distance_table=x["table"],
                            mem_k=x["mem_k"], mem_v=x["mem_v"], mem_split=mem_split))
    lse_all = torch.stack([lse for _, lse in parts])
    return sum(O._lse_correct_impl(o, lse, lse_all) for o, lse in parts)


@pytest.mark.parametrize("kernel", [O._partial_attention_impl, live_partial_attention],
                         ids=["reference", "live"])
@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_split_over_ranks_equals_one_softmax(kernel, dcp):
    x = _inputs()
    valid = x["pos"] >= 0
    err = (_combined(kernel, x, dcp) - _reference(x))[valid].abs().max()
    assert err < 1e-5, err


def test_memory_on_every_rank_is_caught():
    """The mutation: memory joined by every rank of a split attention counts it dcp times."""
    x = _inputs()
    valid = x["pos"] >= 0
    err = (_combined(O._partial_attention_impl, x, 2, mem_split=False)
           - _reference(x))[valid].abs().max()
    assert err > 1e-3, err


def test_one_definition_of_the_bias_of_a_distance():
    """ALiBi's slopes are the table ``-slope_h * d``: the same bias at every causal key."""
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    table = -slopes[:, None] * torch.arange(L)
    q_pos = torch.tensor([[3, 9]])
    k_pos = torch.arange(10)[None]
    a = distance_bias(q_pos, k_pos, HKV, slopes=slopes)
    t = distance_bias(q_pos, k_pos, HKV, table=table)
    causal = (k_pos[:, None, None, None, :] <= q_pos[:, None, None, :, None]).expand_as(a)
    assert torch.equal(a[causal], t[causal])
