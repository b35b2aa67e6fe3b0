"""The dcp custom ops on their edge cases: empty shards, -inf LSE, garbage writes, fakes."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dcp_compile.runtime.kernels.ops
from dcp_compile.runtime import layout
from dcp_compile.runtime.kernels.ops import owned_capacity

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


# ----------------------------------------------------------------------------------------
# Safe by construction: whatever the block table holds, a write never reaches a block the
# table does not name for that position, and attention never reads an unallocated entry.
# ----------------------------------------------------------------------------------------

def test_slot_mapping_masks_entries_whose_row_arithmetic_would_wrap():
    pos = torch.tensor([[0, 1]])
    for entry in (2 ** 62, 2 ** 63 - 1, dcp_compile.runtime.kernels.ops.max_block_id(4) + 1):
        got = ops.slot_mapping(pos, torch.tensor([[entry]]), torch.tensor(0), 1, 4, 4)
        assert got.tolist() == [[-1, -1]], entry
    edge = dcp_compile.runtime.kernels.ops.max_block_id(4)
    got = ops.slot_mapping(pos, torch.tensor([[edge]]), torch.tensor(0), 1, 4, 4)
    assert got.tolist() == [[edge * 4, edge * 4 + 1]]      # largest id: exact, no wrap


def test_cache_write_sends_slots_outside_the_usable_blocks_to_the_garbage_block():
    kc, vc = _cache(fill=float("nan")), _cache(fill=float("nan"))
    k = torch.ones(1, 4, 1, 2)
    # 12..15 is the garbage block itself, 16 and 2**40 are past the cache.
    new_k, _ = ops.cache_write(kc, vc, k, k, torch.tensor([[13, 16, 2 ** 40, -1]]))
    flat = new_k.reshape(-1, 1, 2)
    assert torch.isnan(flat[:12]).all()                          # usable blocks untouched
    assert torch.isfinite(flat[12]).all()                        # all of it went to garbage


@pytest.mark.parametrize("entry", [-1, 3, 7, 2 ** 62],
                         ids=["unallocated", "garbage-block", "beyond-cache", "block-2**62"])
def test_partial_attention_never_reads_an_entry_that_names_no_usable_block(entry):
    """Prior slots under such an entry are masked, not read from block 0 (another
    sequence's KV, here huge values that would dominate the output)."""
    kc, vc = _cache(blocks=4), _cache(blocks=4)
    kc[0], vc[0] = 50.0, 1e6                       # block 0: someone else's KV
    kc[1], vc[1] = 0.1, 2.0                        # block 1: this sequence's entry 1
    kc[3], vc[3] = float("nan"), float("nan")      # the garbage block
    q = torch.ones(1, 1, 1, 2)
    k_cur = torch.zeros(1, 1, 1, 2)
    table = torch.tensor([[entry, 1]])
    out, lse = ops.partial_attention(q, torch.tensor([[8]]), k_cur, k_cur, torch.tensor([[-1]]),
                                     kc, vc, table, torch.tensor([8]), torch.tensor(0), 1, 4,
                                     1.0)
    assert torch.allclose(out, torch.full_like(out, 2.0))      # only block 1's values
    assert torch.isfinite(lse).all()


# -- the prefill index ops against the spec's formulas --------------------------------------


def _positions(start, length, S):
    pos = torch.full((1, S), -1)
    pos[0, :length] = torch.arange(start, start + length)
    return pos


@pytest.mark.parametrize("W,I", [(2, 8), (4, 16), (4, 8), (8, 8)])
def test_aligned_chunk_slice_is_the_spec_view(W, I):
    """Aligned start, full chunk: exactly view(S // (W*I), W, I)[:, R, :] and its inverse."""
    S = 3 * W * I
    for start in (0, W * I, 5 * W * I):
        pos = _positions(start, S, S)
        un = torch.ops.dcp.q_unshuffle_index(pos, S // W, W, I, I)[0]
        for R in range(W):
            got = torch.ops.dcp.interleave_slice_index(pos, torch.tensor(R), S // W, W, I, I)
            spec = torch.arange(S).view(S // (W * I), W, I)[:, R, :].reshape(-1)
            assert torch.equal(got[0], spec)
            assert torch.equal(got[0], layout.interleave_slice_index(
                torch.arange(S // W), R, dcp=W, interleave=I))
        assert torch.equal(un, layout.q_unshuffle_index(torch.arange(S), S, dcp=W,
                                                        interleave=I))


@pytest.mark.parametrize("W,I", [(2, 8), (4, 16), (4, 4)])
def test_any_start_keeps_exactly_the_owned_positions(W, I):
    """Brute force over starts in two vblocks and lengths: the slice is the owned tokens in
    order, padded with -1; the unshuffle finds every token; the capacity bound is tight."""
    kw = dict(dcp=W, interleave=I, block=I)
    for S in (1, W * I - 1, W * I, W * I + 1, 2 * W * I + 3):
        C = owned_capacity(S, dcp=W, interleave=I)
        most = 0
        for start in range(0, 2 * W * I + 1):
            for length in {S, max(S - 2, 0)}:
                pos = _positions(start, length, S)
                un = torch.ops.dcp.q_unshuffle_index(pos, C, W, I, I)[0]
                slices = []
                for R in range(W):
                    idx = torch.ops.dcp.interleave_slice_index(pos, torch.tensor(R), C, W, I,
                                                               I)[0]
                    owned = [p for p in range(length) if layout.owner(start + p, **kw) == R]
                    assert idx.tolist() == owned + [-1] * (C - len(owned))
                    most = max(most, len(owned))
                    slices.append(idx)
                for p in range(length):
                    r, j = divmod(int(un[p]), C)
                    assert int(slices[r][j]) == p
        assert most == C, f"capacity {C} not tight for S={S}: most {most}"
