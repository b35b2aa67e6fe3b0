"""Mixture-of-experts models in DCP form (runtime/kernels/moe.py, passes/canonicalize_moe.py).

Each transformers MoE model (tiny config, seeded random weights) is transformed with
tensor-parallel experts (default) or ``expert_parallel=True`` and run on a threaded world
with the garbage block NaN-poisoned; every rank's greedy tokens and logits must equal the
model's OWN full forward (its configured experts implementation, no cache) within 1e-4
(fp32) over 8 decode steps, or the prefill step, on prompts of 1, 7 and 12 tokens (around the
interleave period W*I and block boundaries).

The default run is a small slice (< 60 s). ``DCP_MOE_MATRIX=1`` runs the full matrix: every
model x {decode, prefill} x {tp=4/dcp=2, tp=8/largest dcp the heads allow} x {TP, EP
experts} x {the model's default experts implementation, batched_mm} x {hf.prepare,
transform(model) directly}.
"""

from __future__ import annotations

import itertools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dcp_compile  # noqa: E402
from dcp_compile import hf  # noqa: E402
from dcp_compile.runtime.config import DCPConfig  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402
from dcp_compile.runtime.errors import DCPConfigError, DCPTransformError  # noqa: E402
from dcp_compile.verify import run_threaded_program  # noqa: E402

from helpers import assert_runs_match, full_forward_reference, prompts_of  # noqa: E402
from full_runs import full  # noqa: E402

MATRIX = full("DCP_MOE_MATRIX")
VOCAB, BLOCK, ATOL = 256, 4, 1e-4
INTERLEAVE = 2      # decode; prefill (the DI producer) needs interleave == block
LENGTHS = (1, 7, 12)
STEPS = {"decode": 8, "prefill": 1}
SHAPES = StepShapes(batch=4, context_len=12, max_blocks=6, num_blocks=16)

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, max_position_embeddings=64)
_GROUPED = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                norm_topk_prob=True, routed_scaling_factor=2.5)
_MLA = dict(kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=12, num_key_value_heads=8, attn_implementation="sdpa")
# gpt-oss as it ships (alternating sliding/full layers, yarn RoPE, attention sinks) with a
# swiglu_limit of 1 so that its clamped gate bites; the window (64 = max positions) fits
# hf.prepare's rule (tests/frontends/test_sinks.py runs a window that bites).
_GPT_OSS = dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8, sliding_window=64,
                swiglu_limit=1.0, layer_types=["sliding_attention", "full_attention"],
                rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                     original_max_position_embeddings=16, beta_fast=32.0,
                                     beta_slow=1.0))

# id -> (config class, model class, config overrides): routers and shared experts covered.
MODELS = {
    # softmax -> top-2 -> renormalise
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, num_experts_per_tok=2)),
    # softmax -> top-k, norm_topk_prob
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, head_dim=8)),
    # + shared expert behind a sigmoid gate
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, norm_topk_prob=False)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=8, num_experts_per_tok=2)),
    # top-k of logits, softmax over the k
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(num_local_experts=8, num_experts_per_tok=2)),
    # sigmoid, group-limited top-k with score-correction bias, scaling, shared experts
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(_GROUPED, head_dim=8)),
    # sparsemixer (eval form: masked softmax around the top score, twice for top-2)
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM",
               dict(num_local_experts=8, num_experts_per_tok=2)),
    # the same router as GLM4-MoE with MLA; layer 0 dense, layer 1 MoE
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_GROUPED, **_MLA)),
    # biased router -> top-k of logits -> softmax over the k; biased experts, gate/up
    # interleaved and transposed, clamped SwiGLU; eager attention with sinks
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", _GPT_OSS),
}


