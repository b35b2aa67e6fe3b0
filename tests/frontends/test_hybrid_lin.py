"""Linear-attention hybrids (docs/hybrid.md, "Linear-attention hybrids"): prefill under
sequence parallelism of Qwen3-Next and Qwen3.5 (dense, MoE), whose gated attention's output
gate is computed again on the O projection's tokens (passes/dcp_prefill.py,
``LayerPlan.o_recomputed``), against the model's own forward (fp32, 1e-4, greedy tokens
equal, prompts of 1, 5 and 8 tokens, one chunk and two cut at unaligned places).

And LFM2-MoE (its experts as dcp.moe), Kimi Linear and Bailing-hybrid (Kimi Delta
Attention as ``dcp.kimi_delta_attention``, MLA beside it) and MiniMax (lightning attention as
``dcp.lightning_attention``), decode and prefill.

The slice (default run): Qwen3.5 (dense) prefill in two chunks, LFM2-MoE, Kimi Linear and
MiniMax decode at tp=4/dcp=2, the lightning mixer's chunks, the KDA op against transformers'
own, the gate's graph test, the experts' activation and Bailing-hybrid's gate lookups (its
programs: full run only);
``DCP_HYBRID_FULL=1``: every family here x tp=4/dcp=2 and tp=8/dcp=4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import dcp_compile  # noqa: E402
from dcp_compile import verify  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402
from full_runs import full  # noqa: E402
from hybrid_runs import (TOL, assert_decode_matches,  # noqa: E402
                         assert_prefill_matches, cases, collectives,
                         program as _program)

FULL = full("DCP_HYBRID_FULL")


def _cases(types, slice_):
    return cases(types, slice_, FULL)


QWEN_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def _prefill_cases(types, slice_):
    """(model type, tp, dcp, chunks) of the full matrix; ``slice_``'s (two chunks: the first
    one's path and the continued state's) always run."""
    return [pytest.param(*p.values, chunks, id=f"{p.id}-x{chunks}",
                         marks=() if chunks == 2 and not p.marks else
                         pytest.mark.skipif(not FULL, reason="DCP_HYBRID_FULL=1 runs it"))
            for p in _cases(types, slice_) for chunks in (1, 2)]


@pytest.mark.parametrize("model_type,tp,dcp,chunks",
                         _prefill_cases(QWEN_TYPES, {("qwen3_5_text", 4, 2)}))
def test_qwen_prefill_under_sequence_parallelism_matches(model_type, tp, dcp, chunks):
    """Prefill of the Gated DeltaNet hybrids: every real token's logits within 1e-4 of the
    model's own forward; with two chunks the second continues each row's state from its
    slot and reads the first chunk's KV from the DCP shards."""
    assert_prefill_matches(*_program(model_type, tp, dcp, "prefill"), chunks,
                           f"{model_type} tp={tp} dcp={dcp}")


def _collectives(gm) -> list[str]:
    return collectives(gm.graph.nodes)


def test_the_output_gate_is_computed_on_the_o_tokens_without_a_collective():
    """A model whose q projection carries an output gate ([q ; gate] rows) has, in prefill,
    the same collectives as the one without the gate: the gate is computed again from the
    hidden state at the O projection's S/W tokens (q_proj run a second time there), not
    gathered; and it matches the model's own forward over two unaligned chunks."""
    from model_grammar import SHARDING_CASES, build
    from dataclasses import replace

    spec, tp, dcp = SHARDING_CASES["q-output-gate"]
    shapes = StepShapes.fitting(2, 16, 40, block_size=8, dcp=dcp)
    programs = {}
    for gate in ("rows", "per_head", "none"):
        model = build(replace(spec, q_gate=gate))
        programs[gate] = model, dcp_compile.transform(model, tp=tp, dcp=dcp, mode="prefill",
                                                      block_size=8, shapes=shapes,
                                                      check=False)
    plain = _collectives(programs["none"][1].graphs["prefill"])
    for gate in ("rows", "per_head"):
        model, program = programs[gate]
        gm = program.graphs["prefill"]
        assert _collectives(gm) == plain, gate
        sigmoids = [n for n in gm.graph.nodes if n.target == torch.ops.aten.sigmoid.default]
        assert len(sigmoids) == model.num_layers, gate    # the owned-token copy erased
        report = verify.verify_prefill(model, program,
                                       [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [7, 2, 5]],
                                       2)
        assert report.ok and report.max_abs_error < TOL, (gate, report)


# -- LFM2-MoE: its experts as dcp.moe ---------------------------------------------------------

