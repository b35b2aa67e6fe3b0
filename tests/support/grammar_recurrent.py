"""The recurrent layers of the model grammar (tests/support/model_grammar.py, its feature
``recurrent``): a hybrid grammar model puts transformers' own recurrent mixers — LFM2's short
conv, Bamba's Mamba2, Qwen3.5's Gated DeltaNet, the classes the hybrid frontend's swap rules
name (dcp_compile/frontends/module_recurrent.py) — at the layers its ``kinds`` marks R, beside
the grammar's attention (by SDPA over the whole sequence: an ordinary causal LM, the KV cache
inserted from the graph), MLP and MoE (docs/hybrid.md, "The fuzz's hybrids")."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model_grammar import (MLP, Attention, GrammarModel, Layer, ModelSpec, MoE, _norm,
                           rope_tables)


class SDPAAttention(Attention):
    """The same attention over the whole sequence by ``F.scaled_dot_product_attention`` (a
    hybrid grammar model is an ordinary causal LM: the cache is inserted from the graph)."""

    def forward(self, x, cos, sin):
        q, k, v, gate = self._heads_qkv(x, cos, sin)
        groups = self.spec.q_heads // self.spec.kv_heads
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                         scale=self.spec.head_dim ** -0.5)
        return self._output(out.transpose(1, 2), gate)


_TF = "transformers.models"
# recurrent -> (config class, its module, the mixer class, the mixer's module, the config's
# sizes at hidden size h). Tiny sizes in the families' own names (as
# tests/support/hybrid_configs.py's): Mamba2 with 4 heads in 2 groups and a scan chunk of 4
# (the model's own SSD scan runs several chunks), Gated DeltaNet with 4 value heads over 2 key
# heads, the conv kernels 3 (LFM2's default) and 4.
MIXERS = {
    "short_conv": ("Lfm2Config", f"{_TF}.lfm2.modeling_lfm2", "Lfm2ShortConv",
                   lambda h: dict(conv_bias=False, conv_L_cache=3)),
    "mamba2": ("BambaConfig", f"{_TF}.bamba.modeling_bamba", "BambaMixer",
               lambda h: dict(mamba_n_heads=4, mamba_d_head=2 * h // 4, mamba_n_groups=2,
                              mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                              mamba_chunk_size=4)),
    "gated_deltanet": ("Qwen3_5TextConfig", f"{_TF}.qwen3_5.modeling_qwen3_5",
                       "Qwen3_5GatedDeltaNet",
                       lambda h: dict(linear_num_value_heads=4, linear_num_key_heads=2,
                                      linear_key_head_dim=8, linear_value_head_dim=8,
                                      linear_conv_kernel_dim=4)),
}


def mixer(spec: ModelSpec, layer: int) -> nn.Module:
    """Layer ``layer``'s recurrent mixer: the transformers module of ``spec.recurrent``."""
    import importlib

    import transformers
    config_cls, module, cls, sizes = MIXERS[spec.recurrent]
    config = getattr(transformers, config_cls)(
        hidden_size=spec.hidden, num_hidden_layers=spec.layers,
        num_attention_heads=spec.q_heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, vocab_size=spec.vocab, **sizes(spec.hidden))
    return getattr(importlib.import_module(module), cls)(config, layer)


class SDPALayer(Layer):
    """The grammar's layer, its attention over the whole sequence (SDPA)."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.attn = SDPAAttention(spec)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_norm(x))


class RecurrentLayer(nn.Module):
    """A recurrent layer: the mixer where attention would be, the grammar's MLP or MoE."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.input_norm = _norm(spec, spec.hidden)
        self.mixer = mixer(spec, layer)
        self.post_norm = _norm(spec, spec.hidden)
        self.mlp = MLP(spec) if spec.moe == "none" else MoE(spec)

    def forward(self, x, cos, sin):
        x = x + self.mixer(self.input_norm(x))
        return x + self.mlp(self.post_norm(x))


class HybridGrammarModel(nn.Module):
    """A recurrent grammar model (``spec.recurrent``): an ordinary causal LM,
    ``forward(input_ids, position_ids) -> logits``, with no paged hooks: the hybrid frontend
    takes it (its mixers are ones a swap rule names) and carries the state."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(RecurrentLayer(spec, i) if spec.is_recurrent(i)
                                    else SDPALayer(spec) for i in range(spec.layers))
        self.norm = _norm(spec, spec.hidden)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied:
            self.lm_head.weight = self.embed.weight
        d = spec.head_dim
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d)),
                             persistent=False)
        self._init_weights()

    _init_weights = GrammarModel._init_weights

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.embed(input_ids)
        cos, sin = rope_tables(self.spec, position_ids, self.inv_freq)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
