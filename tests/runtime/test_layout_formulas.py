"""Every formula in dcp_compile.runtime.layout against an independent brute force.

The brute force builds the layout the way the specification describes it — vblocks of
block_size * dcp positions, dealt out in runs of interleave_size positions round-robin over the
ranks — and counts. The formulas are then checked on Python ints and on torch tensors
(vectorised, rank as a tensor), and slot_mapping against a transcription of vLLM's
``_compute_slot_mapping_cpu``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dcp_compile.runtime import layout

WS = (1, 2, 3, 4, 8)
IS = (1, 2, 4, 16)


def _configs():
    for W in WS:
        for I in IS:
            for B in sorted({I, 2 * I, 16, 32}):
                if B % I == 0:
                    yield pytest.param(W, I, B, id=f"W{W}-I{I}-B{B}")


CONFIGS = list(_configs())
PERIODS = 3  # N runs over this many vblocks (plus one)


# ----------------------------------------------------------------------------------------
# Brute force: deal the positions out and count.
# ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def brute(W, I, B, n_positions):
    """owners[p], local_slots[p] and owned[r] (positions of rank r, in order)."""
    owners = []
    while len(owners) < n_positions:
        for _vblock_run in range(B // I):  # one vblock = B/I rounds of W runs of I
            for r in range(W):
                owners.extend([r] * I)
    owners = owners[:n_positions]
    owned = {r: [] for r in range(W)}
    local_slots = []
    for p, r in enumerate(owners):
        local_slots.append(len(owned[r]))
        owned[r].append(p)
    return owners, local_slots, owned


def n_max(W, I, B):
    return PERIODS * B * W + 1


def _kw(W, I, B):
    return dict(dcp=W, interleave=I, block=B)


# ----------------------------------------------------------------------------------------
# Python ints
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("W,I,B", CONFIGS)
def test_owner_and_active_mask_on_ints(W, I, B):
    owners, _, _ = brute(W, I, B, n_max(W, I, B))
    kw = _kw(W, I, B)
    for p, o in enumerate(owners):
        assert layout.owner(p, **kw) == o, p
        for r in range(W):
            assert layout.dcp_active_mask(p, r, **kw) == int(o == r), (p, r)


@pytest.mark.parametrize("W,I,B", CONFIGS)
def test_local_filled_on_ints(W, I, B):
    N = n_max(W, I, B)
    owners, _, _ = brute(W, I, B, N)
    kw = _kw(W, I, B)
    for r in range(W):
        count = 0
        for n in range(N + 1):
            assert layout.local_filled(n, r, **kw) == count, (n, r)
            if n < N:
                count += owners[n] == r


@pytest.mark.parametrize("W,I,B", CONFIGS)
def test_local_slot_and_global_position_on_ints(W, I, B):
    owners, local_slots, owned = brute(W, I, B, n_max(W, I, B))
    kw = _kw(W, I, B)
    for p, s in enumerate(local_slots):
        assert layout.local_slot(p, **kw) == s, p
    for r, positions in owned.items():
        for s, p in enumerate(positions):
            assert layout.global_position(s, r, dcp=W, interleave=I) == p, (s, r)


@pytest.mark.parametrize("W,I,B", CONFIGS)
def test_physical_slot_on_ints(W, I, B):
    for slot in range(3 * B):
        for entry in (0, 1, 5):
            row = layout.physical_slot(slot, entry, block=B)
            assert row // B == entry and row % B == slot % B


def _slice_brute(W, I, S, r):
    """spec (Model Runner): x.view(S // (W*I), W, I)[:, R, :].reshape(-1) on x = arange(S)."""
    return torch.arange(S).view(S // (W * I), W, I)[:, r, :].reshape(-1).tolist()


@pytest.mark.parametrize("W,I,B", CONFIGS)
@pytest.mark.parametrize("chunks", [1, 3], ids=["S=W*I", "S=3*W*I"])
def test_interleave_slice_and_unshuffle_on_ints(W, I, B, chunks):
    S = chunks * W * I
    gathered = []  # rank-major, as the cp_kv all-gather lays it out
    for r in range(W):
        kept = _slice_brute(W, I, S, r)
        assert [layout.interleave_slice_index(j, r, dcp=W, interleave=I)
                for j in range(S // W)] == kept
        gathered.extend(kept)
    assert sorted(gathered) == list(range(S))
    for p in range(S):
        assert gathered[layout.q_unshuffle_index(p, S, dcp=W, interleave=I)] == p


# ----------------------------------------------------------------------------------------
# torch tensors: the same function bodies, vectorised, rank as data
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("W,I,B", CONFIGS)
def test_formulas_on_tensors_match_ints(W, I, B):
    N = n_max(W, I, B)
    owners, local_slots, owned = brute(W, I, B, N)
    kw = _kw(W, I, B)
    pos = torch.arange(N + 1, dtype=torch.int64)            # [N+1]
    ranks = torch.arange(W, dtype=torch.int64)[:, None]      # [W, 1]: one trace, all ranks

    assert layout.owner(pos[:-1], **kw).tolist() == owners
    assert layout.local_slot(pos[:-1], **kw).tolist() == local_slots
    mask = layout.dcp_active_mask(pos[:-1], ranks, **kw)
    assert mask.dtype == torch.int64
    assert mask.tolist() == [[int(o == r) for o in owners] for r in range(W)]
    filled = layout.local_filled(pos, ranks, **kw)
    assert filled.tolist() == [[layout.local_filled(n, r, **kw) for n in range(N + 1)]
                               for r in range(W)]
    assert (filled.sum(0) == pos).all()
    for r, positions in owned.items():
        slots = torch.arange(len(positions))
        got = layout.global_position(slots, torch.tensor(r), dcp=W, interleave=I)
        assert got.tolist() == positions
    S = 2 * W * I
    j = torch.arange(S // W)
    idx = layout.interleave_slice_index(j, ranks, dcp=W, interleave=I)   # [W, S/W]
    assert idx.tolist() == [_slice_brute(W, I, S, r) for r in range(W)]
    rows = layout.q_unshuffle_index(torch.arange(S), S, dcp=W, interleave=I)
    assert idx.reshape(-1)[rows].tolist() == list(range(S))


def test_helpers_pick_the_right_primitive():
    t = torch.tensor([-3, 0, 5, 9])
    assert layout.clamp(t, lo=0, hi=5).tolist() == [0, 0, 5, 5]
    assert layout.clamp(-3, lo=0, hi=5) == 0 and layout.clamp(9, hi=5) == 5
    assert layout.indicator_eq(t, 5).tolist() == [0, 0, 1, 0]
    assert layout.indicator_eq(3, 3) == 1 and layout.indicator_eq(3, 4) == 0
    assert layout.select(torch.tensor([1, 0]), torch.tensor([7, 7]), -1).tolist() == [7, -1]
    assert layout.select(0, 7, -1) == -1


EDGE_LENGTHS = {
    "len=0": lambda W, I, B: 0,
    "len=1": lambda W, I, B: 1,
    "len=I-1": lambda W, I, B: I - 1,
    "len=I": lambda W, I, B: I,
    "len=W*I-1": lambda W, I, B: W * I - 1,
    "len=W*I": lambda W, I, B: W * I,
    "len=W*I+1": lambda W, I, B: W * I + 1,
    "len=B*W-1": lambda W, I, B: B * W - 1,
    "len=B*W": lambda W, I, B: B * W,
    "len=B*W+I": lambda W, I, B: B * W + I,
}


@pytest.mark.parametrize("length", EDGE_LENGTHS.values(), ids=EDGE_LENGTHS.keys())
@pytest.mark.parametrize("W,I,B", [(4, 16, 16), (4, 4, 16), (3, 2, 8), (8, 1, 16)],
                         ids=["W4-I16-B16", "W4-I4-B16", "W3-I2-B8", "W8-I1-B16"])
def test_local_filled_at_edge_lengths(W, I, B, length):
    n = length(W, I, B)
    owners, _, _ = brute(W, I, B, n)
    kw = _kw(W, I, B)
    assert [layout.local_filled(n, r, **kw) for r in range(W)] == \
        [sum(o == r for o in owners) for r in range(W)]
    # The active (decode) token at position n has exactly one owner.
    assert sum(layout.dcp_active_mask(n, r, **kw) for r in range(W)) == 1


# ----------------------------------------------------------------------------------------
# slot_mapping vs vLLM's _compute_slot_mapping_cpu (CP branch), transcribed
# ----------------------------------------------------------------------------------------


def vllm_compute_slot_mapping_cpu(block_table_cpu, slot_mapping_np, positions, req_indices,
                                  block_size, cp_world_size=1, cp_rank=0,
                                  cp_kv_cache_interleave_size=1):
    """Transcription of vllm-neuron's ``_compute_slot_mapping_cpu`` (numpy)."""
    np = pytest.importorskip("numpy")
    PAD_SLOT_ID = -1
    max_blocks_per_req = block_table_cpu.shape[1]
    virtual_block_size = block_size * cp_world_size
    block_indices = positions // virtual_block_size
    flat_indices = req_indices * max_blocks_per_req + block_indices
    block_numbers = block_table_cpu.ravel()[flat_indices]
    if cp_world_size > 1:
        virtual_block_offsets = positions % virtual_block_size
        is_local = (virtual_block_offsets // cp_kv_cache_interleave_size % cp_world_size
                    == cp_rank)
        block_offsets = (virtual_block_offsets
                         // (cp_world_size * cp_kv_cache_interleave_size)
                         * cp_kv_cache_interleave_size
                         + virtual_block_offsets % cp_kv_cache_interleave_size)
        slot_mapping = block_numbers * block_size + block_offsets
        slot_mapping_np[: len(positions)] = np.where(is_local, slot_mapping, PAD_SLOT_ID)
    else:
        block_offsets = positions % block_size
        np.add(block_numbers * block_size, block_offsets,
               out=slot_mapping_np[: len(positions)])


@pytest.mark.parametrize("W,I,B", CONFIGS)
def test_slot_mapping_matches_vllm(W, I, B):
    np = pytest.importorskip("numpy")
    kw = _kw(W, I, B)
    vblock = B * W
    lengths = [PERIODS * vblock + 1, vblock - 1, 1]
    max_blocks = PERIODS + 1
    g = torch.Generator().manual_seed(W * 1000 + I * 10 + B)
    table = torch.randperm(64, generator=g)[: len(lengths) * max_blocks]
    table = table.view(len(lengths), max_blocks).numpy().astype(np.int64)
    req = np.concatenate([np.full(n, i, dtype=np.int64) for i, n in enumerate(lengths)])
    pos = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    for r in range(W):
        expected = np.full(len(pos), -7, dtype=np.int64)
        vllm_compute_slot_mapping_cpu(table, expected, pos, req, B, W, r, I)
        entries = table[req, pos // vblock]
        got_ints = [layout.slot_mapping(int(p), r, int(e), **kw) for p, e in zip(pos, entries)]
        assert got_ints == expected.tolist()
        got_t = layout.slot_mapping(torch.from_numpy(pos), torch.tensor(r),
                                    torch.from_numpy(entries), **kw)
        assert got_t.tolist() == expected.tolist()
