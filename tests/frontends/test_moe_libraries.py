"""MoE blocks of the model libraries read at the module level (dcp_compile/frontends/
module_experts.py): litgpt's torch.where loop over experts (Mixtral, Qwen3-MoE), torchtitan's
grouped-matmul experts (Qwen3-MoE), Hugging Face Llama-4's dense bmm over all experts with
score-scaled inputs. Each becomes dcp.moe while the model is captured.

Shown here: (1) the swapped block computes the model's own forward (eager, every library, a
few lengths); (2) the transformed program matches the model's own full forward (fp32, 1e-4,
greedy tokens; tests/support/hf_corpus.run_model: threaded tp=4/dcp=2 world, prompts of
1, 7, 9 and 16 tokens around the vblock of 8, garbage block poisoned), TP and EP experts;
(3) the refusals name the real limit: library code that is not the pinned code, bf16 experts
in an fp32 model (torchtitan's: its own forward changes with the batch beyond 1e-4; with fp32
experts its DeepSeek-V3 matches), a model in training mode, expert parallelism with fewer
experts than ranks. The default run is a slice; ``DCP_MOE_MATRIX=1`` runs every
row (test_moe.MATRIX).
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

import dcp_compile
import hf_corpus
from dcp_compile.frontends import module_experts as mx
from dcp_compile.runtime.errors import DCPTransformError

transformers = pytest.importorskip("transformers")

import test_moe  # noqa: E402
import third_party as T  # noqa: E402

MATRIX = test_moe.MATRIX


def _needs(dist: str) -> None:
    if importlib.util.find_spec(dist) is None:
        pytest.skip(f"{dist} is not installed: run scripts/setup.sh (requirements/corpus.txt)")


def llama4(chunked: bool = False):
    """The HF corpus' tiny Llama-4 (MoE in both layers, top-2, a shared expert); without
    chunked attention unless asked."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from helpers import seeded_weights
    kw = hf_corpus.config_kwargs("llama4_text")
    if not chunked:
        kw["attention_chunk_size"] = None
    config = CONFIG_MAPPING["llama4_text"](**kw)
    return seeded_weights(AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa").eval(), 0)


# name -> (distribution, build, logits of ids)
MODELS = {
    "litgpt-mixtral": ("litgpt", lambda: T.build("litgpt/Mixtral-8x7B-v0.1"), T.logits_of),
    "litgpt-qwen3-moe": ("litgpt", lambda: T.build("litgpt/Qwen3-30B-A3B"), T.logits_of),
    "torchtitan-qwen3-moe": ("torchtitan", lambda: T.build("torchtitan/qwen3-moe"),
                             T.logits_of),
    "hf-llama4": ("transformers", llama4, hf_corpus.hf_logits),
}


@pytest.mark.parametrize("length", [1, 7, 16], ids=lambda n: f"len={n}")
@pytest.mark.parametrize("name", list(MODELS))
def test_swapped_block_computes_the_models_own_forward(name, length):
    dist, build, logits_of = MODELS[name]
    _needs(dist)
    model = build()
    stacked = mx.stacked_experts(model)
    assert len(stacked) >= 1
    ids = torch.randint(0, 200, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        want = logits_of(model, ids)
        with mx.module_experts_enabled(model, stacked) as swapped:
            got = logits_of(model, ids)
        again = logits_of(model, ids)
    assert swapped == len(stacked)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(again, want, rtol=0, atol=0)    # the swap is undone


# (model, mode, expert_parallel, through hf.prepare): the slice, then the rest of the matrix.
SLICE = [("litgpt-mixtral", "decode", False, False),
         ("litgpt-qwen3-moe", "prefill", False, False),
         ("hf-llama4", "decode", False, True)]
ROWS = SLICE + ([] if not MATRIX else [
    ("litgpt-mixtral", "prefill", False, False), ("litgpt-mixtral", "decode", True, False),
    ("litgpt-qwen3-moe", "decode", False, False), ("litgpt-qwen3-moe", "prefill", True, False),
    ("hf-llama4", "prefill", False, True), ("hf-llama4", "decode", True, False),
    ("hf-llama4", "prefill", False, False), ("hf-llama4", "prefill", True, True)])


@pytest.mark.parametrize("name,mode,ep,prepare", ROWS, ids=[
    f"{n}-{m}-{'ep' if e else 'tp'}{'-prepare' if p else ''}" for n, m, e, p in ROWS])
def test_program_matches_the_models_own_forward(name, mode, ep, prepare, monkeypatch):
    dist, build, logits_of = MODELS[name]
    _needs(dist)
    monkeypatch.setattr(dcp_compile, "transform",
                        functools.partial(dcp_compile.transform, expert_parallel=ep))
    model = build() if name != "hf-llama4" or not prepare else llama4(chunked=True)
    out = hf_corpus.run_model(model, mode, logits_of=logits_of, check=False,
                              prepare=dcp_compile.hf.prepare if prepare else None)
    assert out.kind == "matches", (out.cell(), out.message[:800])


# -- refusals ------------------------------------------------------------------------------

def test_library_code_other_than_the_pinned_code_is_refused_naming_it():
    """A subclass that overrides the block's forward is not the code the rule was written
    from: refused, naming the function and the library version."""
    _needs("litgpt")
    from litgpt.model import LLaMAMoE
    model = T.build("litgpt/Mixtral-8x7B-v0.1")

    class Tweaked(LLaMAMoE):
        def forward(self, x):
            return super().forward(x) * 2

    model.transformer.h[0].mlp.__class__ = Tweaked
    with pytest.raises(DCPTransformError, match=r"litgpt 0\.5\.13's MoE block.*code differs.*"
                                                r"LLaMAMoE\.forward"):
        mx.stacked_experts(model)


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_bf16_experts_of_an_fp32_model_are_refused(ep, monkeypatch):
    """torchtitan's GroupedExperts computes in bf16 inside an fp32 model. bf16 matmuls round
    by the batch they are given: the model's own forward is not reproducible at fp32
    tolerance (shown below), so no program equals it; refused, TP or EP experts alike."""
    _needs("torchtitan")
    monkeypatch.setattr(dcp_compile, "transform",
                        functools.partial(dcp_compile.transform, expert_parallel=ep))
    out = hf_corpus.run_model(T.build("torchtitan/qwen3-moe"), "prefill",
                              logits_of=T.logits_of, check=False)
    assert out.kind == "refused" and out.reason == "experts in bf16 inside an fp32 model", \
        out.message
    assert "model.to(torch.bfloat16)" in out.message


def test_bf16_experts_make_the_models_own_forward_depend_on_the_batch():
    """The limit above is the model's: torchtitan's DeepSeek-V3 gives one prompt other
    logits (beyond 1e-4) when it shares the batch with other prompts."""
    _needs("torchtitan")
    model = T.build("torchtitan/deepseek_v3")
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 256, (1, 12), generator=g), torch.randint(0, 256, (3, 12), generator=g)
    with torch.no_grad():
        alone, together = model(a), model(torch.cat([a, b]))[:1]
    assert (alone - together).abs().max() > 1e-4


def _fp32_grouped_experts(self, x, counts):
    """torchtitan's GroupedExperts.forward without its bf16 casts."""
    import torch.nn.functional as F
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, self.w1_EFD.transpose(-2, -1), offs=offs)) * \
        torch._grouped_mm(x, self.w3_EFD.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, self.w2_EDF.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("mode", ["decode", "prefill"] if MATRIX else ["decode"])
@pytest.mark.parametrize("name", ["torchtitan/deepseek_v3", "torchtitan/qwen3-moe"])
def test_torchtitan_moe_with_fp32_experts_matches(name, mode, monkeypatch):
    """torchtitan's DeepSeek-V3 (MLA read tokens-first and absorbed, MoE as dcp.moe) and
    Qwen3-MoE (its wqkv fused per KV head read as [all q; all k; all v], decode at tp=4 over 2
    KV heads) with their experts computing in fp32 (the one change: its bf16 casts dropped,
    and the rule told so): the program matches its own forward, TP experts."""
    _needs("torchtitan")
    import dataclasses

    T._stub_torchtitan_triton_kernels()     # before torchtitan's first import (no triton)
    import torchtitan.models.common.moe as titan_moe
    monkeypatch.setattr(titan_moe.GroupedExperts, "forward", _fp32_grouped_experts)
    rule = next(r for r in mx.RULES if r.block.endswith("moe:MoE"))
    pin = "torchtitan.models.common.moe:GroupedExperts.forward"
    fp32 = dataclasses.replace(
        rule, pinned={**rule.pinned, pin: {mx.source_hash(_fp32_grouped_experts)}},
        stack=lambda block: mx.StackedExperts(torch.cat(
            [block.routed_experts.inner_experts.w1_EFD,
             block.routed_experts.inner_experts.w3_EFD], dim=1),
            block.routed_experts.inner_experts.w2_EDF))
    monkeypatch.setattr(mx, "RULES", tuple(fp32 if r is rule else r for r in mx.RULES))
    out = T.run_case(name, mode)
    assert out.kind == "matches", (out.cell(), out.message[:800])


def test_a_library_block_in_training_mode_is_refused():
    _needs("torchtitan")
    model = T.build("torchtitan/qwen3-moe").train()
    with pytest.raises(DCPTransformError, match=r"training mode.*model\.eval\(\)"):
        mx.stacked_experts(model)


def test_expert_parallel_with_fewer_experts_than_ranks_is_refused_naming_the_limit(
        monkeypatch):
    from dcp_compile.runtime.serving.engine import StepShapes
    monkeypatch.setitem(test_moe.MODELS, "mixtral4", (
        "MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)))
    model = test_moe.build("mixtral4")
    with pytest.raises(DCPTransformError, match=r"fewer experts than ranks: experts=4, "
                                                r"tp=8.*expert_parallel=False"):
        dcp_compile.transform(model, tp=8, dcp=4, mode="decode", block_size=4,
                              shapes=StepShapes(batch=1, context_len=4, max_blocks=2,
                                                num_blocks=4),
                              check=False, expert_parallel=True)


def test_models_without_library_blocks_get_no_stacked_experts():
    model = test_moe.build("mixtral")          # transformers' experts interface, not a rule
    assert len(mx.stacked_experts(model)) == 0


def test_experts_that_do_not_stack_are_refused_naming_the_block():
    """One litgpt expert with another intermediate size: no [E, ...] weight holds them all."""
    _needs("litgpt")
    model = T.build("litgpt/Mixtral-8x7B-v0.1")
    expert = model.transformer.h[1].mlp.experts[2]
    expert.fc_1 = torch.nn.Linear(expert.fc_1.in_features, 7, bias=False)
    with pytest.raises(DCPTransformError, match=r"transformer\.h\.1\.mlp \(LLaMAMoE\).*do not "
                                                r"stack"):
        mx.stacked_experts(model)


@pytest.mark.parametrize("name", ["litgpt-mixtral", "hf-llama4"])
def test_replaced_expert_weights_are_no_program_inputs(name):
    """torch.export lifts every parameter; the experts the swap replaced (litgpt's per-expert
    linears; Llama-4's own stacked weights under their second name) are unread and are not
    program weights, so no rank carries them. Llama-4's experts keep their checkpoint names."""
    from dcp_compile.runtime.serving.engine import StepShapes
    dist, build, _ = MODELS[name]
    _needs(dist)
    model = build()
    target = dcp_compile.hf.prepare(llama4(chunked=True)) if name == "hf-llama4" else model
    program = dcp_compile.transform(target, tp=4, dcp=2, mode="decode", block_size=4,
                                    shapes=StepShapes(batch=4, context_len=16, max_blocks=4,
                                                      num_blocks=18), check=False)
    experts = [w for w in program.weight_inputs if "experts" in w and "shared" not in w]
    assert all(w.startswith("p_library_experts_") for w in experts), experts
    assert len(experts) == 4                          # gate_up and down of 2 MoE layers
    if name == "hf-llama4":
        assert {program.weight_names[w][0] for w in experts} == {
            f"model.layers.{i}.feed_forward.experts.{p}" for i in (0, 1)
            for p in ("gate_up_proj", "down_proj")}
