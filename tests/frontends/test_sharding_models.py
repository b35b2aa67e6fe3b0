"""Sound sharding: models with fused projections, output gates, norms across heads and literal
head counts transform and match their own single-device forward (fp32 logits within 1e-4,
the same greedy tokens), or transform() refuses. Decode (context + 8 decode steps) and
chunked prefill (two unaligned chunks, every token's logits and each rank's cache) on the
threaded world. Programs are built with check=False: each test compares every step with
the model, which the transform's one-step check (tests/frontends/test_transform_check.py) repeated.
The models are named points of the fuzz's grammar (tests/support/model_grammar.SHARDING_CASES).
The feature models' placement analysis also runs both ways (worklist and full sweeps, the
same plan: tests/passes/test_placement_worklist.compare_both)."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch

import dcp_compile
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.verify import verify, verify_prefill
from dcp_compile.runtime.serving.engine import StepShapes

from dcp_compile.frontends.module_recurrent import recurrent_layers
from grammar_recurrent import HybridGrammarModel
from model_grammar import (FEATURES, GQA, SHARDING, SHARDING_CASES, GrammarModel, ModelSpec,
                           build, reference_of)
from test_placement_worklist import compare_both

STEPS = 8

SHAPES = StepShapes.fitting(2, 12, 12 + STEPS + 1, block_size=16, dcp=2)


@pytest.mark.parametrize("name", list(SHARDING_CASES))
def test_sharding_case_is_a_point_of_the_fuzz_grammar(name):
    """Every feature value a case picks is one the fuzz draws, and the case builds the model
    it names (so the fuzz and these tests cover one space of models)."""
    spec, _, _ = SHARDING_CASES[name]
    for feature, value in asdict(spec).items():
        if feature in FEATURES:
            assert value in FEATURES[feature], (name, feature, value)
    model = build(spec)
    assert model.spec == spec and len(model.layers) == 2
    if spec.recurrent != "none":        # a hybrid: an ordinary LM with the mixers it names
        assert isinstance(model, HybridGrammarModel) and len(spec.kinds) == 2
        assert [m.layer_idx for _, m, _ in recurrent_layers(model)] == \
            [i for i, k in enumerate(spec.kinds) if k == "R"]
        return
    assert isinstance(model, GrammarModel)
    assert model.num_layers == 2 and model.kv_cache_shape(5, 16) == (5, 16, spec.kv_heads, 8)


@pytest.mark.parametrize("name", list(SHARDING_CASES))
def test_feature_model_decode_matches_single_device(name, monkeypatch):
    spec, tp, dcp = SHARDING_CASES[name]
    compared = compare_both(monkeypatch)     # placement: worklist == full sweeps, per graph
    model = build(spec)
    shapes = StepShapes.fitting(2, 12, 12 + STEPS + 1, block_size=16, dcp=dcp)
    prog = dcp_compile.transform(model, tp=tp, dcp=dcp, mode="decode", shapes=shapes,
                                 check=False)
    report = verify(reference_of(model), prog, [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 2]],
                    STEPS)
    assert report.tokens_agree and report.max_abs_error < 1e-4, report
    assert [kind for kind, _, _ in compared] == ["plan", "plan"]    # context, decode


# Models whose prefill is refused, by name (none now: the output gate, computed from q_proj
# on the rank's owned tokens, is computed again on the contiguous S/W tokens the attention
# output arrives on after the reduce-scatter: passes/dcp_prefill.py, LayerPlan.o_recomputed).
PREFILL_REFUSED: dict[str, str] = {}
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6], [7, 2, 5]]


@pytest.mark.parametrize("name", list(SHARDING_CASES))
def test_feature_model_prefill_matches_single_device(name, monkeypatch):
    spec, tp, dcp = SHARDING_CASES[name]
    compared = compare_both(monkeypatch)
    model = build(spec)
    shapes = StepShapes.fitting(2, 16, 40, block_size=8, dcp=dcp)
    if name in PREFILL_REFUSED:
        with pytest.raises(DCPTransformError, match=PREFILL_REFUSED[name]):
            dcp_compile.transform(model, tp=tp, dcp=dcp, mode="prefill", block_size=8,
                                  shapes=shapes)
        return
    prog = dcp_compile.transform(model, tp=tp, dcp=dcp, mode="prefill", block_size=8,
                                 shapes=shapes, check=False)
    reference = reference_of(model)    # a hybrid's: its own full forward (no KV cache)
    report = verify_prefill(reference, prog, PROMPTS, 2,   # two chunks, unaligned prior
                            check_cache=reference is model)
    assert report.ok and report.max_abs_error < 1e-4, report
    assert [kind for kind, _, _ in compared] == ["plan"]


# -- Hugging Face architectures with these features, built from config with random weights --

HF_MODELS = {  # id: (config class, model class, overrides, tp, dcp)
    # fused qkv_proj ([q; k; v] rows cut by slicing) and fused gate_up_proj (chunk)
    "phi3-fused-qkv-gate-up": ("Phi3Config", "Phi3ForCausalLM",
                               dict(num_attention_heads=8, num_key_value_heads=2), 4, 2),
    # query_key_value per head ([h, 3, d]), parallel residual, partial rotary
    "gpt-neox-per-head-qkv": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                              dict(num_attention_heads=4, rotary_pct=0.5), 4, 1),
    # q_norm / k_norm over the whole projection (all heads), before the head view
    "olmo2-qk-norm-across-heads": ("Olmo2Config", "Olmo2ForCausalLM",
                                   dict(num_attention_heads=8, num_key_value_heads=2), 4, 2),
}


# Families whose prefill used to be refused by the token-wise op lists (embedding scale,
# LayerNorm, parallel blocks, logit scale, partial rotary, [B, H, S, D] RoPE transposes).
HF_PREFILL_FAMILIES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8), 4, 2),
    "cohere": ("CohereConfig", "CohereForCausalLM",
               dict(num_attention_heads=8, num_key_value_heads=2), 4, 2),
    "olmo": ("OlmoConfig", "OlmoForCausalLM",
             dict(num_attention_heads=8, num_key_value_heads=2), 4, 2),
    "phi": ("PhiConfig", "PhiForCausalLM",
            dict(num_attention_heads=8, num_key_value_heads=2), 4, 2),
}


@pytest.mark.parametrize("model_id", list(HF_MODELS) + list(HF_PREFILL_FAMILIES))
def test_hf_model_prefill_matches_single_device(model_id):
    pytest.importorskip("transformers")
    from dcp_compile import hf
    from helpers import prompts_of
    from test_hf import build

    config_name, model_name, overrides, tp, dcp = {**HF_MODELS,
                                                   **HF_PREFILL_FAMILIES}[model_id]
    model = build(config_name, model_name, overrides)
    shapes = StepShapes.fitting(3, 12, 24, block_size=4, dcp=dcp)
    wrapper = hf.prepare(model)      # its single-device forward equals HF's (test_hf.py)
    prog = dcp_compile.transform(wrapper, tp=tp, dcp=dcp, mode="prefill", block_size=4,
                                 shapes=shapes, check=False)
    report = verify_prefill(wrapper, prog, prompts_of((1, 6, 20), vocab=256), 2)
    assert report.ok and report.max_abs_error < 1e-4, report


@pytest.mark.parametrize("model_id", list(HF_MODELS))
def test_hf_model_decode_matches_its_own_forward(model_id):
    pytest.importorskip("transformers")
    from dcp_compile import hf
    from dcp_compile.verify import run_threaded_program
    from helpers import assert_close_report, prompts_of
    from test_hf import build, hf_reference

    config_name, model_name, overrides, tp, dcp = HF_MODELS[model_id]
    model = build(config_name, model_name, overrides)
    shapes = StepShapes.fitting(4, 12, 12 + STEPS, block_size=4, dcp=dcp)
    program = dcp_compile.transform(hf.prepare(model), tp=tp, dcp=dcp, mode="decode",
                                    block_size=4, shapes=shapes, check=False)
    prompts = prompts_of((1, 6, 12), vocab=256)
    runs = run_threaded_program(program, prompts, STEPS, poison_garbage=True)
    ref_tokens, ref_logits = hf_reference(model, prompts, STEPS)
    for run in runs:
        assert run.result.tokens == ref_tokens, f"rank {run.rank}"
        for t, got in enumerate(run.result.logits):
            for b in range(len(prompts)):
                assert_close_report(got[b], ref_logits[b][t], atol=1e-4,
                                    what=f"rank {run.rank} step {t} seq {b}")


# -- refused, by op and source line: never a silently wrong program ------------------------

ONE_LAYER = replace(ModelSpec(**GQA, **SHARDING), layers=1)


def _q_heads(q):
    """The q projection's output as [B, S, 8 heads, 8]."""
    return q.view(*q.shape[:2], 8, 8)


