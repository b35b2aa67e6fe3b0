"""The recurrent mixers cut by heads over TP (docs/hybrid.md, "The layout"): Gated DeltaNet
(Qwen3-Next, Qwen3.5 dense and MoE) by key heads, Mamba2 (Bamba, Granite-4-H, Nemotron-H,
Falcon-H1, Zamba2) by groups, lightning attention (MiniMax) by heads, its norm over all heads
all-reduced, KDA (Kimi Linear, Bailing-hybrid) by heads, LFM2's short conv by channels. Decode and prefill of the head-cut variants of the tiny hybrids
(``HEAD_CUT_SIZES``: 8 key heads / 8 groups) match the model's own forward (fp32, 1e-4,
greedy tokens equal); each rank holds 1/tp of the state (``state_spec``); a recurrent layer
costs one all-reduce in decode (its output projection row-parallel), one all-gather and one
reduce-scatter in prefill; which layout each tiny hybrid gets is asserted, with the reason
for the replicated ones. The one-group Mamba2 variants (``ONE_GROUP_SIZES``: the real
configs' default for Bamba, Granite-4-H, Falcon-H1 and Zamba2) cut by heads with B and C
whole on every rank, the gated norm's sum of squares all-reduced (one more all-reduce per
layer, of a [tokens, 1] scalar; in prefill over the whole gathered chunk, not the
sequence-parallel stream); dropping that all-reduce makes the prefill mismatch.

The slice (default run): Qwen3.5 decode, one-group Bamba and MiniMax prefill at tp=4/dcp=2
(state bytes, collectives, layout facts, the mutations), LFM2 prefill at tp=8/dcp=4, the
layout table; KDA's slice is test_hybrid_lin.py's Kimi Linear decode at tp=4/dcp=2 (its 4
heads cut, the state 1/4 per rank, asserted there). ``DCP_HYBRID_FULL=1``:
every family and variant x tp=4/dcp=2 and tp=8/dcp=4, decode and prefill in one and two
chunks.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dcp_compile  # noqa: E402
from dcp_compile import verify  # noqa: E402
from dcp_compile.frontends.module_recurrent import (recurrent_layers,  # noqa: E402
                                                    recurrent_layout, state_spec)
from dcp_compile.frontends.ordinary import FullForwardReference  # noqa: E402
from dcp_compile.passes.op_classes import RECURRENT_OPS  # noqa: E402
from dcp_compile.runtime.names import META_NORM_REDUCE  # noqa: E402
from full_runs import full  # noqa: E402
from hybrid_configs import HEAD_CUT_SIZES, ONE_GROUP_SIZES, build_hybrid  # noqa: E402
from hybrid_runs import (BLOCK, LAYOUTS, SHAPES, STEPS, TOL,  # noqa: E402
                         prompts as _prompts)
from test_hybrid_program import _mixer_collectives  # noqa: E402

FULL = full("DCP_HYBRID_FULL")
VARIANTS = {"cut": HEAD_CUT_SIZES, "one-group": ONE_GROUP_SIZES}
CUT_CASES = [(t, v) for v, sizes in VARIANTS.items() for t in sizes]
SLICE = {("qwen3_5_text", "cut", 4, 2, "decode"), ("bamba", "one-group", 4, 2, "prefill"),
         ("minimax", "cut", 4, 2, "prefill"), ("lfm2", "cut", 8, 4, "prefill")}

_PROGRAMS: dict = {}


def _program(model_type: str, tp: int, dcp: int, mode: str, variant: str = "cut"):
    key = (model_type, variant, tp, dcp, mode)
    if key not in _PROGRAMS:
        model = build_hybrid(model_type, **VARIANTS[variant][model_type])
        _PROGRAMS[key] = model, dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode,
                                                      block_size=BLOCK, shapes=SHAPES,
                                                      check=False)
    return _PROGRAMS[key]


def _cases(mode):
    return [pytest.param(t, v, tp, dcp, id=f"{t}-{v}-tp{tp}-dcp{dcp}",
                         marks=() if (t, v, tp, dcp, mode) in SLICE or FULL else
                         pytest.mark.skip(reason="DCP_HYBRID_FULL=1 runs it"))
            for t, v in CUT_CASES for tp, dcp in LAYOUTS]


def _whole_bc(model) -> list[int]:
    """Per recurrent layer, the conv channels a one-group Mamba2 keeps whole on every rank
    (B's and C's, 2·N), read from the mixer itself; 0 for a mixer with several groups."""
    return [2 * m.ssm_state_size if getattr(m, "n_groups", None) == 1 else 0
            for _, m, _ in recurrent_layers(model)]


def _check_cut(model, program, tp, variant="cut"):
    """Every mixer cut (the facts say so), the state 1/tp per rank (one group: but for B's
    and C's conv channels, whole on every rank), the ops' head counts the rank's."""
    layout = program.facts.recurrent_layout
    assert layout and all(la == "head cut" for _, la in layout), layout
    spec, whole = program.state_spec(), state_spec(model, SHAPES.batch)
    assert spec.tp == tp
    bc = _whole_bc(model)
    assert (not any(bc)) if variant == "cut" else all(bc), bc
    if variant == "cut":
        assert spec.bytes_per_rank() * tp == whole.bytes_per_rank()
    for la, w, keep in zip(spec.layers, whole.layers, bc):
        conv, rec = spec.shapes(la)
        assert la.conv_whole == keep, la
        assert (rec is None and w.rec is None) or rec[1] * tp == w.rec[0], (la, w)
        assert (conv is None and w.conv is None) or \
            (conv[1] - keep) * tp == w.conv[0] - keep, (la, w)


@pytest.mark.parametrize("model_type,variant,tp,dcp", _cases("decode"))
def test_head_cut_decode_matches_the_models_own_forward(model_type, variant, tp, dcp):
    model, program = _program(model_type, tp, dcp, "decode", variant)
    _check_cut(model, program, tp, variant)
    report = verify.verify(FullForwardReference(model), program, _prompts(), steps=STEPS,
                           atol=TOL)
    assert report.ok and report.tokens_agree, report
    print(f"{model_type} {variant} tp={tp} dcp={dcp} decode: max |logit error| "
          f"{report.max_abs_error:.1e}")


@pytest.mark.parametrize("model_type,variant,tp,dcp", _cases("prefill"))
@pytest.mark.parametrize("chunks", [1, 2], ids=["one-chunk", "two-chunks"])
def test_head_cut_prefill_matches_the_models_own_forward(model_type, variant, tp, dcp, chunks):
    model, program = _program(model_type, tp, dcp, "prefill", variant)
    _check_cut(model, program, tp, variant)
    prompts = _prompts()
    plan = [prompts] if chunks == 1 else verify.chunk_plan_of(prompts, chunks)
    report = verify.verify_prefill(FullForwardReference(model), program, plan, atol=TOL,
                                   check_cache=False)
    assert report.ok and report.tokens_agree, report
    print(f"{model_type} {variant} tp={tp} dcp={dcp} prefill x{chunks}: max |logit error| "
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


def _norm_reductions(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target == torch.ops._c10d_functional.all_reduce.default
            and n.meta.get(META_NORM_REDUCE)]


@pytest.mark.parametrize("model_type,variant", [("bamba", "one-group"), ("minimax", "cut")])
def test_a_norm_over_all_heads_is_all_reduced_over_the_gathered_chunk_in_prefill(model_type,
                                                                                  variant):
    """Prefill, one group: the layer's input gathered over the sequence-parallel group (every
    rank holds the whole chunk, in order), the norm's sum of squares a [B, S, 1, 1] partial
    all-reduced over world on that whole chunk (token t of every rank is the same token: the
    sum is over heads, never over tokens), then the output projection reduce-scattered back
    to the rank's S_pad/tp tokens. MiniMax's norm over all heads ([B, S, 1]) the same."""
    _, program = _program(model_type, 4, 2, "prefill", variant)
    gm = program.graphs["prefill"]
    per_layer = _mixer_collectives(gm)
    assert per_layer == [(["all_gather_into_tensor@world"],
                          ["all_reduce@world", "reduce_scatter_tensor@world"])] * 2, per_layer
    chunk = SHAPES.context_len
    norms = _norm_reductions(gm)
    assert [tuple(n.args[0].meta["val"].shape)[:3] for n in norms] == [(SHAPES.batch, chunk, 1)] * 2
    assert program.collectives_per_layer("prefill")["all_reduce@world"] == 1.0


def test_a_cut_short_conv_layer_costs_a_gather_and_a_reduce_scatter_in_prefill():
    """LFM2 at tp=8/dcp=4: the layer's input gathered, in_proj column-parallel (three
    segments), the op on the rank's 64/8 channels, out_proj's pending sum reduce-scattered."""
    model, program = _program("lfm2", 8, 4, "prefill")
    _check_cut(model, program, 8)
    gm = program.graphs["prefill"]
    assert _mixer_collectives(gm) == [(["all_gather_into_tensor@world"],
                                       ["reduce_scatter_tensor@world"])] * 2
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in RECURRENT_OPS]
    assert [op.args[0].meta["val"].shape[2] for op in ops] == [64 // 8] * 2


@pytest.mark.skipif(not FULL, reason="DCP_HYBRID_FULL=1 runs it")
def test_a_cut_kda_layer_costs_one_all_reduce_in_decode():
    """Kimi Linear's KDA cut by heads: its projections and the low-rank gates' up halves
    column-parallel, the output projection row-parallel (one all-reduce); its per-head gated
    norm needs none; the op's head count the rank's."""
    model, program = _program("kimi_linear", 8, 4, "decode")
    _check_cut(model, program, 8)
    for kind, gm in program.graphs.items():
        assert _mixer_collectives(gm) == [([], ["all_reduce@tp"])] * 2, kind
        ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in RECURRENT_OPS]
        assert [op.args[9] for op in ops] == [8 // 8] * 2


@pytest.mark.skipif(not FULL, reason="DCP_HYBRID_FULL=1 runs it")
def test_a_one_group_mamba2_layer_costs_two_all_reduces_in_decode():
    """Decode, one group: B and C whole on every rank, the gated norm's sum of squares
    all-reduced ([B, 1, 1, 1] per token), then the output projection's all-reduce."""
    _, program = _program("bamba", 4, 2, "decode", "one-group")
    for kind, gm in program.graphs.items():
        per_layer = _mixer_collectives(gm)
        assert per_layer == [([], ["all_reduce@tp", "all_reduce@tp"])] * 2, (kind, per_layer)
        assert len(_norm_reductions(gm)) == 2, kind


@pytest.mark.parametrize("model_type,variant", [("bamba", "one-group"), ("minimax", "cut")])
def test_a_cut_without_the_norms_all_reduce_does_not_match(model_type, variant):
    """The mutation: the same prefill program with each rank's partial mean of squares used
    as it is (the norm's all-reduce dropped) is caught by the prefill check: a one-group
    Mamba2's gated norm, MiniMax's norm over all heads."""
    model, program = _program(model_type, 4, 2, "prefill", variant)
    graphs = {k: copy.deepcopy(gm) for k, gm in program.graphs.items()}
    for gm in graphs.values():
        norms = _norm_reductions(gm)
        assert norms
        _drop(gm, norms)
    broken = dataclasses.replace(program, graphs=graphs)
    report = verify.verify_prefill(FullForwardReference(model), broken, [_prompts()],
                                   atol=TOL, check_cache=False)
    assert not report.ok, report
    print(f"{model_type} {variant} without the norm's all-reduce: max |logit error| "
          f"{report.max_abs_error:.1e}")


def _drop(gm, collectives) -> None:
    """Each collective's wait replaced by the collective's own input (the rank's partial)."""
    for n in collectives:
        wait, = n.users
        wait.replace_all_uses_with(n.args[0])
        gm.graph.erase_node(wait)
        gm.graph.erase_node(n)
    gm.recompile()


def _out_proj_reductions(gm):
    """The all-reduce after each recurrent mixer's output projection (row-parallel)."""
    from dcp_compile.passes.infra import linears_reached
    out = []
    for op in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in RECURRENT_OPS]:
        out_proj, = linears_reached(list(op.users), lambda x: list(x.users))
        out += [u for u in out_proj.users
                if u.target == torch.ops._c10d_functional.all_reduce.default]
    return out


MUTANT_CASES = [("lfm2", 4, 2), ("kimi_linear", 4, 2), ("minimax", 4, 2), ("qwen3_5_text", 4, 2)]


@pytest.mark.parametrize("model_type,tp,dcp", [
    pytest.param(t, tp, dcp, id=f"{t}-tp{tp}-dcp{dcp}",
                 marks=() if t == "lfm2" or FULL else
                 pytest.mark.skip(reason="DCP_HYBRID_FULL=1 runs it"))
    for t, tp, dcp in MUTANT_CASES])
def test_a_cut_without_the_output_projections_all_reduce_does_not_match(model_type, tp, dcp):
    """The mutation: a cut mixer's output projection is row-parallel (each rank its heads' /
    channels' share of the sum); with its all-reduce dropped in the decode graphs, decode no
    longer matches the model."""
    model, program = _program(model_type, tp, dcp, "decode")
    graphs = {k: copy.deepcopy(gm) for k, gm in program.graphs.items()}
    for gm in graphs.values():
        reductions = _out_proj_reductions(gm)
        assert len(reductions) == 2, reductions
        _drop(gm, reductions)
    broken = dataclasses.replace(program, graphs=graphs)
    report = verify.verify(FullForwardReference(model), broken, _prompts(), steps=2, atol=TOL)
    assert not report.ok, report
    print(f"{model_type} tp={tp} dcp={dcp} without the output projection's all-reduce: max "
          f"|logit error| {report.max_abs_error:.1e}")


# -- which layout each tiny hybrid gets ------------------------------------------------------

GDN_KEYS = "replicated (tp=4 does not divide the 2 key heads)"
GROUPS = ("replicated (tp=4 does not divide the 2 groups (B, C and the gated norm are per "
          "group))")
LAYOUT_AT_TP4 = {
    "qwen3_next": GDN_KEYS, "qwen3_5_text": GDN_KEYS, "qwen3_5_moe_text": GDN_KEYS,
    "olmo_hybrid": GDN_KEYS,
    "bamba": GROUPS, "granitemoehybrid": GROUPS, "nemotron_h": GROUPS, "falcon_h1": GROUPS,
    "zamba2": GROUPS,
    "lfm2": "head cut", "lfm2_moe": "head cut",                    # 64 conv channels
    "kimi_linear": "head cut", "bailing_hybrid": "head cut",       # 4 KDA heads
    "minimax": "head cut",
    "jamba": "replicated (its op has no head cut)",
    "zamba": "replicated (its op has no head cut)",
    # its 8 heads: cut at tp=4 (test_hybrid_rglru.py runs its programs)
    "recurrent_gemma": "head cut",
}


@pytest.mark.parametrize("model_type", sorted(LAYOUT_AT_TP4))
def test_each_tiny_hybrid_gets_its_layout(model_type):
    """The tiny configs at tp=4: replicated, with the reason (but MiniMax's 8 lightning heads
    and Kimi Linear's and Bailing's 4 KDA heads, LFM2's 64 conv channels cut); their head-cut variants cut at tp=4 and tp=8, replicated at tp=1 (and where
    tp does not divide the heads, with that reason)."""
    model = build_hybrid(model_type)
    layout = set(recurrent_layout(model, 4).values())
    assert layout == {LAYOUT_AT_TP4[model_type]}, layout
    for sizes in VARIANTS.values():
        if model_type in sizes:
            cut = build_hybrid(model_type, **sizes[model_type])
            for tp in (4, 8):
                assert set(recurrent_layout(cut, tp).values()) == {"head cut"}
            assert set(recurrent_layout(cut, 1).values()) == {"replicated (tp=1)"}
    if model_type == "minimax":            # 8 lightning heads: tp=16 cannot cut them
        assert set(recurrent_layout(model, 16).values()) == {
            "replicated (tp=16 does not divide the 8 heads)"}
    if model_type in ("lfm2", "lfm2_moe"):                # 64 channels: tp=128 cannot
        assert set(recurrent_layout(model, 128).values()) == {
            "replicated (tp=128 does not divide the 64 channels)"}
    if model_type in ("kimi_linear", "bailing_hybrid"):    # 4 KDA heads: tp=8 cannot
        assert set(recurrent_layout(model, 8).values()) == {
            "replicated (tp=8 does not divide the 4 heads)"}
    if model_type in ONE_GROUP_SIZES:      # one group, 8 heads: tp=16 cannot cut them
        one = build_hybrid(model_type, **ONE_GROUP_SIZES[model_type])
        assert set(recurrent_layout(one, 16).values()) == {
            "replicated (tp=16 does not divide the 8 heads (one group: B and C whole on "
            "every rank, the heads cut))"}


def test_the_default_tiny_hybrid_program_says_it_runs_replicated():
    """No silent difference: the program of the tiny Jamba (Mamba-1: no head cut, its conv
    neither) lists every mixer's ops replicated with the reason, and its state whole on every
    rank."""
    from test_hybrid_program import _program as plain_program
    _, program = plain_program("jamba", 4, 2, "decode")
    layout = program.facts.recurrent_layout
    assert len(layout) == 2 and {la for _, la in layout} == {LAYOUT_AT_TP4["jamba"]}, layout
    assert program.state_spec().tp == 1


def test_every_head_cut_rule_is_the_frontends():
    """The op rule (passes/placement/recurrent.py, HEAD_CUTS) and the mixer rules
    (module_recurrent.RULES' ``cut``) agree: every family whose op has a head cut has a cut
    function, so the program's state cache and the ops' layout cannot differ."""
    from dcp_compile.frontends.module_recurrent import RULES
    from dcp_compile.passes.placement.recurrent import HEAD_CUTS
    cut_ops = {op._opname for op in HEAD_CUTS}
    assert cut_ops == {"gated_delta_net", "mamba2_ssm", "lightning_attention",
                       "kimi_delta_attention", "rg_lru", "short_conv"}
    with_cut = {r.cls for r in RULES if r.cut is not None}
    assert with_cut == {"Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet",
                        "Qwen3_5MoeGatedDeltaNet", "OlmoHybridGatedDeltaNet", "BambaMixer",
                        "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer", "FalconH1Mixer",
                        "Zamba2MambaMixer", "MiniMaxLightningAttention",
                        "KimiLinearDeltaAttention", "BailingHybridDeltaAttention",
                        "Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv",
                        "RecurrentGemmaRecurrentBlock", "LaraMiniGatedDeltaNet",
                        "Qwen4ExpTextGatedDeltaNet"}


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


def test_a_saved_and_reloaded_one_group_program_keeps_b_and_c_whole(tmp_path):
    """The one-group state spec (``conv_whole``: B's and C's channels) survives a program
    file, and the loaded prefill program matches the model."""
    from dcp_compile.runtime.program.program_file import load_program
    model, program = _program("bamba", 4, 2, "prefill", "one-group")
    program.save(tmp_path / "one-group.dcp")
    loaded = load_program(tmp_path / "one-group.dcp")
    assert loaded.state_spec() == program.state_spec()
    assert [la.conv_whole for la in loaded.state_spec().layers] == _whole_bc(model)
    report = verify.verify_prefill(FullForwardReference(model), loaded, [_prompts()],
                                   atol=TOL, check_cache=False)
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
