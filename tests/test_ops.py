"""The dcp custom ops on their edge cases: empty shards, -inf LSE, garbage writes, fakes."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dcp_compile.ops  # noqa: F401

ops = torch.ops.dcp


def _cache(blocks=4, block=4, heads=1, dim=2, fill=0.0):
    return torch.full((blocks, block, heads, dim), fill)


def test_slot_mapping_never_writes_outside_the_block_table():
    table = torch.tensor([[0, -1]])          # entry 1 unallocated
    pos = torch.tensor([[3, 4, 9, -1]])      # block 0, block 1 (-1), beyond the table, pad
    got = ops.slot_mapping(pos, table, torch.tensor(0), 1, 4, 4)
    assert got.tolist() == [[3, -1, -1, -1]]


def test_cache_write_sends_slot_minus_one_to_the_garbage_block_only():
    kc, vc = _cache(fill=float("nan")), _cache(fill=float("nan"))
    k = torch.ones(1, 2, 1, 2)
    new_k, _ = ops.cache_write(kc, vc, k, k, torch.tensor([[5, -1]]))
    flat = new_k.reshape(-1, 1, 2)
    assert torch.equal(flat[5], torch.ones(1, 2))
    assert torch.isfinite(flat[12:]).any()                       # garbage block (3) touched
    assert torch.isnan(torch.cat([flat[:5], flat[6:12]])).all()  # nothing else written
    assert torch.isnan(kc).all()                                 # functional: input intact


def test_empty_shard_gives_zero_output_and_minus_inf_lse_without_nan():
    q = torch.randn(1, 1, 2, 2)
    k = torch.randn(1, 1, 1, 2)
    out, lse = ops.partial_attention(
        q, torch.tensor([[0]]), k, k, torch.tensor([[-1]]),          # active token not owned
        _cache(fill=float("nan")), _cache(fill=float("nan")), torch.tensor([[0]]),
        torch.tensor([0]), torch.tensor(1), 2, 4, 0.5)               # no prior slot owned
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_lse_correct_weights_sum_to_one_and_empty_ranks_contribute_zero():
    out = torch.ones(1, 1, 2, 2)
    lse_all = torch.tensor([[[[0.0, float("-inf")]]], [[[float("-inf"), float("-inf")]]]])
    r0 = ops.lse_correct(out, lse_all[0], lse_all)
    r1 = ops.lse_correct(out, lse_all[1], lse_all)
    assert torch.equal(r0[..., 0, :], torch.ones(1, 1, 2))      # the only rank with keys
    assert torch.equal(r1, torch.zeros_like(r1))                 # empty shard: exactly 0
    assert not torch.isnan(r0).any()                             # head nobody saw: 0, not NaN
    assert torch.equal(r0[..., 1, :], torch.zeros(1, 1, 2))


def test_fake_implementations_give_shapes_only():
    with FakeTensorMode():
        q = torch.empty(2, 3, 4, 8)
        out, lse = ops.partial_attention(q, torch.empty(2, 3, dtype=torch.long),
                                         torch.empty(2, 3, 1, 8), torch.empty(2, 3, 1, 8),
                                         torch.empty(2, 3, dtype=torch.long),
                                         torch.empty(5, 4, 1, 8), torch.empty(5, 4, 1, 8),
                                         torch.empty(2, 2, dtype=torch.long),
                                         torch.empty(2, dtype=torch.long),
                                         torch.empty((), dtype=torch.long), 2, 4, 0.3)
        assert out.shape == q.shape and lse.shape == (2, 3, 4) and lse.dtype == torch.float32