@pytest.mark.parametrize("model_type,tp,dcp", _cases(("lfm2_moe",), {("lfm2_moe", 4, 2)}))
def test_lfm2_moe_decode_matches(model_type, tp, dcp):
    """LFM2-MoE's experts (``act_fn = F.silu``, a function, not an activation module) run as
    dcp.moe with SiLU; its sigmoid router with the expert bias stays the model's own. The
    prompts through the context step, then 6 greedy decode steps."""
    assert_decode_matches(*_program(model_type, tp, dcp, "decode"),
                          f"{model_type} tp={tp} dcp={dcp}")


@pytest.mark.parametrize("model_type,tp,dcp,chunks", _prefill_cases(("lfm2_moe",), set()))
def test_lfm2_moe_prefill_matches(model_type, tp, dcp, chunks):
    test_qwen_prefill_under_sequence_parallelism_matches(model_type, tp, dcp, chunks)


def test_an_experts_activation_function_is_read_by_identity():
    """``act_fn`` as a torch function (LFM2-MoE) maps to dcp.moe's activation like an
    activation module does; another function is refused naming it."""
    from types import SimpleNamespace

    from dcp_compile.frontends.huggingface import _default_gate
    from dcp_compile.runtime.errors import DCPTransformError
    from dcp_compile.runtime.kernels.moe import ExpertActivation
    assert _default_gate(SimpleNamespace(act_fn=torch.nn.functional.silu))[0] \
        == ExpertActivation.SILU
    assert _default_gate(SimpleNamespace(act_fn=torch.nn.SiLU()))[0] == ExpertActivation.SILU
    with pytest.raises(DCPTransformError, match="activation tanh is not one dcp.moe computes"):
        _default_gate(SimpleNamespace(act_fn=torch.tanh))


# -- Kimi Linear: Kimi Delta Attention as dcp.kimi_delta_attention, MLA beside it -------------

