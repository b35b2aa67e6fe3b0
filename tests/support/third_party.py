"""The second corpus: model code users train with, not written here (issue #35 item 3).

Every decoder architecture that torchtune, litgpt, torchtitan and x-transformers ship
(installed from the registry, pinned: requirements/corpus.txt, scripts/setup.sh), and two
single-file classics written into the repository with their licences (tests/support/classics:
nanoGPT, gpt-fast), each built tiny (2 layers, width 64, 8 query heads, 2 KV heads where the
architecture has a KV-head count, vocab 256) with seeded random weights in fp32, as an
ordinary ``forward(input_ids) -> logits`` module.

Each cell (architecture x decode/prefill) goes through ``dcp_compile.transform`` and the HF
corpus's own harness (tests/support/hf_corpus.run_model: threaded world, tp=4/dcp=2, garbage block
poisoned, fp32 logits within 1e-4 and equal greedy tokens vs the model's own full forward).
``transform`` runs with ``check=False``: this corpus measures what the compiler itself does;
``check=`` is a safety net, not the promise.

``python tests/support/third_party.py [ARCH,...] [MODE,...]`` prints one line per cell;
``--table [PROCESSES]`` runs every cell and prints the docs' table.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

import torch
from torch import nn

import hf_corpus  # noqa: E402  (tests/support, on the path by tests/conftest.py)
from helpers import seeded_weights  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 256, 64, 2, 8, 2, 8, 96
MAX_LEN = 64            # every prompt plus its decode steps fits (hf_corpus.LENGTHS, STEPS)
WINDOW = 4              # sliding windows short enough that the prompts leave them
MODES = hf_corpus.MODES


class Library(StrEnum):
    TORCHTUNE = "torchtune"
    LITGPT = "litgpt"
    TORCHTITAN = "torchtitan"
    X_TRANSFORMERS = "x-transformers"
    NANOGPT = "nanoGPT"
    GPT_FAST = "gpt-fast"


# The distribution each library is installed as (None: written into tests/support/classics).
DISTRIBUTIONS = {Library.TORCHTUNE: "torchtune", Library.LITGPT: "litgpt",
                 Library.TORCHTITAN: "torchtitan", Library.X_TRANSFORMERS: "x-transformers",
                 Library.NANOGPT: None, Library.GPT_FAST: None}


@dataclass(frozen=True)
class Arch:
    name: str
    library: Library
    build: Callable[[], nn.Module]     # the library's module, tiny, before seeding
    logits: Callable[[nn.Module], nn.Module] = lambda m: m   # wraps it to ids -> logits
    what: str = ""                     # what this architecture adds over its siblings
    kv_heads: int | None = KV_HEADS    # its KV heads as built (None: MLA, latent KV)


class LogitsLM(nn.Module):
    """``forward(input_ids) -> logits [B, S, V]`` over a library model whose forward needs
    more (positions, a cache) or returns less (the last position's logits). ``call(model,
    ids)`` is the library's own call, or its forward's body over the library's own modules;
    each such call says which."""

    def __init__(self, model: nn.Module, call: Callable):
        super().__init__()
        self.model, self._call = model, call

    def forward(self, input_ids):
        return self._call(self.model, input_ids)


# ---------------------------------------------------------------------------------- torchtune

def _torchtune(family: str, **kw):
    def build():
        import importlib
        fn = getattr(importlib.import_module(f"torchtune.models.{family}"), family)
        return fn(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, embed_dim=DIM,
                  max_seq_len=MAX_LEN, **{"num_kv_heads": KV_HEADS, **kw})
    return build


def _torchtune_archs():
    ffn = dict(intermediate_dim=FFN)
    rows = [   # (name, the component builder, its arguments, what it is)
        ("llama2", "llama2", {}, "Llama 2 (also code_llama2): GQA by expand + flatten, RoPE"),
        ("llama2-mha", "llama2", {"num_kv_heads": HEADS}, "Llama-2-7B's multi-head attention"),
        ("llama3", "llama3", {}, "Llama 3: theta 500k"),
        ("llama3_1", "llama3_1", {}, "Llama 3.1 (also 3.3): RoPE frequency scaling"),
        ("llama3_2", "llama3_2", {}, "Llama 3.2: scaled RoPE, tied embeddings"),
        ("mistral", "mistral", ffn, "Mistral"),
        ("gemma", "gemma", {**ffn, "head_dim": HEAD_DIM},
         "Gemma: GELU-tanh MLP, scaled embeddings"),
        ("gemma2", "gemma2", {**ffn, "head_dim": HEAD_DIM, "sliding_window_size": WINDOW},
         "Gemma 2: soft-capping, local/global layers"),
        ("phi3", "phi3", ffn, "Phi-3 (also phi4)"),
        ("qwen2", "qwen2", ffn, "Qwen 2 (also qwen2_5): biased q/k/v"),
        ("qwen2_tied", "qwen2", {**ffn, "tie_word_embeddings": True},
         "Qwen 2.5 small: tied head"),
    ]
    return [Arch(f"torchtune/{name}", Library.TORCHTUNE, _torchtune(family, **kw), what=what,
                 kv_heads=kw.get("num_kv_heads", KV_HEADS)) for name, family, kw, what in rows]


# ------------------------------------------------------------------------------------- litgpt

# One config per distinct architecture among litgpt's 210 named configs (grouped by the
# Config fields that change the model's code path); the names are litgpt's own.
LITGPT_CONFIGS = {
    "stablelm-base-alpha-3b": (HEADS, "GPT-NeoX (also Pythia): parallel residual, partial "
                                      "rotary, LayerNorm"),
    "stablelm-3b-4e1t": (HEADS, "StableLM 2: sequential residual, partial rotary"),
    "falcon-7b": (1, "Falcon: MQA, shared attention norm, parallel residual"),
    "falcon-40b": (KV_HEADS, "Falcon 40B: grouped KV, two norms, parallel residual"),
    "Falcon3-1B-Base": (KV_HEADS, "Falcon 3: Llama-like GQA"),
    "open_llama_3b": (HEADS, "Llama 2 family (Llama-2, Vicuna, CodeLlama...)"),
    "Llama-3.1-8B": (KV_HEADS, "Llama 3.x: RoPE adjustments (scaled frequencies)"),
    "OLMo-1B-hf": (HEADS, "OLMo: non-parametric LayerNorm"),
    "OLMo-2-1124-7B": (HEADS, "OLMo 2: q/k norm over all heads, post-norms"),
    "Gemma-2b": (1, "Gemma: MQA, GELU-tanh, scaled embeddings"),
    "Gemma-7b": (HEADS, "Gemma 7B: multi-head attention"),
    "Gemma-2-2b": (KV_HEADS, "Gemma 2: soft-capping, sliding window, post-norms"),
    "Gemma-3-1b-it": (1, "Gemma 3: q/k norm, local RoPE base, 5:1 window pattern"),
    "Gemma-3-4b-it": (KV_HEADS, "Gemma 3 (4B+): the same with GQA"),
    "phi-1_5": (HEADS, "Phi-1.5 / Phi-2: parallel residual, partial rotary, biased head"),
    "Phi-3-mini-4k-instruct": (HEADS, "Phi-3 mini: sliding window"),
    "Phi-4-mini-instruct": (KV_HEADS, "Phi-4 mini: partial rotary, tied embeddings"),
    "Mistral-7B-v0.1": (KV_HEADS, "Mistral: sliding window"),
    "Mixtral-8x7B-v0.1": (KV_HEADS, "Mixtral: mixture of experts"),
    "Qwen2.5-0.5B": (KV_HEADS, "Qwen 2.5: biased q/k/v"),
    "Qwen3-0.6B": (KV_HEADS, "Qwen 3: q/k norm per head"),
    "Qwen3-30B-A3B": (KV_HEADS, "Qwen 3 MoE"),
}


def _litgpt(config_name: str, kv: int):
    def build():
        from litgpt.config import Config
        from litgpt.model import GPT
        base = Config.from_name(config_name)
        kind = {base.n_head: HEADS, 1: 1}.get(base.n_query_groups, KV_HEADS)
        if kind != kv:
            raise ValueError(f"{config_name}: LITGPT_CONFIGS says {kv} KV heads, litgpt's "
                             f"config {kind}: correct the table")
        tiny = dict(n_layer=LAYERS, n_embd=DIM, n_head=HEADS, n_query_groups=kv,
                    head_size=HEAD_DIM, intermediate_size=FFN, vocab_size=VOCAB,
                    padded_vocab_size=VOCAB, block_size=MAX_LEN)
        if base.n_expert:
            tiny.update(n_expert=4, n_expert_per_token=2, moe_intermediate_size=32)
        if base.sliding_window_size is not None:
            tiny.update(sliding_window_size=WINDOW)
        if base.rope_adjustments and "original_max_seq_len" in base.rope_adjustments:
            tiny.update(rope_adjustments={**base.rope_adjustments,
                                          "original_max_seq_len": MAX_LEN // 2})
        return GPT(Config.from_name(config_name, **tiny))
    return build


def _litgpt_archs():
    return [Arch(f"litgpt/{name}", Library.LITGPT, _litgpt(name, kv), what=what,
                 kv_heads=kv) for name, (kv, what) in LITGPT_CONFIGS.items()]


# --------------------------------------------------------------------------------- torchtitan

def _stub_torchtitan_triton_kernels() -> None:
    """torchtitan imports its expert-parallel Triton kernels with every model (models.common
    -> moe -> token_dispatcher -> minimal_async_ep.kernels -> ``import triton``). Triton is
    about 1 GB and the corpus never dispatches tokens across ranks, so that one module is a
    stub whose every kernel raises if called."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name in sys.modules:
        return
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass

    class _Kernels(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def kernel(*args, **kwargs):
                raise RuntimeError(f"{name}.{attr} is a stub (triton is not installed)")
            return kernel
    sys.modules[name] = _Kernels(name)


def _sdpa_inner_attention(config) -> None:
    """Every FlexAttention config in ``config``'s tree becomes torchtitan's own
    ScaledDotProductAttention (causal): torchtitan 0.3 builds language models with flex or
    varlen only; flex compiles with Inductor at every new shape (a minute each on CPU) and
    varlen needs CUDA kernels. The model code around the inner attention is unchanged."""
    import dataclasses
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    seen = set()

    def walk(node):
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, (list, tuple)):
            for item in node:
                walk(item)
            return
        if not dataclasses.is_dataclass(node):
            return
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if isinstance(value, FlexAttention.Config):
                setattr(node, f.name, ScaledDotProductAttention.Config())
            else:
                walk(value)
    walk(config)


