"""The attention forms the popular model libraries write (issue #35 item 2), each in a tiny
model of its own, transformed and compared with the model's own forward (fp32, 1e-4, greedy
tokens) at edge-case lengths, decode and prefill -- or refused by name where DCP cannot
serve it. canonicalize_ops rewrites each form into the one the attention reader reads
(tests/passes/test_before_expected_attention_forms.py shows the rewrites).

  gqa-expand-flatten     torchtune: k.unsqueeze(2).expand(b, n_kv, g, s, d).flatten(1, 2)
  gqa-expand-reshape     the same, ending in reshape
  gqa-token-major        torchtune's Gemma 2: heads repeated on [B, S, H, D], then moved
  gqa-broadcast-to       Falcon: k[:, :, None].broadcast_to(...) of grouped K/V
  kt-mT                  litgpt's Gemma 2 soft-capping path: q @ k.mT
  kt-permute             q @ k.permute(0, 1, 3, 2)
  kt-permute-bshd        k kept [B, S, H, D]: q @ k.permute(0, 2, 3, 1)
  kt-transpose-2-3       q @ k.transpose(2, 3)
  einsum                 x-transformers' Attend: einsum scores, softmax, einsum
  autocast-off-rope      x-transformers' RoPE under torch.autocast(enabled=False)
  bmm-heads-in-batch     XGLM: bmm on [B*H, S, D], max(scores, finfo.min)
  where-then-mask        GPT-Neo: where(tril buffer, scores, tensor(min)) + additive mask
  tril-buffer-index      gpt-fast: tril buffer indexed as causal_mask[None, None, pos]
  l2-normalize           x-transformers: F.normalize as qk_norm and as its RMSNorm
  tiled-heads            x-transformers: K/V heads tiled ('b kvh n d -> b (r kvh) n d') into SDPA
  tiled-heads-einsum     the same into its einsum attention
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dcp_compile
from dcp_compile.runtime.errors import DCPTokenMixingError, DCPTransformError
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.verify import run_threaded_program

from full_runs import full
from helpers import assert_runs_match, full_forward_reference, prompts_of, seeded_weights

TP, DCP, BLOCK = 4, 2, 4
VOCAB, DIM, HEADS, KV, HD = 256, 64, 8, 2, 8
G = HEADS // KV
MAX = 32
SHAPES = StepShapes(batch=4, context_len=12, max_blocks=4, num_blocks=12)
# 1 token; one short of and exactly BLOCK * DCP (a vblock); the longest the shapes allow.
LENGTHS = (1, BLOCK * DCP - 1, BLOCK * DCP, 12)
MIN = torch.finfo(torch.float32).min


def _causal_additive(s):
    return torch.full((s, s), float("-inf")).triu(1)


def _angles(pos):
    """RoPE's cos and sin [S, D/2] at positions ``pos`` [S] (x-transformers' outer-product
    einsum)."""
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
    ang = torch.einsum("i , j -> i j", pos.float(), inv)
    return ang.cos(), ang.sin()


def _rope(x, cos, sin):
    """Rotary embedding on [B, H, S, D] (half-split form)."""
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _repeat_kv(t):
    return t[:, :, None].expand(t.shape[0], KV, G, t.shape[2], HD).reshape(
        t.shape[0], HEADS, t.shape[2], HD)


def _eager(q, k, v, scores_of=lambda q, k: q @ k.transpose(-2, -1)):
    s = scores_of(q, _repeat_kv(k)) / math.sqrt(HD) + _causal_additive(q.shape[2])
    return F.softmax(s, dim=-1) @ _repeat_kv(v)


def gqa_expand_flatten(m, q, k, v, pos):
    b, _, s, _ = k.shape
    k, v = (t.unsqueeze(2).expand(b, KV, G, s, HD).flatten(1, 2) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def gqa_expand_reshape(m, q, k, v, pos):
    b, _, s, _ = k.shape
    k, v = (t.unsqueeze(2).expand(b, KV, G, s, HD).reshape(b, HEADS, s, HD) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def gqa_token_major(m, q, k, v, pos):
    b, _, s, _ = k.shape
    k, v = (t.transpose(1, 2).reshape(b, s, KV, 1, HD).expand(b, s, KV, G, HD)
            .reshape(b, s, HEADS, HD).transpose(1, 2) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def gqa_broadcast_to(m, q, k, v, pos):
    b, _, s, _ = k.shape
    k, v = (t[:, :, None].broadcast_to(b, KV, G, s, HD).reshape(b, HEADS, s, HD)
            for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def kt_mT(m, q, k, v, pos):
    """litgpt's soft-capping path: scores = q @ k.mT * scale, capped, masked."""
    s = _repeat_kv(k).mT
    scores = (q @ s) * (1.0 / math.sqrt(HD))
    scores = torch.tanh(scores / 30.0) * 30.0 + _causal_additive(q.shape[2])
    return F.softmax(scores, dim=-1, dtype=torch.float).to(q.dtype) @ _repeat_kv(v)


