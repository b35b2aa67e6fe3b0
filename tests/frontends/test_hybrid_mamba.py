"""The other Mamba hybrids (docs/hybrid.md, "The other Mamba hybrids"): ``transform()`` of the
tiny Nemotron-H, Falcon-H1, Zamba2, Jamba and Zamba models of tests/support/hybrid_configs.py
gives a program whose decode (the prompts through the context step, then decode steps, a
batch of mixed lengths 1, 5, 8) and prefill under sequence parallelism (one and two chunks)
match the model's own forward (fp32, 1e-4, greedy tokens equal) on a threaded world, or a
``DCPHybridError`` naming the limit.

The slice (default run): one cheap cell per family. ``DCP_HYBRID_FULL=1``: every family x
tp=4/dcp=2 and tp=8/dcp=4 x decode, prefill in one chunk and in two.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import dcp_compile  # noqa: E402
from dcp_compile.passes.op_classes import RECURRENT_OPS  # noqa: E402
from full_runs import full  # noqa: E402
from hybrid_runs import (LAYOUTS, assert_decode_matches,  # noqa: E402
                         assert_prefill_matches, model_of as _model, program as _program)

FULL = full("DCP_HYBRID_FULL")

# family -> its cell in the default run: (mode, tp, dcp, chunks)
FAMILIES = {
    "nemotron_h": ("decode", 4, 2, 1),
    "falcon_h1": ("prefill", 4, 2, 2),
    "zamba2": ("prefill", 4, 2, 1),
    "jamba": ("prefill", 4, 2, 2),
    "zamba": ("prefill", 4, 2, 1),
}


def _cases():
    """(model type, mode, chunks, tp, dcp) of the full matrix; each family's slice cell
    always runs."""
    out = []
    for t, cell in FAMILIES.items():
        for mode, chunks in (("decode", 1), ("prefill", 1), ("prefill", 2)):
            for tp, dcp in LAYOUTS:
                run = FULL or (mode, tp, dcp, chunks) == cell
                out.append(pytest.param(
                    t, mode, chunks, tp, dcp, id=f"{t}-{mode}x{chunks}-tp{tp}-dcp{dcp}",
                    marks=() if run else pytest.mark.skip(reason="DCP_HYBRID_FULL=1 runs it")))
    return out


@pytest.mark.parametrize("model_type,mode,chunks,tp,dcp", _cases())
def test_program_matches_the_models_own_forward(model_type, mode, chunks, tp, dcp):
    """Decode: the prompts through the context step, then 6 greedy decode steps, every
    step's logits within 1e-4 of the model's own forward over the whole sequence. Prefill:
    the chunk's tokens split over the ranks, every real token's logits; with two chunks the
    second continues each row's state from its slot (cut at unaligned places)."""
    model, program = _program(model_type, tp, dcp, mode)
    label = f"{model_type} tp={tp} dcp={dcp}"
    if mode == "decode":
        assert_decode_matches(model, program, label)
    else:
        assert_prefill_matches(model, program, chunks, label)
    ops = [n for n in program.graphs[mode].graph.nodes
           if n.op == "call_function" and n.target in RECURRENT_OPS]
    per_layer = 2 if model_type in ("jamba", "zamba") else 1   # Mamba-1: conv, then scan
    assert len(ops) == per_layer * len(program.state_spec().layers) > 0


def test_nemotron_h_attends_in_its_attention_blocks_only():
    """Nemotron-H's pattern has MLP-only blocks: the attention layers the cache insertion
    counts are its attention blocks (module_recurrent.ATTENTION_LAYERS), not every block
    without a Mamba2 mixer."""
    from dcp_compile.frontends.hf_config import attention_windows
    from dcp_compile.frontends.module_recurrent import recurrent_layers
    model = _model("nemotron_h")
    kinds = model.config.layers_block_type
    assert len(attention_windows(model)) == kinds.count("full_attention") == 2
    assert [m.layer_idx for _, m, _ in recurrent_layers(model)] == \
        [i for i, k in enumerate(kinds) if k == "linear_attention"]


