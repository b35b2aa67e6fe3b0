"""A grammar of small decoder models written against ``torch.ops.dcp.paged_attention``: the one
model zoo of hand-written layouts, drawn at random by the sharding fuzz
(tests/corpora/test_fuzz_sharding.py, :func:`model_specs`) and named case by case by the
sharding tests (tests/frontends/test_sharding_models.py, :data:`SHARDING_CASES`).

Each model is described by a :class:`ModelSpec` (one choice per feature) and built by
:class:`GrammarModel`, which has the demo model's step interface (``num_layers``,
``kv_cache_shape``, ``forward(input_ids, positions, block_table, kv_caches) -> (logits,
new_caches)``). The features are the ways real checkpoints lay out the same computation:

  qkv       separate q/k/v | fused [q;k;v] rows cut by split | the same cut by slicing (Phi3)
            | fused per head ([h, 3, d] for MHA as GPT-NeoX, [kv_heads, q_per_kv + 2, d] for
            GQA as InternLM2) | fused [3, h, d]
  q_gate    none | q projection carries an output gate as [q ; gate] rows | per head
            [h, 2, d] (Qwen3-Next); then chunk, and sigmoid(gate) scales the attention output
  qk_norm   none | RMSNorm per head (Qwen3) | RMSNorm over all heads before the view (OLMo2)
            | the same without a gain (nothing of the norm's shape is sharded)
  rope      rotate-half | interleaved pairs via stack/flatten (GPT-J) | none
  mlp       separate gate/up (SwiGLU) | fused gate_up + chunk (Phi3) | GELU (no gate)
  bias      none | on q/k/v | on every linear
  norm      RMSNorm | LayerNorm (with bias)
  head_matmul  none | q through a per-head [d, d] matrix | the attention output through one:
            ``x_h @ W.view(h, d, d)[h]`` as one matmul batched over heads against a view of a
            [h*d, d] parameter (MLA's absorbed W_UK / W_UV)
  explicit_heads  head counts written in views (view(b, s, 8, d), and the attention output's
            reshape(b, s, 8 * d)) instead of -1
  tied      LM head shares the embedding's weight
  moe       none (dense MLP) | a mixture of experts calling dcp.moe, routed by softmax ->
            top-k -> renormalise (Mixtral) | top-k of the logits -> softmax over the k
            (GraniteMoE) | sigmoid + score-correction bias, group-limited top-k, scaling
            (DeepSeek-V3 noaux_tc); with ``experts`` in 4..16, ``top_k`` in 1..4
  shared    (MoE) none | a shared SwiGLU expert added to the routed ones | the same behind a
            sigmoid gate, a linear to one feature (Qwen2-MoE)
  expert_parallel  (MoE) transform(..., expert_parallel=True): experts partitioned over tp
  experts_form  (MoE) concatenated [gate; up], act(gate) * up (Mixtral) | gpt-oss's: biased,
            gate/up interleaved and transposed, clamped SwiGLU (limit 1: the clamps bite) |
            ungated: the up projection alone, relu² (Nemotron-H)
  token_mix  none | the attention input mixes tokens along the sequence before attention:
            a token shift of half the features (x-transformers ``shift_tokens=1``) | a roll
            | pad + slice | a cumsum | a causal depthwise convolution. A paged step cannot
            compute these (it holds no earlier token's hidden state): a model with one must
            be refused (DCPTokenMixingError), never compiled.
  recurrent none | short_conv (LFM2's ``Lfm2ShortConv``) | mamba2 (Bamba's ``BambaMixer``)
            | gated_deltanet (Qwen3.5's ``Qwen3_5GatedDeltaNet``): some layers' attention is a
            recurrent mixer instead, which layers given by ``kinds`` ("R" recurrent, "A"
            attention, one letter per layer: "RA", "AR", "RAR", "ARA", "RRA"). The mixers are
            transformers' own modules (tiny configs at the grammar's hidden size), the ones the
            hybrid frontend's swap rules name (dcp_compile/frontends/module_recurrent.py): the
            real path of a hybrid, their state carried by the program as for any hybrid. Such a
            model is an ordinary causal LM (``grammar_recurrent.HybridGrammarModel``:
            ``forward(input_ids, position_ids) -> logits``, attention by SDPA over the
            whole sequence, every other feature as above); it is compared with its own full forward
            (:func:`reference_of`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from hypothesis import strategies as st
from torch import Tensor, nn

import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.*)

HEADS = [(4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]     # (q heads, kv heads)
QKV_MHA_ONLY = {"fused_3hd"}                                  # [3, h, d] needs hq == hkv


@dataclass(frozen=True)
class ModelSpec:
    q_heads: int
    kv_heads: int
    qkv: str = "separate"
    q_gate: str = "none"
    qk_norm: str = "none"
    rope: str = "half"
    mlp: str = "separate"
    bias: str = "none"
    norm: str = "rms"
    head_matmul: str = "none"
    explicit_heads: bool = False
    tied: bool = False
    moe: str = "none"
    shared: str = "none"
    experts: int = 4
    top_k: int = 2
    expert_parallel: bool = False
    experts_form: str = "concatenated"
    token_mix: str = "none"
    recurrent: str = "none"
    kinds: str = ""             # recurrent models: one letter per layer, R or A
    layers: int = 1
    hidden: int = 32
    head_dim: int = 8
    vocab: int = 64
    seed: int = 0

    def features(self) -> set[str]:
        """'name=value' for every feature that differs from the plain Llama layout."""
        plain = ModelSpec(self.q_heads, self.kv_heads)
        out = {f"{k}={v}" for k, v in asdict(self).items()
               if k in FEATURES and v != getattr(plain, k)}
        if self.recurrent != "none":
            out.add(f"kinds={self.kinds}")
        return out | {f"gqa={self.q_heads}/{self.kv_heads}"}

    def is_recurrent(self, layer: int) -> bool:
        return self.recurrent != "none" and self.kinds[layer] == "R"

    def describe(self) -> str:
        return "ModelSpec(" + ", ".join(f"{k}={v!r}" for k, v in asdict(self).items()) + ")"


FEATURES = {
    "qkv": ["separate", "fused_rows", "fused_slices", "fused_per_head", "fused_3hd"],
    "q_gate": ["none", "rows", "per_head"],
    "qk_norm": ["none", "per_head", "all_heads", "all_heads_plain"],
    "rope": ["half", "interleaved", "none"],
    "mlp": ["separate", "fused_chunk", "gelu"],
    "bias": ["none", "qkv", "all"],
    "norm": ["rms", "layer"],
    "head_matmul": ["none", "q", "out"],
    "explicit_heads": [False, True],
    "tied": [False, True],
    "moe": ["none", "softmax", "topk_softmax", "sigmoid_group"],
    "shared": ["none", "plain", "gated"],
    "expert_parallel": [False, True],
    "experts_form": ["concatenated", "gpt_oss", "ungated"],
    "token_mix": ["none", "shift", "roll", "pad_slice", "cumsum", "conv"],
    "recurrent": ["none", "short_conv", "mamba2", "gated_deltanet"],
}
# Which layers of a recurrent model are recurrent: every pattern has an attention layer (a
# program without one has no KV cache to shard by sequence: not a DCP program).
LAYER_KINDS = ["RA", "AR", "RAR", "ARA", "RRA"]

# Features whose every non-plain value must be refused (the fuzz expects the refusal).
REFUSED_FEATURES = {"token_mix"}


def _feature(name: str, values: list | None = None):
    """The plain (first) value 2/3 of the time, else one of the others: a model carries about
    three features at once, so that one refused feature does not hide all the others."""
    first, *others = values or FEATURES[name]
    return st.one_of(st.just(first), st.just(first), st.sampled_from(others))


@st.composite
def model_specs(draw, recurrent_share: int = 0) -> ModelSpec:
    """A drawn model; about one in ``recurrent_share`` is recurrent (a hybrid: transformers'
    mixers, the layers ``kinds`` names), none at 0."""
    hq, hkv = draw(st.sampled_from(HEADS))
    qkv = draw(_feature("qkv", [q for q in FEATURES["qkv"]
                                if hq == hkv or q not in QKV_MHA_ONLY]))
    # The output gate rides on a q projection of its own.
    q_gate = draw(_feature("q_gate")) if qkv == "separate" else "none"
    picks = {k: draw(_feature(k))
             for k in ("qk_norm", "rope", "mlp", "bias", "norm", "head_matmul",
                       "explicit_heads", "tied", "token_mix")}
    moe = draw(_feature("moe"))
    if moe != "none":
        picks.update(moe=moe, shared=draw(_feature("shared")),
                     experts=draw(st.sampled_from([4, 8, 16])),
                     top_k=draw(st.integers(1, 4)),
                     expert_parallel=draw(st.booleans()),
                     experts_form=draw(_feature("experts_form")))
    spec = ModelSpec(hq, hkv, qkv=qkv, q_gate=q_gate, layers=draw(_feature("layers", [1, 2])),
                     hidden=draw(st.sampled_from([32, 64])),
                     seed=draw(st.integers(0, 2**16)), **picks)
    # Decided by a hash of the model's seed, not by a draw of its own: hypothesis' draws
    # favour the first value of a sampled_from and small integers (drawn, one model in three
    # was a short conv in the layers "RA"); the hash spreads the hybrids over every mixer and
    # layer pattern, and the attention-only models are the ones drawn before recurrent
    # layers were in the grammar.
    h = (spec.seed * 0x9E3779B1 + 0x7F4A7C15) % 2**32 // 7
    if recurrent_share > 0 and h % recurrent_share == 0:
        h //= recurrent_share
        mixers = FEATURES["recurrent"][1:]
        kinds = LAYER_KINDS[h // len(mixers) % len(LAYER_KINDS)]
        # The grammar's token mixing before attention is refused whatever else the model
        # has; a hybrid keeps it off so that its recurrent layers are what is tried.
        spec = replace(spec, recurrent=mixers[h % len(mixers)], kinds=kinds,
                       layers=len(kinds), token_mix="none")
    return spec


# -- the model --------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, *, gain: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size)) if gain else None
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else self.weight * x


def _norm(spec: ModelSpec, size: int) -> nn.Module:
    return RMSNorm(size) if spec.norm == "rms" else nn.LayerNorm(size)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: Tensor) -> Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rope_tables(spec: ModelSpec, positions: Tensor, inv_freq: Tensor):
    angles = positions.clamp(min=0).float()[..., None] * inv_freq
    if spec.rope == "half":
        emb = torch.cat((angles, angles), dim=-1)
    else:
        emb = torch.repeat_interleave(angles, 2, dim=-1)
    return emb.cos()[:, :, None, :], emb.sin()[:, :, None, :]    # [B, S, 1, D]


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        hq, hkv, d, h = spec.q_heads, spec.kv_heads, spec.head_dim, spec.hidden
        qkv_bias = spec.bias != "none"
        if spec.qkv == "separate":
            q_out = hq * d * (2 if spec.q_gate != "none" else 1)
            self.q_proj = nn.Linear(h, q_out, bias=qkv_bias)
            self.k_proj = nn.Linear(h, hkv * d, bias=qkv_bias)
            self.v_proj = nn.Linear(h, hkv * d, bias=qkv_bias)
        else:
            self.qkv_proj = nn.Linear(h, (hq + 2 * hkv) * d, bias=qkv_bias)
        self.o_proj = nn.Linear(hq * d, h, bias=spec.bias == "all")
        if spec.qk_norm == "per_head":
            self.q_norm, self.k_norm = RMSNorm(d), RMSNorm(d)
        elif spec.qk_norm.startswith("all_heads"):
            gain = spec.qk_norm == "all_heads"
            self.q_norm, self.k_norm = RMSNorm(hq * d, gain=gain), RMSNorm(hkv * d, gain=gain)
        if spec.head_matmul != "none":
            self.head_w = nn.Parameter(torch.empty(hq * d, d))

    def _per_head(self, t: Tensor) -> Tensor:
        """[B, S, hq, d] -> each head times its own [d, d] block of head_w, batched."""
        w = self.head_w.view(self.spec.q_heads, self.spec.head_dim, self.spec.head_dim)
        return torch.matmul(t.transpose(1, 2), w).transpose(1, 2)

    def _heads(self, t: Tensor, n: int) -> Tensor:
        b, s = t.shape[:2]
        return t.view(b, s, n if self.spec.explicit_heads else -1, self.spec.head_dim)

    def _project(self, x: Tensor):
        """(q, k, v) flat [B, S, heads * d] or per head [B, S, heads, d], and the gate."""
        spec, d = self.spec, self.spec.head_dim
        hq, hkv = spec.q_heads, spec.kv_heads
        b, s, _ = x.shape
        n = (lambda k: k) if spec.explicit_heads else (lambda k: -1)
        gate = None
        if spec.qkv == "separate":
            q = self.q_proj(x)
            if spec.q_gate == "rows":
                q, gate = q.chunk(2, dim=-1)
            elif spec.q_gate == "per_head":
                q, gate = q.view(b, s, n(hq), 2 * d).chunk(2, dim=-1)
                gate = gate.reshape(b, s, -1)
            return q, self.k_proj(x), self.v_proj(x), gate
        qkv = self.qkv_proj(x)
        if spec.qkv == "fused_rows":
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            return q, k, v, None
        if spec.qkv == "fused_slices":                   # Phi3: the same rows, cut by slicing
            q, k, v = qkv[..., :hq * d], qkv[..., hq * d:(hq + hkv) * d], qkv[..., (hq + hkv) * d:]
            return q, k, v, None
        if spec.qkv == "fused_3hd":
            q, k, v = qkv.view(b, s, 3, n(hq), d).unbind(2)
            return q, k, v, None
        if hq == hkv:                                    # GPT-NeoX: [h, 3, d]
            q, k, v = qkv.view(b, s, n(hq), 3 * d).chunk(3, dim=-1)
            return q, k, v, None
        g = hq // hkv                                    # InternLM2: [kv, g + 2, d]
        t = qkv.view(b, s, n(hkv), g + 2, d)
        q, k, v = t.split([g, 1, 1], dim=3)
        return q.reshape(b, s, n(hq), d), k.squeeze(3), v.squeeze(3), None

    def _heads_qkv(self, x, cos, sin):
        """q [B, S, hq, d], k, v [B, S, hkv, d] (normed, rotated) and the output gate."""
        spec = self.spec
        b, s, _ = x.shape
        q, k, v, gate = self._project(x)
        if spec.qk_norm.startswith("all_heads"):
            q, k = self.q_norm(q.reshape(b, s, -1)), self.k_norm(k.reshape(b, s, -1))
        q, k, v = (self._heads(t, n) if t.dim() == 3 else t
                   for t, n in ((q, spec.q_heads), (k, spec.kv_heads), (v, spec.kv_heads)))
        if spec.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        if spec.head_matmul == "q":
            q = self._per_head(q)
        if spec.rope != "none":
            rot = rotate_half if spec.rope == "half" else rotate_interleaved
            q = q * cos + rot(q) * sin
            k = k * cos + rot(k) * sin
        return q, k, v, gate

    def _output(self, out: Tensor, gate: Tensor | None) -> Tensor:
        """The attention output [B, S, hq, d] through the head matmul, the gate and o_proj."""
        spec = self.spec
        b, s = out.shape[:2]
        if spec.head_matmul == "out":
            out = self._per_head(out)
        out = out.reshape(b, s, spec.q_heads * spec.head_dim if spec.explicit_heads else -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def forward(self, x, cos, sin, positions, block_table, key_cache, value_cache):
        q, k, v, gate = self._heads_qkv(x, cos, sin)
        out, key_cache, value_cache = torch.ops.dcp.paged_attention(
            q, k, v, key_cache, value_cache, positions, block_table, self.spec.head_dim ** -0.5)
        return self._output(out, gate), key_cache, value_cache


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.kind = spec.mlp
        h, inter, bias = spec.hidden, 2 * spec.hidden, spec.bias == "all"
        if spec.mlp == "separate":
            self.gate_proj = nn.Linear(h, inter, bias=bias)
            self.up_proj = nn.Linear(h, inter, bias=bias)
        elif spec.mlp == "fused_chunk":
            self.gate_up_proj = nn.Linear(h, 2 * inter, bias=bias)
        else:
            self.up_proj = nn.Linear(h, inter, bias=bias)
        self.down_proj = nn.Linear(inter, h, bias=bias)

    def forward(self, x):
        if self.kind == "separate":
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.kind == "fused_chunk":
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(nn.functional.silu(gate) * up)
        return self.down_proj(nn.functional.gelu(self.up_proj(x)))


# experts_form -> dcp.moe's data (and biases) for a MoE block
EXPERTS_FORMS = {
    "concatenated": lambda m: dict(activation="silu"),
    "gpt_oss": lambda m: dict(activation="clamped_swiglu", gate_up_bias=m.gate_up_proj_bias,
                              down_bias=m.down_proj_bias, layout="interleaved_transposed",
                              alpha=1.702, limit=1.0),
    "ungated": lambda m: dict(activation="relu2", layout="ungated"),
}


class MoE(nn.Module):
    """Routed experts through torch.ops.dcp.moe (a plain model's MoE block), optionally with
    a shared expert; the router is one of three families (see ``moe`` above)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        e, h, inter = spec.experts, spec.hidden, spec.hidden
        self.router = nn.Linear(h, e, bias=False)
        if spec.experts_form == "gpt_oss":      # [E, in, out], biased
            self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * inter))
            self.down_proj = nn.Parameter(torch.empty(e, inter, h))
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * inter))
            self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        else:                                   # ungated: the up projection [E, I, H]
            width = inter if spec.experts_form == "ungated" else 2 * inter
            self.gate_up_proj = nn.Parameter(torch.empty(e, width, h))
            self.down_proj = nn.Parameter(torch.empty(e, h, inter))
        if spec.moe == "sigmoid_group":
            self.score_bias = nn.Parameter(torch.empty(e))
        if spec.shared != "none":
            self.shared = MLP(ModelSpec(spec.q_heads, spec.kv_heads, hidden=h))
        if spec.shared == "gated":
            self.shared_gate = nn.Linear(h, 1, bias=False)

    def _route(self, t: Tensor):
        spec, k = self.spec, self.spec.top_k
        logits = self.router(t)
        if spec.moe == "softmax":
            weights, ids = logits.softmax(dim=-1).topk(k, dim=-1)
            return ids, weights / weights.sum(dim=-1, keepdim=True)
        if spec.moe == "topk_softmax":
            top, ids = logits.topk(k, dim=-1)
            return ids, top.softmax(dim=-1)
        scores = logits.sigmoid()                        # noaux_tc: 2 groups
        e = spec.experts
        choice = scores + self.score_bias
        groups = choice.view(-1, 2, e // 2).topk(min(2, e // 2), dim=-1)[0].sum(dim=-1)
        keep = 1 if k <= e // 2 else 2
        mask = torch.zeros_like(groups).scatter(1, groups.topk(keep, dim=-1)[1], 1.0)
        mask = mask.unsqueeze(-1).expand(-1, 2, e // 2).reshape(-1, e)
        ids = choice.masked_fill(mask == 0, float("-inf")).topk(k, dim=-1)[1]
        weights = scores.gather(1, ids)
        return ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * 2.5

    def forward(self, x):
        b, s, h = x.shape
        t = x.reshape(-1, h)
        ids, weights = self._route(t)
        rank0 = torch.zeros((), dtype=torch.int64, device=x.device)
        form = EXPERTS_FORMS[self.spec.experts_form](self)
        out = torch.ops.dcp.moe(t, ids, weights, self.gate_up_proj, self.down_proj, rank0,
                                **form)
        if self.spec.shared != "none":
            shared = self.shared(t)
            if self.spec.shared == "gated":
                shared = torch.sigmoid(self.shared_gate(t)) * shared
            out = out + shared
        return out.view(b, s, h)


CONV_WIDTH = 3


def mix_tokens(kind: str, x: Tensor, conv: Tensor | None) -> Tensor:
    """``x`` [B, S, H] with each token mixed with earlier ones along S (``token_mix``)."""
    if kind == "shift":         # x-transformers shift_tokens=1: half the features, one back
        half = x.shape[-1] // 2
        shifted = nn.functional.pad(x[..., :half], (0, 0, 1, -1))
        return torch.cat([shifted, x[..., half:]], dim=-1)
    if kind == "roll":
        return x + torch.roll(x, 1, dims=1)
    if kind == "pad_slice":
        return x + nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]
    if kind == "cumsum":
        return x + 0.1 * x.cumsum(dim=1)
    if kind == "conv":          # causal depthwise convolution over the tokens
        t = nn.functional.pad(x.transpose(1, 2), (CONV_WIDTH - 1, 0))
        return nn.functional.conv1d(t, conv, groups=x.shape[-1]).transpose(1, 2)
    return x


class Layer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.token_mix = spec.token_mix
        self.mix_conv = nn.Parameter(torch.empty(spec.hidden, 1, CONV_WIDTH)) \
            if spec.token_mix == "conv" else None
        self.input_norm = _norm(spec, spec.hidden)
        self.attn = Attention(spec)
        self.post_norm = _norm(spec, spec.hidden)
        self.mlp = MLP(spec) if spec.moe == "none" else MoE(spec)

    def forward(self, x, cos, sin, positions, block_table, key_cache, value_cache):
        a = mix_tokens(self.token_mix, self.input_norm(x), self.mix_conv)
        h, key_cache, value_cache = self.attn(a, cos, sin, positions, block_table, key_cache,
                                              value_cache)
        x = x + h
        return x + self.mlp(self.post_norm(x)), key_cache, value_cache


class GrammarModel(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(Layer(spec) for _ in range(spec.layers))
        self.norm = _norm(spec, spec.hidden)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied:
            self.lm_head.weight = self.embed.weight
        d = spec.head_dim
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d)),
                             persistent=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self):
        # Seeded, and large enough everywhere (biases, norm gains) that a wrong shard shows.
        gen = torch.Generator().manual_seed(self.spec.seed)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                base = 1.0 if name.endswith("norm.weight") else 0.0      # gains vs biases
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)

    @property
    def num_layers(self) -> int:
        return self.spec.layers

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.spec.kv_heads, self.spec.head_dim)

    def forward(self, input_ids: Tensor, positions: Tensor, block_table: Tensor,
                kv_caches: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        x = self.embed(input_ids)
        cos, sin = rope_tables(self.spec, positions, self.inv_freq)
        new_caches = []
        for i, layer in enumerate(self.layers):
            x, kc, vc = layer(x, cos, sin, positions, block_table, kv_caches[2 * i],
                              kv_caches[2 * i + 1])
            new_caches += [kc, vc]
        return self.lm_head(self.norm(x)), new_caches


def build(spec: ModelSpec) -> nn.Module:
    """The model of ``spec``: a :class:`GrammarModel`, or for a recurrent spec a
    ``grammar_recurrent.HybridGrammarModel``."""
    if spec.recurrent != "none":
        from grammar_recurrent import HybridGrammarModel
        return HybridGrammarModel(spec).eval()
    return GrammarModel(spec).eval()


def reference_of(model: nn.Module) -> nn.Module:
    """What a program of ``model`` is compared with: the model's own paged step, or for a
    recurrent model its own full forward over the sequence so far, every step."""
    if isinstance(model, GrammarModel):
        return model
    from dcp_compile.frontends.ordinary import FullForwardReference
    return FullForwardReference(model)


# -- the sharding tests' cases: named points of the grammar ----------------------------------

GQA = dict(q_heads=8, kv_heads=2)       # tp=4, dcp=2: KV heads replicated twice
MHA = dict(q_heads=4, kv_heads=4)       # tp=4, dcp=1: plain tensor parallelism
MQA = dict(q_heads=4, kv_heads=1)       # tp=2, dcp=1: the one KV head on every rank
# Two layers, biased q/k/v, a wider model than the fuzz's default: a wrong shard of any
# projection (or of a bias) shows in the logits.
SHARDING = dict(layers=2, hidden=64, vocab=128, bias="qkv")


def sharding_case(tp: int, dcp: int, heads: dict, **features) -> tuple[ModelSpec, int, int]:
    return ModelSpec(**heads, **SHARDING, **features), tp, dcp


# id -> (spec, tp, dcp): the projection and norm layouts real models use, one or a few at a time.
SHARDING_CASES: dict[str, tuple[ModelSpec, int, int]] = {
    "fused-gate-up": sharding_case(4, 2, GQA, mlp="fused_chunk"),
    "fused-qkv-rows": sharding_case(4, 2, GQA, qkv="fused_rows"),
    "fused-qkv-slices": sharding_case(4, 2, GQA, qkv="fused_slices", mlp="fused_chunk"),
    # K and V pieces of the fused output are replicated, not sharded (found by the fuzz;
    # the same model taking q/k/v by slices instead of split is refused, not wrong).
    "fused-qkv-rows-mqa": sharding_case(2, 1, MQA, qkv="fused_rows"),
    "fused-qkv-per-head-h3d": sharding_case(4, 1, MHA, qkv="fused_per_head"),
    "fused-qkv-3hd": sharding_case(4, 1, MHA, qkv="fused_3hd"),
    "q-output-gate": sharding_case(4, 2, GQA, q_gate="rows"),
    "qk-norm-across-heads": sharding_case(4, 2, GQA, qk_norm="all_heads"),
    "qk-norm-across-heads-mha": sharding_case(4, 1, MHA, qk_norm="all_heads"),
    "qk-norm-per-head": sharding_case(4, 2, GQA, qk_norm="per_head"),
    "literal-head-counts": sharding_case(4, 2, GQA, explicit_heads=True, qkv="fused_rows"),
    "literal-heads-h3d": sharding_case(4, 1, MHA, explicit_heads=True, qkv="fused_per_head"),
    "interleaved-rope": sharding_case(4, 2, GQA, rope="interleaved"),
    "everything": sharding_case(4, 2, GQA, qkv="fused_slices", mlp="fused_chunk",
                                qk_norm="all_heads", explicit_heads=True, rope="interleaved"),
    # Hybrids (recurrent layers beside attention; each recurrent layer's state carried by the
    # program, its mixer replicated over TP and DCP, only the attention's KV cut by sequence):
    # LFM2-like (short conv, q/k norm per head), Qwen3.5-like (Gated DeltaNet, gated attention
    # with q/k norm, MoE), Bamba/Granite-4-H-like (Mamba2 after an attention layer, tied).
    "hybrid-short-conv": sharding_case(4, 2, GQA, recurrent="short_conv", kinds="RA",
                                       qk_norm="per_head"),
    "hybrid-gated-deltanet-moe": sharding_case(4, 2, GQA, recurrent="gated_deltanet",
                                               kinds="RA", q_gate="per_head",
                                               qk_norm="per_head", moe="softmax"),
    "hybrid-mamba2-tied": sharding_case(4, 2, GQA, recurrent="mamba2", kinds="AR",
                                        tied=True, mlp="fused_chunk"),
}