def _titan_model(family: str, model_cls: str, layers, *, norm, tied: bool = False):
    from torchtitan.models.common import Embedding, Linear
    module = __import__(f"torchtitan.models.{family}", fromlist=[model_cls])
    return getattr(module, model_cls).Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=norm, lm_head=Linear.Config(in_features=DIM, out_features=VOCAB), layers=layers)


def _titan_llama3():
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, RMSNorm
    layers = llama3._build_llama3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN,
        rope=ComplexRoPE.Config(dim=HEAD_DIM, max_seq_len=MAX_LEN, theta=500000,
                                scaling="llama"),
        fuse_qkv=True, attn_backend="flex")
    return _titan_model("llama3", "Llama3Model", layers,
                        norm=RMSNorm.Config(normalized_shape=DIM))


def _titan_qwen3(fuse_qkv: bool, moe: bool = False):
    def config():
        from torchtitan.models import qwen3
        from torchtitan.models.common import CosSinRoPE
        common = dict(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
                      head_dim=HEAD_DIM, fuse_qkv=fuse_qkv, attn_backend="flex",
                      rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=MAX_LEN,
                                             theta=1000000.0))
        layers = (qwen3._build_qwen3_moe_layers(moe_hidden_dim=32, num_experts=4, top_k=2,
                                                moe_comm_backend="standard", **common)
                  if moe else qwen3._build_qwen3_layers(hidden_dim=FFN, **common))
        return _titan_model("qwen3", "Qwen3Model", layers, norm=qwen3._qwen3_norm(DIM),
                            tied=not moe)
    return config


