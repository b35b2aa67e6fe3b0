"""compute_slot_mapping: host-side CP slot mapping for a batch, and every input it refuses."""

from __future__ import annotations

import copy

import pytest
import torch

from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.serving.metadata import compute_slot_mapping


def brute_slot(pos, table_row, rank, W, I, B):
    """Deal positions out (runs of I, round-robin over ranks, B per rank per vblock), count."""
    if pos < 0:
        return -1
    vblock = B * W
    owners = [(q % vblock) // I % W for q in range(pos + 1)]  # spec: owner formula
    if owners[pos] != rank:
        return -1
    # The rank's earlier positions in this vblock fill the block's rows before this one.
    start = (pos // vblock) * vblock
    row = sum(1 for q in range(start, pos) if owners[q] == rank)
    return table_row[pos // vblock] * B + row


def brute(table, positions, rank, W, I, B):
    return [[brute_slot(p, table[b], rank, W, I, B) for p in row]
            for b, row in enumerate(positions)]


def _batch(W, I, B, lengths, *, seed=0, num_blocks=100, pad_to=None):
    """Block tables of distinct random blocks (never the garbage block, num_blocks - 1);
    sequence b holds positions 0 .. lengths[b] - 1, padded with -1."""
    vblock = B * W
    g = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // vblock)) for n in lengths]
    width = max(need)
    ids = torch.randperm(num_blocks - 1, generator=g).tolist()
    table, positions = [], []
    pad_to = pad_to or max(lengths)
    for b, n in enumerate(lengths):
        row = ids[:need[b]] + [-1] * (width - need[b])
        ids = ids[need[b]:]
        table.append(row)
        positions.append(list(range(n)) + [-1] * (pad_to - n))
    return table, positions


CONFIGS = [
    pytest.param(1, 16, 16, id="dcp1"),
    pytest.param(2, 16, 16, id="dcp2-I=B"),
    pytest.param(4, 16, 16, id="dcp4-I=B"),
    pytest.param(4, 4, 16, id="dcp4-I<B"),
    pytest.param(3, 2, 4, id="dcp3-odd"),
    pytest.param(8, 1, 2, id="dcp8-I1"),
]


@pytest.mark.parametrize("W,I,B", CONFIGS)
def test_matches_brute_force_for_a_mixed_batch(W, I, B):
    vblock = B * W
    lengths = [1, I, W * I - 1, W * I + 1, vblock, 2 * vblock + 3]
    table, positions = _batch(W, I, B, lengths)
    for rank in range(W):
        got = compute_slot_mapping(table, positions, rank, W, B, I, num_blocks=100)
        assert got.dtype == torch.int64 and got.shape == (len(lengths), max(lengths))
        assert got.tolist() == brute(table, positions, rank, W, I, B)


@pytest.mark.parametrize("W,I,B", CONFIGS)
def test_every_position_written_by_exactly_one_rank_to_distinct_rows(W, I, B):
    table, positions = _batch(W, I, B, [3 * B * W + 1, B * W - 1])
    maps = torch.stack([compute_slot_mapping(table, positions, r, W, B, I) for r in range(W)])
    valid = torch.tensor(positions) >= 0
    assert ((maps >= 0).sum(0) == valid.to(torch.int64)).all()
    for r in range(W):  # within one rank's cache, distinct tokens get distinct rows
        rows = maps[r][maps[r] >= 0]
        assert rows.unique().numel() == rows.numel()


def test_decode_step_positions_and_tensor_inputs():
    W, I, B = 2, 4, 8
    table = torch.tensor([[5, 9, -1], [3, -1, -1]], dtype=torch.int32)
    positions = torch.tensor([[16], [4]], dtype=torch.int32)  # one active token per sequence
    for rank in range(W):
        got = compute_slot_mapping(table, positions, torch.tensor(rank), W, B, I)
        assert got.tolist() == brute(table.tolist(), positions.tolist(), rank, W, I, B)
    # position 16 = vblock 1 (entry 9), offset 0 -> rank 0; position 4 -> rank 1, row 0 of 3
    assert compute_slot_mapping(table, positions, 0, W, B, I).tolist() == [[72], [-1]]
    assert compute_slot_mapping(table, positions, 1, W, B, I).tolist() == [[-1], [24]]


def test_lists_tensors_and_one_sequence_agree():
    W, I, B = 4, 2, 4
    table, positions = _batch(W, I, B, [37, 20], seed=3)
    as_lists = compute_slot_mapping(table, positions, 1, W, B, I)
    as_tensors = compute_slot_mapping(torch.tensor(table), torch.tensor(positions), 1, W, B, I)
    assert torch.equal(as_lists, as_tensors)
    one = compute_slot_mapping(table[0], positions[0], 1, W, B, I)
    assert one.dim() == 1 and one.tolist() == as_lists[0].tolist()


def test_ragged_block_table_lists_are_padded_as_unallocated():
    got = compute_slot_mapping([[4, 7], [2]], [[0, 9], [1, -1]], 0, 2, 4, 4)
    assert got.tolist() == brute([[4, 7], [2, -1]], [[0, 9], [1, -1]], 0, 2, 4, 4)


@pytest.mark.parametrize("positions", [[[-1, -1]], [[]]], ids=["all-padding", "no-tokens"])
def test_padding_only(positions):
    got = compute_slot_mapping([[]], positions, 0, 2, 4, 4)
    assert got.tolist() == [[-1] * len(positions[0])]


# ----------------------------------------------------------------------------------------
# Errors: a DCPInputError naming the values, nothing computed, inputs untouched.
# ----------------------------------------------------------------------------------------

GOOD = dict(block_table=[[3, 5], [7, -1]], positions=[[0, 17], [4, -1]], cp_rank=1, dcp=2,
            block_size=8, interleave_size=4)

ERRORS = {
    "position-beyond-table": (dict(positions=[[0, 32], [4, -1]]),
                              "positions[0, 1] = 32 is beyond its block table",
                              "entry 2 is past the 2-entry table"),
    "position-in-unallocated-entry": (dict(positions=[[0, 17], [16, -1]]),
                                      "positions[1, 0] = 16 is beyond its block table",
                                      "block_table[1, 1] = -1 is unallocated"),
    "garbage-block": (dict(block_table=[[3, 9], [7, -1]], num_blocks=10),
                      "is the garbage block", "block_table[0, 1] = 9"),
    "garbage-block-unused-entry": (dict(block_table=[[3, 5], [7, 9]], num_blocks=10),
                                   "garbage block", "block_table[1, 1] = 9"),
    "entry-beyond-cache": (dict(block_table=[[3, 12], [7, -1]], num_blocks=10),
                           "outside the cache", "block_table[0, 1] = 12"),
    "entry-below-minus-one": (dict(block_table=[[3, -2], [7, -1]]), "block id in",
                              "block_table[0, 1] = -2 is below -1"),
    "position-below-minus-one": (dict(positions=[[0, -5], [4, -1]]),
                                 "positions are >= 0, or -1 for padding",
                                 "positions[0, 1] = -5"),
    "dcp=0": (dict(dcp=0), "dcp must be a positive integer", "dcp=0"),
    "negative-block-size": (dict(block_size=-8), "block_size must be a positive integer",
                            "block_size=-8"),
    "float-interleave": (dict(interleave_size=4.0), "interleave_size must be a positive",
                         "4.0"),
    "block-not-multiple-of-interleave": (dict(interleave_size=3), "multiple of interleave",
                                         "interleave_size=3"),
    "rank-negative": (dict(cp_rank=-1), "cp_rank must be an int in [0, dcp)", "cp_rank=-1"),
    "rank-equals-dcp": (dict(cp_rank=2), "cp_rank must be an int in [0, dcp)", "dcp=2"),
    "rank-bool": (dict(cp_rank=True), "cp_rank must be an int", "True"),
    "rank-float": (dict(cp_rank=1.0), "cp_rank must be an int", "1.0"),
    "float-positions": (dict(positions=torch.tensor([[0.0, 17.0], [4.0, -1.0]])),
                        "positions must hold integers", "float32"),
    "ragged-positions": (dict(positions=[[0, 17], [4]]), "rectangular", "positions"),
    "batch-mismatch": (dict(positions=[[0, 1]]), "same batch", "(1, 2)"),
    "num-blocks-too-small": (dict(num_blocks=1), "num_blocks must be an int >= 2",
                             "num_blocks=1"),
}


@pytest.mark.parametrize("change,what,values", ERRORS.values(), ids=ERRORS.keys())
def test_invalid_inputs_raise_input_error(change, what, values):
    kwargs = {**GOOD, **change}
    before = copy.deepcopy(kwargs)
    with pytest.raises(DCPInputError) as info:
        compute_slot_mapping(**kwargs)
    msg = str(info.value)
    assert what in msg and values in msg, msg
    assert msg.rstrip().endswith("."), msg  # <what is wrong>: <values>. <how to fix it>.
    for k, v in before.items():  # nothing mutated
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, kwargs[k])
        else:
            assert v == kwargs[k]


def test_good_reference_input_is_valid():
    got = compute_slot_mapping(**GOOD, num_blocks=10)
    assert got.tolist() == brute(GOOD["block_table"], GOOD["positions"], 1, 2, 4, 8)


def test_error_names_the_first_offender_and_counts_the_rest():
    positions = [[100 + i for i in range(10)]]
    with pytest.raises(DCPInputError, match=r"positions\[0, 0\] = 100 \(and 9 more\)"):
        compute_slot_mapping([[1]], positions, 0, 2, 4, 4)
