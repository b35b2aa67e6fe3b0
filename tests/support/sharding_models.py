"""Hand-written decoders with the projection and norm layouts real models use, written against
``torch.ops.dcp.paged_attention`` like the demo model (dcp_compile/models/demo.py).

``FeatureConfig`` picks one feature per axis:
  qkv:      separate | fused_rows ([q; k; v] rows, cut by split_with_sizes) | fused_slices
            ([q; k; v] cut by slicing, as Phi3) | per_head ([h, 3, d], GPT-NeoX) |
            three_first ([3, h, d], unbind)
  mlp:      separate | fused (gate_up then chunk, as Phi3)
  q_gate:   the q projection also carries an output gate [q ; gate], chunked, sigmoid
  qk_norm:  none | per_head (over head_dim) | across (over the whole projection, OLMo2)
  literal_heads: views name the head count (view(b, s, 8, 16)) instead of -1
  rope:     half (rotate_half) | interleaved (stack of pairs, GPT-J style)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

import dcp_compile.runtime.kernels.ops  # noqa: F401
from dcp_compile.models.demo import RMSNorm, rope_cos_sin, rotate_half


@dataclass(frozen=True)
class FeatureConfig:
    qkv: str = "separate"
    mlp: str = "separate"
    q_gate: bool = False
    qk_norm: str = "none"
    literal_heads: bool = False
    rope: str = "half"
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 8
    hidden: int = 64
    intermediate: int = 96
    vocab: int = 128
    layers: int = 2
    seed: int = 0


def rotate_interleaved(x: Tensor) -> Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class FeatureAttention(nn.Module):
    def __init__(self, c: FeatureConfig):
        super().__init__()
        self.c = c
        hq, hkv, d = c.num_q_heads, c.num_kv_heads, c.head_dim
        self.qw, self.kvw = hq * d, hkv * d
        qw = self.qw * (2 if c.q_gate else 1)
        if c.qkv == "separate":
            self.q_proj = nn.Linear(c.hidden, qw, bias=False)
            self.k_proj = nn.Linear(c.hidden, self.kvw, bias=False)
            self.v_proj = nn.Linear(c.hidden, self.kvw, bias=True)
        else:
            assert not c.q_gate
            self.qkv_proj = nn.Linear(c.hidden, self.qw + 2 * self.kvw, bias=True)
        if c.qk_norm == "per_head":
            self.q_norm, self.k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
        elif c.qk_norm == "across":
            self.q_norm, self.k_norm = RMSNorm(self.qw, 1e-6), RMSNorm(self.kvw, 1e-6)
        self.o_proj = nn.Linear(self.qw, c.hidden, bias=False)

    def _heads(self, x, b, s, h):
        return x.view(b, s, h if self.c.literal_heads else -1, self.c.head_dim)

    def project(self, x):
        c, (b, s, _) = self.c, x.shape
        hq, hkv, d = c.num_q_heads, c.num_kv_heads, c.head_dim
        gate = None
        if c.qkv == "separate":
            q = self.q_proj(x)
            if c.q_gate:
                q, gate = q.chunk(2, dim=-1)
            k, v = self.k_proj(x), self.v_proj(x)
        elif c.qkv == "fused_rows":
            q, k, v = self.qkv_proj(x).split([self.qw, self.kvw, self.kvw], dim=-1)
        elif c.qkv == "fused_slices":
            qkv = self.qkv_proj(x)
            q = qkv[..., :self.qw]
            k = qkv[..., self.qw:self.qw + self.kvw]
            v = qkv[..., self.qw + self.kvw:]
        elif c.qkv == "per_head":       # [h, 3, d]: GPT-NeoX query_key_value
            qkv = self.qkv_proj(x).view(b, s, hq if c.literal_heads else -1, 3 * d)
            q, k, v = qkv.split(d, dim=-1)
            return q, k, v, gate
        elif c.qkv == "three_first":    # [3, h, d]
            qkv = self.qkv_proj(x).view(b, s, 3, hq if c.literal_heads else -1, d)
            q, k, v = qkv.unbind(2)
            return q, k, v, gate
        if c.qk_norm == "across":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = self._heads(q, b, s, hq), self._heads(k, b, s, hkv), self._heads(v, b, s, hkv)
        return q, k, v, gate

    def forward(self, x, cos, sin, positions, block_table, key_cache, value_cache):
        c, (b, s, _) = self.c, x.shape
        q, k, v, gate = self.project(x)
        if c.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        rot = rotate_half if c.rope == "half" else rotate_interleaved
        q = q * cos + rot(q) * sin
        k = k * cos + rot(k) * sin
        out, key_cache, value_cache = torch.ops.dcp.paged_attention(
            q, k, v, key_cache, value_cache, positions, block_table, c.head_dim ** -0.5)
        out = out.reshape(b, s, c.num_q_heads * c.head_dim if c.literal_heads else -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out), key_cache, value_cache


class FeatureMLP(nn.Module):
    def __init__(self, c: FeatureConfig):
        super().__init__()
        self.fused = c.mlp == "fused"
        if self.fused:
            self.gate_up_proj = nn.Linear(c.hidden, 2 * c.intermediate, bias=False)
        else:
            self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
            self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x):
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.functional.silu(gate) * up)


class FeatureLayer(nn.Module):
    def __init__(self, c: FeatureConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden, 1e-6)
        self.self_attn = FeatureAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden, 1e-6)
        self.mlp = FeatureMLP(c)

    def forward(self, x, cos, sin, positions, block_table, kc, vc):
        h, kc, vc = self.self_attn(self.input_layernorm(x), cos, sin, positions, block_table,
                                   kc, vc)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kc, vc


class FeatureLM(nn.Module):
    def __init__(self, c: FeatureConfig = FeatureConfig()):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(FeatureLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, 1e-6)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        d = c.head_dim
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        gen = torch.Generator().manual_seed(c.seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5))
        self.eval()

    @property
    def num_layers(self) -> int:
        return self.config.layers

    def kv_cache_shape(self, num_blocks: int, block_size: int):
        return (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)

    def forward(self, input_ids, positions, block_table, kv_caches):
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        if self.config.rope == "interleaved":   # pairs (2i, 2i+1) share a frequency
            angles = positions.clamp(min=0).float()[..., None] * self.inv_freq
            emb = torch.stack((angles, angles), dim=-1).flatten(-2)
            cos, sin = emb.cos()[:, :, None, :], emb.sin()[:, :, None, :]
        new = []
        for i, layer in enumerate(self.layers):
            x, kc, vc = layer(x, cos, sin, positions, block_table, kv_caches[2 * i],
                              kv_caches[2 * i + 1])
            new += [kc, vc]
        return self.lm_head(self.norm(x)), new
