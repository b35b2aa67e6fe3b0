"""An ordinary Multi-head Latent Attention (MLA) causal LM, DeepSeek-V2/V3 style.

``forward(input_ids [B, S] (, position_ids [B, S])) -> logits [B, S, vocab]``, no KV cache,
attention through ``F.scaled_dot_product_attention`` over the *expanded* K/V, written as
Hugging Face's ``DeepseekV3Attention`` computes it:

  q          = q_proj(x)  or  q_b_proj(RMSNorm(q_a_proj(x)))  -> [B, H, S, dn + dr]
  q_nope, q_pe = split(q, [dn, dr])
  latent, k_pe = split(kv_a_proj_with_mqa(x), [L, dr])          (L = kv_lora_rank)
  k_nope, v  = split(kv_b_proj(RMSNorm(latent)) per head, [dn, dv])
  q_pe, k_pe = RoPE(q_pe), RoPE(k_pe)                           (k_pe: one head, shared)
  k          = cat(k_nope, k_pe expanded to all heads)          (qk_head_dim = dn + dr)
  out        = SDPA(cat(q_nope, q_pe), k, v, causal, scale = qk_head_dim ** -0.5)

The compiler's cache holds per token only [RMSNorm(latent) ; RoPE(k_pe)] (L + dr wide, one
"KV head"): passes/absorb_latent_attention.py rewrites this attention into that form.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .demo import DemoLlama, RMSNorm, rotate_half
from .plain import PlainDecoderLayer


@dataclass(frozen=True)
class MLAConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_q_heads: int = 8
    q_lora_rank: int = 0            # 0: plain q_proj
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 12
    intermediate_size: int = 96
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    attention: str = "sdpa"         # "sdpa" | "eager" (q @ k^T, additive mask, softmax, @ v)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def to_json(self) -> dict:
        return asdict(self)


class MLAAttention(nn.Module):
    def __init__(self, cfg: MLAConfig):
        super().__init__()
        self.cfg = cfg
        h, dq = cfg.num_q_heads, cfg.qk_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * dq, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, h * dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size,
                                            cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank,
                                   h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.scale = dq ** -0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        c = self.cfg
        b, s, _ = x.shape
        dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if c.q_lora_rank \
            else self.q_proj(x)
        q = q.view(b, s, -1, dn + dr).transpose(1, 2)                     # [B, H, S, dq]
        q_nope, q_pe = torch.split(q, [dn, dr], dim=-1)
        latent, k_pe = torch.split(self.kv_a_proj_with_mqa(x), [c.kv_lora_rank, dr], dim=-1)
        k_pe = k_pe.view(b, s, 1, dr).transpose(1, 2)                     # [B, 1, S, dr]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, -1, dn + dv)
        k_nope, v = torch.split(kv.transpose(1, 2), [dn, dv], dim=-1)    # [B, H, S, *]
        q_pe = q_pe * cos + rotate_half(q_pe) * sin
        k_pe = k_pe * cos + rotate_half(k_pe) * sin
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        if c.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
            out = torch.softmax(q @ k.transpose(-2, -1) * self.scale + mask, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class PlainMLA(nn.Module):
    """A DeepSeek-style MLA decoder as an ordinary PyTorch causal LM (see module doc)."""

    def __init__(self, cfg: MLAConfig = MLAConfig()):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(PlainDecoderLayer(cfg, MLAAttention(cfg))
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        dr = cfg.qk_rope_head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dr, 2).float() / dr))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        DemoLlama.reset_parameters(self)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        x = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=x.device).unsqueeze(0)
        angles = position_ids.float()[..., None] * self.inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]  # [B,1,S,dr]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def plain_mla(cfg: MLAConfig | None = None, *, device="cpu", dtype=torch.float32,
              **fields) -> PlainMLA:
    """An ordinary MLA model with deterministic weights; ``fields`` override MLAConfig."""
    cfg = cfg or MLAConfig()
    if fields:
        cfg = MLAConfig(**{**cfg.to_json(), **fields})
    with torch.device(device):
        model = PlainMLA(cfg)
    return model.to(dtype).eval()


# Hugging Face DeepseekV2/V3ForCausalLM from a tiny config (every layer dense: no MoE layer is
# exported), the same sizes as MLAConfig's defaults.
HF_DEEPSEEK_TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
    topk_group=1, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
    pad_token_id=None, attn_implementation="sdpa")


def hf_deepseek(version: str = "V3", **overrides):
    """``transformers.Deepseek<version>ForCausalLM`` with seeded random weights (no download).

    HF's 0.02-std init makes logits of ~1e-2 whose top two nearly tie; the weights are scaled
    (``randn / sqrt(fan_in)``, norms ``1 + 0.1 randn``) so greedy tokens are a meaningful
    comparison. ``overrides`` replace fields of :data:`HF_DEEPSEEK_TINY`.
    """
    import transformers
    config = getattr(transformers, f"Deepseek{version}Config")(
        **{**HF_DEEPSEEK_TINY, **overrides})
    model = getattr(transformers, f"Deepseek{version}ForCausalLM")(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    return model
