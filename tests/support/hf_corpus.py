"""The corpus: every causal decoder model type of transformers 5.x that builds from a tiny
config, built with random weights (nothing is downloaded), and what dcp_compile does with it.

`CORPUS` is our own list, by model type: the overrides that make the type's config tiny.
`EXCLUDED` names the model types of transformers' causal-LM mapping that are not in the
corpus and why (they do not build as a tiny text decoder). tests/corpora/test_hf_corpus.py runs
each corpus type through transform() (via hf.prepare and directly, decode and prefill) and
compares with the model's own forward; `python tests/support/hf_corpus.py --write-docs` rewrites
the table of docs/models.md.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from dataclasses import dataclass

import torch

from helpers import seeded_weights
from suite_path import ROOT

# Every tiny config starts from this; CORPUS rows add or drop keys for their type.
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, intermediate_size=96, head_dim=8,
            max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, attention_dropout=0.0)
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
           shared_expert_intermediate_size=32, decoder_sparse_step=1, n_group=2,
           topk_group=1, norm_topk_prob=True)
MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8,
           v_head_dim=8, head_dim=4, num_key_value_heads=8)
DROP = object()   # a CORPUS value: do not pass this key (the config derives it)

OVR = {
    **{t: MLA for t in ("deepseek_v2", "deepseek_v32", "minicpm3", "glm4_moe_lite",
                        "glm_moe_dsa", "sarvam_mla", "axk1", "axk2", "youtu")},
    "deepseek_v3": {**MOE, **MLA}, "longcat_flash": {**MOE, **MLA, "num_layers": 2},
    "codegen": dict(rotary_dim=4), "gptj": dict(rotary_dim=4),
    "falcon": dict(head_dim=DROP), "gpt_neo": dict(attention_types=[[["global", "local"], 1]],
                                                   num_layers=2, num_heads=8),
    "dbrx": dict(d_model=64, n_heads=8, n_layers=2),
    "ministral": dict(sliding_window=64), "cwm": dict(bos_token_id=DROP, eos_token_id=DROP, pad_token_id=DROP),
    "modernbert-decoder": dict(pad_token_id=DROP, bos_token_id=DROP, eos_token_id=DROP),
    "exaone4": dict(sliding_window=64, sliding_window_pattern=2),
    # Gemma 4: head_dim 8 on sliding layers, 16 on full ones (per_layer_config), the last two
    # layers reading the KV of earlier ones (num_kv_shared_layers), a small per-layer input.
    "gemma4_text": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=16,
                        sliding_window=64, num_hidden_layers=4,
                        layer_types=["sliding_attention", "full_attention"] * 2,
                        per_layer_config={"01": {"head_dim": 16}, "03": {"head_dim": 16}},
                        num_kv_shared_layers=2),
}
# Sizes under the type's own config names (hybrid linear-attention / Mamba heads, per-layer
# lists, index heads, MoE sizes the MOE keys do not reach). Per-layer lists follow
# num_hidden_layers=2: each list names one layer of each kind the type interleaves.
LINEAR = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_conv_kernel_dim=4)
ENCODER_IDS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2)   # RoBERTa-style embeddings
OVR.update({
    "axk2": {**MLA, "index_head_dim": 8, "index_n_heads": 2},
    "hy_v4": {**MLA, "index_head_dim": 16, "index_n_heads": 16},
    "dots3_note_text": {**MLA, "num_key_value_heads": 8, "index_head_dim": 8, "index_n_heads": 2,
                        "shared_experts_intermediate_size": 32, "sliding_window": 8,
                        "per_layer_config": {}},
    "deepseek_v4": dict(head_dim=16, q_lora_rank=24, qk_rope_head_dim=4, o_groups=2,
                        o_lora_rank=16, index_n_heads=2, index_head_dim=8, sliding_window=8,
                        num_nextn_predict_layers=0, num_key_value_heads=1),
    "ergo": dict(first_dense_intermediate_size=96, shared_intermediate_size=32, sliding_window=8,
                 num_dense_blocks=1, global_attention_every_n_layers=2),
    "gemma3n_text": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=8,
                         sliding_window=8, num_kv_shared_layers=0, intermediate_size=[96, 96],
                         altup_num_inputs=2, laurel_rank=4,
                         activation_sparsity_pattern=[0.0, 0.0]),
    **{t: dict(unpadded_vocab_size=256, swa_num_attention_heads=8, swa_num_key_value_heads=2,
               swa_head_dim=8, sliding_window_size=8, n_layers_per_attn_res_block=1)
       for t in ("inkling_text", "inkling2_text", "inkling2_loop_text")},
    "kimi_linear": dict(MLA, num_shared_experts=1, num_experts_per_token=2, num_expert_group=1,
                        linear_head_dim=8, linear_num_heads=8, q_lora_rank=DROP),
    "kolibri1_1": dict(head_dim=16, index_num_heads=2, mlp_only_intermediate_size=96,
                       sliding_window=8),
    "laguna": dict(num_attention_heads_per_layer=[8, 8], sliding_window=8),
    "lara_mini": dict(LINEAR, sliding_window=8),
    "mimo_v2_flash": dict(v_head_dim=8, sliding_window=8),
    "moshi": dict(ffn_dim=96, sliding_window=64),
    "qwen3_5_text": LINEAR, "qwen3_5_moe_text": LINEAR, "qwen3_next": LINEAR,
    "qwen4_exp_text": dict(LINEAR, ngram_vocab_size_base=256, heads_per_ngram=2),
    "roc_bert": dict(shape_vocab_size=16, shape_embed_dim=8, pronunciation_vocab_size=16,
                     pronunciation_embed_dim=8),
    "zaya": dict(router_hidden_size=16, num_experts_per_tok=1),
    "xlnet": dict(max_position_embeddings=DROP, d_model=64, n_head=8, d_inner=96, n_layer=2),
    "xlm": dict(pad_index=0, emb_dim=64, n_heads=8, n_layers=2),
    "reformer": dict(is_decoder=True, feed_forward_size=96, attn_layers=["local", "local"], axial_pos_shape=[8, 16],
                     axial_pos_embds_dim=[32, 32], attention_head_size=8,
                     local_attn_chunk_length=8, pad_token_id=DROP),
    "cpmant": dict(dim_head=8, dim_ff=96),
    # Dory: input, recurrent (looped n_recurrent_loops times) and output layers must add up to
    # num_hidden_layers (its defaults are 8 + (-14) + 8 at 2 layers).
    "dory": dict(n_input_layers=1, n_recurrent_layers=1, n_output_layers=0),
    "cohere_compass_text": dict(sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={t: dict(rope_type="default", rope_theta=1e4)
                                                 for t in ("sliding_attention",
                                                           "full_attention")}),
    "dbrx": dict(d_model=64, n_heads=8, n_layers=2, max_seq_len=128,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0), ffn_config=dict(ffn_hidden_size=96,
                                                                 moe_num_experts=4,
                                                                 moe_top_k=2)),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "mamba2": dict(num_heads=8, head_dim=16, state_size=16, n_groups=1, chunk_size=8,
                   pad_token_id=DROP),
    "modernbert-decoder": dict(pad_token_id=0, bos_token_id=DROP, eos_token_id=DROP,
                               sliding_window=8),
    "zamba": dict(num_hidden_layers=4, attention_hidden_size=128, attention_head_dim=16,
                  n_mamba_heads=2, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False,
                  # two hybrid layers: they share one attention block (tied weights)
                  layers_block_type=["linear_attention", "hybrid"] * 2),
    "zamba2": dict(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
                   hybrid_layer_ids=[1], mamba_d_state=8, n_mamba_heads=2, mamba_headdim=64,
                   attention_hidden_size=128, attention_head_dim=16, kv_channels=8,
                   num_query_groups=8, use_mamba_kernels=False, chunk_size=8),
    **{t: ENCODER_IDS for t in ("camembert", "data2vec-text", "roberta", "roberta-prelayernorm",
                                "xlm-roberta", "xlm-roberta-xl", "xmod")},
})
for _t in ("axk1", "axk2", "deepseek_v2", "deepseek_v4", "ergo", "glm4_moe_lite", "hy_v4",
           "inkling_text", "inkling2_text", "inkling2_loop_text", "kimi_linear", "kolibri1",
           "kolibri1_1", "laguna", "lara_mini", "minicpm5_moe", "mimo_v2_flash", "param2moe",
           "qwen3_5_moe_text", "qwen3_next", "qwen4_exp_text", "sarvam_mla", "zaya",
           "dots3_note_text", "lfm2_moe", "jamba", "bailing_hybrid", "granitemoehybrid"):
    OVR[_t] = {**MOE, **OVR.get(_t, {})}
# Hybrids: one layer of each kind (recurrent / linear first, then full attention).
HYBRID_LAYERS = {
    "bailing_hybrid": dict(MLA, layer_types=["linear_attention", "full_attention"]),
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"]),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm3": dict(layer_types=["conv", "full_attention"]),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "indexed_attention"],
                           indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
                           indexer_budget=8, indexer_compress_ratio=4),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"]),
    "kolibri1": dict(layer_types=["sliding_attention", "full_attention"]),
    "laguna": dict(layer_types=["sliding_attention", "full_attention"]),
    "dots3_note_text": dict(layer_types=["indexed_attention", "sliding_attention"],
                            head_dim=12),   # its SWA head_dim is qk_nope + qk_rope
    "deepseek_v4": dict(layer_types=["heavily_compressed_attention",
                                     "compressed_sparse_attention"],
                        mlp_layer_types=["hash_moe", "moe"]),
}
for _t, _layers in HYBRID_LAYERS.items():
    OVR[_t] = {**OVR.get(_t, {}), **_layers}
for _t in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared",
           "glm4_moe", "phimoe", "jetmoe", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "minimax",
           "minimax_m2", "flex_olmo", "sarvam_moe", "afmoe", "gpt_oss", "lfm2_moe", "cohere2_moe",
           "exaone_moe", "granitemoe_swa", "aria_text", "llama4_text"):
    OVR[_t] = {**MOE, **OVR.get(_t, {})}

# Our list: every causal decoder type of transformers 5.x that builds from a tiny config.
CORPUS = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2", "bailing_hybrid",
    "bamba", "beam", "bert", "bert-generation", "big_bird", "biogpt", "bitnet", "bloom",
    "camembert", "codegen", "cohere", "cohere2", "cohere2_moe", "cohere_compass_text", "cpmant",
    "ctrl", "cwm", "data2vec-text", "dbrx", "deepseek_v2", "deepseek_v3", "deepseek_v32",
    "deepseek_v4", "diffllama", "doge", "dory", "dots1", "dots3_note_text", "electra", "ergo",
    "ernie", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "falcon", "falcon_h1",
    "falcon_mamba", "flex_olmo", "flint", "fuyu", "gemma", "gemma2", "gemma3_text", "gemma3n_text",
    "gemma4_text", "gemma4_unified_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite",
    "glm_moe_dsa", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gpt_neox_japanese",
    "gpt_oss", "gptj", "granite", "granite_swa", "granitemoe", "granitemoe_swa",
    "granitemoehybrid", "granitemoeshared", "helium", "hrm_text", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax", "inkling2_loop_text", "inkling2_text",
    "inkling_text", "internlm3", "iquestcoder", "jais2", "jamba", "jetmoe", "kimi_linear",
    "kolibri1", "kolibri1_1", "laguna", "lara_mini", "lfm2", "lfm2_moe", "lfm3", "llama",
    "llama4_text", "longcat_flash", "mamba", "mamba2", "megatron-bert", "mellum", "mimo_v2_flash",
    "minicpm3", "minicpm5_moe", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral",
    "ministral3", "mistral", "mixtral", "modernbert-decoder", "moshi", "mpt", "nanochat",
    "nemotron", "nemotron_h", "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe", "openai-gpt",
    "opt", "param2moe", "persimmon", "phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen4_exp_text",
    "recurrent_gemma", "reformer", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
    "roformer", "rwkv", "sarvam_mla", "sarvam_moe", "seed_oss", "smollm3", "solar_open",
    "stablelm", "starcoder2", "trocr", "vaultgemma", "xglm", "xlm", "xlm-roberta",
    "xlm-roberta-xl", "xlnet", "xlstm", "xmod", "youtu", "zamba", "zamba2", "zaya",
)

# Not in the corpus, and why: composite (multimodal / encoder-decoder) models whose causal LM
# needs more than a text config, and types whose configs do not build as a tiny decoder here.
EXCLUDED = {
    "bart": "encoder-decoder family (decoder-only head needs decoder_* sizes)",
    "bigbird_pegasus": "encoder-decoder family", "blenderbot": "encoder-decoder family",
    "blenderbot-small": "encoder-decoder family", "marian": "encoder-decoder family",
    "mbart": "encoder-decoder family", "mvp": "encoder-decoder family",
    "pegasus": "encoder-decoder family", "plbart": "encoder-decoder family",
    "prophetnet": "encoder-decoder family", "whisper": "speech encoder-decoder",
    "blt": "byte-latent composite",
    "emu3": "multimodal composite", "gemma3": "multimodal composite (gemma3_text is in)",
    "gemma3n": "multimodal composite", "gemma4": "multimodal composite",
    "gemma4_unified": "multimodal composite (gemma4_unified_text is in)",
    "gemma4_assistant": "assistant head of a composite",
    "gemma4_unified_assistant": "assistant head of a composite",
    "git": "vision-text composite", "got_ocr2": "vision-text composite",
    "llama4": "multimodal composite (llama4_text is in)", "mllama": "multimodal composite",
    "moss_transcribe_diarize": "speech composite", "phi4_multimodal": "multimodal composite",
    "qwen3_5": "multimodal composite (qwen3_5_text is in)",
    "qwen3_5_moe": "multimodal composite (qwen3_5_moe_text is in)",
    "qwen4_exp": "multimodal composite", "musicgen": "audio composite",
    "musicgen_melody": "audio composite",
    "dots3_note": "multimodal composite (dots3_note_text is in)",
}

# What a DCPError says, by the feature it names (first match wins). A refusal that names
# none of these is reported as "other" and fails the corpus test: users must learn why.
REASONS = (
    # Parts of 2026 models no dcp op computes (module_recurrent.NOT_BUILT), named first:
    ("QSA block-sparse attention (Qwen4-exp indexed_attention)", r"through QSA"),
    ("hashed n-gram embeddings (Qwen4-exp PLE)", r"hashed n-grams"),
    ("compressed convolutional attention (ZAYA CCA)", r"Compressed Convolutional Attention"),
    ("four short convs per layer + hidden-state position bias (Inkling)",
     r"four depthwise short convolutions"),
    ("differential attention (two softmaxes over one K)", r"attends over the same keys as"),
    ("layers looped with shared weights (recurrent depth)", r"loops its layers with shared"),
    ("mixture of attention heads (JetMoE: routed projections)", r"mixture of attention heads"),
    # (before the features: its message names the source file, e.g. integrations/moe.py)
    ("prefill: MLP over flattened tokens [B*S, H]", r"sequence parallelism splits dim 1|"
                                                    r"survived sequence parallelism"),
    ("MHA: decode DCP needs tp > kv heads", r"tp > num_kv_heads"),
    ("compressed attention (DeepSeek-V4 HCA / CSA)", r"compressed attention is not served"),
    ("DeepSeek Sparse Attention (indexer top-k)", r"DeepSeek Sparse Attention"),
    ("per-layer KV layouts (hf.prepare keeps one)", r"has per-layer KV layouts or KV shared"),
    ("KV shared in part (K or V only)", r"but not its (key|value): a layer reads another"),
    ("ALiBi", r"alibi"),
    ("scores carried across layers (residual attention)", r"\(residual attention"),
    ("heads mixed before the softmax (talking heads)", r"\(talking heads"),
    ("attention sinks", r"attention sinks|\bsinks?\b|s_aux"),
    ("hybrid: hf.prepare carries no recurrent state", r"hf\.prepare carries no recurrent "
                                                       r"state"),
    ("SSM / linear-attention layers", r"SSM|mamba|linear[- ]attention|recurren|state[- ]space"
                                      r"|conv1d|short conv"),
    ("memory key/values", r"memory key/values"),
    ("encoder (not causal)", r"not causal|is_causal=False|bidirectional|encoder|cross[- ]att"),
    ("token mixing outside attention", r"mixes tokens along the sequence"),
    ("logits of the last position only", r"returns the logits of the last position only"),
    ("length-dependent positions (LongRoPE, dynamic NTK)", r"max\(positions\)"),
    ("mask written in place", r"is written in place|unrecognised op aten\.\w+_\.\w+ between"),
    ("chunked attention", r"chunk"),
    ("softcap", r"softcap"),
    ("experts in bf16 inside an fp32 model", r"the experts compute in \S+ inside a"),
    ("data-dependent control flow (not exportable)", r"on fake tensors: DynamicOutputShape"),
    ("mixture of experts", r"expert|\bmoe\b(?!-mla)|router"),   # not docs/moe-mla.md
    ("latent attention (MLA)", r"latent|\bmla\b"),
    ("sliding window", r"window"),
    ("model-built attention mask", r"attention mask|its own mask"),
    ("position encoding", r"position|rope|rotary"),
    ("no AttentionInterface (prepare)", r"AttentionInterface"),
    ("decoder layer drops attention kwargs", r"does not pass \*\*kwargs"),
    # Limits of the compiler itself, named by what the message says it met:
    ("prefill: residual stream not [B, S, ...] (Gemma 3n's stacked AltUp streams)",
     r"sequence parallelism needs \[B, S="),
    ("mask form not recognised (where on scores)", r"where\.ScalarOther between `q @ k\^T`"),
    ("a bias added to the scores", r"unrecognised op aten\.add\.Tensor between `q @ k\^T`"),
    ("K/V heads tiled", r"K/V heads tiled"),
    # A product mask scores * b + F * (1 - b) is read (OpenAI-GPT's, F = -1e4); with a
    # fill that does not vanish it is refused naming F; other tensor scales as such:
    ("a finite mask fill that does not vanish", r"a finite mask fill F="),
    ("mask form not recognised (scores * mask)", r"attention scores scaled by a tensor"),
    ("attention shared across calls", r"called attention twice|layer_idx=None"),
    ("prefill: attention output gated per token", r"reaches its O projection (\S+ )?through "
                                                  r"token-indexed inputs"),
    ("data-dependent control flow (not exportable)", r"could not capture|data-dependent|"
                                                      r"dynamic shape \([^)]*u\d+"),
    ("attention form not recognised", r"no attention this compiler recognises"),
    ("prefill: a view folds the token dim", r"the token dim \(dim \d+, size \d+\) and the "
                                            r"dims before it must stay"),
    ("per-head modules over split + cat (StableLM qk_layernorm)",
     r"per-head modules with their own parameters"),
    ("a projection fused per group, cut finer than its groups",
     r"is finer than the \d+ groups"),
    ("unsupported op", r"no (placement )?rule|not recogni[sz]ed|cannot shard|refus"),
    ("config", r"config"),
)

PATHS = ("prepare", "sdpa", "eager")   # hf.prepare; the model itself, with that attention
MODES = ("decode", "prefill")
TP, DCP, BLOCK = 4, 2, 4
LENGTHS = (1, 7, 9, 16)               # vblock = 8: inside, at and past a vblock's edge
STEPS = {"decode": 8, "prefill": 1}
ATOL = 1e-4


@dataclass
class Outcome:
    kind: str            # "matches" | "refused" | "mismatch" | "crash" | "n/a"
    reason: str = ""     # refused: the REASONS name; mismatch: the error; crash: the type
    message: str = ""

    def cell(self) -> str:
        return {"matches": "matches", "n/a": "n/a"}.get(self.kind, f"{self.kind}: {self.reason}")


def reason_of(message: str) -> str:
    # The ordinary frontend's note on how it took the model is context, not the reason.
    message = message.split(" was taken as an ordinary causal LM")[0]
    for name, pattern in REASONS:
        if re.search(pattern, message, re.IGNORECASE):
            return name
    return "other"


# What a type needs after it is built and before it runs (X-MOD: the language its adapters use).
AFTER_BUILD = {"xmod": lambda model: model.set_default_language(model.config.languages[0])}


def config_kwargs(model_type: str) -> dict:
    kw = {**TINY, **OVR.get(model_type, {})}
    return {k: v for k, v in kw.items() if v is not DROP}


def build(model_type: str, attention: str | None = None, *, seed: int = 0, **overrides):
    """The tiny model of ``model_type`` (its config keys ``overrides`` changed) with seeded
    weights large enough that greedy tokens are not near-ties; norms and biases random too,
    so a mis-sharded one shows."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type](**{**config_kwargs(model_type), **overrides})
    kwargs = {"attn_implementation": attention} if attention else {}
    model = AutoModelForCausalLM.from_config(config, **kwargs).eval()
    if model_type in AFTER_BUILD:
        AFTER_BUILD[model_type](model)
    return seeded_weights(model, seed)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in LENGTHS]


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """A transformers causal LM's logits for ``ids`` from its full forward, no cache."""
    return model(ids, use_cache=False).logits


