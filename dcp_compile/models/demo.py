"""The built-in demo model: a small Llama-style decoder whose attention is the paged op.

Embedding -> L x [RMSNorm -> GQA attention with RoPE (``dcp.paged_attention``) -> residual
-> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head. Weights are seeded and
deterministic. Head reshapes use -1 for the head count (as Hugging Face models do), so that a
tensor-parallel shard of the projections needs no edit of view shapes.

Step signature (the same for every step kind and for the transformed programs):
    forward(input_ids [B, S], positions [B, S], block_table [B, M], kv_caches)
        -> (logits [B, S, vocab], new_kv_caches)
``kv_caches`` is a flat list [k_0, v_0, k_1, v_1, ...] of per-layer caches, each
[num_blocks, block_size, num_kv_heads, head_dim]; positions are -1 on padding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from dcp_compile.runtime.kernels import ops  # noqa: F401  (registers torch.ops.dcp.*)


@dataclass(frozen=True)
class DemoConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_q_heads: int = 16
    num_kv_heads: int = 2
    head_dim: int = 8
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0

    def to_json(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype) -> tuple[Tensor, Tensor]:
    angles = positions.clamp(min=0).float()[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    # [B, S, 1, D]: broadcast over heads, so any head shard works unchanged.
    return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_q_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_q_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, positions, block_table, key_cache, value_cache):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out, key_cache, value_cache = torch.ops.dcp.paged_attention(
            q, k, v, key_cache, value_cache, positions, block_table, self.scale)
        return self.o_proj(out.reshape(b, s, -1)), key_cache, value_cache


class MLP(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, positions, block_table, key_cache, value_cache):
        h, key_cache, value_cache = self.self_attn(self.input_layernorm(x), cos, sin,
                                                   positions, block_table, key_cache,
                                                   value_cache)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, key_cache, value_cache


class DemoLlama(nn.Module):
    """Tiny Llama-style decoder; default sizes admit tp=8, dcp=4 in both modes."""

    def __init__(self, cfg: DemoConfig = DemoConfig()):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float()
                                              / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        if any(p.is_meta for p in self.parameters()):
            return
        gen = torch.Generator().manual_seed(self.config.seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5))

    # Facts the transform reads instead of guessing from shapes.
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)

    def forward(self, input_ids: Tensor, positions: Tensor, block_table: Tensor,
                kv_caches: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        new_caches = []
        for i, layer in enumerate(self.layers):
            x, kc, vc = layer(x, cos, sin, positions, block_table, kv_caches[2 * i],
                              kv_caches[2 * i + 1])
            new_caches += [kc, vc]
        return self.lm_head(self.norm(x)), new_caches


def demo_model(cfg: DemoConfig | None = None, *, device="cpu",
               dtype=torch.float32) -> DemoLlama:
    """The built-in demo model with deterministic weights (meta device: shapes only)."""
    with torch.device(device):
        model = DemoLlama(cfg or DemoConfig())
    return model.to(dtype).eval()
