"""Prefill DCP numerics: threaded world vs the single-device model (the torchrun/gloo world:
tests/e2e/test_torchrun_world.py).

Each case runs a chunked prefill — a first chunk, then chunks that attend to the prior cache —
on the transformed program and on the single-device demo model, through the same engine.
Compared: the logits of every real token of every chunk (so every hidden state, through the
LM head; the last token's logits are among them) within float32 tolerance, on every rank; and
each rank's KV cache, allocated as NaN: exactly the rows of the positions its cp_rank owns are
written (every other row except the garbage block is still NaN), with the single-device
cache's values for its KV heads. Values agree to ~5e-6, not bit for bit: the sharded q/k/v
GEMMs run with other shapes than the single device's (different kernel blocking), and from
layer 1 on the residual stream is a reduce-scattered sum.

"mixed" plans: three sequences of different lengths per chunk (one sits a chunk out, one
gets a single token), priors that are not multiples of W*I, chunks shorter than the static
chunk length. "full" plans: every chunk is the whole static length, priors multiples of it,
with S a multiple of lcm(TP, W*I): no padding anywhere — the spec's own setting.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

import dcp_compile
from dcp_compile.runtime import layout
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPConfigError, DCPInputError
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.serving.rank_program import copy_graph_module
from dcp_compile.verify import (check_prefill_caches, compare_prefill_logits,
                                run_prefill_reference, run_threaded_prefill, verify_prefill)
from dcp_compile.workers.prefill import plan_tokens, shapes_for

from helpers import assert_close_report, prompts_of


def mixed_plan(S: int, W: int, I: int) -> list[list[int]]:
    return [[S, S - 5, 1],
            [S - 3, 7, 0],
            [min(W * I + 1, S), S, 2],
            [1, S - 1, S]]


def full_plan(S: int) -> list[list[int]]:
    return [[S, S]] * 3


CASES = {  # id: (tp, dcp, interleave = block_size, S, plan kind, layers)
    "tp4-dcp2-I8-S64-unpadded": (4, 2, 8, 64, "full", 2),
    "tp8-dcp4-I8-S32-unpadded": (8, 4, 8, 32, "full", 1),
    "tp8-dcp4-I16-S40-padded": (8, 4, 16, 40, "mixed", 2),
    "tp4-dcp2-I16-S36-padded": (4, 2, 16, 36, "mixed", 1),
    "tp8-dcp4-I8-S30-S_not_multiple_of_tp": (8, 4, 8, 30, "mixed", 1),
    "tp8-dcp2-I8-S24-kv-heads-replicated": (8, 2, 8, 24, "mixed", 1),
    "tp4-dcp4-I16-S20-dcp_tp-size-1": (4, 4, 16, 20, "mixed", 1),
    # The garbage block first (vLLM's null block): garbage_block=0.
    "tp4-dcp2-I16-S36-padded-garbage-first": (4, 2, 16, 36, "mixed", 1),
}


def plan_of(case: str) -> list[list[int]]:
    tp, dcp, interleave, S, kind, _ = CASES[case]
    return full_plan(S) if kind == "full" else mixed_plan(S, dcp, interleave)


@functools.lru_cache(maxsize=None)
def program_for(case: str):
    tp, dcp, interleave, S, _, layers = CASES[case]
    model = demo_model(DemoConfig(num_layers=layers, seed=tp + dcp))
    plan = plan_of(case)
    prog = dcp_compile.transform(model, tp=tp, dcp=dcp, mode="prefill",
                                 block_size=interleave,
                                 shapes=shapes_for(plan, S, dcp, interleave),
                                 garbage_block=0 if case.endswith("garbage-first") else -1)
    return model, prog


def _assert_matches(prog, runs, ref, what=""):
    for run in runs:
        for t, (got, exp, pos) in enumerate(zip(run.logits, ref.logits, ref.positions)):
            valid = pos >= 0
            assert_close_report(got[valid], exp[valid], atol=1e-4,
                                what=f"{what}rank {run.rank} chunk {t} logits")
        assert run.lengths == ref.lengths
        last, _, first, agree = compare_prefill_logits(run, ref, atol=1e-4)
        assert first is None and agree and max(last) <= 1e-4
    problem = check_prefill_caches(prog, runs, ref, atol=1e-5)
    assert problem is None, f"{what}cache: {problem}"


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_matches_single_device(case):
    model, prog = program_for(case)
    tp, dcp, interleave, S, kind, _ = CASES[case]
    chunks = plan_tokens(plan_of(case), seed=tp * 10 + dcp)
    if kind == "mixed":   # the point of these plans: priors not aligned to W*I
        priors = {sum(len(c[b]) for c in chunks[:i]) for i in range(1, len(chunks))
                  for b in range(3)}
        assert any(p % (dcp * interleave) for p in priors)
    ref = run_prefill_reference(model, prog, chunks)
    runs = run_threaded_prefill(prog, chunks, fill=float("nan"))
    _assert_matches(prog, runs, ref)


def test_bf16_prefill_within_stated_tolerance():
    """bf16 weights and caches: every real token's logits within 0.1 of the bf16
    single-device model (8 mantissa bits; the LSE combine and reduce-scatters reorder sums;
    the combine itself runs in float32), cache rows exactly the owned ones, within 0.05."""
    plan = mixed_plan(36, 2, 16)
    model = demo_model(DemoConfig(num_layers=2), dtype=torch.bfloat16)
    prog = dcp_compile.transform(model, tp=4, dcp=2, mode="prefill", block_size=16,
                                 shapes=shapes_for(plan, 36, 2, 16))
    chunks = plan_tokens(plan, seed=1)
    ref = run_prefill_reference(model, prog, chunks)
    runs = run_threaded_prefill(prog, chunks, fill=float("nan"))
    for run in runs:
        _, every, first, _ = compare_prefill_logits(run, ref, atol=0.1)
        assert first is None and max(every) <= 0.1, (run.rank, every)
    assert check_prefill_caches(prog, runs, ref, atol=0.05) is None


class _PadIds:
    """Executor wrapper: random token ids wherever the position is padding."""

    def __init__(self, inner, seed):
        self.inner, self.gen = inner, torch.Generator().manual_seed(seed)

    @property
    def caches(self):
        return self.inner.caches

    def step(self, kind, input_ids, positions, block_table):
        noise = torch.randint(0, 256, input_ids.shape, generator=self.gen)
        ids = torch.where(positions >= 0, input_ids, noise)
        return self.inner.step(kind, ids, positions, block_table)


def test_pad_tokens_never_reach_outputs_or_caches():
    """Changing the ids of pad tokens changes no real token's logits and no cache row."""
    from dcp_compile.runtime.serving.rank_engine import RecordingExecutor
    from dcp_compile.verify import run_chunks
    from dcp_compile.runtime.serving.engine import Engine, LocalExecutor
    from dcp_compile.runtime.distributed.world import bind_roles, run_threaded
    case = "tp8-dcp4-I8-S30-S_not_multiple_of_tp"
    _, prog = program_for(case)
    chunks = plan_tokens(plan_of(case), seed=1)

    def rank_main(rank, seed):
        loaded = prog.load(rank, bind_roles(prog.topology, rank))
        inner = LocalExecutor(loaded.step_fns(), prog.cache_spec().allocate(fill=float("nan")))
        rec = RecordingExecutor(inner if seed is None else _PadIds(inner, seed + rank))
        engine = Engine(rec, prog.shapes, block_size=8, dcp=4, prompt_kind="prefill")
        return run_chunks(engine, rec, chunks, rank, prog.shapes.max_blocks)

    with torch.no_grad():
        plain = run_threaded(8, rank_main, None)
        noisy = run_threaded(8, rank_main, 123)
    for a, b in zip(plain, noisy):
        for la, lb, pos in zip(a.logits, b.logits, a.positions):
            assert torch.equal(la[pos >= 0], lb[pos >= 0])
        for ca, cb in zip(a.caches, b.caches):
            assert torch.equal(ca[:-1].nan_to_num(7.0), cb[:-1].nan_to_num(7.0))


