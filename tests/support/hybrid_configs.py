"""Tiny configs of hybrid (recurrent + attention) transformers types, one function for all:
``tiny_hybrid_config(model_type)`` -> the config keyword arguments (per-layer lists that
match ``num_hidden_layers``; sizes under the config's own names). The corpus
(tests/support/hf_corpus.py) may reuse it for the types it lists as not building here.

Layer pattern: four layers, recurrent / full attention alternating, so a program has two of
each and the interleave of the two kinds is exercised (a layer's index decides its kind).
"""

from __future__ import annotations

from hf_corpus import MLA, MOE, TINY

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

# The layer kinds of the configs above that are attention (the others are recurrent).
ATTENTION_KINDS = ("full_attention", "attention")

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
    return {**TINY, **_HYBRID[model_type]}


def build_hybrid(model_type: str, attention: str = "sdpa", *, seed: int = 0):
    """The tiny ``model_type`` model with seeded weights (fp32, eval)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from helpers import seeded_weights

    config = CONFIG_MAPPING[model_type](**tiny_hybrid_config(model_type))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    return seeded_weights(model, seed)