def reference(model, prompt_list, steps, logits_of=hf_logits):
    """Greedy tokens and each step's logits from the model's own full forward (no cache);
    ``logits_of(model, ids)`` is that forward's ``[1, S, V]`` (or ``[1, 1, V]``) logits."""
    tokens, logits = [], []
    with torch.no_grad():
        for p in prompt_list:
            ids, got, rows = list(p), [], []
            for _ in range(steps):
                row = logits_of(model, torch.tensor([ids]))[0, -1]
                rows.append(row)
                got.append(int(row.argmax()))
                ids.append(got[-1])
            tokens.append(got)
            logits.append(torch.stack(rows))
    return tokens, logits


def run_case(model_type: str, path: str, mode: str) -> Outcome:
    """One corpus cell: transform, run on a threaded world, compare with the model."""
    from dcp_compile import hf

    try:
        model = build(model_type, None if path == "prepare" else path)
    except (ValueError, ImportError) as e:
        if path != "prepare" and "attn" in str(e).lower() or "support" in str(e).lower():
            return Outcome("n/a", message=str(e).splitlines()[0])
        raise
    return run_model(model, mode, prepare=hf.prepare if path == "prepare" else None)


def run_model(model, mode: str, *, prepare=None, logits_of=hf_logits,
              check: bool | None = None, tp: int = TP, dcp: int = DCP) -> Outcome:
    """One corpus cell for a built ``model`` (any corpus: tests/support/third_party.py uses
    it too): transform ``prepare(model)`` (or the model itself) with ``check`` at ``tp`` /
    ``dcp``, run the program on a threaded world with the garbage block poisoned, compare
    every step with the model's own full forward (``logits_of``)."""
    import dcp_compile
    from dcp_compile.runtime.serving.engine import StepShapes
    from dcp_compile.runtime.errors import DCPCompilerBug, DCPError
    from dcp_compile.verify import run_threaded_program

    steps = STEPS[mode]
    blocks = 4 * DCP // dcp          # a row's context over fewer ranks needs more blocks
    shapes = StepShapes(batch=len(LENGTHS), context_len=max(LENGTHS),
                        max_blocks=blocks, num_blocks=blocks * len(LENGTHS) + 2)
    try:
        target = prepare(model) if prepare is not None else model
        program = dcp_compile.transform(target, tp=tp, dcp=dcp, mode=mode, block_size=BLOCK,
                                        shapes=shapes, check=check)
        runs = run_threaded_program(program, prompts(), steps, poison_garbage=True)
    except DCPCompilerBug as e:    # a DCPError, but a bug, not a refusal
        return Outcome("crash", f"DCPCompilerBug({type(e.original).__name__})", str(e)[:2000])
    except DCPError as e:
        return Outcome("refused", reason_of(str(e)), str(e))
    except Exception as e:  # noqa: BLE001  (a non-project exception is a corpus failure)
        return Outcome("crash", type(e).__name__,
                       "".join(traceback.format_exception_only(type(e), e)).strip()[:2000])
    ref_tokens, ref_logits = reference(model, prompts(), steps, logits_of)
    worst = 0.0
    for run in runs:
        for t, got in enumerate(run.result.logits):
            for b in range(len(LENGTHS)):
                worst = max(worst, float((got[b] - ref_logits[b][t]).abs().max()))
        if run.result.tokens != ref_tokens:
            return Outcome("mismatch", f"tokens differ on rank {run.rank}",
                           f"max |logits error| {worst:.3g}")
    if not worst <= ATOL:
        return Outcome("mismatch", f"max |logits error| {worst:.3g}")
    return Outcome("matches")


PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "models.md")
START, END = "<!-- corpus-table:start -->", "<!-- corpus-table:end -->"


def render_table(results: dict) -> str:
    """The corpus table of docs/models.md (a row per type, a column per path x mode) and the counts."""
    head = "| model type | " + " | ".join(f"{p} {m}" for p in PATHS for m in MODES) + " |"
    rule = "|" + "---|" * (1 + len(PATHS) * len(MODES))
    rows = [f"| `{t}` | " + " | ".join(results[(t, p, m)].cell() for p in PATHS
                                       for m in MODES) + " |" for t in CORPUS]
    counts: dict[str, int] = {}
    for out in results.values():
        counts[out.cell()] = counts.get(out.cell(), 0) + 1
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    return "\n".join([head, rule, *rows, "", f"Cells: {len(results)}. {summary}."])


def _cell(args):
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    return args, run_case(*args)


def write_docs(processes: int = 2) -> dict:
    """Run every cell (a process pool) and rewrite docs/models.md's table between its markers."""
    import multiprocessing
    cells = [(t, p, m) for t in CORPUS for p in PATHS for m in MODES]
    with multiprocessing.get_context("spawn").Pool(processes, maxtasksperchild=20) as pool:
        results = dict(pool.imap_unordered(_cell, cells))
    text = open(PAGE).read()
    table = render_table(results)
    new = re.sub(re.escape(START) + ".*?" + re.escape(END),
                 lambda _: f"{START}\n{table}\n{END}", text, flags=re.S)
    open(PAGE, "w").write(new)
    return results


