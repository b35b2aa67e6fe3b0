"""OLMo-hybrid (docs/hybrid.md, "OLMo-hybrid"): its Gated DeltaNet layers run as
``dcp.gated_delta_net`` through their own swap rule (separate q / k / v projections, its
``g_proj`` output gate, beta doubled by ``allow_neg_eigval``, ``o_norm`` / ``o_proj``) beside
its full attention (q / k norms over all heads, post-norm layers).

Decode (the prompts through the context step, then greedy steps) and prefill under sequence
parallelism (one and two chunks) at tp=4/dcp=2 and tp=8/dcp=4 match the model's own forward
(fp32, 1e-4, greedy tokens equal), on the tiny config (2 key heads: replicated) and on its
head-cut variant (8 key heads: cut by heads over TP); speculative decode runs in
tests/frontends/test_hybrid_hspec.py, the head-cut matrix in test_hybrid_headcut.py.

The slice (default run): the swapped mixer against the model's own, with and without
``allow_neg_eigval``, and decode at tp=4/dcp=2. ``DCP_HYBRID_FULL=1``: every cell.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from dcp_compile.frontends.module_recurrent import recurrent_layers  # noqa: E402
from full_runs import full  # noqa: E402
from hybrid_configs import build_hybrid  # noqa: E402
from hybrid_runs import (assert_decode_matches, assert_prefill_matches,  # noqa: E402
                         assert_swapped_rows_match, cases, program)

FULL = full("DCP_HYBRID_FULL")
TYPE = "olmo_hybrid"


@torch.no_grad()
@pytest.mark.parametrize("neg_eigval", [True, False], ids=["allow_neg_eigval", "beta-in-0-1"])
def test_the_swapped_mixer_is_the_models_own(neg_eigval):
    """Every OLMo-hybrid mixer runs as the op (its rule names it), and the model over a batch
    of mixed lengths equals its own forward row by row, with beta in [0, 2] and in [0, 1]
    (a swap that ignored ``allow_neg_eigval`` differs here: the two models' logits do)."""
    model = build_hybrid(TYPE, linear_allow_neg_eigval=neg_eigval)
    layers = recurrent_layers(model)
    assert [type(m).__name__ for _, m, _ in layers] == ["OlmoHybridGatedDeltaNet"] * 2
    ids = assert_swapped_rows_match(model)
    other = build_hybrid(TYPE, linear_allow_neg_eigval=not neg_eigval)
    assert (other(ids, use_cache=False).logits - model(ids, use_cache=False).logits
            ).abs().max() > 1e-3


@pytest.mark.parametrize("model_type,tp,dcp", cases((TYPE,), {(TYPE, 4, 2)}, FULL))
def test_olmo_hybrid_decode_matches(model_type, tp, dcp):
    model, prog = program(model_type, tp, dcp, "decode")
    assert {la for _, la in prog.facts.recurrent_layout} == {
        f"replicated (tp={tp} does not divide the 2 key heads)"}
    assert_decode_matches(model, prog, f"{model_type} tp={tp} dcp={dcp}")


@pytest.mark.parametrize("model_type,tp,dcp", cases((TYPE,), set(), FULL))
@pytest.mark.parametrize("chunks", [1, 2], ids=["one-chunk", "two-chunks"])
def test_olmo_hybrid_prefill_matches(model_type, tp, dcp, chunks):
    assert_prefill_matches(*program(model_type, tp, dcp, "prefill"), chunks,
                           f"{model_type} tp={tp} dcp={dcp}")
