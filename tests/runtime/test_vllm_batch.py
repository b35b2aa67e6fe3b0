"""The plugin's host side without vLLM: a vLLM batch as program calls
(dcp_compile/vllm/batch.py) and the CP slot-mapping kernel it gives vLLM
(dcp_compile/vllm/slot_mapping.py) against vLLM's own kernel, written out here."""

import pytest
import torch

from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.names import StepKind
from dcp_compile.vllm.batch import (ProgramShapes, at_bucket, calls_of, pieces_of,
                                   scatter_logits, table_rows)
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


def test_program_shapes_follow_vllms_and_hf_overrides_are_checked_by_name():
    from types import SimpleNamespace

    from dcp_compile.runtime.errors import DCPConfigError
    from dcp_compile.vllm.model import program_options
    limits = dict(max_num_seqs=6, max_num_batched_tokens=32, max_model_len=256)
    assert program_options(SimpleNamespace(), **limits) == \
        {"batch": 6, "context_len": 32, "chunk_len": 32, "decode_len": 4, "buckets": []}
    # A token budget past the proven chunk width: the chunk step stays at 64.
    assert program_options(SimpleNamespace(), max_num_seqs=2, max_num_batched_tokens=2048,
                           max_model_len=512) == \
        {"batch": 2, "context_len": 512, "chunk_len": 64, "decode_len": 4, "buckets": []}
    given = SimpleNamespace(dcp_compile={"decode_len": 8, "batch": 3, "chunk_len": 0,
                                         "buckets": [64]})
    assert program_options(given, **limits) == \
        {"batch": 3, "context_len": 32, "chunk_len": 0, "decode_len": 8, "buckets": [64]}
    with pytest.raises(DCPConfigError, match=r"unknown dcp_compile options .*\['width'\]"):
        program_options(SimpleNamespace(dcp_compile={"width": 2}), **limits)
    with pytest.raises(DCPConfigError, match=r"context_len=0 \(needs >= 1\)"):
        program_options(SimpleNamespace(dcp_compile={"context_len": 0}), **limits)
    with pytest.raises(DCPConfigError, match=r"chunk_len=65 \(the chunk step is a decode "
                                             r"step, proven for widths up to 64\)"):
        program_options(SimpleNamespace(dcp_compile={"chunk_len": 65}), **limits)


CHUNKED = ProgramShapes(batch=2, context_len=4, decode_len=2, max_blocks=4, vblock=8,
                        chunk_len=6)


def test_chunks_after_prior_context_run_as_one_chunk_call_each():
    """A later prefill chunk of 6 (one chunk piece), a cache-hit rest of 9 (a chunk of 6,
    then 3 > decode_len: another chunk), a prompt of 7 from 0 (context 4, then 3 as a chunk),
    decode tokens (2 and 1: decode pieces). Round 0: 3 chunk pieces in 2 calls, 2 decode
    pieces in 1; round 1: one chunk."""
    pos, starts = _batch([(8, 6), (16, 9), (0, 7), (20, 2), (5, 1)])
    context, rounds = pieces_of(starts, pos, CHUNKED)
    assert [(p.request, p.length) for p in context] == [(2, 4)]
    assert [[(p.request, p.length, p.kind) for p in r] for r in rounds] == [
        [(0, 6, StepKind.CHUNK), (1, 6, StepKind.CHUNK), (2, 3, StepKind.CHUNK),
         (3, 2, StepKind.DECODE), (4, 1, StepKind.DECODE)],
        [(1, 3, StepKind.CHUNK)]]
    table = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 6], [7, 0, 0, 0], [8, 9, 0, 0],
                          [10, 0, 0, 0]])
    calls = calls_of(torch.arange(len(pos)), pos, starts,
                     table_rows(table, [14, 25, 7, 22, 6], CHUNKED), CHUNKED)
    assert [(c.kind, len(c.rows), c.positions.shape[1]) for c in calls] == [
        (StepKind.CONTEXT, 1, 4), (StepKind.CHUNK, 2, 6), (StepKind.CHUNK, 1, 6),
        (StepKind.DECODE, 2, 2), (StepKind.CHUNK, 1, 6)]
    assert calls[1].positions.tolist() == [list(range(8, 14)), list(range(16, 22))]
    assert calls[2].positions.tolist()[0] == [4, 5, 6, -1, -1, -1]
    # Context buckets of 8 and 16 tokens (1 and 2 entries) and the full 32: each call's
    # table is the smallest bucket holding its rows' positions.
    widths = [at_bucket(c, (8, 16, 32), CHUNKED).block_table.shape[1] for c in calls]
    assert widths == [1, 4, 1, 4, 4]
    assert at_bucket(calls[0], (8, 16, 32), CHUNKED).block_table.tolist() == [[7], [-1]]


def test_unserved_vllm_features_are_refused_by_name():
    """Pipeline / prefill context parallelism and speculative decoding: a DCPConfigError
    naming the option, before the plugin registers anything (an ngram speculative config
    crashed inside vLLM's kernel rebinding before this check)."""
    from types import SimpleNamespace

    from dcp_compile.runtime.errors import DCPConfigError
    from dcp_compile.vllm.model import refuse_unserved

    def config(pp=1, pcp=1, spec=None):
        return SimpleNamespace(parallel_config=SimpleNamespace(
            pipeline_parallel_size=pp, prefill_context_parallel_size=pcp),
            speculative_config=spec)
    refuse_unserved(config())
    with pytest.raises(DCPConfigError, match="pipeline_parallel_size=2"):
        refuse_unserved(config(pp=2))
    with pytest.raises(DCPConfigError, match=r"speculative decoding \(speculative_config "
                                             r"method='ngram'\) is not served"):
        refuse_unserved(config(spec=SimpleNamespace(method="ngram")))