@dataclass
class _Cell:
    """A cell as the page shows it (``update_docs`` keeps the rows it does not re-run)."""
    text: str

    def cell(self) -> str:
        return self.text


def page_cells() -> dict:
    """(type, path, mode) -> the cell docs/models.md's table shows now."""
    text = open(PAGE).read()
    rows = text.split(START)[1].split(END)[0].strip().splitlines()[2:]
    out = {}
    for row in rows:
        if not row.startswith("| `"):
            continue
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        for (path, mode), cell in zip([(p, m) for p in PATHS for m in MODES], cells[1:]):
            out[(cells[0].strip("`"), path, mode)] = _Cell(cell)
    return out


def update_docs(types: list[str], processes: int = 2) -> dict:
    """Run every cell of ``types`` only, and rewrite their rows of docs/models.md's table
    (and the counts; the other rows as the page shows them)."""
    import multiprocessing
    unknown = sorted(set(types) - set(CORPUS))
    if unknown:
        raise SystemExit(f"not corpus types: {unknown}")
    cells = [(t, p, m) for t in types for p in PATHS for m in MODES]
    with multiprocessing.get_context("spawn").Pool(processes, maxtasksperchild=20) as pool:
        fresh = dict(pool.imap_unordered(_cell, cells))
    results = {**page_cells(), **fresh}
    text = open(PAGE).read()
    table = render_table(results)
    open(PAGE, "w").write(re.sub(re.escape(START) + ".*?" + re.escape(END),
                                 lambda _: f"{START}\n{table}\n{END}", text, flags=re.S))
    return fresh


