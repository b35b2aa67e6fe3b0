"""Tiny configs of hybrid (recurrent + attention) transformers types, one function for all:
``tiny_hybrid_config(model_type)`` -> the config keyword arguments (per-layer lists that
match ``num_hidden_layers``; sizes under the config's own names). The corpus
(tests/support/hf_corpus.py) may reuse it for the types it lists as not building here.

Layer pattern: four layers, recurrent / full attention alternating, so a program has two of
each and the interleave of the two kinds is exercised (a layer's index decides its kind).
"""

from __future__ import annotations

from hf_corpus import DROP, MLA, MOE, TINY

# Recurrent layer, attention layer, twice.
_LAYERS = 4
_QWEN_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                 linear_value_head_dim=8, linear_conv_kernel_dim=4)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
               mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4)

_HYBRID = {
    "qwen3_next": dict(**MOE, **_QWEN_GDN, num_hidden_layers=_LAYERS,
                       layer_types=["linear_attention", "full_attention"] * (_LAYERS // 2)),
    "qwen3_5_moe_text": dict(**MOE, **_QWEN_GDN, num_hidden_layers=_LAYERS,
                             layer_types=["linear_attention", "full_attention"] * (_LAYERS // 2)),
    "qwen3_5_text": dict(**_QWEN_GDN, num_hidden_layers=_LAYERS,
                         layer_types=["linear_attention", "full_attention"] * (_LAYERS // 2)),
    # Mamba2 + attention; chunk size 4 so the model's own SSD scan runs several chunks
    "bamba": dict(**_MAMBA2, num_hidden_layers=_LAYERS, attn_layer_indices=[1, 3]),
    # Granite-4-H: Bamba's mixer, granite's MoE and scalings
    "granitemoehybrid": dict(**MOE, **_MAMBA2, num_hidden_layers=_LAYERS,
                             layer_types=["mamba", "attention"] * (_LAYERS // 2)),
    # LFM2: short convolutions (conv state only) beside attention; dense and MoE
    "lfm2": dict(num_hidden_layers=_LAYERS, layer_types=["conv", "full_attention"] * (_LAYERS // 2)),
    "lfm2_moe": dict(**MOE, num_hidden_layers=_LAYERS,
                     layer_types=["conv", "full_attention"] * (_LAYERS // 2)),
}

# The other Mamba2 hybrids (docs/hybrid.md, "The other Mamba hybrids").
_HYBRID.update({
    # Nemotron-H: its own layer pattern (mamba / attention / MLP / MoE blocks, one mixer
    # each); a Mamba2 block followed by a MoE block (ungated relu² experts, a group-limited
    # sigmoid router, a shared expert), an attention block followed by an MLP block
    "nemotron_h": dict(**MOE, layers_block_type=["mamba", "moe", "attention", "mlp"] * 2,
                       mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=8,
                       conv_kernel=4, chunk_size=4, num_hidden_layers=DROP,
                       moe_shared_expert_intermediate_size=32),
    # Falcon-H1: a Mamba2 mixer and attention side by side in every layer; every mup
    # multiplier away from 1 (the ssm's per-segment ones too) and the gated group norm on
    "falcon_h1": dict(num_hidden_layers=2, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
                      mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4,
                      mamba_rms_norm=True, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9],
                      ssm_in_multiplier=0.7, ssm_out_multiplier=1.3,
                      attention_in_multiplier=0.9, attention_out_multiplier=1.1,
                      key_multiplier=0.8, embedding_multiplier=1.2, lm_head_multiplier=0.9,
                      mlp_multipliers=[0.9, 1.1]),
    # Zamba2: a Mamba2 mixer in every layer; the two hybrid layers call one shared attention
    # block (num_mem_blocks=1: its weights tied), with RoPE. Grouped-query attention and no
    # LoRA adapters: the model's k/v adapters assume as many KV heads as query heads, and
    # decode DCP needs fewer (docs/hybrid.md)
    "zamba2": dict(num_hidden_layers=_LAYERS, layers_block_type=["mamba", "hybrid"] * 2,
                   n_mamba_heads=8, mamba_ngroups=2, mamba_d_state=8, mamba_d_conv=4,
                   mamba_expand=2, chunk_size=4, attention_hidden_size=DROP,
                   num_mem_blocks=1, use_shared_attention_adapter=False,
                   use_mem_rope=True, head_dim=DROP),
    # Jamba: Mamba-1 mixers (conv, x_proj, dt / B / C norms, selective scan) beside attention
    # (period 2, offset 1), MoE feed-forward on every other layer
    "jamba": dict(**MOE, num_hidden_layers=_LAYERS, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                  mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8),
    # Zamba: multi-head Mamba-1 (per-head x_proj / dt_proj) in every layer; the two hybrid
    # layers call one shared attention block (tied weights) on [hidden | embeddings]
    "zamba": dict(num_hidden_layers=_LAYERS, layers_block_type=["mamba", "hybrid"] * 2,
                  attention_hidden_size=128, attention_head_dim=16, n_mamba_heads=2,
                  mamba_d_state=8, mamba_dt_rank=8, mamba_d_conv=4, mamba_expand=2,
                  head_dim=DROP),
})
# Appended by the linear-attention work (docs/hybrid.md, "Linear-attention hybrids").
# Kimi Linear: KDA / MLA alternating, MoE in every layer; MLA sizes of the corpus (q LoRA),
# 4 KDA heads of 8 (the conv over 3 * 32 channels).
_HYBRID["kimi_linear"] = dict(
    **MOE, **MLA, num_shared_experts=1, num_experts_per_token=2, num_expert_group=1,
    linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
    num_hidden_layers=_LAYERS, layer_types=["linear_attention", "full_attention"] * (_LAYERS // 2),
    mlp_layer_types=["sparse"] * _LAYERS)
# Bailing-hybrid: KDA (its forget gate, the model's own module, with the config's default
# safe-gate bound) / MLA alternating, MoE in every layer after the first.
_HYBRID["bailing_hybrid"] = dict(
    **MOE, **MLA, num_shared_experts=1, num_experts_per_token=2, num_expert_group=2,
    linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
    num_hidden_layers=_LAYERS, layer_types=["linear_attention", "full_attention"] * (_LAYERS // 2))

# OLMo-hybrid: Gated DeltaNet (separate q / k / v projections, beta doubled by
# allow_neg_eigval, value heads wider than key heads) / full attention with q / k norms over
# all heads, post-norm layers.
_HYBRID["olmo_hybrid"] = dict(linear_num_value_heads=4, linear_num_key_heads=2,
                              linear_key_head_dim=8, linear_value_head_dim=16,
                              linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
                              num_hidden_layers=_LAYERS,
                              layer_types=["linear_attention", "full_attention"] * (_LAYERS // 2))

# The layer kinds of the configs above that are attention (the others are recurrent).
ATTENTION_KINDS = ("full_attention", "attention")
# The layer kinds with no recurrent mixer: attention, and Nemotron-H's MLP / MoE blocks.
NON_RECURRENT_KINDS = ATTENTION_KINDS + ("mlp", "moe")
# The layer kinds that attend: attention, and "hybrid" layers (a Mamba2 mixer beside the
# attention: Falcon-H1's every layer, Zamba2's shared-block layers).
ATTENDING_KINDS = ATTENTION_KINDS + ("hybrid",)

HYBRID_TYPES = tuple(_HYBRID)

# MiniMax: lightning attention / full attention alternating, MoE in every layer (block_size
# 4: the model's own block form runs several blocks on a prompt of 8). Not in HYBRID_TYPES:
# its mixer takes (hidden, position_embeddings, attention_mask) and returns a pair, and has
# no conv state (tests/frontends/test_hybrid_lin.py tests it).
_HYBRID["minimax"] = dict(**MOE, num_hidden_layers=_LAYERS, block_size=4,
                          layer_types=["linear_attention", "full_attention"] * (_LAYERS // 2))


def tiny_hybrid_config(model_type: str) -> dict:
    """The tiny config's keyword arguments for ``model_type`` (KeyError: no tiny config
    written for it yet)."""
    kw = {**TINY, **_HYBRID[model_type]}
    return {k: v for k, v in kw.items() if v is not DROP}


# Sizes under which the recurrent mixers run cut by heads at tp=4 and tp=8
# (docs/hybrid.md, "The layout"): 8 key heads (Gated DeltaNet), 8 groups (Mamba2), 8 heads
# (lightning attention, KDA), 64 channels (short conv).
_GDN_CUT = dict(linear_num_key_heads=8, linear_num_value_heads=16)
_MAMBA2_CUT = dict(mamba_n_groups=8)
HEAD_CUT_SIZES = {
    "qwen3_next": _GDN_CUT, "qwen3_5_text": _GDN_CUT, "qwen3_5_moe_text": _GDN_CUT,
    "olmo_hybrid": _GDN_CUT,
    "bamba": _MAMBA2_CUT, "granitemoehybrid": _MAMBA2_CUT, "falcon_h1": _MAMBA2_CUT,
    "nemotron_h": dict(n_groups=8), "zamba2": dict(mamba_ngroups=8),
    # MiniMax's lightning attention is cut by heads: its tiny config's 8 already divide by 8
    "minimax": {},
    # KDA (Kimi Linear, Bailing-hybrid) by heads: 8 of them (the tiny configs have 4)
    "kimi_linear": dict(linear_num_heads=8), "bailing_hybrid": dict(linear_num_heads=8),
    # LFM2's short conv by channels: the tiny configs' 64 divide by 8
    "lfm2": {}, "lfm2_moe": {},
}
# One group (the configs' default for Bamba, Granite-4-H, Falcon-H1, Zamba2): cut by heads
# with B and C whole on every rank.
ONE_GROUP_SIZES = {"bamba": dict(mamba_n_groups=1), "granitemoehybrid": dict(mamba_n_groups=1),
                   "falcon_h1": dict(mamba_n_groups=1), "nemotron_h": dict(n_groups=1),
                   "zamba2": dict(mamba_ngroups=1)}


def build_hybrid(model_type: str, attention: str = "sdpa", *, seed: int = 0, **sizes):
    """The tiny ``model_type`` model with seeded weights (fp32, eval); ``sizes`` override
    the tiny config's (``HEAD_CUT_SIZES[model_type]``: the head-cut variant)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from helpers import seeded_weights

    config = CONFIG_MAPPING[model_type](**{**tiny_hybrid_config(model_type), **sizes})
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    return seeded_weights(model, seed)

# RecurrentGemma: recurrent (Conv1d + RG-LRU) / local attention alternating. A window of 4
# (shorter than the prompts of 8 and the decode steps after them: the sliding window bites)
# and a logits soft-cap of 5 (logits of magnitude 4-8: the cap bites). Not in HYBRID_TYPES:
# its block takes (hidden, position_ids, attention_mask) and returns a pair
# (tests/frontends/test_hybrid_rglru.py tests it).
_HYBRID["recurrent_gemma"] = dict(num_hidden_layers=_LAYERS, lru_width=64,
                                  block_types=["recurrent", "attention"],
                                  attention_window_size=4, logits_soft_cap=5.0)

# The 2026 hybrids with swap rules (docs/hybrid.md, "LFM3 and LaRA-mini"). Not in HYBRID_TYPES
# (tests/frontends/test_hybrid_newhyb.py tests them). LFM3: LFM2's short conv beside
# sliding (window 4: shorter than the prompts of 8) and full attention with the per-head
# sigmoid output gate and sandwich norms. LaRA-mini: Qwen3.5's Gated DeltaNet beside sliding
# attention (RoPE) and full attention (NoPE), MoE in every layer.
_HYBRID["lfm3"] = dict(num_hidden_layers=_LAYERS, sliding_window=4, use_attention_gate=True,
                       use_sandwich_norm=True,
                       layer_types=["conv", "sliding_attention", "conv", "full_attention"])
_HYBRID["lara_mini"] = dict(**MOE, **_QWEN_GDN, num_hidden_layers=_LAYERS, sliding_window=4,
                            layer_types=["linear_attention", "sliding_attention",
                                         "linear_attention", "full_attention"])
HEAD_CUT_SIZES["lara_mini"] = _GDN_CUT
