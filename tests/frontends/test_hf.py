"""Hugging Face transformers models through dcp_compile.hf: the transformed program on a
threaded world decodes the same greedy tokens, with the same logits, as the HF model's own
``generate`` and full forward (default attention); what would shard wrong is rejected by name.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dcp_compile  # noqa: E402
from dcp_compile import hf  # noqa: E402
from dcp_compile.runtime.errors import DCPTransformError  # noqa: E402
from dcp_compile.verify import run_threaded_program  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402

from helpers import assert_close_report, prompts_of, seeded_weights  # noqa: E402

TP, DCP, BLOCK = 4, 2, 4
VOCAB = 256
# vblock = BLOCK * DCP = 8: prompts of 1, 6 and 12 tokens plus the decoded ones span 1-3
# vblocks, so a sequence crosses block and rank boundaries while it decodes.
LENGTHS = (1, 6, 12)
SHAPES = StepShapes(batch=4, context_len=12, max_blocks=4, num_blocks=12)
STEPS = {"decode": 6, "prefill": 1}
ATOL = 1e-4

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
            max_position_embeddings=64)

# id -> (config class, model class, config overrides, prepare kwargs)
MODELS = {
    "llama-gqa-8to2": ("LlamaConfig", "LlamaForCausalLM",
                       dict(num_attention_heads=8, num_key_value_heads=2), {}),
    "qwen2-qkv-bias": ("Qwen2Config", "Qwen2ForCausalLM",
                       dict(num_attention_heads=8, num_key_value_heads=2), {}),
    # Mistral's default 4096-token sliding window is exact for sequences no longer than it.
    "mistral-head_dim16-window": ("MistralConfig", "MistralForCausalLM",
                                  dict(num_attention_heads=8, num_key_value_heads=2,
                                       head_dim=16), dict(max_model_len=4096)),
    "llama-gqa-16to1": ("LlamaConfig", "LlamaForCausalLM",
                        dict(num_attention_heads=16, num_key_value_heads=1), {}),
    "qwen3-per-head-qk-norm": ("Qwen3Config", "Qwen3ForCausalLM",
                               dict(num_attention_heads=8, num_key_value_heads=2,
                                    head_dim=8), {}),
    "qwen2-tied-embeddings": ("Qwen2Config", "Qwen2ForCausalLM",
                              dict(num_attention_heads=8, num_key_value_heads=2,
                                   tie_word_embeddings=True), {}),
}
MODEL_PARAMS = list(MODELS)


def build(config_name: str, model_name: str, overrides: dict, *, seed: int = 0):
    """A tiny model with seeded weights large enough that greedy tokens are not near-ties;
    norms and biases are random too, so a mis-sharded one could not go unnoticed."""
    config = getattr(transformers, config_name)(**{**BASE, **overrides})
    model = getattr(transformers, model_name)(config).eval()
    return seeded_weights(model, seed)


def hf_reference(model, prompts, steps):
    """Per prompt: HF greedy tokens (its own generate) and each step's logits from one
    plain full forward over prompt + generated tokens."""
    tokens, logits = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, max_new_tokens=steps, do_sample=False)
            new = out[0, len(p):].tolist()
            full = model(torch.tensor([p + new[:-1]])).logits[0]
            tokens.append(new)
            logits.append(full[len(p) - 1:len(p) - 1 + steps])
    return tokens, logits


def transform_or_xfail(wrapper, mode):
    return dcp_compile.transform(wrapper, tp=TP, dcp=DCP, mode=mode, block_size=BLOCK,
                                 shapes=SHAPES, check=False)  # compared with generate()


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("model_id", MODEL_PARAMS)
def test_transformed_hf_model_matches_hf_generate(model_id, mode):
    config_name, model_name, overrides, prepare_kwargs = MODELS[model_id]
    model = build(config_name, model_name, overrides)
    own_attention = model.config._attn_implementation
    wrapper = hf.prepare(model, **prepare_kwargs)
    program = transform_or_xfail(wrapper, mode)

    steps = STEPS[mode]
    prompts = prompts_of(LENGTHS, vocab=VOCAB)
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True)
    assert model.config._attn_implementation == own_attention   # HF's own attention, still
    ref_tokens, ref_logits = hf_reference(model, prompts, steps)

    for run in runs:
        assert run.result.tokens == ref_tokens, f"rank {run.rank}"
        for t, got in enumerate(run.result.logits):
            for b in range(len(prompts)):
                assert_close_report(got[b], ref_logits[b][t], atol=ATOL,
                                    what=f"rank {run.rank} step {t} seq {b} "
                                         f"(len={LENGTHS[b]})")


def test_wrapper_matches_hf_forward_single_device():
    """The wrapper alone (paged attention, one device) equals HF's forward, incl. padding."""
    model = build("LlamaConfig", "LlamaForCausalLM", MODELS["llama-gqa-8to2"][2])
    wrapper = hf.prepare(model)
    prompts = prompts_of((5, 3), vocab=VOCAB)
    ids = torch.zeros(2, 5, dtype=torch.int64)
    positions = torch.full((2, 5), -1, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
        positions[b, :len(p)] = torch.arange(len(p))
    caches = [torch.zeros(wrapper.kv_cache_shape(5, BLOCK)) for _ in range(4)]
    table = torch.tensor([[0, 1], [2, 3]])
    with torch.no_grad():
        logits, new = wrapper(ids, positions, table, caches)
        for b, p in enumerate(prompts):
            expected = model(torch.tensor([p])).logits[0]
            assert_close_report(logits[b, :len(p)], expected, atol=ATOL, what=f"seq {b}")
    assert len(new) == 4 and all(c.shape == caches[0].shape for c in new)
    assert wrapper.num_layers == 2 and wrapper.kv_cache_shape(7, 4) == (7, 4, 2, 8)


# -- rejected: never sharded wrong ---------------------------------------------------------

def test_fused_qkv_and_norms_across_heads_are_left_to_the_placement_analysis():
    # Phi3's fused qkv_proj and OLMo2's q_norm over all heads prepare; transform() shards
    # them segment-aware (numerics: tests/frontends/test_sharding_models.py).
    hf.prepare(build("Phi3Config", "Phi3ForCausalLM",
                     dict(num_attention_heads=8, num_key_value_heads=2)))
    hf.prepare(build("Olmo2Config", "Olmo2ForCausalLM",
                     dict(num_attention_heads=8, num_key_value_heads=2)))


def test_sliding_window_needs_max_model_len():
    model = build("MistralConfig", "MistralForCausalLM",
                  dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=32))
    with pytest.raises(DCPTransformError,
                       match=r"model\.layers\.0\.self_attn uses sliding-window attention"):
        hf.prepare(model)
    with pytest.raises(DCPTransformError, match="max_model_len <= 32"):
        hf.prepare(model, max_model_len=64)
    assert hf.prepare(model, max_model_len=32).max_model_len == 32