def main(argv: list[str]) -> int:
    """``python tests/support/hf_corpus.py TYPE[,TYPE...] [PATH,...] [MODE,...]``: run cells, print
    one line each (tab-separated: type, path, mode, cell, message).
    ``python tests/support/hf_corpus.py --write-docs [PROCESSES]``: every cell, into docs/models.md.
    ``python tests/support/hf_corpus.py --update-docs TYPE[,TYPE...] [PROCESSES]``: those
    types' cells only, into their rows of docs/models.md (and the counts)."""
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    if argv and argv[0] == "--write-docs":
        results = write_docs(int(argv[1]) if len(argv) > 1 else 2)
        bad = {k: v for k, v in results.items() if v.kind in ("mismatch", "crash")
               or v.reason == "other"}
        for k, v in sorted(bad.items()):
            print("\t".join(k), v.cell(), v.message[:300], sep="\t")
        return 1 if bad else 0
    if argv and argv[0] == "--update-docs":
        results = update_docs(argv[1].split(","), int(argv[2]) if len(argv) > 2 else 2)
        for k, v in sorted(results.items()):
            print("\t".join(k), v.cell(), v.message.replace("\n", " ")[:300], sep="\t")
        bad = [v for v in results.values() if v.kind in ("mismatch", "crash")
               or v.reason == "other"]
        return 1 if bad else 0
    types = argv[0].split(",")
    paths = argv[1].split(",") if len(argv) > 1 else PATHS
    modes = argv[2].split(",") if len(argv) > 2 else MODES
    for t in types:
        for path in paths:
            for mode in modes:
                out = run_case(t, path, mode)
                msg = out.message.replace("\n", " ")[:300]
                print(f"{t}\t{path}\t{mode}\t{out.cell()}\t{msg}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
