"""RecurrentGemma as a hybrid (docs/hybrid.md, "RecurrentGemma"): its RG-LRU as ``dcp.rg_lru``
(runtime/kernels/rg_lru.py), its block's Conv1d as ``dcp.short_conv``, the
RecurrentGemmaRecurrentBlock swap (module_recurrent.RULES), and its programs against the
model's own forward.

- the op against transformers' own ``RecurrentGemmaRglru`` (fp32, 1e-5) on rows of lengths
  8, 5, 3 and a padding row, its state against the module's, chunk by chunk through the
  state cache; the swapped block against the module's own forward, chunk by chunk;
- the tiny model (tests/support/hybrid_configs.py: recurrent / local attention alternating,
  a window of 4 that the prompts of 8 and the decode steps pass, a logits soft-cap of 5):
  decode and prefill (one and two chunks) at tp=4/dcp=2 and tp=8/dcp=4 against its own
  forward (1e-4, greedy tokens equal), the block cut by its 8 heads over TP (the state 1/tp
  per rank, one all-reduce per recurrent layer in decode); speculative decode is in
  test_hybrid_hspec.py;
- the mutation: the RG-LRU reading a zero state instead of the carried one leaves the model's
  logits (the program tests can fail).

The slice (default run): the op and block tests and the mutation, on the one program of the
default run: the speculative (width-3) decode program at tp=4/dcp=2, whose cell is
test_hybrid_hspec.py's (it runs the context step and verification steps against the model's
own forward, a rejected draft rolling the state back); ``DCP_HYBRID_FULL=1``: the six
program cells here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dcp_compile.frontends.module_recurrent import (allocate_states,  # noqa: E402
                                                    recurrent_as_ops, recurrent_layers)
from dcp_compile.passes.op_classes import RECURRENT_OPS  # noqa: E402
from dcp_compile.runtime.kernels import rg_lru as rg_lru_kernel  # noqa: E402
from full_runs import full  # noqa: E402
from hybrid_runs import (LAYOUTS, assert_decode_matches,  # noqa: E402
                         assert_prefill_matches, model_of, program)

FULL = full("DCP_HYBRID_FULL")
TYPE = "recurrent_gemma"
OP_TOL = 1e-5


def _block(layer: int = 0):
    return model_of(TYPE).model.layers[layer].temporal_block


def _rows():
    """Rows of lengths 8, 5, 3 (slots 0, 1, 2) and a padding row (slot -1); slot 3 is no
    row's. Returns (x [4, 8, W], state_slot, lengths)."""
    g = torch.Generator().manual_seed(3)
    width = model_of(TYPE).config.lru_width
    return (torch.randn(4, 8, width, generator=g), torch.tensor([0, 1, 2, -1]),
            torch.tensor([8, 5, 3, 0]))


def _op(lru, x, cache, slot, fresh, lengths):
    return torch.ops.dcp.rg_lru(x, lru.input_gate_weight, lru.input_gate_bias,
                                lru.recurrent_gate_weight, lru.recurrent_gate_bias,
                                lru.recurrent_param, cache, slot, fresh, lengths)


@torch.no_grad()
def test_rg_lru_is_the_models_own_rglru():
    """dcp.rg_lru from a fresh start equals transformers' RecurrentGemmaRglru (its gates, the
    reset at position 0, its scan) on each row alone, outputs and end state; padding tokens
    give zeros, the padding row writes the garbage slot only, a slot no row names keeps its
    bytes; the rows continued chunk by chunk (3 + 5) through the cache equal the whole."""
    lru = _block().rg_lru
    x, slot, lengths = _rows()
    cache = torch.randn(5, x.shape[-1])                      # stale bytes in every slot
    fresh = torch.ones(4, dtype=torch.bool)
    y, state = _op(lru, x, cache, slot, fresh, lengths)
    for b, n in enumerate(lengths.tolist()[:3]):
        lru.recurrent_states = None
        want = lru(x[b:b + 1, :n], torch.arange(n)[None])
        assert (y[b, :n] - want[0]).abs().max() < OP_TOL
        assert (state[b] - lru.recurrent_states[0]).abs().max() < OP_TOL
        assert not y[b, n:].any()                            # padding tokens: zeros
    lru.recurrent_states = None
    assert not y[3].any()
    assert torch.equal(state[3], cache[3])                   # no row's slot: untouched
    assert not torch.equal(state[4], cache[4])               # the padding row's garbage slot
    cut = 3
    first, mid = _op(lru, x[:, :cut], cache, slot, fresh, lengths.clamp(max=cut))
    second, end = _op(lru, x[:, cut:], mid, slot, torch.zeros(4, dtype=torch.bool),
                      (lengths - cut).clamp(min=0))
    assert (torch.cat([first, second], 1) - y).abs().max() < OP_TOL
    assert (end[:3] - state[:3]).abs().max() < OP_TOL


@pytest.mark.parametrize("chunks", [[8], [3, 5], [1, 1, 1, 1, 4]],
                         ids=["whole", "3+5", "decode-steps"])
@torch.no_grad()
def test_the_swapped_block_is_the_models_own_recurrent_block(chunks):
    """RecurrentGemmaRecurrentBlock with its Conv1d and RG-LRU as dcp.short_conv and
    dcp.rg_lru, run chunk by chunk with the state carried in its slots (rows of lengths 8, 5,
    3 in one batch), equals the module's own forward over the whole sequence (fp32, 1e-5)."""
    model, block = model_of(TYPE), _block()
    g = torch.Generator().manual_seed(4)
    lengths = [8, 5, 3]
    h = torch.randn(3, 8, model.config.hidden_size, generator=g)
    states = allocate_states(model, num_slots=3)
    with recurrent_as_ops(model, states):
        outs, start = [], 0
        for c in chunks:
            ln = [max(0, min(n - start, c)) for n in lengths]
            states.step([0, 1, 2], [start == 0] * 3, ln)
            pos = torch.arange(start, start + c).expand(3, c)
            outs.append(block(h[:, start:start + c], pos, None)[0])
            start += c
    got = torch.cat(outs, 1)
    for b, n in enumerate(lengths):
        want = block(h[b:b + 1, :n], torch.arange(n)[None], None, use_cache=False)[0][0]
        err = (got[b, :n] - want).abs().max()
        assert err < OP_TOL, (chunks, b, float(err))


