"""Masks proven, not sampled (passes/mask_predicate.py, passes/prove/masks.py).

An ordinary model's attention mask is read from the graph as a predicate K(i, j) of the
query position i and the key position j, and proven, for every i, j >= 0, to be exactly
causal or exactly causal within a window W. The captured chunk length no longer matters: a
window longer than the chunk is seen in the mask's formula, not in its sampled values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dcp_compile
from dcp_compile import check as checking
from dcp_compile.models.demo import DemoConfig
from dcp_compile.models.plain import plain_llama
from dcp_compile.ordinary import FullForwardReference
from dcp_compile.runtime.engine import StepShapes
from dcp_compile.runtime.errors import DCPCheckError, DCPTransformError

VOCAB, BLOCK = 256, 4
CFG = DemoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_q_heads=8,
                 num_kv_heads=2, head_dim=8, intermediate_size=96)
CONTEXT = 12
WINDOW = 14                    # longer than the captured chunk: the mask shows no cut there
# Capacity 8 blocks: 32 tokens at dcp=1, so sequences run well past the window.
SHAPES = StepShapes(batch=4, context_len=CONTEXT, max_blocks=8, num_blocks=40)
CONFIGS = [(4, 2), (2, 1), (8, 2)]


def _steps(mode: str, gen: torch.Generator) -> list[checking.CheckStep]:
    """Rows crossing the window (14), the interleave period (8 at dcp=2) and vblocks."""
    def ids(n):
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    if mode == "decode":   # prompts 12, 9, 7, 1 then 11 decode steps: up to 23 tokens
        steps = [checking.CheckStep("context", [ids(n) for n in (12, 9, 7, 1)])]
        steps += [checking.CheckStep(f"decode {t}", [ids(1) for _ in range(4)], decode=True)
                  for t in range(11)]
        return steps
    chunks = ((12, 7, 1, 12), (12, 9, 12, 3), (5, 8, 3, 1))   # up to 29 tokens a row
    return [checking.CheckStep(f"chunk {c}", [ids(n) for n in lens])
            for c, lens in enumerate(chunks)]


def assert_matches_own_forward(model, program, mode):
    steps = _steps(mode, torch.Generator().manual_seed(1))
    ref = checking.run_model(FullForwardReference(model), program, steps)
    runs = checking.run_program(program, steps)
    errors, tol, first = checking.compare(ref, runs, steps, torch.float32)
    assert first is None, f"program differs from the model's own forward: {first}, " \
                          f"errors per step {errors}, tolerance {tol:.3g}"


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("tp,dcp", CONFIGS, ids=[f"tp{t}-dcp{d}" for t, d in CONFIGS])
def test_window_longer_than_the_chunk_matches(tp, dcp, mode):
    model = plain_llama(CFG, attention="eager", window=WINDOW)
    program = dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, block_size=BLOCK,
                                    shapes=SHAPES, check=False)
    assert checking.program_windows(program) == [WINDOW] * CFG.num_layers
    assert_matches_own_forward(model, program, mode)
