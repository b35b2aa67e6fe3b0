"""Decode DCP numerics on the threaded world against the single-device model.

Every program runs its own context step, then >= 16 greedy decode steps; logits are compared
at every step, tokens must agree, the garbage block is re-poisoned with NaN before every step
(outputs stay finite only if it is never read), and the per-rank caches gathered back equal
the single-device cache.
"""

from __future__ import annotations

import functools

import pytest
import torch

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.verify import run_reference, run_threaded_program
import dcp_compile.runtime.layout
import dcp_compile.runtime.kernels.ops
from dcp_compile.runtime.transfer.cache_layout import gather_cache
from dcp_compile.runtime.serving.engine import StepShapes

from helpers import assert_close_report, prompts_of

STEPS = 16
MODELS = {
    "demo-16q2kv": DemoConfig(num_layers=2),
    "mqa-16q1kv": DemoConfig(num_layers=2, num_kv_heads=1, seed=1),
    "more-kv-16q4kv": DemoConfig(num_layers=2, num_kv_heads=4, seed=2),
}


def lengths_for(dcp: int, interleave: int, block: int) -> list[int]:
    """Prompt lengths hitting the edge cases: an empty shard on most ranks, +-1 around the
    interleave period and around a vblock (decode then walks 16 positions past them)."""
    period, vblock = interleave * dcp, block * dcp
    return sorted({1, max(period - 1, 2), period + 1, vblock})[:4] if period < vblock \
        else [1, vblock - 1, vblock, vblock + 1]


@functools.lru_cache(maxsize=None)
def program_for(model_name: str, tp: int, dcp: int, interleave: int, max_len: int,
                dtype: torch.dtype = torch.float32, garbage_block: int = -1):
    model = demo_model(MODELS[model_name], dtype=dtype)
    shapes = StepShapes.fitting(4, max_len, max_len + STEPS, block_size=16, dcp=dcp)
    prog = dcp_compile.transform(model, tp=tp, dcp=dcp, mode="decode", shapes=shapes,
                                 interleave_size=interleave, check=False,  # compared below
                                 garbage_block=garbage_block)
    return model, prog


CASES = [
    # (model, tp, dcp, interleave)
    ("demo-16q2kv", 4, 2, 16), ("demo-16q2kv", 4, 2, 4), ("demo-16q2kv", 4, 2, 1),
    ("mqa-16q1kv", 4, 4, 16), ("demo-16q2kv", 8, 2, 4), ("demo-16q2kv", 8, 4, 16),
    ("demo-16q2kv", 8, 4, 1), ("mqa-16q1kv", 2, 2, 16), ("more-kv-16q4kv", 8, 2, 4),
]
# With the garbage block first (vLLM's null block, garbage_block=0): a few of the cases.
CASES_FIRST = [("demo-16q2kv", 4, 2, 4), ("mqa-16q1kv", 2, 2, 16)]
GARBAGE_CASES = [(*c, -1) for c in CASES] + [(*c, 0) for c in CASES_FIRST]


def _check_against_reference(model, prog, prompts, runs, ref, atol):
    for run in runs:
        assert run.result.tokens == ref.tokens, f"rank {run.rank} tokens differ"
        for t, (got, exp) in enumerate(zip(run.result.logits, ref.logits)):
            assert_close_report(got, exp, atol=atol, what=f"rank {run.rank} step {t}")


@pytest.mark.parametrize("model_name,tp,dcp,interleave,garbage", GARBAGE_CASES,
                         ids=[f"{m}-tp{t}-dcp{d}-I{i}" + ("-garbage-first" if g == 0 else "")
                              for m, t, d, i, g in GARBAGE_CASES])
