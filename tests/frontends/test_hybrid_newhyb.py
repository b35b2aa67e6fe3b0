"""The 2026 hybrid types of transformers 5.25 (docs/hybrid.md, "The 2026 hybrids"): LFM3's
short conv and LaRA-mini's Gated DeltaNet run as ``dcp.short_conv`` / ``dcp.gated_delta_net``
through their own swap rules (LFM2's and Qwen3.5's forwards, the same source), beside their
sliding, full (LaRA-mini: NoPE) and gated (LFM3) attention. Qwen4-exp's Gated DeltaNet has a
rule too, but its attention (QSA indexed attention) and its PLE n-gram layers have no op: the
model is refused naming them, as are ZAYA's CCA projection and Inkling's four short convs
with its hidden-state relative position bias (``module_recurrent.NOT_BUILT``).

Decode (the prompts through the context step, then greedy steps) and prefill under sequence
parallelism (one and two chunks) at tp=4/dcp=2 and tp=8/dcp=4 match the model's own forward
(fp32, 1e-4, greedy tokens equal); speculative decode and prefix caching run in
tests/frontends/test_hybrid_hspec.py (FAMILY_TYPES).

The slice (default run): the swapped mixers against the models' own, LFM3 decode at
tp=4/dcp=2 and the refusals. ``DCP_HYBRID_FULL=1``: every cell.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import dcp_compile  # noqa: E402
from dcp_compile import hf  # noqa: E402
from dcp_compile.frontends import module_recurrent as mr  # noqa: E402
from dcp_compile.frontends.module_recurrent import recurrent_layers  # noqa: E402
from dcp_compile.runtime.errors import DCPHybridError  # noqa: E402
from full_runs import full  # noqa: E402
from hybrid_configs import build_hybrid  # noqa: E402
from hybrid_runs import (SHAPES, assert_decode_matches, assert_prefill_matches,  # noqa: E402
                         assert_swapped_rows_match, cases, program)

FULL = full("DCP_HYBRID_FULL")
TYPES = ("lfm3", "lara_mini")
MIXERS = {"lfm3": "Lfm3ShortConv", "lara_mini": "LaraMiniGatedDeltaNet",
          "qwen4_exp_text": "Qwen4ExpTextGatedDeltaNet"}


def _model(model_type):
    if model_type == "qwen4_exp_text":      # no tiny hybrid config: the corpus's (GDN + QSA)
        from hf_corpus import build
        return build(model_type, "sdpa")
    return build_hybrid(model_type)


@torch.no_grad()
@pytest.mark.parametrize("model_type", [*TYPES, "qwen4_exp_text"])
def test_the_swapped_mixer_is_the_models_own(model_type):
    """Every mixer of the type runs as its op (its rule names it), and the model over a batch
    of mixed lengths equals its own forward row by row (Qwen4-exp too: its rule is right,
    though the model is refused for its attention, below)."""
    model = _model(model_type)
    layers = recurrent_layers(model)
    assert layers and {type(m).__name__ for _, m, _ in layers} == {MIXERS[model_type]}
    assert_swapped_rows_match(model)


@pytest.mark.parametrize("model_type,tp,dcp", cases(TYPES, {("lfm3", 4, 2)}, FULL))
def test_new_hybrid_decode_matches(model_type, tp, dcp):
    model, prog = program(model_type, tp, dcp, "decode")
    want = {"lfm3": "head cut",                  # LFM2's short conv: by channels
            "lara_mini": f"replicated (tp={tp} does not divide the 2 key heads)"}[model_type]
    assert {la for _, la in prog.facts.recurrent_layout} == {want}
    assert_decode_matches(model, prog, f"{model_type} tp={tp} dcp={dcp}")


@pytest.mark.parametrize("model_type,tp,dcp", cases(TYPES, set(), FULL))
@pytest.mark.parametrize("chunks", [1, 2], ids=["one-chunk", "two-chunks"])
def test_new_hybrid_prefill_matches(model_type, tp, dcp, chunks):
    assert_prefill_matches(*program(model_type, tp, dcp, "prefill"), chunks,
                           f"{model_type} tp={tp} dcp={dcp}")


# -- the parts no op computes: refused by name ------------------------------------------------

REFUSED = {
    "qwen4_exp_text": (dict(), r"Qwen4ExpTextQSAIndexer at model\.layers\.1\.self_attn\.indexer: "
                               r"its indexed_attention layers .* through QSA"),
    "zaya": (dict(), r"ZayaCCAProjection at .*: .*Compressed Convolutional Attention.*grouped "
                     r"causal Conv1d"),
    "inkling_text": (dict(), r"InklingShortConvolution at .*: every Inkling layer runs four "
                             r"depthwise short convolutions.*InklingRelativeLogits"),
}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_part_no_op_computes_is_refused_by_name(model_type):
    """transform() and hf.prepare refuse the model naming the part and what an op for it
    needs, not the generic "no swap rule" nor the token-wise check's SSM diagnosis."""
    from hf_corpus import build
    overrides, pattern = REFUSED[model_type]
    model = build(model_type, "sdpa", **overrides)
    with pytest.raises(DCPHybridError, match=pattern + r".*Serve this model without DCP") as e:
        dcp_compile.transform(model, tp=4, dcp=2, mode="decode", block_size=2, shapes=SHAPES,
                              check=False)
    assert "no swap rule" not in str(e.value)
    with pytest.raises(DCPHybridError, match=pattern):
        hf.prepare(model)


def test_qwen4_exp_with_ple_layers_names_both_parts():
    """A Qwen4-exp with PLE layers: the refusal names the QSA attention and the n-gram PLE
    layer (its token-id history and dilated conv states)."""
    from hf_corpus import build
    model = build("qwen4_exp_text", "sdpa", ple_layer_ids=[1], ple_embed_dim=16, eos_token_id=1,
                  ngram_size=3)
    with pytest.raises(DCPHybridError, match=r"Qwen4ExpTextPLELayer at model\.layers\.0\.ple: "
                                             r".*hashed n-grams.*dilation") as e:
        dcp_compile.transform(model, tp=4, dcp=2, mode="decode", block_size=2, shapes=SHAPES,
                              check=False)
    assert "Qwen4ExpTextQSAIndexer at model.layers.1.self_attn.indexer" in str(e.value)


@pytest.mark.parametrize("cls", ["Qwen4ExpTextQSAIndexer", "Qwen4ExpTextPLELayer",
                                 "ZayaCCAProjection", "InklingShortConvolution"])
def test_each_not_built_entry_names_a_class_of_the_installed_transformers(cls):
    """A NOT_BUILT entry that names no class (a rename in transformers) would refuse nothing."""
    assert cls in mr.NOT_BUILT
    modules = {"Qwen4Exp": "qwen4_exp", "Zaya": "zaya", "Inkling": "inkling"}
    prefix = next(p for p in modules if cls.startswith(p))
    mod = importlib.import_module(f"transformers.models.{modules[prefix]}."
                                  f"modeling_{modules[prefix]}")
    assert isinstance(getattr(mod, cls), type)
