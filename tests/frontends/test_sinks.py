"""Attention sinks (gpt-oss) in DCP form: the sink logit joins the softmax denominator once.

A sink is one learned logit per q head that takes part in the softmax and attends to no
value: ``softmax([scores ; sink])[:-1]``. Under DCP each rank sees only its shard of the keys;
``dcp.sink_correct`` scales the combined output by ``sigmoid(global_lse - sink)`` after the
LSE combine, so the sink is counted once whatever dcp is. ``test_combine_counts_the_sink_once``
shows that adding it per rank (before the combine) is wrong.

End to end, every rank's greedy tokens and logits must equal the model's OWN forward (fp32,
1e-4, garbage block NaN-poisoned), decode (8 steps) and prefill, prompts of 1, 4, 7 and 9
tokens (around the interleave period W*I; a 1-token prompt leaves dcp-1 ranks with empty
shards), at tp=4/dcp=2 and tp=8/dcp=4:
- a plain module whose attention is ``dcp.paged_attention(..., sinks=...)`` with an
  alternating sliding window, against an independent cache-free forward written here;
- transformers' gpt-oss (tiny config: alternating sliding/full layers, yarn RoPE, sinks)
  through ``hf.prepare`` (``s_aux`` -> ``sinks``; window 24 >= max_model_len) and directly
  (its eager cat-sinks-softmax-slice form; window 5, which bites), against its own eager
  forward. The model is whole: its own attention and its own MoE layers (biased,
  interleaved, clamped-gate experts as dcp.moe, tensor-parallel; tests/frontends/test_moe.py runs the
  gpt-oss MoE matrix).
The default run is a slice; DCP_SINKS_MATRIX=1 runs every case.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import dcp_compile
from dcp_compile.models import demo
from dcp_compile.runtime.kernels import ops
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.verify import run_threaded_program

from helpers import assert_close_report, assert_runs_match, full_forward_reference, prompts_of
from full_runs import full  # noqa: E402

VOCAB, BLOCK, ATOL = 256, 4, 1e-4
LENGTHS = (1, 4, 7, 9)
STEPS = {"decode": 8, "prefill": 1}
SHAPES = StepShapes(batch=4, context_len=12, max_blocks=6, num_blocks=16)
WINDOW = 5            # the plain model's sliding layers (odd ones)
CONFIGS = [(4, 2), (8, 4)]
# The default run is a slice (one case per model form); DCP_SINKS_MATRIX=1 runs every form x
# {decode, prefill} x {tp=4/dcp=2, tp=8/dcp=4} (and the all_to_all combine at both).
MATRIX = full("DCP_SINKS_MATRIX")
SLICE = {"plain": ("decode", (8, 4)), "a2a": ("decode", (4, 2)),
         "prepare": ("prefill", (4, 2)), "direct": ("decode", (4, 2))}


def in_slice(form: str, mode: str, tp_dcp) -> None:
    if not MATRIX and SLICE[form] != (mode, tuple(tp_dcp)):
        pytest.skip("in the full matrix (DCP_SINKS_MATRIX=1)")


# ----------------------------------------------------------------------------------------
# The combine (unit)
# ----------------------------------------------------------------------------------------


def _shards(scores, values, dcp):
    """Per-rank (out, lse) of softmax attention over a round-robin shard of the keys."""
    parts = []
    for r in range(dcp):
        s, v = scores[..., r::dcp], values[r::dcp]
        lse = torch.logsumexp(s, -1)
        parts.append((torch.softmax(s, -1) @ v, lse))
    return parts


def _combine(parts, sinks, per_rank: bool):
    """The DCP combine (lse_correct on every part, summed), the sink once after it
    (sink_correct on the global LSE) or, ``per_rank``, folded into every rank's own LSE."""
    outs = torch.stack([o for o, _ in parts])
    lses = torch.stack([lse for _, lse in parts])
    if per_rank:   # each rank adds exp(sink) to its own denominator: counted dcp times
        outs = torch.stack([ops.sink_correct(o, lse, sinks) for o, lse in parts])
        lses = torch.logaddexp(lses, sinks)
    total = sum(ops.lse_correct(o, lse, lses) for o, lse in zip(outs, lses))
    if per_rank:
        return total
    return ops.sink_correct(total, torch.logsumexp(lses, 0), sinks)


@pytest.mark.parametrize("dcp", [2, 4])
@pytest.mark.parametrize("per_rank", [False, True], ids=["once", "per_rank"])
def test_combine_counts_the_sink_once(dcp, per_rank):
    gen = torch.Generator().manual_seed(0)
    heads, keys, dim = 3, 10, 4
    scores = torch.randn(heads, keys, generator=gen) * 2
    values = torch.randn(keys, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen)
    # Single device: the sink column in the softmax, then dropped.
    probs = torch.softmax(torch.cat([scores, sinks[:, None]], -1), -1)[:, :-1]
    expected = probs @ values
    got = _combine(_shards(scores, values, dcp), sinks, per_rank)
    close = torch.allclose(got, expected, atol=1e-6)
    assert close != per_rank, (f"per_rank={per_rank}: max error "
                               f"{(got - expected).abs().max():.2e}")