def _titan_debugmodel(family: str):
    """The family's own debug model (its smallest shipped flavor), cut to LAYERS layers:
    its layer builders have no small-size parameters we could pass."""
    def config():
        import importlib
        config = importlib.import_module(f"torchtitan.models.{family}").model_registry(
            "debugmodel", attn_backend="flex").model
        config.layers = config.layers[:LAYERS]
        return config
    return config


# name -> (the model's config, what it is)
TORCHTITAN = {
    "llama3": (_titan_llama3, "Llama 3: fused wqkv, complex RoPE, GQA"),
    "qwen3": (_titan_qwen3(True), "Qwen 3: fused wqkv, q/k norm, tied head"),
    "qwen3-separate-qkv": (_titan_qwen3(False), "Qwen 3 with separate wq/wk/wv"),
    "qwen3-moe": (_titan_qwen3(True, moe=True), "Qwen 3 MoE"),
    "deepseek_v3": (_titan_debugmodel("deepseek_v3"), "DeepSeek-V3: MLA + MoE "
                                                      "(its debug model, 2 layers)"),
}


def _torchtitan(config_of):
    def build():
        _stub_torchtitan_triton_kernels()
        config = config_of()
        _sdpa_inner_attention(config)
        return config.build()
    return build


def _torchtitan_archs():
    return [Arch(f"torchtitan/{name}", Library.TORCHTITAN, _torchtitan(config), what=what,
                 kv_heads=None if name == "deepseek_v3" else KV_HEADS)
            for name, (config, what) in TORCHTITAN.items()]