def kt_permute(m, q, k, v, pos):
    return _eager(q, k, v, lambda q, k: q @ k.permute(0, 1, 3, 2))


def kt_permute_bshd(m, q, k, v, pos):
    """K moved to [B, S, H, D] (after its heads were repeated), then ``permute(0, 2, 3, 1)``
    makes k^T from it."""
    return _eager(q, k, v, lambda q, k: q @ k.transpose(1, 2).permute(0, 2, 3, 1))


def kt_transpose_2_3(m, q, k, v, pos):
    return _eager(q, k, v, lambda q, k: q @ k.transpose(2, 3))


def einsum(m, q, k, v, pos):
    """x-transformers' Attend: kv heads repeated in place, einsum, masked_fill, einsum."""
    k, v = _repeat_kv(k), _repeat_kv(v)
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * HD ** -0.5
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
    return torch.einsum("b h i j, b h j d -> b h i d", sim.softmax(dim=-1), v)


def autocast_off_rope(m, q, k, v, pos):
    """x-transformers: RoPE applied under autocast(enabled=False) (its tables too, in
    FormLM.forward)."""
    with torch.autocast("cpu", enabled=False):
        q, k = _rope(q, *pos.tables), _rope(k, *pos.tables)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def bmm_heads_in_batch(m, q, k, v, pos):
    """XGLM: heads flattened into the batch, bmm, view back for the mask, max with
    finfo.min, view again for the softmax, bmm."""
    b, _, s, _ = q.shape
    q3, k3, v3 = (t.reshape(b * HEADS, s, HD) for t in (q * HD ** -0.5, _repeat_kv(k),
                                                          _repeat_kv(v)))
    w = torch.bmm(q3, k3.transpose(1, 2))
    w = w.view(b, HEADS, s, s) + _causal_additive(s)
    w = torch.max(w, torch.tensor(MIN))
    w = F.softmax(w.view(b * HEADS, s, s), dim=-1)
    return torch.bmm(w, v3).view(b, HEADS, s, HD)


def where_then_mask(m, q, k, v, pos):
    """GPT-Neo: where(the tril buffer, scores, tensor(min)), then the additive mask."""
    s = q.shape[2]
    w = q @ _repeat_kv(k).transpose(-1, -2)
    w = torch.where(m.tril[:, :, :s, :s], w, torch.tensor(MIN))
    w = F.softmax(w + _causal_additive(s), dim=-1)
    return w @ _repeat_kv(v)


def tril_buffer_index(m, q, k, v, pos):
    """gpt-fast: its bool tril buffer indexed by the positions, cut to the keys."""
    mask = m.tril2d[None, None, pos.positions][..., : q.shape[2]]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def l2_normalize(m, q, k, v, pos):
    """x-transformers' qk_norm: q and k l2-normalised per head (F.normalize: a vector norm and
    an expand_as), a fixed scale; FormLM also normalises its residual stream so (its RMSNorm)."""
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=10.0)