def test_kda_op_is_the_models_own_recurrence():
    """dcp.kimi_delta_attention with an identity convolution (kernel [0, 0, 0, 1], no
    activation) is the KDA recurrence alone: equal (fp32, 1e-5) to transformers' own
    ``recurrent_kimi_delta_attention`` and ``chunk_kimi_delta_attention`` (l2-normalised q and
    k in the kernel), end state included; rows of lengths 7 and 4 in one batch, the second
    padded, whose padding tokens give zeros and leave its state at token 4's."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kl
    g_ = torch.Generator().manual_seed(0)
    B, S, H, d = 2, 7, 3, 8
    q, k, v = (torch.randn(B, S, H, d, generator=g_) for _ in range(3))
    g = -torch.rand(B, S, H, d, generator=g_)              # log of a decay per key channel
    beta = torch.rand(B, S, H, generator=g_)
    lengths = torch.tensor([7, 4])
    C = 3 * H * d
    conv_w = torch.zeros(C, 4)
    conv_w[:, -1] = 1.0
    mixed = torch.cat([x.reshape(B, S, -1) for x in (q, k, v)], dim=-1)
    out, _, rec = torch.ops.dcp.kimi_delta_attention(
        mixed, g, beta, conv_w, torch.zeros(B + 1, C, 3), torch.zeros(B + 1, H, d, d),
        torch.tensor([0, 1]), torch.tensor([True, True]), lengths, H, d, "identity")
    for fn in (kl.recurrent_kimi_delta_attention, kl.chunk_kimi_delta_attention):
        for b, n in enumerate(lengths.tolist()):
            own, state = fn(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], g=g[b:b + 1, :n],
                            beta=beta[b:b + 1, :n], initial_state=None, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
            assert (out[b, :n] - own[0]).abs().max() < 1e-5, (fn.__name__, b)
            assert (rec[b] - state[0]).abs().max() < 1e-5, (fn.__name__, b)
    assert out[1, 4:].abs().max() == 0


@pytest.mark.parametrize("model_type,tp,dcp", _cases(("kimi_linear",), {("kimi_linear", 4, 2)}))
def test_kimi_linear_decode_matches(model_type, tp, dcp):
    """Kimi Linear (KDA layers as dcp.kimi_delta_attention, MLA layers as DCP attention,
    MoE): the prompts through the context step, then 6 greedy decode steps. Its 4 KDA heads
    run cut by heads at tp=4 (each rank 1/4 of the state; test_hybrid_headcut.py), whole at
    tp=8."""
    from dcp_compile.frontends.module_recurrent import state_spec
    from hybrid_runs import SHAPES
    test_lfm2_moe_decode_matches(model_type, tp, dcp)
    model, program = _program(model_type, tp, dcp, "decode")
    cut = tp if 4 % tp == 0 else 1
    spec = program.state_spec()
    assert spec.tp == cut, spec
    assert spec.bytes_per_rank() * cut == state_spec(model, SHAPES.batch).bytes_per_rank()
    assert {la for _, la in program.facts.recurrent_layout} == (
        {"head cut"} if cut > 1 else {f"replicated (tp={tp} does not divide the 4 heads)"})


@pytest.mark.parametrize("model_type,tp,dcp,chunks", _prefill_cases(("kimi_linear",), set()))
def test_kimi_linear_prefill_matches(model_type, tp, dcp, chunks):
    test_qwen_prefill_under_sequence_parallelism_matches(model_type, tp, dcp, chunks)


# -- Bailing-hybrid: the same KDA, its experts' own gate ---------------------------------------

@pytest.mark.parametrize("model_type,tp,dcp", _cases(("bailing_hybrid",), set()))
def test_bailing_hybrid_decode_matches(model_type, tp, dcp):
    """Bailing-hybrid (KDA with a one-linear output gate, MLA, MoE): its mixer's swap is in
    the default run through tests/frontends/test_hybrid_recurrent.py; the programs here."""
    test_lfm2_moe_decode_matches(model_type, tp, dcp)


@pytest.mark.parametrize("model_type,tp,dcp,chunks", _prefill_cases(("bailing_hybrid",), set()))
def test_bailing_hybrid_prefill_matches(model_type, tp, dcp, chunks):
    test_qwen_prefill_under_sequence_parallelism_matches(model_type, tp, dcp, chunks)


def test_bailing_experts_clamped_gate_is_refused_by_name():
    """Its experts' ``_apply_gate`` is the default gate without ``swiglu_limits``; with a
    limit (a clamp dcp.moe does not compute) it is refused naming the limit."""
    from types import SimpleNamespace

    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridExperts

    from dcp_compile.frontends.module_experts import more_expert_gates
    from dcp_compile.runtime.errors import DCPTransformError
    from dcp_compile.runtime.kernels.moe import ExpertActivation
    gate = more_expert_gates()[BailingHybridExperts._apply_gate]
    assert gate(SimpleNamespace(act_fn=torch.nn.SiLU(), limit=None))[0] == ExpertActivation.SILU
    with pytest.raises(DCPTransformError, match=r"clamps act\(gate\) and up at limit=7.0"):
        gate(SimpleNamespace(act_fn=torch.nn.SiLU(), limit=7.0))


# -- MiniMax: lightning attention as dcp.lightning_attention ----------------------------------

@torch.no_grad()
@pytest.mark.parametrize("chunks", [[8], [3, 5], [1, 1, 1, 1, 4]],
                         ids=["whole", "3+5", "decode-steps"])
def test_lightning_mixer_chunks_carry_the_state(chunks):
    """MiniMax's lightning attention swapped to dcp.lightning_attention, run chunk by chunk
    with the state in each row's slot (rows of 8, 5 and 3 tokens padded in one batch), equals
    the module's own forward over each row's whole sequence (its block form: block_size 4,
    two blocks); the layer has a recurrence cache and no conv cache; a slot no row names
    stays zero."""
    from dcp_compile.frontends.module_recurrent import (allocate_states, recurrent_as_ops,
                                                        recurrent_layers)
    from hybrid_configs import build_hybrid
    model = build_hybrid("minimax")
    _, m, _ = recurrent_layers(model)[0]
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([8, 5, 3])
    B, S, H = 3, 8, model.config.hidden_size
    x = torch.randn(B, S, H, generator=gen)
    want = [m(x[b:b + 1, :n], None, None)[0] for b, n in enumerate(lengths.tolist())]
    states = allocate_states(model, num_slots=4)
    assert m.layer_idx not in states.conv and m.layer_idx in states.rec
    slots, outs, start = [2, 0, 3], [], torch.zeros(B, dtype=torch.int64)
    with recurrent_as_ops(model, states):
        for c in chunks:
            n = (lengths - start).clamp(min=0, max=c)
            chunk = torch.zeros(B, c, H)
            for b in range(B):
                chunk[b, :n[b]] = x[b, start[b]:start[b] + n[b]]
            states.step(slots, start == 0, n)
            out, _ = m(chunk, None, None)
            outs.append([out[b, :n[b]] for b in range(B)])
            start = start + n
    for b in range(B):
        got = torch.cat([o[b] for o in outs])
        assert (got - want[b][0]).abs().max() < TOL, (b, chunks)
    assert states.rec[m.layer_idx][1].abs().max() == 0


@pytest.mark.parametrize("model_type,tp,dcp", _cases(("minimax",), {("minimax", 4, 2)}))
def test_minimax_decode_matches(model_type, tp, dcp):
    """MiniMax (lightning attention as dcp.lightning_attention, full attention, MoE): the
    prompts through the context step, then 6 greedy decode steps."""
    test_lfm2_moe_decode_matches(model_type, tp, dcp)


@pytest.mark.parametrize("model_type,tp,dcp,chunks", _prefill_cases(("minimax",), set()))
def test_minimax_prefill_matches(model_type, tp, dcp, chunks):
    test_qwen_prefill_under_sequence_parallelism_matches(model_type, tp, dcp, chunks)