# ------------------------------------------------------------------------------ x-transformers

# x-transformers is one Decoder with switches; each row is one architecture it offers. Its
# attention is einsum scores + softmax unless attn_flash=True (then SDPA).
LLAMA_LIKE = dict(rotary_pos_emb=True, attn_kv_heads=KV_HEADS, use_rmsnorm=True, ff_glu=True,
                  ff_swish=True, ff_no_bias=True)
X_TRANSFORMERS = {
    "absolute": ({}, "GPT-style learned absolute positions"),
    "rotary-gqa-llama": (LLAMA_LIKE, "Llama-like: RoPE, GQA, RMSNorm, SwiGLU"),
    "rotary-gqa-llama-flash": ({**LLAMA_LIKE, "attn_flash": True},
                               "the same through SDPA (attn_flash) instead of einsum"),
    "shift-tokens-flash": (dict(rotary_pos_emb=True, shift_tokens=1, attn_flash=True),
                           "token shift, SDPA attention"),
    "alibi": (dict(alibi_pos_bias=True, alibi_num_heads=4), "ALiBi"),
    "rel-pos-bias": (dict(rel_pos_bias=True), "T5 relative position bias"),
    "dynamic-pos-bias": (dict(dynamic_pos_bias=True), "an MLP of relative distances"),
    "xpos": (dict(rotary_pos_emb=True, rotary_xpos=True), "xPos: RoPE with a decay"),
    "shift-tokens": (dict(rotary_pos_emb=True, shift_tokens=1), "token shift before attention"),
    "qk-norm": (dict(rotary_pos_emb=True, attn_qk_norm=True), "cosine-sim q/k norm"),
    "sandwich-norm": (dict(rotary_pos_emb=True, sandwich_norm=True), "sandwich norms"),
    "residual-attn": (dict(rotary_pos_emb=True, residual_attn=True),
                      "scores passed on between layers"),
    "mem-kv": (dict(rotary_pos_emb=True, attn_num_mem_kv=2), "learned memory key/values"),
    "talking-heads": (dict(rotary_pos_emb=True, attn_pre_talking_heads=True),
                      "talking heads (mixes heads before softmax)"),
    "gate-values": (dict(rotary_pos_emb=True, attn_gate_values=True),
                    "gated attention outputs"),
    "macaron": (dict(rotary_pos_emb=True, macaron=True), "macaron (FF-attn-FF) layers"),
    "scalenorm": (dict(rotary_pos_emb=True, use_scalenorm=True), "ScaleNorm"),
}