def _tile(t):
    """einops' 'b kvh n d -> b (r kvh) n d' (x-transformers): q head h reads kv head h % KV."""
    b, _, s, _ = t.shape
    return t.unsqueeze(1).expand(b, G, KV, s, HD).reshape(b, HEADS, s, HD)


def tiled_heads(m, q, k, v, pos):
    """x-transformers with attn_flash: tiled K/V heads into SDPA. Read as GQA with the query
    heads permuted (passes/untile_kv_heads.py): the q rows and o columns reordered."""
    return F.scaled_dot_product_attention(q, _tile(k), _tile(v), is_causal=True)


def tiled_heads_einsum(m, q, k, v, pos):
    """x-transformers' Attend on tiled K/V heads: einsum scores, masked_fill, softmax,
    einsum; the mask and the scale broadcast over the heads."""
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, _tile(k)) * HD ** -0.5
    s = q.shape[2]
    sim = sim.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), MIN)
    return torch.einsum("b h i j, b h j d -> b h i d", sim.softmax(dim=-1), _tile(v))


FORMS = {f.__name__.replace("_", "-"): f for f in (
    gqa_expand_flatten, gqa_expand_reshape, gqa_token_major, gqa_broadcast_to, kt_mT,
    kt_permute, kt_permute_bshd, kt_transpose_2_3, einsum, autocast_off_rope,
    bmm_heads_in_batch, where_then_mask, tril_buffer_index, l2_normalize, tiled_heads,
    tiled_heads_einsum)}


class Positions:
    """A forward's positions [S] and RoPE tables, made once before the layers."""

    def __init__(self, positions):
        self.positions, self.tables = positions, None


class FormLM(nn.Module):
    """Two layers of RoPE'd GQA attention (8 q heads, 2 kv heads) written in one form."""

    def __init__(self, attend):
        super().__init__()
        self.attend = attend
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            q=nn.Linear(DIM, HEADS * HD, bias=False), k=nn.Linear(DIM, KV * HD, bias=False),
            v=nn.Linear(DIM, KV * HD, bias=False), o=nn.Linear(HEADS * HD, DIM, bias=False)))
            for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        tril = torch.tril(torch.ones(MAX, MAX, dtype=torch.bool))
        self.register_buffer("tril2d", tril, persistent=False)
        self.register_buffer("tril", tril[None, None], persistent=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        pos = Positions(torch.arange(s))
        if self.attend is autocast_off_rope:
            with torch.autocast("cpu", enabled=False):
                pos.tables = _angles(pos.positions)
        else:
            pos.tables = _angles(pos.positions)
        for layer in self.layers:
            if self.attend is l2_normalize:       # x-transformers' RMSNorm
                x = F.normalize(x, dim=-1) * DIM ** 0.5
            heads = lambda t: t.view(b, s, -1, HD).transpose(1, 2)  # noqa: E731
            q, k, v = heads(layer["q"](x)), heads(layer["k"](x)), heads(layer["v"](x))
            if self.attend is not autocast_off_rope:
                q, k = _rope(q, *pos.tables), _rope(k, *pos.tables)
            y = self.attend(self, q, k, v, pos)
            x = x + layer["o"](y.transpose(1, 2).reshape(b, s, -1))
        return self.head(x)


def _transform(model, mode):
    return dcp_compile.transform(model, tp=TP, dcp=DCP, mode=mode, block_size=BLOCK,
                                 shapes=SHAPES, check=False)


# The slice: every form once, decode and prefill in turn (canonicalize_ops rewrites a form
# before the mode's passes, so each mode sees half the forms); DCP_FORMS_FULL=1 runs every
# form in both modes.
FORM_CELLS = [(form, mode) for k, form in enumerate(FORMS)
              for mode in ("decode", "prefill")
              if full("DCP_FORMS_FULL") or mode == ("decode", "prefill")[k % 2]]


@pytest.mark.parametrize("form,mode", FORM_CELLS, ids=[f"{f}-{m}" for f, m in FORM_CELLS])
def test_form_matches_the_models_own_forward(form, mode):
    model = seeded_weights(FormLM(FORMS[form]), 0).eval()
    program = _transform(model, mode)
    prompts = prompts_of(LENGTHS, vocab=VOCAB)
    steps = 4 if mode == "decode" else 1
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True)
    assert_runs_match(runs, *full_forward_reference(model, prompts, steps), atol=1e-4)