def test_the_block_is_found_at_its_layer_and_its_state_is_conv_and_h():
    """The block keeps no layer index: it is the decoder layer's its path runs through; its
    state is the conv's last conv1d_width - 1 inputs and h, [lru_width] each."""
    from dcp_compile.frontends.hf_config import attention_windows
    from dcp_compile.frontends.module_recurrent import state_spec
    model = model_of(TYPE)
    kinds = model.config.layers_block_type
    assert [m.layer_idx for _, m, _ in recurrent_layers(model)] == \
        [i for i, k in enumerate(kinds) if k == "linear_attention"] == [0, 2]
    W, K = model.config.lru_width, model.config.conv1d_width
    assert {(s.conv, s.rec) for s in state_spec(model, 2).layers} == {((W, K - 1), (W,))}
    assert attention_windows(model) == [4, 4]                # the local attention layers


def _cases():
    out = []
    for mode, chunks in (("decode", 1), ("prefill", 1), ("prefill", 2)):
        for tp, dcp in LAYOUTS:
            out.append(pytest.param(
                mode, chunks, tp, dcp, id=f"{mode}x{chunks}-tp{tp}-dcp{dcp}",
                marks=() if FULL else pytest.mark.skip(reason="DCP_HYBRID_FULL=1 runs it")))
    return out


@pytest.mark.parametrize("mode,chunks,tp,dcp", _cases())
def test_program_matches_the_models_own_forward(mode, chunks, tp, dcp):
    """Decode: the prompts (1, 5, 8 tokens) through the context step, then 6 greedy decode
    steps past the window of 4; prefill: the chunk's tokens split over the ranks, the second
    chunk continuing each row's state. Logits (soft-capped) within 1e-4 of the model's own
    forward, greedy tokens equal; cut by heads (``_check_head_cut``)."""
    model, prog = program(TYPE, tp, dcp, mode)
    label = f"{TYPE} tp={tp} dcp={dcp}"
    if mode == "decode":
        assert_decode_matches(model, prog, label)
    else:
        assert_prefill_matches(model, prog, chunks, label)
    _check_head_cut(model, prog, tp, mode)


def _check_head_cut(model, prog, tp, mode):
    """Both ops of each recurrent layer cut by heads (the 8 heads over tp=4 or 8): the facts
    say so, each rank holds 1/tp of the state, and a layer costs one all-reduce in decode
    (its linear_out row-parallel), one all-gather and one reduce-scatter in prefill."""
    from dcp_compile.frontends.module_recurrent import state_spec
    from test_hybrid_program import _mixer_collectives
    gm = prog.graphs[mode]
    ops = [n.target for n in gm.graph.nodes
           if n.op == "call_function" and n.target in RECURRENT_OPS]
    assert ops == [torch.ops.dcp.short_conv.default, torch.ops.dcp.rg_lru.default] * 2
    assert prog.facts.windows == (4, 4)
    assert prog.facts.recurrent_layout == tuple(
        (f"step.model.model.layers.{i}.temporal_block", "head cut") for i in (0, 2))
    spec, whole = prog.state_spec(), state_spec(model, prog.state_spec().num_slots)
    assert spec.tp == tp and spec.bytes_per_rank() * tp == whole.bytes_per_rank()
    per_op = ([], ["all_reduce@tp"]) if mode == "decode" else \
        (["all_gather_into_tensor@world"], ["reduce_scatter_tensor@world"])
    assert _mixer_collectives(gm) == [per_op] * 4


@pytest.mark.parametrize("heads,tp,layout", [
    (8, 4, "head cut"), (8, 8, "head cut"), (8, 1, "replicated (tp=1)"),
    (2, 4, "replicated (tp=4 does not divide the RG-LRU's 2 heads)")])
def test_the_block_is_cut_by_heads_where_tp_divides_them(heads, tp, layout):
    """The layout rule (rg_lru_cut, read by the placement analysis and the state cache): a
    rank holds whole heads, else the block runs replicated with the reason."""
    from dcp_compile.frontends.module_recurrent import recurrent_layout
    from hybrid_configs import build_hybrid
    model = build_hybrid(TYPE, num_attention_heads=heads, num_key_value_heads=1)
    assert set(recurrent_layout(model, tp).values()) == {layout}


def test_a_wrong_state_carry_leaves_the_models_logits(monkeypatch):
    """The mutation: the RG-LRU reads a zero state for every row (the carried h dropped
    between steps). The speculative decode program's logits then leave the model's own (the
    program tests can fail); unmutated, the same program matches (test_hybrid_hspec.py's
    slice). The program is cut by heads as the program cells' are."""
    from test_hybrid_hspec import _program as spec_program, _prompts, _speculative
    model, prog = spec_program(TYPE, 4, 2)
    _check_head_cut(model, prog, 4, "decode")
    monkeypatch.setattr(rg_lru_kernel, "_read_state",
                        lambda cache, rows, fresh, usable: torch.zeros_like(cache[rows]))
    report = _speculative(model, prog, _prompts())
    assert not report.ok and report.max_abs_error > 1e-2, report
    print(f"{TYPE} without the carried h: max |logit error| {report.max_abs_error:.1e}")
