"""An ordinary Llama-style causal LM: no KV cache, no project API.

``forward(input_ids [B, S] (, position_ids [B, S])) -> logits [B, S, vocab]``, attention
through ``F.scaled_dot_product_attention`` or written out (``q @ k^T * scale + causal mask ->
softmax -> @ v``). This is the kind of model ``dcp_compile.transform`` rewrites by inserting
the paged KV cache itself (passes/insert_paged_cache.py); it shares the demo model's config,
weights initialisation and blocks, so the two are directly comparable.

Options (each one an attention form the cache insertion recognises):
  attention   "sdpa" (is_causal=True) | "sdpa_mask" (explicit boolean causal mask) |
              "eager" (additive -inf mask, float32 softmax)
  gqa         "repeat_kv" (expand + reshape, as Hugging Face) | "repeat_interleave" |
              "enable_gqa" (SDPA's own GQA; sdpa attentions only)
  fused_qkv   one [q; k; v] projection split after the matmul
  position_ids  False: forward(input_ids) only; positions are ``arange(S)``
  window      eager only: a sliding window (key j visible to query i iff i - window < j <= i)
  softcap     eager only: logit soft-capping ``tanh(scores / softcap) * softcap`` (Gemma 2)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .demo import MLP, DemoConfig, DemoLlama, RMSNorm, rotate_half

ATTENTIONS = ("sdpa", "sdpa_mask", "eager")
GQA_FORMS = ("repeat_kv", "repeat_interleave", "enable_gqa")


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * groups, S, D] (Hugging Face's expand + reshape)."""
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


class PlainAttention(nn.Module):
    def __init__(self, cfg: DemoConfig, attention: str, gqa: str, fused_qkv: bool,
                 window: int = 0, softcap: float = 0.0):
        super().__init__()
        self.cfg, self.attention, self.gqa, self.fused_qkv = cfg, attention, gqa, fused_qkv
        self.window, self.softcap = window, softcap
        self.scale = cfg.head_dim ** -0.5
        q_w, kv_w = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if fused_qkv:
            self.qkv_proj = nn.Linear(cfg.hidden_size, q_w + 2 * kv_w, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, q_w, bias=False)
            self.k_proj = nn.Linear(cfg.hidden_size, kv_w, bias=False)
            self.v_proj = nn.Linear(cfg.hidden_size, kv_w, bias=False)
        self.o_proj = nn.Linear(q_w, cfg.hidden_size, bias=False)

    def _qkv(self, x):
        if not self.fused_qkv:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        c = self.cfg
        return self.qkv_proj(x).split([c.num_q_heads * c.head_dim,
                                       c.num_kv_heads * c.head_dim,
                                       c.num_kv_heads * c.head_dim], dim=-1)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        d = self.cfg.head_dim
        q, k, v = (t.view(b, s, -1, d) for t in self._qkv(x))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))              # [B, H, S, D]
        groups = q.shape[1] // k.shape[1]
        if self.gqa == "repeat_kv":
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        elif self.gqa == "repeat_interleave":
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        gqa = self.gqa == "enable_gqa"
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                 enable_gqa=gqa)
        elif self.attention == "sdpa_mask":
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=gqa)
        else:
            mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
            if self.window:
                mask = mask + torch.full((s, s), float("-inf"),
                                         device=x.device).tril(-self.window)
            scores = q @ k.transpose(-2, -1) * self.scale
            if self.softcap:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            scores = scores + mask
            out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class PlainDecoderLayer(nn.Module):
    """Pre-norm residual block around ``self_attn`` (any attention module taking
    ``(x, cos, sin)``; also the MLA model's) and the demo MLP."""

    def __init__(self, cfg, self_attn: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class PlainLlama(nn.Module):
    """The demo model's architecture as an ordinary PyTorch causal LM (see module doc)."""

    def __init__(self, cfg: DemoConfig = DemoConfig(), *, attention: str = "sdpa",
                 gqa: str = "repeat_kv", fused_qkv: bool = False, window: int = 0,
                 softcap: float = 0.0):
        super().__init__()
        if attention not in ATTENTIONS or gqa not in GQA_FORMS or \
                ((window or softcap) and attention != "eager"):
            raise ValueError(f"attention must be one of {ATTENTIONS} (eager for window and "
                             f"softcap) and gqa one of {GQA_FORMS}: got attention="
                             f"{attention!r}, gqa={gqa!r}, window={window}, softcap={softcap}.")
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            PlainDecoderLayer(cfg, PlainAttention(cfg, attention=attention, gqa=gqa,
                                                  fused_qkv=fused_qkv, window=window,
                                                  softcap=softcap))
            for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float()
                                              / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        DemoLlama.reset_parameters(self)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        x = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=x.device).unsqueeze(0)
        angles = position_ids.float()[..., None] * self.inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, :, None], emb.sin().to(x.dtype)[:, :, None]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class PlainLlamaNoPositions(PlainLlama):
    """``forward(input_ids)`` only: positions come from an arange over the sequence."""

    def forward(self, input_ids: Tensor) -> Tensor:
        return super().forward(input_ids)


def plain_llama(cfg: DemoConfig | None = None, *, device="cpu", dtype=torch.float32,
                position_ids: bool = True, **options) -> PlainLlama:
    """An ordinary Llama-style model with deterministic weights (meta device: shapes only)."""
    cls = PlainLlama if position_ids else PlainLlamaNoPositions
    with torch.device(device):
        model = cls(cfg or DemoConfig(), **options)
    return model.to(dtype).eval()