class PerGroupQKVLM(nn.Module):
    """torchtitan's fused wqkv: rows [q heads of group g; k_g; v_g] per KV head, read as
    ``view(b, s, KV, G + 2, HD).split([G, 1, 1], dim=-2)``; RoPE, SDPA with enable_gqa."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.wqkv = nn.ModuleList(nn.Linear(DIM, KV * (G + 2) * HD, bias=True) for _ in range(2))
        self.wo = nn.ModuleList(nn.Linear(HEADS * HD, DIM, bias=False) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        cos, sin = _angles(torch.arange(s))
        for wqkv, wo in zip(self.wqkv, self.wo):
            q, k, v = wqkv(x).view(b, s, -1, G + 2, HD).split([G, 1, 1], dim=-2)
            q, k, v = (t.reshape(b, s, -1, HD).transpose(1, 2) for t in (q, k, v))
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + wo(y.transpose(1, 2).reshape(b, s, -1))
        return self.head(x)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_qkv_fused_per_kv_group_matches_at_tp_above_kv_heads(mode):
    """tp=4 over 2 KV heads: a decode rank holds half of one group's q heads and the group's
    whole k/v. Read as [all q; all k; all v] with the rows reordered (ShardSpec.perm)."""
    model = seeded_weights(PerGroupQKVLM(), 0).eval()
    program = _transform(model, mode)
    assert sorted(n for n, spec in program.shards.items() if spec.perm) == [
        f"p_model_wqkv_{i}_{w}" for i in (0, 1) for w in ("bias", "weight")]
    prompts = prompts_of(LENGTHS, vocab=VOCAB)
    steps = 4 if mode == "decode" else 1
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True)
    assert_runs_match(runs, *full_forward_reference(model, prompts, steps), atol=1e-4)


class GatedValuesLM(nn.Module):
    """x-transformers' gate_values: the attention output times a per-token, per-head sigmoid
    gate of the hidden state, before the O projection (GQA, RoPE, SDPA)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            q=nn.Linear(DIM, HEADS * HD, bias=False), k=nn.Linear(DIM, KV * HD, bias=False),
            v=nn.Linear(DIM, KV * HD, bias=False), gate=nn.Linear(DIM, HEADS),
            o=nn.Linear(HEADS * HD, DIM, bias=False))) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        cos, sin = _angles(torch.arange(s))
        for layer in self.layers:
            heads = lambda t: t.view(b, s, -1, HD).transpose(1, 2)  # noqa: E731
            q, k, v = heads(layer["q"](x)), heads(layer["k"](x)), heads(layer["v"](x))
            y = F.scaled_dot_product_attention(_rope(q, cos, sin), _rope(k, cos, sin), v,
                                               is_causal=True, enable_gqa=True)
            y = y * layer["gate"](x).sigmoid().transpose(1, 2)[..., None]   # b h n 1
            x = x + layer["o"](y.transpose(1, 2).reshape(b, s, -1))
        return self.head(x)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_gated_attention_output_matches(mode):
    """Prefill: the gate is computed on every token of the chunk; the attention output holds
    this rank's contiguous tokens after the LSE reduce-scatter, and the gate is read at
    those (dcp_prefill._slice_o_side_inputs), padding rows included."""
    model = seeded_weights(GatedValuesLM(), 0).eval()
    program = _transform(model, mode)
    prompts = prompts_of(LENGTHS, vocab=VOCAB)
    steps = 4 if mode == "decode" else 1
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True)
    assert_runs_match(runs, *full_forward_reference(model, prompts, steps), atol=1e-4)


