"""The plugin's host side without vLLM: a vLLM batch as program calls
(dcp_compile/vllm/batch.py) and the CP slot-mapping kernel it gives vLLM
(dcp_compile/vllm/slot_mapping.py) against vLLM's own kernel, written out here."""

import pytest
import torch

from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.names import StepKind
from dcp_compile.vllm.batch import ProgramShapes, calls_of, pieces_of, scatter_logits, table_rows
from dcp_compile.vllm.slot_mapping import compute_slot_mapping

SHAPES = ProgramShapes(batch=2, context_len=4, decode_len=3, max_blocks=4, vblock=8)


def _batch(runs):
    """(positions, query starts) of requests given as (first position, tokens)."""
    pos, starts = [], [0]
    for first, n in runs:
        pos += list(range(first, first + n))
        starts.append(len(pos))
    return torch.tensor(pos), starts


def test_prompts_start_as_context_steps_and_the_rest_runs_as_width_k_decode_steps():
    # A long prompt (6 tokens from 0), a prefix-cache hit / later chunk (5 from 16), a
    # decode token (at 9), a short prompt (2 from 0).
    pos, starts = _batch([(0, 6), (16, 5), (9, 1), (0, 2)])
    context, rounds = pieces_of(starts, pos, SHAPES)
    assert [(p.request, p.length) for p in context] == [(0, 4), (3, 2)]
    assert [[(p.request, p.length) for p in r] for r in rounds] == \
        [[(0, 2), (1, 3), (2, 1)], [(1, 2)]]


def test_calls_run_in_order_and_fill_padding_with_minus_one():
    pos, starts = _batch([(0, 6), (16, 5), (9, 1), (0, 2)])
    ids = torch.arange(100, 100 + len(pos))
    table = table_rows(torch.tensor([[3, 5, 0, 0], [4, 6, 7, 0], [8, 9, 0, 0], [1, 0, 0, 0]]),
                       [6, 21, 10, 2], SHAPES)
    calls = calls_of(ids, pos, starts, table, SHAPES)
    assert [(c.kind, len(c.rows)) for c in calls] == [
        (StepKind.CONTEXT, 2), (StepKind.DECODE, 2), (StepKind.DECODE, 1), (StepKind.DECODE, 1)]
    first = calls[1]
    assert first.positions.tolist() == [[4, 5, -1], [16, 17, 18]]
    assert first.input_ids[0, :2].tolist() == [104, 105]
    assert first.block_table.tolist() == [[3, -1, -1, -1], [4, 6, 7, -1]]
    logits = [(c, torch.full((2, c.positions.shape[1], 1), float(i))) for i, c in enumerate(calls)]
    out = scatter_logits(logits, len(pos), 1)
    assert out[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 3, 3, 2, 0, 0]


def test_vllms_null_block_never_reaches_the_program_and_long_rows_are_refused():
    rows = table_rows(torch.tensor([[5, 0, 0, 0]]), [8], SHAPES)
    assert rows.tolist() == [[5, -1, -1, -1]]
    with pytest.raises(DCPInputError, match="Lower max_model_len to <= 32"):
        table_rows(torch.zeros(1, 8, dtype=torch.int32), [33], SHAPES)


def _vllm_kernel(starts, positions, block_table, block, world, rank, interleave):
    """vLLM's ComputeSlotMappingKernel.kernel (vllm/v1/worker/block_table.py), per token."""
    out = []
    for r in range(len(starts) - 1):
        for t in range(starts[r], starts[r + 1]):
            pos = int(positions[t])
            vb, off = pos // (block * world), pos % (block * world)
            local = (off // interleave) % world == rank
            slot = int(block_table[r, vb]) * block + (off // (world * interleave)) * interleave \
                + off % interleave
            out.append(slot if local else -1)
    return out


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (2, 4), (4, 2)])
def test_the_slot_mapping_override_is_vllms_kernel(world, interleave):
    block = 4
    pos, starts = _batch([(0, 9), (5, 7), (30, 1)])
    table = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16],
                          [17, 18, 19, 20, 21, 22, 23, 24]], dtype=torch.int32)
    for rank in range(world):
        got = torch.zeros(24, dtype=torch.int64)
        compute_slot_mapping(len(pos), 24, torch.tensor(starts, dtype=torch.int32), pos,
                             table, table.shape[1], got, block, world, rank, interleave)
        want = _vllm_kernel(starts, pos, table, block, world, rank, interleave)
        assert got[:len(pos)].tolist() == want and (got[len(pos):] == -1).all()


def test_program_options_come_from_hf_overrides_and_are_checked_by_name():
    from types import SimpleNamespace

    from dcp_compile.runtime.errors import DCPConfigError
    from dcp_compile.vllm.model import program_options
    assert program_options(SimpleNamespace(), max_num_seqs=2) == \
        {"batch": 2, "context_len": 64, "decode_len": 4}
    given = SimpleNamespace(dcp_compile={"decode_len": 8, "batch": 6})
    assert program_options(given, max_num_seqs=16) == \
        {"batch": 6, "context_len": 64, "decode_len": 8}
    with pytest.raises(DCPConfigError, match=r"unknown dcp_compile options .*\['width'\]"):
        program_options(SimpleNamespace(dcp_compile={"width": 2}), max_num_seqs=4)
    with pytest.raises(DCPConfigError, match="positive ints: context_len=0"):
        program_options(SimpleNamespace(dcp_compile={"context_len": 0}), max_num_seqs=4)