def test_sink_correct_with_no_key_is_zero():
    """A query no rank could see (global LSE -inf) stays 0, never NaN."""
    out = torch.zeros(1, 2, 3)
    got = ops.sink_correct(out, torch.full((1, 2), float("-inf")), torch.zeros(2))
    assert torch.equal(got, out)


# ----------------------------------------------------------------------------------------
# A plain module with sinks and an alternating sliding window
# ----------------------------------------------------------------------------------------


class SinkAttention(demo.Attention):
    def __init__(self, cfg, window: int):
        super().__init__(cfg)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_q_heads))
        self.window = window

    def forward(self, x, cos, sin, positions, block_table, key_cache, value_cache):
        b, s, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        out, key_cache, value_cache = torch.ops.dcp.paged_attention(
            q, k, v, key_cache, value_cache, positions, block_table, self.scale,
            window=self.window, sinks=self.sinks)
        return self.o_proj(out.reshape(b, s, -1)), key_cache, value_cache

    def qkv(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        return (q * cos + demo.rotate_half(q) * sin, k * cos + demo.rotate_half(k) * sin, v)

    def full(self, x, cos, sin):
        """Cache-free eager attention of a whole sequence: scores, causal and window mask,
        the sink column cat'ed, softmax, the column dropped (gpt-oss's eager form)."""
        q, k, v = self.qkv(x, cos, sin)
        groups = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
        scores = torch.einsum("bihd,bjhd->bhij", q, k) * self.scale
        i = torch.arange(x.shape[1])
        allowed = i[None, :] <= i[:, None]
        if self.window:
            allowed &= i[:, None] - i[None, :] < self.window
        scores = scores.masked_fill(~allowed, float("-inf"))
        sink = self.sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        out = torch.einsum("bhij,bjhd->bihd", probs, v)
        return self.o_proj(out.reshape(*x.shape[:2], -1))


def sink_model(seed: int = 0) -> demo.DemoLlama:
    model = demo.demo_model()
    for i, layer in enumerate(model.layers):
        layer.self_attn = SinkAttention(model.config, WINDOW if i % 2 else 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):   # around the scores' scale, so the sink matters
                p.copy_(torch.randn(p.shape, generator=gen) * 2)
            elif "self_attn" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model.eval()


def plain_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """[1, S] -> logits [1, S, vocab], no cache, no dcp op."""
    x = model.embed_tokens(ids)
    cos, sin = demo.rope_cos_sin(torch.arange(ids.shape[1])[None], model.inv_freq, x.dtype)
    for layer in model.layers:
        x = x + layer.self_attn.full(layer.input_layernorm(x), cos, sin)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x))


def check(subject, forward, mode, tp, dcp, combine="all_gather") -> float:
    program = dcp_compile.transform(subject, tp=tp, dcp=dcp, mode=mode, block_size=BLOCK,
                                    interleave_size=2 if mode == "decode" else BLOCK,
                                    shapes=SHAPES, check=False, combine=combine)
    steps = STEPS[mode]
    prompts = prompts_of(LENGTHS, vocab=VOCAB)
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True)
    ref_tokens, ref_logits = full_forward_reference(forward, prompts, steps)
    return assert_runs_match(runs, ref_tokens, ref_logits, atol=ATOL, lengths=LENGTHS)


CASES = list(itertools.product(("decode", "prefill"), CONFIGS))
IDS = [f"{m}-tp{t}dcp{d}" for m, (t, d) in CASES]


@pytest.mark.parametrize("mode,tp_dcp", CASES, ids=IDS)
def test_plain_module_with_sinks_matches_own_forward(mode, tp_dcp):
    in_slice("plain", mode, tp_dcp)
    model = sink_model()
    check(model, lambda ids: plain_forward(model, ids), mode, *tp_dcp)


@pytest.mark.parametrize("tp,dcp", CONFIGS, ids=[f"tp{t}dcp{d}" for t, d in CONFIGS])
def test_plain_module_with_sinks_all_to_all_combine(tp, dcp):
    """Decode combine="all_to_all": the sink once on the logsumexp of the merged LSEs."""
    in_slice("a2a", "decode", (tp, dcp))
    model = sink_model()
    check(model, lambda ids: plain_forward(model, ids), "decode", tp, dcp, "all_to_all")


def test_plain_forward_is_the_paged_op():
    """The independent reference and the model's paged forward agree on one device (so a
    wrong reference cannot hide behind a wrong op, and the sinks change the result)."""
    model = sink_model()
    ids = torch.tensor([prompts_of([9], vocab=VOCAB)[0]])
    caches = [torch.zeros(model.kv_cache_shape(4, BLOCK)) for _ in range(4)]
    table = torch.tensor([[0, 1, 2]])
    with torch.no_grad():
        paged, _ = model(ids, torch.arange(9)[None], table, caches)
        full = plain_forward(model, ids)
        assert_close_report(paged, full, atol=1e-5)
        for layer in model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert (plain_forward(model, ids) - full).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------
