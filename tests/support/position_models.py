"""Hand-written causal LMs whose positions are computed the usual ways (tests/frontends/test_positions).

Each is ``forward(input_ids [B, S]) -> logits``, no KV cache, no ``position_ids``: positions
come from ``torch.arange(S)`` or from a table sliced by the length, as people write them.
``POSITION_FORMS`` names each form; the attention and MLP are the plain Llama blocks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dcp_compile.models.demo import MLP, DemoConfig, DemoLlama, RMSNorm, rotate_half


def _inv_freq(d: int, theta: float = 10000.0) -> Tensor:
    return 1.0 / theta ** (torch.arange(0, d, 2).float() / d)


class ArangeFloatRope(nn.Module):
    """The most common plain Llama: ``arange(S).float()``, outer product with inv_freq,
    cat, cos / sin (lit-gpt, many tutorials); ``temperature`` scales queries by a log1p of
    the position (positions through arithmetic)."""

    complex = False

    def __init__(self, d: int, temperature: bool = False):
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(d), persistent=False)
        self.temperature = temperature

    def forward(self, s: int, device):
        t = torch.arange(s, device=device).float()
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = None
        if self.temperature:   # [S, 1]: one query scale per position
            scale = (1 + 0.1 * torch.log1p(t)).unsqueeze(-1)
        return emb.cos(), emb.sin(), scale


class CachedTableRope(nn.Module):
    """cos / sin tables computed once in __init__ and sliced by the length (``cos[:S]``)."""

    complex = False

    def __init__(self, d: int, max_positions: int = 64):
        super().__init__()
        t = torch.arange(max_positions).float()
        emb = torch.cat([torch.outer(t, _inv_freq(d))] * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, s: int, device):
        return self.cos_cached[:s], self.sin_cached[:s], None


class ComplexRope(nn.Module):
    """Meta's Llama reference: ``freqs_cis = polar(1, outer(t, inv_freq))`` in __init__,
    ``freqs_cis[:S]``, and the rotation as a complex product."""

    complex = True

    def __init__(self, d: int, max_positions: int = 64):
        super().__init__()
        angles = torch.outer(torch.arange(max_positions).float(), _inv_freq(d))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def forward(self, s: int, device):
        return self.freqs_cis[:s], None, None


def _rotate_complex(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """x [B, S, H, D] real; freqs_cis [S, D/2] complex."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[:, None, :]).flatten(3)
    return out.type_as(x)


class PosAttention(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_q_heads * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_q_heads * d, cfg.hidden_size, bias=False)

    def forward(self, x, rope, complex_rope: bool):
        b, s, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, s, -1, d)
        k = self.k_proj(x).view(b, s, -1, d)
        v = self.v_proj(x).view(b, s, -1, d)
        if rope is not None:
            cos, sin, scale = rope
            if complex_rope:
                q, k = _rotate_complex(q, cos), _rotate_complex(k, cos)
            else:       # [S, D] tables broadcast over [B, H, S, D] after the transpose
                q, k = q.transpose(1, 2), k.transpose(1, 2)
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
                if scale is not None:
                    q = q * scale
                q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class PosLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = PosAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, complex_rope):
        x = x + self.self_attn(self.input_layernorm(x), rope, complex_rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LearnedPositions(nn.Module):
    """A learned position table looked up by ``arange(S) + offset`` (OPT keeps 2 extra rows:
    ``max_positions + 2``), added to the token embedding."""

    def __init__(self, cfg: DemoConfig, rows: int, offset: int):
        super().__init__()
        self.offset = offset
        self.table = nn.Embedding(rows, cfg.hidden_size)

    def forward(self, s, device):
        return self.table(torch.arange(s, device=device).unsqueeze(0) + self.offset)


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal positions (the Transformer paper, XGLM): a [max, hidden] table made
    in __init__, rows gathered by position."""

    def __init__(self, cfg: DemoConfig, rows: int = 64):
        super().__init__()
        half = cfg.hidden_size // 2
        freq = torch.exp(torch.arange(half).float() * -(math.log(10000.0) / (half - 1)))
        angles = torch.arange(rows).float()[:, None] * freq[None]
        self.register_buffer("table", torch.cat([angles.sin(), angles.cos()], dim=1),
                             persistent=False)

    def forward(self, s, device):
        return self.table.index_select(0, torch.arange(s, device=device))[None]


class PositionsLM(nn.Module):
    """Plain Llama blocks; positions by ``rope`` (rotary) and/or ``absolute`` (added)."""

    def __init__(self, cfg: DemoConfig, rope: nn.Module | None = None,
                 absolute: nn.Module | None = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope, self.absolute = rope, absolute
        self.layers = nn.ModuleList(PosLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        DemoLlama.reset_parameters(self)
        if absolute is not None:
            with torch.no_grad():
                for p in absolute.parameters():
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))

    def forward(self, input_ids: Tensor) -> Tensor:
        s = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        if self.absolute is not None:
            x = x + self.absolute(s, x.device)
        rope = self.rope(s, x.device) if self.rope is not None else None
        complex_rope = getattr(self.rope, "complex", False)
        for layer in self.layers:
            x = layer(x, rope, complex_rope)
        return self.lm_head(self.norm(x))


def position_models(cfg: DemoConfig) -> dict:
    """id -> factory of each position form (the ids name the form)."""
    d = cfg.head_dim
    return {
        "arange-float-rope": lambda: PositionsLM(cfg, rope=ArangeFloatRope(d)),
        "arange-rope-log1p-temperature": lambda: PositionsLM(
            cfg, rope=ArangeFloatRope(d, temperature=True)),
        "cached-cos-sin-sliced": lambda: PositionsLM(cfg, rope=CachedTableRope(d)),
        "complex-freqs_cis-sliced": lambda: PositionsLM(cfg, rope=ComplexRope(d)),
        "learned-table-opt-offset-2050-rows": lambda: PositionsLM(
            cfg, absolute=LearnedPositions(cfg, rows=2050, offset=2)),
        "sinusoidal-table": lambda: PositionsLM(cfg, absolute=SinusoidalPositions(cfg)),
    }