def test_decode_matches_single_device(model_name, tp, dcp, interleave, garbage):
    lengths = lengths_for(dcp, interleave, 16)
    model, prog = program_for(model_name, tp, dcp, interleave, max(lengths),
                              garbage_block=garbage)
    prompts = prompts_of(lengths, seed=tp * 10 + dcp)
    ref, ref_engine = run_reference(model, prog, prompts, STEPS)
    runs = run_threaded_program(prog, prompts, STEPS, poison_garbage=True)
    _check_against_reference(model, prog, prompts, runs, ref, atol=1e-4)

    # Gathering every rank's shard reproduces the single-device cache at every position.
    n = len(prompts)
    lengths_now = runs[0].lengths
    assert lengths_now == ref_engine.lengths
    ref_table = ref_engine.allocator.table(list(range(n)), ref_engine.shapes.max_blocks)
    rebuilt = [torch.full_like(c, float("nan")) for c in ref_engine.executor.caches]
    gather_cache({r.rank: r.caches for r in runs}, runs[0].block_table, lengths_now, rebuilt,
                 ref_table, cp_rank_of=prog.topology.cp_rank, dcp=dcp,
                 interleave=interleave, kv_heads_of=prog.topology.kv_heads_of)
    for layer, (got, exp) in enumerate(zip(rebuilt, ref_engine.executor.caches)):
        for b, length in enumerate(lengths_now):
            pos = torch.arange(length)
            rows = ref_table[b, pos // 16] * 16 + pos % 16
            assert_close_report(got.reshape(-1, *got.shape[2:])[rows],
                                exp.reshape(-1, *exp.shape[2:])[rows], atol=1e-5,
                                what=f"cache {layer} seq {b}")


@pytest.mark.parametrize("tp,dcp,interleave,garbage", [(4, 2, 16, -1), (8, 4, 1, -1),
                                                        (4, 2, 16, 0)])
def test_each_rank_writes_exactly_the_positions_it_owns(tp, dcp, interleave, garbage):
    """Caches start as NaN: after the run, exactly the owned slots are finite."""
    lengths = lengths_for(dcp, interleave, 16)
    _, prog = program_for("demo-16q2kv", tp, dcp, interleave, max(lengths),
                          garbage_block=garbage)
    prompts = prompts_of(lengths)
    runs = run_threaded_program(prog, prompts, 4, fill=float("nan"))
    kw = prog.config.layout_kwargs()
    for run in runs:
        cp = prog.topology.cp_rank(run.rank)
        expected = torch.zeros(prog.shapes.num_blocks * 16, dtype=torch.bool)
        for b, length in enumerate(run.lengths):
            for p in range(length):
                if dcp_compile.runtime.layout.owner(p, **kw) == cp:
                    slot = dcp_compile.runtime.layout.local_slot(p, **kw)
                    expected[int(run.block_table[b, slot // 16]) * 16 + slot % 16] = True
        written = torch.isfinite(run.caches[0]).reshape(-1, run.caches[0].shape[2]
                                                        * run.caches[0].shape[3]).all(-1)
        block = prog.cache_spec().garbage_block
        written[block * 16:(block + 1) * 16] = False   # non-owners' writes land there
        assert torch.equal(written, expected), f"rank {run.rank} wrote other slots"


@pytest.mark.parametrize("tp,dcp,interleave", [(4, 2, 4), (8, 4, 16)])
def test_decode_from_scattered_reference_cache(tp, dcp, interleave):
    lengths = lengths_for(dcp, interleave, 16)
    model, prog = program_for("demo-16q2kv", tp, dcp, interleave, max(lengths))
    prompts = prompts_of(lengths, seed=7)
    ref, ref_engine = run_reference(model, prog, prompts, STEPS)
    # A fresh reference engine that has only prefilled: its caches are the starting point.
    _, start_engine = run_reference(model, prog, prompts, 0)
    runs = run_threaded_program(prog, prompts, STEPS, poison_garbage=True,
                                from_reference=(start_engine, ref.logits[0]))
    _check_against_reference(model, prog, prompts, runs, ref, atol=1e-4)


def test_bf16_decode_within_stated_tolerance():
    """bf16 weights and caches: logits within 0.1 of the bf16 single-device model (bf16 has
    8 bits of mantissa; the partial/combined attention reorders sums), tokens compared where
    the reference margin between the top two logits exceeds that tolerance."""
    lengths = lengths_for(2, 16, 16)
    model, prog = program_for("demo-16q2kv", 4, 2, 16, max(lengths), torch.bfloat16)
    prompts = prompts_of(lengths, seed=3)
    ref, _ = run_reference(model, prog, prompts, 4)
    runs = run_threaded_program(prog, prompts, 4)
    got = runs[0].result.logits[0]
    assert_close_report(got, ref.logits[0], atol=0.1, what="bf16 first logits")


def test_broken_layout_is_caught_by_numerics(monkeypatch):
    """The comparison can fail: a program whose active mask is wrong on purpose diverges."""
    lengths = lengths_for(2, 16, 16)
    model, prog = program_for("demo-16q2kv", 4, 2, 16, max(lengths))
    prompts = prompts_of(lengths, seed=5)
    ref, _ = run_reference(model, prog, prompts, 4)
    real = dcp_compile.runtime.kernels.ops._active_mask_impl
    monkeypatch.setattr(dcp_compile.runtime.kernels.ops, "_active_mask_impl",
                        lambda n, rank, *a: torch.ones_like(real(n, rank, *a)))
    runs = run_threaded_program(prog, prompts, 4)
    diff = (runs[0].result.logits[1] - ref.logits[1]).abs().max()
    assert diff > 1e-3, "counting the active token on every rank must change the output"
