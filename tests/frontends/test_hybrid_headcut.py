"""The recurrent mixers cut by heads over TP (docs/hybrid.md, "The layout"): Gated DeltaNet
(Qwen3-Next, Qwen3.5 dense and MoE) by key heads, Mamba2 (Bamba, Granite-4-H, Nemotron-H,
Falcon-H1, Zamba2) by groups. Decode and prefill of the head-cut variants of the tiny hybrids
(``HEAD_CUT_SIZES``: 8 key heads / 8 groups) match the model's own forward (fp32, 1e-4,
greedy tokens equal); each rank holds 1/tp of the state (``state_spec``); a recurrent layer
costs one all-reduce in decode (its output projection row-parallel), one all-gather and one
reduce-scatter in prefill; which layout each tiny hybrid gets is asserted, with the reason
for the replicated ones.

The slice (default run): Qwen3.5 decode at tp=4/dcp=2 (its state bytes, collectives and
layout facts), the layout table. ``DCP_HYBRID_FULL=1``: every family x tp=4/dcp=2 and
tp=8/dcp=4, decode and prefill in one and two chunks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dcp_compile  # noqa: E402
from dcp_compile import verify  # noqa: E402
from dcp_compile.frontends.module_recurrent import recurrent_layout, state_spec  # noqa: E402
from dcp_compile.frontends.ordinary import FullForwardReference  # noqa: E402
from dcp_compile.passes.op_classes import RECURRENT_OPS  # noqa: E402
from full_runs import full  # noqa: E402
from hybrid_configs import HEAD_CUT_SIZES, build_hybrid  # noqa: E402
from hybrid_runs import (BLOCK, LAYOUTS, SHAPES, STEPS, TOL,  # noqa: E402
                         prompts as _prompts)
from test_hybrid_program import _mixer_collectives  # noqa: E402

FULL = full("DCP_HYBRID_FULL")
CUT_TYPES = tuple(HEAD_CUT_SIZES)
SLICE = {("qwen3_5_text", 4, 2, "decode")}

_PROGRAMS: dict = {}


def _program(model_type: str, tp: int, dcp: int, mode: str):
    key = (model_type, tp, dcp, mode)
    if key not in _PROGRAMS:
        model = build_hybrid(model_type, **HEAD_CUT_SIZES[model_type])
        _PROGRAMS[key] = model, dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode,
                                                      block_size=BLOCK, shapes=SHAPES,
                                                      check=False)
    return _PROGRAMS[key]


def _cases(mode):
    return [pytest.param(t, tp, dcp, id=f"{t}-tp{tp}-dcp{dcp}",
                         marks=() if (t, tp, dcp, mode) in SLICE or FULL else
                         pytest.mark.skip(reason="DCP_HYBRID_FULL=1 runs it"))
            for t in CUT_TYPES for tp, dcp in LAYOUTS]


def _check_cut(model, program, tp):
    """Every mixer cut (the facts say so), the state 1/tp per rank, the ops' head counts the
    rank's."""
    layout = program.facts.recurrent_layout
    assert layout and all(la == "head cut" for _, la in layout), layout
    spec, whole = program.state_spec(), state_spec(model, SHAPES.batch)
    assert spec.tp == tp
    assert spec.bytes_per_rank() * tp == whole.bytes_per_rank()
    for la, w in zip(spec.layers, whole.layers):
        conv, rec = spec.shapes(la)
        assert conv[1] * tp == w.conv[0] and rec[1] * tp == w.rec[0], (la, w)


@pytest.mark.parametrize("model_type,tp,dcp", _cases("decode"))
def test_head_cut_decode_matches_the_models_own_forward(model_type, tp, dcp):
    model, program = _program(model_type, tp, dcp, "decode")
    _check_cut(model, program, tp)
    report = verify.verify(FullForwardReference(model), program, _prompts(), steps=STEPS,
                           atol=TOL)
    assert report.ok and report.tokens_agree, report
    print(f"{model_type} head cut tp={tp} dcp={dcp} decode: max |logit error| "
          f"{report.max_abs_error:.1e}")