def _aligned_only_slice(positions, rank, capacity, dcp, interleave, block):
    """The reference implementation's assumption: the chunk starts at a multiple of W*I, so
    the slice is view(S // (W*I), W, I)[:, R, :] of the chunk, whatever the prior."""
    j = torch.arange(capacity)
    idx = layout.interleave_slice_index(j, rank, dcp=dcp, interleave=interleave)
    idx = idx.unsqueeze(0).expand(positions.shape[0], -1)
    return torch.where(idx < (positions >= 0).sum(1, keepdim=True), idx,
                       torch.full_like(idx, -1))


def _aligned_only_unshuffle(positions, capacity, dcp, interleave, block):
    p = torch.arange(positions.shape[1]).unsqueeze(0).expand_as(positions)
    row = layout.q_unshuffle_index(p, dcp * capacity, dcp=dcp, interleave=interleave)
    return torch.where(positions >= 0, row, torch.zeros_like(row))


def test_aligned_prior_assumption_breaks_on_unaligned_prior():
    """Swap in the aligned-prior slice (the known implementation's). The first chunk (prior
    0) still matches. A chunk after an unaligned prior still *attends* correctly (its keys are
    still split among the ranks) but writes its K/V to ranks that do not own those positions,
    and the next chunk, reading them back as prior, is wrong: so the owner-based slice
    matters, and both checks (cache ownership, logits) catch a wrong layout."""
    case = "tp4-dcp2-I16-S36-padded"
    model, prog = program_for(case)
    gm = copy_graph_module(prog.graphs["prefill"])
    swap = {torch.ops.dcp.interleave_slice_index.default: _aligned_only_slice,
            torch.ops.dcp.q_unshuffle_index.default: _aligned_only_unshuffle}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in swap:
            n.target = swap[n.target]
    gm.recompile()
    broken = dataclasses.replace(prog, graphs={"prefill": gm})
    S = CASES[case][3]
    chunks = plan_tokens([[S, S - 5, 1], [S - 3, 7, 3], [9, 9, 9]], seed=2)
    ref = run_prefill_reference(model, prog, chunks)
    runs = run_threaded_prefill(broken, chunks, fill=float("nan"))
    _, every, _, _ = compare_prefill_logits(runs[0], ref, atol=1e-4)
    assert every[0] <= 1e-4 and every[1] <= 1e-4
    assert every[2] > 1e-2, "reading the misplaced prior must change the third chunk"
    problem = check_prefill_caches(broken, runs, ref, atol=1e-5)
    assert problem is not None and problem["problem"] in ("written", "unwritten")