def build(model_id: str, *, experts: str | None = None, seed: int = 0, ties: bool = False):
    """A tiny model with seeded weights; norms, biases and the routers' score-correction
    biases random too, so a mis-sharded or mis-routed one could not go unnoticed.

    ``ties``: the router's rows come in groups of three equal rows, so every token's router
    scores tie exactly between three experts whose weights differ: a rank breaking a tie
    differently from the others (or from the model) changes the output."""
    config_name, model_name, overrides = MODELS[model_id]
    config = getattr(transformers, config_name)(**{**BASE, **overrides})
    model = getattr(transformers, model_name)(config).eval()
    if experts is not None:
        model.set_experts_implementation(experts)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in itertools.chain(model.named_parameters(), model.named_buffers()):
            if not p.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        if ties:
            for name, p in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "router.weight")) and p.dim() == 2:
                    p.copy_(p[torch.arange(p.shape[0]) // 3 * 3])
    return model


def largest_dcp(model, tp: int) -> int:
    """The largest dcp the model's heads allow at ``tp`` (DCPConfig's own rules)."""
    cfg = model.config
    mla = hasattr(cfg, "kv_lora_rank")
    for dcp in (d for d in range(tp, 0, -1) if tp % d == 0):
        try:
            DCPConfig(tp=tp, dcp=dcp, mode="decode", block_size=BLOCK,
                      interleave_size=INTERLEAVE, num_q_heads=cfg.num_attention_heads,
                      num_kv_heads=1 if mla else cfg.num_key_value_heads, mla=mla)
            return dcp
        except DCPConfigError:
            continue
    raise AssertionError("no dcp fits")


def check_matches_own_forward(model_id, mode, tp, dcp, expert_parallel, experts=None,
                              direct=False, ties=False) -> float:
    model = build(model_id, experts=experts, ties=ties)
    if not direct and hasattr(model.config, "kv_lora_rank"):
        pytest.skip("MLA is transformed from the model's own attention (the ordinary "
                    "frontend); hf.prepare's paged attention has no latent form")
    # max_model_len: the longest sequence any position can serve (gpt-oss's sliding layers'
    # window covers it, hf.prepare's rule for windows)
    subject = model if direct else hf.prepare(
        model, max_model_len=model.config.max_position_embeddings)
    program = dcp_compile.transform(subject, tp=tp, dcp=dcp, mode=mode, block_size=BLOCK,
                                    interleave_size=INTERLEAVE if mode == "decode" else BLOCK,
                                    shapes=SHAPES, check=False,
                                    expert_parallel=expert_parallel)
    moe = next(r for r in program.history if r.name == "canonicalize_moe")
    assert moe.matched["moe_layers"] >= 1 and moe.matched["router_linears"] >= 1
    cfg = model.config
    if hasattr(cfg, "kv_lora_rank"):   # MLA: one latent head, 1/dcp of the tokens per rank
        spec = program.cache_spec()
        assert program.config.mla and spec.kv_heads == 1
        assert 2 * spec.head_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if mode == "decode":
            tokens = (SHAPES.num_blocks - 1) * dcp * BLOCK
            per_token = cfg.num_hidden_layers * 2 * spec.head_dim * 4
            assert spec.bytes_per_rank() == per_token * (tokens // dcp + BLOCK)
    steps = STEPS[mode]
    prompts = prompts_of(LENGTHS, vocab=VOCAB)
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True)
    ref_tokens, ref_logits = full_forward_reference(model, prompts, steps)
    for run in runs[1:]:      # the same routing and the same sums on every rank: same bits
        assert all(torch.equal(a, b) for a, b in zip(run.result.logits,
                                                      runs[0].result.logits)), run.rank
    return assert_runs_match(runs, ref_tokens, ref_logits, atol=ATOL, lengths=LENGTHS)


# The default slice: the three priority families, both sharding modes, decode and prefill;
# Mixtral's routers tie exactly (test_routing_ties_break_alike_on_every_rank).
SLICE = [("qwen3_moe", "decode", 4, 2, True, True), ("deepseek_v3", "decode", 8, 8, False, True),
         ("mixtral", "prefill", 4, 2, True, False)]


def _matrix():
    for model_id, mode, (tp, dcp), ep, experts, direct in itertools.product(
            MODELS, ("decode", "prefill"), ((4, 2), (8, None)), (False, True),
            (None, "batched_mm"), (False, True)):
        yield pytest.param(model_id, mode, tp, dcp, ep, experts, direct,
                           id=f"{model_id}-{mode}-tp{tp}-{'ep' if ep else 'tp_experts'}-"
                              f"{experts or 'default'}-{'direct' if direct else 'prepare'}")


@pytest.mark.parametrize("model_id,mode,tp,dcp,ep,direct", SLICE,
                         ids=[f"{m}-{mode}-tp{t}dcp{d}-{'ep' if e else 'tp_experts'}-"
                              f"{'direct' if di else 'prepare'}"
                              for m, mode, t, d, e, di in SLICE])
def test_moe_model_matches_own_forward(model_id, mode, tp, dcp, ep, direct):
    check_matches_own_forward(model_id, mode, tp, dcp, ep, direct=direct)


@pytest.mark.parametrize("ep", [False, True], ids=["tp_experts", "expert_parallel"])
def test_routing_ties_break_alike_on_every_rank(ep):
    """Exact ties between experts with different weights: every rank must pick what the
    model picks (TP: a rank choosing differently adds another expert's partial sum; EP: a
    token would get an expert from two ranks, or from none) and every rank's logits are the
    same bits."""
    if ep and not MATRIX:
        pytest.skip("the expert-parallel tie run is in the full matrix (DCP_MOE_MATRIX=1)")
    model = build("mixtral", ties=True)
    router = model.model.layers[0].mlp.gate.weight
    assert torch.equal(router[0], router[1]) and torch.equal(router[1], router[2])
    check_matches_own_forward("mixtral", "decode", 4, 2, ep, ties=True)


@pytest.mark.skipif(not MATRIX, reason="full matrix: DCP_MOE_MATRIX=1")
@pytest.mark.parametrize("model_id,mode,tp,dcp,ep,experts,direct", list(_matrix()))
def test_moe_matrix(model_id, mode, tp, dcp, ep, experts, direct):
    if dcp is None:
        dcp = largest_dcp(build(model_id), tp)
    worst = check_matches_own_forward(model_id, mode, tp, dcp, ep, experts, direct)
    print(f"{model_id} {mode} tp={tp} dcp={dcp} ep={ep} {experts} direct={direct}: "
          f"max |logit err| {worst:.2e}")