def test_gqa_forms_cache_the_kv_heads():
    """The cache holds the 2 kv heads (decode at tp=4 > 2 is served, not refused as MHA)."""
    program = _transform(seeded_weights(FormLM(gqa_expand_flatten), 0).eval(), "decode")
    assert program.config.num_kv_heads == KV


# -- refused by name -----------------------------------------------------------------------


def tiled_heads_per_head_scale(m, q, k, v, pos):
    """Tiled K/V heads, and q scaled per head by a tensor no projection computes: the head
    permutation would have to reorder it too, which untile_kv_heads does not do."""
    q = q * torch.linspace(0.5, 1.5, HEADS)[None, :, None, None]
    return F.scaled_dot_product_attention(q, _tile(k), _tile(v), is_causal=True)


def residual_scores(m, q, k, v, pos):
    """x-transformers' residual_attn: each layer's pre-softmax scores carried into the next
    layer's (the first layer adds nothing)."""
    s = q @ _repeat_kv(k).transpose(-2, -1) / math.sqrt(HD)
    if getattr(pos, "prev", None) is not None:
        s = s + pos.prev
    s = s.masked_fill(torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1), MIN)
    pos.prev = s
    return F.softmax(s, dim=-1) @ _repeat_kv(v)


def talking_heads(m, q, k, v, pos):
    """x-transformers' pre-softmax talking heads: a 1x1 conv2d over the heads (as channels)
    of the scores, added to them."""
    s = q @ _repeat_kv(k).transpose(-2, -1) / math.sqrt(HD)
    mix = torch.eye(HEADS)[:, :, None, None] * 0.5 + 0.01
    s = (s + F.conv2d(s, mix)).masked_fill(
        torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1), MIN)
    return F.softmax(s, dim=-1) @ _repeat_kv(v)


def autocast_on(m, q, k, v, pos):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = q @ _repeat_kv(k).transpose(-2, -1)
    s = s.float() / math.sqrt(HD) + _causal_additive(q.shape[2])
    return F.softmax(s, dim=-1) @ _repeat_kv(v)


@pytest.mark.parametrize("attend,match", [
    (tiled_heads_per_head_scale, r"K/V heads tiled \(q head h reads kv head h % 2.*cannot "
                                 r"be read as grouped-query attention with the 8 query heads "
                                 r"permuted: its operand .* carries heads .*Repeat each kv "
                                 r"head in place"),
    (autocast_on, r"torch\.autocast\(enabled=True\) region.*Run the model without autocast"),
    (residual_scores, r"scores of another attention layer are added.*\(residual attention.*"
                      r"a real limit.*Build the model without residual attention"),
    (talking_heads, r"mixed across heads before the softmax \(talking heads.*a real limit.*"
                    r"Build the model without pre-softmax talking heads"),
], ids=["tiled-kv-heads-per-head-scale", "autocast-enabled", "residual-attention",
        "talking-heads"])
def test_form_is_refused_naming_what_to_change(attend, match):
    model = seeded_weights(FormLM(attend), 0).eval()
    with pytest.raises(DCPTransformError, match=match) as e:
        _transform(model, "decode")
    assert "test_library_attention_forms.py" in str(e.value)


def test_x_transformers_token_shift_is_refused_as_token_mixing_not_for_its_attention():
    """Its attention (einsum, RoPE under autocast off) is read now; what stops it is the
    shift, by the token-wise analysis."""
    pytest.importorskip("x_transformers")
    import third_party as T
    with pytest.raises(DCPTokenMixingError, match=r"mixes tokens along the sequence: node pad"):
        _transform(T.build("x-transformers/shift-tokens"), "decode")
