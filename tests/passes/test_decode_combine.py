"""Decode combine="all_to_all" and combine_dtype="model" against the single-device model.

Same protocol as test_decode_dcp: each program runs its own context step then greedy decode
steps on the threaded world (in-place writes, live-span attention), the garbage block is
re-poisoned with NaN before every step, and every step's logits are compared. Lengths: a
mixed batch with empty shards, +-1 around the interleave period and around a vblock.
"""

from __future__ import annotations

import functools

import pytest
import torch

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.verify import run_reference, run_threaded_program
from dcp_compile.runtime.serving.engine import StepShapes

from helpers import assert_close_report, prompts_of

STEPS = 8
MODELS = {"gqa-16q2kv": DemoConfig(num_layers=2),
          "mqa-16q1kv": DemoConfig(num_layers=2, num_kv_heads=1, seed=1)}


def lengths_for(dcp: int, interleave: int, block: int = 16) -> list[int]:
    period, vblock = interleave * dcp, block * dcp
    return sorted({1, max(period - 1, 2), period + 1, vblock})[:4] if period < vblock \
        else [1, vblock - 1, vblock, vblock + 1]


@functools.lru_cache(maxsize=None)
def program_for(model_name, tp, dcp, interleave, combine, combine_dtype="float32",
                dtype=torch.float32):
    model = demo_model(MODELS[model_name], dtype=dtype)
    max_len = max(lengths_for(dcp, interleave))
    shapes = StepShapes.fitting(4, max_len, max_len + STEPS, block_size=16, dcp=dcp)
    return model, dcp_compile.transform(model, tp=tp, dcp=dcp, shapes=shapes,
                                        interleave_size=interleave, combine=combine,
                                        combine_dtype=combine_dtype,
                                        check=False)  # the tests compare every step


def _errors(model, prog, seed, steps=STEPS):
    prompts = prompts_of(lengths_for(prog.config.dcp, prog.config.interleave_size), seed=seed)
    ref, _ = run_reference(model, prog, prompts, steps)
    runs = run_threaded_program(prog, prompts, steps, poison_garbage=True)
    return ref, runs


CASES = [("gqa-16q2kv", 4, 2, 4), ("gqa-16q2kv", 4, 2, 16), ("mqa-16q1kv", 4, 4, 1),
         ("mqa-16q1kv", 2, 2, 16)]


@pytest.mark.parametrize("model_name,tp,dcp,interleave", CASES,
                         ids=[f"{m}-tp{t}-dcp{d}-I{i}" for m, t, d, i in CASES])
def test_all_to_all_combine_matches_single_device_fp32(model_name, tp, dcp, interleave):
    model, prog = program_for(model_name, tp, dcp, interleave, "all_to_all")
    ref, runs = _errors(model, prog, seed=tp * 10 + dcp + interleave)
    for run in runs:
        assert run.result.tokens == ref.tokens, f"rank {run.rank} tokens differ"
        for t, (got, exp) in enumerate(zip(run.result.logits, ref.logits)):
            assert_close_report(got, exp, atol=1e-4, what=f"rank {run.rank} step {t}")


BF16 = [("all_gather", "model"), ("all_to_all", "float32"), ("all_to_all", "model")]


@pytest.mark.parametrize("combine,combine_dtype", BF16, ids=[f"{c}-{d}" for c, d in BF16])
def test_bf16_combines_within_stated_tolerance(combine, combine_dtype):
    """bf16 weights and caches: every step's logits within 0.1 of the bf16 single-device model
    (the bound test_decode_dcp states for the default combine; bf16 has 8 mantissa bits and
    the combine reorders sums). Sending the partial outputs in bf16 rounds each partial once
    more before the merge; the measured cost is in docs/benchmarks.md."""
    model, prog = program_for("gqa-16q2kv", 4, 2, 4, combine, combine_dtype, torch.bfloat16)
    ref, runs = _errors(model, prog, seed=3, steps=4)
    for t, (got, exp) in enumerate(zip(runs[0].result.logits, ref.logits)):
        assert_close_report(got, exp, atol=0.1, what=f"bf16 {combine}/{combine_dtype} step {t}")