def _x_transformers(kw: dict):
    def build():
        from x_transformers import Decoder, TransformerWrapper
        use_abs = not any(k in kw for k in ("rotary_pos_emb", "alibi_pos_bias", "rel_pos_bias",
                                            "dynamic_pos_bias"))
        return TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_LEN,
                                  use_abs_pos_emb=use_abs,
                                  attn_layers=Decoder(dim=DIM, depth=LAYERS, heads=HEADS,
                                                      attn_dim_head=HEAD_DIM, **kw))
    return build


def _x_transformers_archs():
    return [Arch(f"x-transformers/{name}", Library.X_TRANSFORMERS, _x_transformers(kw),
                 what=what, kv_heads=kw.get("attn_kv_heads", HEADS))
            for name, (kw, what) in X_TRANSFORMERS.items()]


# ----------------------------------------------------------------------------------- classics

def _nanogpt(flash: bool):
    def build():
        from classics import nanogpt_model as ng
        model = ng.GPT(ng.GPTConfig(block_size=MAX_LEN, vocab_size=VOCAB, n_layer=LAYERS,
                                    n_head=HEADS, n_embd=DIM, dropout=0.0, bias=True))
        if not flash:     # nanoGPT's own fallback (torch < 2.0): its masked softmax
            for block in model.transformer.h:
                block.attn.flash = False
                block.attn.register_buffer("bias", torch.tril(torch.ones(
                    MAX_LEN, MAX_LEN)).view(1, 1, MAX_LEN, MAX_LEN))
        return model
    return build


def _nanogpt_last(model, ids):
    # nanoGPT's inference forward (targets=None): (logits of the last position, None).
    return model(ids)[0]


def _nanogpt_all(model, ids):
    """nanoGPT's GPT.forward as written, with the lm_head over every position (what its
    training branch computes) instead of the last one only."""
    t = model.transformer
    x = t.drop(t.wte(ids) + t.wpe(torch.arange(ids.shape[1], device=ids.device)))
    for block in t.h:
        x = block(x)
    return model.lm_head(t.ln_f(x))


def _gptfast():
    from classics import gptfast_model as gf
    model = gf.Transformer(gf.ModelArgs(block_size=MAX_LEN, vocab_size=VOCAB, n_layer=LAYERS,
                                        n_head=HEADS, dim=DIM, n_local_heads=KV_HEADS,
                                        intermediate_size=FFN))
    model.setup_caches(max_batch_size=1, max_seq_length=MAX_LEN)
    for layer in model.layers:
        layer.attention.kv_cache = None   # its static cache is ours to insert
    return model