@pytest.mark.parametrize("model_type,tp,dcp", _cases("prefill"))
@pytest.mark.parametrize("chunks", [1, 2], ids=["one-chunk", "two-chunks"])
def test_head_cut_prefill_matches_the_models_own_forward(model_type, tp, dcp, chunks):
    model, program = _program(model_type, tp, dcp, "prefill")
    _check_cut(model, program, tp)
    prompts = _prompts()
    plan = [prompts] if chunks == 1 else verify.chunk_plan_of(prompts, chunks)
    report = verify.verify_prefill(FullForwardReference(model), program, plan, atol=TOL,
                                   check_cache=False)
    assert report.ok and report.tokens_agree, report
    print(f"{model_type} head cut tp={tp} dcp={dcp} prefill x{chunks}: max |logit error| "
          f"{report.max_abs_error:.1e}")


def test_a_cut_recurrent_layer_costs_one_all_reduce_in_decode():
    """Decode: nothing before the op (its input projections column-parallel on the layer's
    replicated input), one all-reduce after it (the row-parallel output projection); the
    op's head count and its state caches the rank's."""
    model, program = _program("qwen3_5_text", 4, 2, "decode")
    _check_cut(model, program, 4)
    for kind, gm in program.graphs.items():
        per_layer = _mixer_collectives(gm)
        assert per_layer == [([], ["all_reduce@tp"])] * 2, (kind, per_layer)
        ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in RECURRENT_OPS]
        assert [op.args[9] for op in ops] == [8 // 4] * 2             # key heads per rank
        assert [tuple(op.args[5].meta["val"].shape[1:2]) for op in ops] == [(16 // 4,)] * 2


@pytest.mark.skipif(not FULL, reason="DCP_HYBRID_FULL=1 runs it")
def test_a_cut_recurrent_layer_costs_a_gather_and_a_reduce_scatter_in_prefill():
    """Prefill: the layer's input all-gathered over the sequence-parallel group, the output
    projection's pending sum reduce-scattered back to the rank's tokens."""
    _, program = _program("bamba", 4, 2, "prefill")
    per_layer = _mixer_collectives(program.graphs["prefill"])
    assert per_layer == [(["all_gather_into_tensor@world"],
                          ["reduce_scatter_tensor@world"])] * 2, per_layer


# -- which layout each tiny hybrid gets ------------------------------------------------------

GDN_KEYS = "replicated (tp=4 does not divide the 2 key heads)"
GROUPS = ("replicated (tp=4 does not divide the 2 groups (B, C and the gated norm are per "
          "group))")
LAYOUT_AT_TP4 = {
    "qwen3_next": GDN_KEYS, "qwen3_5_text": GDN_KEYS, "qwen3_5_moe_text": GDN_KEYS,
    "olmo_hybrid": GDN_KEYS,
    "bamba": GROUPS, "granitemoehybrid": GROUPS, "nemotron_h": GROUPS, "falcon_h1": GROUPS,
    "zamba2": GROUPS,
    "lfm2": "replicated (its op has no head cut)",
    "lfm2_moe": "replicated (its op has no head cut)",
    "kimi_linear": "replicated (its op has no head cut)",
    "bailing_hybrid": "replicated (its op has no head cut)",
    "minimax": "replicated (its op has no head cut)",
    "jamba": "replicated (its op has no head cut)",
    "zamba": "replicated (its op has no head cut)",
    # its 8 heads: cut at tp=4 (test_hybrid_rglru.py runs its programs)
    "recurrent_gemma": "head cut",
}


@pytest.mark.parametrize("model_type", sorted(LAYOUT_AT_TP4))
def test_each_tiny_hybrid_gets_its_layout(model_type):
    """The tiny configs at tp=4: replicated, with the reason; their head-cut variants cut at
    tp=4 and tp=8, replicated at tp=1."""
    model = build_hybrid(model_type)
    layout = set(recurrent_layout(model, 4).values())
    assert layout == {LAYOUT_AT_TP4[model_type]}, layout
    if model_type in HEAD_CUT_SIZES:
        cut = build_hybrid(model_type, **HEAD_CUT_SIZES[model_type])
        for tp in (4, 8):
            assert set(recurrent_layout(cut, tp).values()) == {"head cut"}
        assert set(recurrent_layout(cut, 1).values()) == {"replicated (tp=1)"}


def test_the_default_tiny_hybrid_program_says_it_runs_replicated():
    """No silent difference: the program of the tiny LFM2 (no head cut) lists every mixer
    replicated with the reason, and its state whole on every rank."""
    from test_hybrid_program import _program as plain_program
    _, program = plain_program("lfm2", 4, 2, "decode")
    assert {la for _, la in program.facts.recurrent_layout} == {LAYOUT_AT_TP4["lfm2"]}
    assert program.state_spec().tp == 1


def test_every_head_cut_rule_is_the_frontends():
    """The op rule (passes/placement/recurrent.py, HEAD_CUTS) and the mixer rules
    (module_recurrent.RULES' ``cut``) agree: every family whose op has a head cut has a cut
    function, so the program's state cache and the ops' layout cannot differ."""
    from dcp_compile.frontends.module_recurrent import RULES
    from dcp_compile.passes.placement.recurrent import HEAD_CUTS
    cut_ops = {op._opname for op in HEAD_CUTS}
    assert cut_ops == {"gated_delta_net", "mamba2_ssm", "rg_lru", "short_conv"}
    with_cut = {r.cls for r in RULES if r.cut is not None}
    assert with_cut == {"Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet",
                        "Qwen3_5MoeGatedDeltaNet", "OlmoHybridGatedDeltaNet", "BambaMixer", "GraniteMoeHybridMambaLayer",
                        "NemotronHMamba2Mixer", "FalconH1Mixer", "Zamba2MambaMixer",
                        "RecurrentGemmaRecurrentBlock"}


# -- a cut program as a file, speculative decode and prefix caching ----------------------------

def test_a_saved_and_reloaded_head_cut_program_keeps_its_layout(tmp_path):
    """program.save / load_program: the loaded head-cut program lists the same state spec
    (tp-cut) and layout facts, and decodes as the model does."""
    from dcp_compile.runtime.program.program_file import load_program
    model, program = _program("qwen3_5_text", 4, 2, "decode")
    program.save(tmp_path / "cut.dcp")
    loaded = load_program(tmp_path / "cut.dcp")
    assert loaded.state_spec() == program.state_spec() and loaded.state_spec().tp == 4
    assert loaded.facts.recurrent_layout == program.facts.recurrent_layout
    report = verify.verify(FullForwardReference(model), loaded, _prompts(), steps=2, atol=TOL)
    assert report.ok and report.tokens_agree, report


@pytest.mark.skipif(not FULL, reason="DCP_HYBRID_FULL=1 runs it")
@pytest.mark.parametrize("model_type", ["bamba", "qwen3_5_text"])
def test_head_cut_speculative_decode_and_prefix_caching(model_type, monkeypatch):
    """test_hybrid_hspec.py's speculative decode (drafts partly rejected: the snapshots of a
    rank's heads roll back) and prefix-cache hit (a checkpoint of a rank's heads resumed) on
    the head-cut variants at tp=4/dcp=2."""
    import test_hybrid_hspec as hspec
    monkeypatch.setattr(hspec, "build_hybrid",
                        lambda t: build_hybrid(t, **HEAD_CUT_SIZES[t]))
    monkeypatch.setattr(hspec, "_PROGRAMS", {})
    monkeypatch.setattr(hspec, "_CKPT_PROGRAMS", {})
    hspec.test_speculative_decode_matches_greedy_with_drafts_partly_rejected(model_type, 4, 2)
    hspec.test_prefix_cache_hit_resumes_from_the_state_checkpoint(model_type, 4, 2)
    for _, program in (*hspec._PROGRAMS.values(), *hspec._CKPT_PROGRAMS.values()):
        assert program.state_spec().tp == 4
        assert {la for _, la in program.facts.recurrent_layout} == {"head cut"}