class AmaxAcrossHeads(GrammarModel):
    """q scaled by its max over all heads: no sharded form (a max is not a sum)."""

    def __init__(self):
        super().__init__(ONE_LAYER)
        self.eval()
        attn = self.layers[0].attn
        project = attn._project

        def scaled(x):
            q, k, v, gate = project(x)
            q = _q_heads(q)
            return q / q.amax(dim=(2, 3), keepdim=True), k, v, gate
        attn._project = scaled


class ReplicatedSpanningHeads(GrammarModel):
    """q plus a tensor computed in the graph over all heads: every rank holds all of it, and
    only a broadcast over heads is placeable (a parameter or buffer would be cut instead)."""

    def __init__(self):
        super().__init__(ONE_LAYER)
        self.eval()
        attn = self.layers[0].attn
        project = attn._project

        def shifted(x):
            q, k, v, gate = project(x)
            return _q_heads(q) + torch.arange(64, dtype=q.dtype).view(8, 8), k, v, gate
        attn._project = shifted


@pytest.mark.parametrize("model_cls,pattern", [
    (AmaxAcrossHeads, r"aten\.amax\.default.*not a sum.*model_grammar\.py"),
    (ReplicatedSpanningHeads, r"aten\.add\.Tensor.*spans the sharded dim.*model_grammar\.py"),
], ids=["amax-over-heads", "full-width-add"])
def test_unplaceable_op_is_refused_naming_op_and_source(model_cls, pattern):
    with pytest.raises(DCPTransformError, match=pattern):
        dcp_compile.transform(model_cls(), tp=4, dcp=2, mode="decode", shapes=SHAPES)