# transformers' gpt-oss through hf.prepare
# ----------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
from dcp_compile import hf  # noqa: E402

# Alternating sliding/full layers and yarn RoPE, as gpt-oss ships; hf.prepare serves a window
# while sequences fit in it (max_model_len <= sliding_window, its rule for every model).
GPT_OSS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=16, num_key_value_heads=2, head_dim=8,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
               layer_types=["sliding_attention", "full_attention"],
               max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
               pad_token_id=None,
               rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                    original_max_position_embeddings=16, beta_fast=32.0,
                                    beta_slow=1.0))
MAX_MODEL_LEN = 24


def gpt_oss(seed: int = 0, window: int = 24):
    config = transformers.GptOssConfig(**{**GPT_OSS, "sliding_window": window})
    config._attn_implementation = "eager"   # its own form: the sink column cat'ed, softmax
    model = transformers.GptOssForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen) * 2)
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model.eval()


@pytest.mark.parametrize("mode,tp_dcp", CASES, ids=IDS)
def test_gpt_oss_attention_matches_own_forward(mode, tp_dcp):
    in_slice("prepare", mode, tp_dcp)
    model = gpt_oss()
    assert model.model.rotary_emb.rope_type == "yarn"
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [24, None]
    check(hf.prepare(model, max_model_len=MAX_MODEL_LEN), lambda ids: model(ids).logits,
          mode, *tp_dcp)


def test_gpt_oss_s_aux_of_the_wrong_shape_is_refused():
    model = gpt_oss()
    attn = model.model.layers[0].self_attn
    attn.sinks = nn.Parameter(torch.zeros(attn.sinks.shape[0], 2))
    with pytest.raises(DCPTransformError, match=r"s_aux=tensor\(16, 2\).*one logit per q "
                                                r"head, shape \(16,\)"):
        hf.prepare(model, max_model_len=MAX_MODEL_LEN)


@pytest.mark.parametrize("mode,tp_dcp", CASES, ids=IDS)
def test_gpt_oss_direct_matches_own_forward(mode, tp_dcp):
    """transform(model) on gpt-oss's own eager attention: the cat-sinks-softmax-slice form
    becomes dcp.paged_attention(..., sinks=self_attn.sinks); the sliding layers' window (5,
    shorter than the sequences: it bites) comes from the mask proof."""
    in_slice("direct", mode, tp_dcp)
    model = gpt_oss(window=WINDOW)
    check(model, lambda ids: model(ids).logits, mode, *tp_dcp)


# ----------------------------------------------------------------------------------------
# Structure: no extra collective; the program lowers to StableHLO
# ----------------------------------------------------------------------------------------


def _program(model, mode, tp, dcp):
    return dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, block_size=BLOCK,
                                 interleave_size=2 if mode == "decode" else BLOCK,
                                 shapes=SHAPES, check=False)


def _count(program, target) -> dict:
    return {step: sum(n.target == target for n in gm.graph.nodes)
            for step, gm in program.graphs.items()}


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_sinks_add_one_correction_per_layer_and_no_collective(mode, tmp_path):
    """The sink costs one dcp.sink_correct per layer and step, no collective: the programs
    of the model with and without sinks have the same collectives; and it lowers."""
    pytest.importorskip("torch_mlir")
    from dcp_compile.lowering import collectives_in, lower

    with_sinks = _program(sink_model(), mode, 4, 2)
    without = _program(demo.demo_model(), mode, 4, 2)
    layers = with_sinks.num_layers
    assert set(_count(with_sinks, torch.ops.dcp.sink_correct.default).values()) == {layers}
    assert set(_count(without, torch.ops.dcp.sink_correct.default).values()) == {0}
    lowered = lower(with_sinks, target="stablehlo", out_dir=tmp_path / "with")
    lowered_plain = lower(without, target="stablehlo", out_dir=tmp_path / "without")
    for step, m in lowered.modules.items():
        kinds = sorted(c["kind"] for c in collectives_in(m.text))
        assert kinds == sorted(c["kind"] for c in collectives_in(
            lowered_plain.modules[step].text)), step


def test_a_sink_column_in_another_form_is_refused_by_node(monkeypatch):
    """A dropped last softmax column that is not gpt-oss's per-head sink is refused, naming
    the softmax: never read as plain attention, never guessed."""
    from transformers.models.gpt_oss import modeling_gpt_oss as M

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key, value = (M.repeat_kv(t, module.num_key_value_groups) for t in (key, value))
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        column = torch.zeros_like(scores[..., :1]) + module.sinks.view(1, -1, 1, 1)
        probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
        return torch.matmul(probs, value).transpose(1, 2).contiguous(), None

    monkeypatch.setattr(M, "eager_attention_forward", eager)
    with pytest.raises(DCPTransformError, match=r"attention sink column of shape "
                                                r"\(\d+, 16, \d+, 1\).*at node softmax"):
        _program(gpt_oss(window=WINDOW), "decode", 4, 2)