@pytest.mark.parametrize("model_type", ["zamba2", "zamba"])
def test_a_shared_attention_block_has_a_kv_cache_per_calling_layer(model_type):
    """Zamba2's and Zamba's hybrid layers call one shared attention block (tied weights):
    each call site is its own attention layer with its own KV cache (the layer index the
    model passes), and the tied weights are cut alike at both sites (one placement per
    parameter)."""
    from dcp_compile.frontends.hf_config import attention_windows
    model = _model(model_type)
    first, second = (model.model.layers[i].shared_transf for i in (1, 3)) \
        if model_type == "zamba" else \
        (model.model.layers[i].shared_transformer for i in (1, 3))
    assert first.self_attn.q_proj.weight is second.self_attn.q_proj.weight
    hybrid = [i for i, k in enumerate(model.config.layers_block_type) if k == "hybrid"]
    assert len(attention_windows(model)) == len(hybrid) == 2
    _, program = _program(model_type, 4, 2, "decode")
    assert program.cache_spec().num_layers == 2


def test_mamba_ssm_is_the_models_own_selective_scan():
    """dcp.mamba_ssm from a zero state equals Jamba's own slow scan (transformers'
    ``mamba_selective_scan``, the sequential path, D skip, no gate), rows of lengths 8, 5,
    3 padded; the scan continued chunk by chunk (3 + 5) through the state cache equals the
    whole sequence at once, and the state equals the one the model's scan returns."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan
    g = torch.Generator().manual_seed(3)
    Bsz, S, D, N = 3, 8, 6, 4
    x, dt = torch.randn(Bsz, S, D, generator=g), torch.randn(Bsz, S, D, generator=g)
    B, C = torch.randn(Bsz, S, N, generator=g), torch.randn(Bsz, S, N, generator=g)
    A_log, Dskip = torch.randn(D, N, generator=g) * 0.5, torch.randn(D, generator=g)
    dt_bias = torch.randn(D, generator=g)
    lengths = torch.tensor([8, 5, 3])
    slots = torch.arange(Bsz)
    cache = torch.zeros(Bsz + 1, D, N)
    op = torch.ops.dcp.mamba_ssm
    y, state = op(x, dt, A_log, B, C, Dskip, dt_bias, cache, slots,
                  torch.ones(Bsz, dtype=torch.bool), lengths)
    for b, n in enumerate(lengths.tolist()):
        want, want_state = mamba_selective_scan(
            x[b:b + 1, :n].transpose(1, 2), dt[b:b + 1, :n].transpose(1, 2),
            -torch.exp(A_log), B[b:b + 1, :n].transpose(1, 2), C[b:b + 1, :n].transpose(1, 2),
            D=Dskip, delta_bias=dt_bias, delta_softplus=True, return_last_state=True)
        assert (y[b, :n] - want[0].T).abs().max() < 1e-5
        assert (state[b] - want_state[0]).abs().max() < 1e-5
        assert not y[b, n:].any()                            # padding tokens: zeros
    assert state[Bsz].abs().max() == 0                       # the garbage slot: untouched
    cut = 3
    first, mid = op(x[:, :cut], dt[:, :cut], A_log, B[:, :cut], C[:, :cut], Dskip, dt_bias,
                    cache, slots, torch.ones(Bsz, dtype=torch.bool), lengths.clamp(max=cut))
    second, end = op(x[:, cut:], dt[:, cut:], A_log, B[:, cut:], C[:, cut:], Dskip, dt_bias,
                     mid, slots, torch.zeros(Bsz, dtype=torch.bool),
                     (lengths - cut).clamp(min=0))
    assert (torch.cat([first, second], 1) - y).abs().max() < 1e-5
    assert (end - state).abs().max() < 1e-5