def _gptfast_call(model, ids):
    """gpt-fast's Transformer.forward without its static KV cache: its own blocks, its RoPE
    table indexed by the positions, and its causal mask cut to the sequence."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    mask = model.causal_mask[None, None, positions][..., :ids.shape[1]]
    x = model.tok_embeddings(ids)
    freqs_cis = model.freqs_cis[positions]
    for layer in model.layers:
        x = layer(x, positions, freqs_cis, mask)
    return model.output(model.norm(x))


def _classic_archs():
    return [
        Arch("nanoGPT/sdpa", Library.NANOGPT, _nanogpt(True),
             logits=lambda m: LogitsLM(m, _nanogpt_all), what="GPT-2: SDPA is_causal",
             kv_heads=HEADS),
        Arch("nanoGPT/manual", Library.NANOGPT, _nanogpt(False),
             logits=lambda m: LogitsLM(m, _nanogpt_all), what="GPT-2: masked_fill softmax",
             kv_heads=HEADS),
        Arch("nanoGPT/sdpa-last-logits", Library.NANOGPT, _nanogpt(True),
             logits=lambda m: LogitsLM(m, _nanogpt_last),
             what="nanoGPT's own inference forward: logits of the last position only",
             kv_heads=HEADS),
        Arch("gpt-fast/llama", Library.GPT_FAST, _gptfast,
             logits=lambda m: LogitsLM(m, _gptfast_call),
             what="Llama: fused wqkv, GQA by repeat_interleave, bool mask"),
    ]


ARCHS: dict[str, Arch] = {a.name: a for a in (
    *_torchtune_archs(), *_litgpt_archs(), *_torchtitan_archs(), *_x_transformers_archs(),
    *_classic_archs())}

# What the libraries ship that is not in the corpus, and why.
EXCLUDED = {
    "torchtune/llama3_2_vision, clip, t5, flux": "not decoder-only text models",
    "torchtune/phi4, qwen2_5, llama3_3, code_llama2": "built by the phi3, qwen2, llama3_1 "
                                                       "and llama2 builders (in the corpus)",
    "torchtitan/qwen3_5": "Gated DeltaNet layers need flash-linear-attention (fla), which "
                          "needs triton",
    "torchtitan/flux": "a diffusion model",
    "torchtitan/gpt_oss": "its own fp32 forward fails on CPU (the MoE combine's "
                          "deterministic_scatter_add: scatter() dtype mismatch), and its sinks "
                          "need flex attention",
    "torchtitan/kimi_k2_7, muse_glimmer": "multimodal models (a vision encoder; muse_glimmer's "
                                          "forward needs a device mesh)",
    "litgpt/<188 more configs>": "each has the code path of one of LITGPT_CONFIGS' rows",
}


# Refusals that name a real limit (of DCP or of this compiler's design), not a form it fails
# to read: decode DCP replicates the KV heads over the DCP group, so it needs tp > kv heads
# (the specification's rule); a paged step cannot read the hidden states of cached tokens
# (x-transformers' shift_tokens), nor follow a position function of the sequence length
# (x-transformers' xpos scale, centred on max_pos // 2) for tokens already cached.
REAL_LIMITS = {
    "MHA: decode DCP needs tp > kv heads",
    # torchtitan's experts compute in bf16 inside an fp32 model: bf16 matmuls round by the
    # batch they are given (the model's own forward differs from itself by 4.7e-4 when only
    # the batch changes), so no program equals it at fp32 tolerance.
    "experts in bf16 inside an fp32 model",
    "token mixing outside attention",
    "length-dependent positions (LongRoPE, dynamic NTK)",
    # Not a limit of DCP but of the program's contract: a program returns every token's
    # logits and never changes what the model returns (nanoGPT's inference forward returns
    # the last position's only: DCPOutputContractError says to apply the head everywhere).
    "logits of the last position only",
    # x-transformers' residual_attn adds one layer's pre-softmax scores to the next's: a paged
    # attention kernel never materialises scores, and under DCP a rank holds only its keys'.
    "scores carried across layers (residual attention)",
    # x-transformers' pre-softmax talking heads mix the heads' scores: attention is cut by
    # heads over the ranks, and the scores never leave the attention kernel.
    "heads mixed before the softmax (talking heads)",
}

# Cells known to be wrong today: (arch, mode) -> why. Each is a bug of issue #35; a fix turns
# its cell into an XPASS, which fails (strict) until the entry goes. None since x-transformers'
# relative position biases (a distance table, dcp.attention's distance_table) and memory
# key/values (dcp.attention's mem_k / mem_v, added by cp rank 0) are read.
KNOWN: dict[tuple[str, str], str] = {}


def build(name: str, seed: int = 0) -> nn.Module:
    """The tiny ``name`` model, seeded (tests/support/helpers.seeded_weights), fp32, eval, as
    ``forward(input_ids) -> logits``."""
    arch = ARCHS[name]
    torch.manual_seed(seed)
    model = arch.logits(arch.build()).float().eval()
    return seeded_weights(model, seed)


def logits_of(model, ids):
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out[0]


def run_case(name: str, mode: str) -> hf_corpus.Outcome:
    """One cell: the tiny model through transform (check=False) and the HF corpus harness."""
    return hf_corpus.run_model(build(name), mode, logits_of=logits_of, check=False)


def safe_case(name: str, mode: str) -> hf_corpus.Outcome:
    """``run_case``, with a failure to build the library's model reported as a crash."""
    try:
        return run_case(name, mode)
    except Exception as e:  # noqa: BLE001
        return hf_corpus.Outcome("crash", f"build: {type(e).__name__}", str(e)[:2000])