@pytest.mark.parametrize("mode,tp,dcp", [("decode", 4, 2), ("prefill", 4, 2)],
                         ids=["decode-gqa-8to2-tp4-dcp2", "prefill-gqa-8to2-tp4-dcp2"])
def test_olmo2_qk_norm_with_a_cast_weight_matches(mode, tp, dcp):
    """litgpt's OLMo-2: q/k RMSNorm over all heads with ``weight.float()`` (a cast of a weight
    is cut like the weight), here with grouped-query attention (8 q heads, 2 KV heads), so
    that decode DCP runs too; the corpus' cell harness compares every step (prompts of 1,
    7, 9 and 16 tokens)."""
    pytest.importorskip("litgpt")
    from litgpt.config import Config
    from litgpt.model import GPT

    import hf_corpus
    import third_party as T
    from helpers import seeded_weights

    name = "OLMo-2-1124-7B"
    tiny = dict(n_layer=T.LAYERS, n_embd=T.DIM, n_head=T.HEADS, n_query_groups=2,
                head_size=T.HEAD_DIM, intermediate_size=T.FFN, vocab_size=T.VOCAB,
                padded_vocab_size=T.VOCAB, block_size=T.MAX_LEN)
    torch.manual_seed(0)
    model = T.ARCHS[f"litgpt/{name}"].logits(GPT(Config.from_name(name, **tiny)))
    model = seeded_weights(model.float().eval(), 0)
    out = hf_corpus.run_model(model, mode, logits_of=T.logits_of, check=False, tp=tp, dcp=dcp)
    assert out.kind == "matches", out