def test_verify_prefill_report():
    """The entry point `dcp-compile verify --mode prefill` uses: prompts split into chunks."""
    model, prog = program_for("tp4-dcp2-I16-S36-padded")
    prompts = prompts_of((36, 29, 5), seed=4)
    report = verify_prefill(model, prog, prompts, 3)
    assert report.ok, report
    assert report.mode == "prefill" and report.steps == 3 and report.lengths == [36, 29, 5]
    assert len(report.step_errors) == 3 and report.max_abs_error < 1e-4
    assert json.loads(json.dumps(report.to_json()))["ok"] is True


@pytest.mark.parametrize("kwargs,message", [
    (dict(tp=8, dcp=4, kv_role="kv_consumer"), r"apply_prefill_dcp requires DI"),
    (dict(tp=8, dcp=4, block_size=16, interleave_size=8),
     r"interleave_size must equal block_size for DI"),
    (dict(tp=6, dcp=4), r"TP % DCP == 0: tp=6, dcp=4"),
], ids=["no-DI-role", "interleave!=block-under-DI", "tp%dcp!=0"])
def test_bad_config_is_refused_before_capture(kwargs, message):
    model = demo_model(DemoConfig(num_layers=1), device="meta")
    with pytest.raises(DCPConfigError, match=message):
        dcp_compile.transform(model, mode="prefill", **kwargs)


def test_dcp1_prefill_needs_no_di_role():
    DCPConfig(tp=4, dcp=1, mode="prefill", kv_role="kv_consumer")   # no error


def test_chunk_beyond_the_block_table_is_refused_and_writes_nothing():
    """Grow one sequence to the end of its block table; the chunk that would pass it, and a
    chunk longer than the static chunk length, raise DCPInputError before anything runs."""
    from dcp_compile.runtime.serving.engine import Engine, LocalExecutor
    from dcp_compile.runtime.distributed.world import bind_roles, run_threaded
    _, prog = program_for("tp4-dcp4-I16-S20-dcp_tp-size-1")
    capacity = prog.shapes.max_blocks * 16 * 4        # positions a block table addresses
    chunk = [[3] * 20, [], []]

    def rank_main(rank):
        loaded = prog.load(rank, bind_roles(prog.topology, rank))
        ex = LocalExecutor(loaded.step_fns(), prog.cache_spec().allocate(fill=float("nan")))
        engine = Engine(ex, prog.shapes, block_size=16, dcp=4, prompt_kind="prefill")
        while engine.lengths[0] + 20 <= capacity if engine.lengths else True:
            engine.prefill(chunk)
        before, lengths, errors = [c.clone() for c in ex.caches], list(engine.lengths), []
        for bad in (chunk, [[3] * 21, [], []]):
            try:
                engine.prefill(bad)
            except DCPInputError as e:
                errors.append(str(e))
        same = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
                   for a, b in zip(before, ex.caches))
        return errors, same, lengths == engine.lengths

    with torch.no_grad():
        results = run_threaded(4, rank_main)
    for errors, same, lengths_kept in results:
        assert len(errors) == 2
        assert "block table has room for max_blocks" in errors[0]
        assert "longer than the program's context_len" in errors[1]
        assert same and lengths_kept