def _cell(args):
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    return args, safe_case(*args)


def run_all(processes: int = 2) -> dict:
    """Every cell, on a process pool: {(arch, mode): Outcome}."""
    import multiprocessing
    cells = [(name, mode) for name in ARCHS for mode in MODES]
    with multiprocessing.get_context("spawn").Pool(processes, maxtasksperchild=10) as pool:
        return dict(pool.imap_unordered(_cell, cells))


def render_table(results: dict) -> str:
    """The docs' table: a row per architecture (library, decode, prefill, the reason of its
    refusals: a real DCP limit, or the known bug of KNOWN) and the counts."""
    rows = ["| architecture | library | decode | prefill | reason |", "|---|---|---|---|---|"]
    for name, arch in ARCHS.items():
        cells = [results[(name, m)].cell() for m in MODES]
        whys = {mode: KNOWN.get((name, mode)) or (f"real limit: {results[(name, mode)].reason}"
                                                 if results[(name, mode)].kind == "refused"
                                                 else "") for mode in MODES}
        reason = (whys[MODES[0]] if len(set(whys.values())) == 1 else
                  "; ".join(f"{mode}: {why}" for mode, why in whys.items() if why))
        rows.append(f"| `{name}` | {arch.library} | " + " | ".join(cells) + f" | {reason} |")
    counts: dict[str, int] = {}
    for out in results.values():
        counts[out.kind] = counts.get(out.kind, 0) + 1
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    known = sum(1 for cell in results if cell in KNOWN)
    return "\n".join([*rows, "", f"Cells: {len(results)}. {summary}. Known bugs (strict "
                                  f"xfail): {known}."])


def main(argv: list[str]) -> int:
    """``third_party.py ARCH[,ARCH...] [MODE,...]``: one line per cell (tab-separated: arch,
    mode, cell, message). ``third_party.py --table [PROCESSES]``: every cell, the table on
    stdout and every cell's message after it."""
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    if argv and argv[0] == "--table":
        results = run_all(int(argv[1]) if len(argv) > 1 else 2)
        print(render_table(results))
        for (name, mode), out in sorted(results.items()):
            print(f"{name}\t{mode}\t{out.cell()}\t{out.message[:600]}".replace("\n", " "))
        return 0
    names = argv[0].split(",") if argv else list(ARCHS)
    modes = argv[1].split(",") if len(argv) > 1 else MODES
    for name in names:
        for mode in modes:
            out = safe_case(name, mode)
            msg = out.message.replace("\n", " ")[:400]
            print(f"{name}\t{mode}\t{out.cell()}\t{msg}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