def test_training_mode_rejected():
    model = build("LlamaConfig", "LlamaForCausalLM", MODELS["llama-gqa-8to2"][2]).train()
    with pytest.raises(DCPTransformError, match="training mode"):
        hf.prepare(model)


def test_paged_attention_outside_the_wrapper_is_an_error():
    model = build("LlamaConfig", "LlamaForCausalLM", MODELS["llama-gqa-8to2"][2])
    model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    with pytest.raises(DCPTransformError, match="dcp_compile.hf.prepare"):
        model(torch.zeros(1, 2, dtype=torch.int64))


def test_transform_accepts_a_raw_hf_model():
    """transform() wraps a transformers model itself (dcp_compile.hf.prepare)."""
    from dcp_compile.verify import verify
    model = build(*MODELS["llama-gqa-8to2"][:2], MODELS["llama-gqa-8to2"][2])
    shapes = StepShapes(batch=2, context_len=12, max_blocks=2, num_blocks=5)
    program = dcp_compile.transform(model, tp=4, dcp=2, mode="decode", shapes=shapes)
    prompts = [[1, 2, 3], list(range(5, 17))]
    report = verify(dcp_compile.hf.prepare(model), program, prompts, 4)
    assert report.ok, report


# -- hf.prepare names what it cannot take, and only raises our own errors -----------------

def test_prepare_refuses_an_mla_model_naming_the_direct_path():
    model = build("DeepseekV3Config", "DeepseekV3ForCausalLM",
                  dict(num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=16,
                       q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                       head_dim=4, n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, first_k_dense_replace=2, n_group=2,
                       topk_group=1))
    with pytest.raises(DCPTransformError, match=r"Multi-head Latent Attention .*kv_lora_rank=16"
                       r".*Pass the model itself to dcp_compile.transform"):
        hf.prepare(model)


def test_prepare_names_a_decoder_layer_that_drops_the_attention_kwargs():
    # Nemotron's decoder layer calls self_attn without the model's **kwargs: the paged cache
    # never reaches attention. The message says so (not "called outside the wrapper").
    model = build("NemotronConfig", "NemotronForCausalLM",
                  dict(num_attention_heads=8, num_key_value_heads=2))
    with pytest.raises(DCPTransformError,
                       match=r"does not pass \*\*kwargs on to attention.*model itself"):
        hf.prepare(model)


def test_prepare_turns_a_config_error_into_ours(monkeypatch):
    # Gemma-4's config raises (not AttributeError) for a field its layout defines per layer
    # type; prepare reads around it instead of leaking transformers' exception.
    model = build("LlamaConfig", "LlamaForCausalLM", MODELS["llama-gqa-8to2"][2])

    def raising(self):
        raise ValueError("head_dim is defined per layer type")
    monkeypatch.setattr(type(model.config), "head_dim", property(raising), raising=False)
    wrapper = hf.prepare(model)          # head_dim falls back to hidden_size // heads
    assert wrapper.head_dim == 8
