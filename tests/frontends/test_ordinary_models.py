"""Ordinary models in, paged DCP programs out (passes/insert_paged_cache).

Each model has no KV cache and no project API; transform() inserts the cache. The program,
run by the engine on a threaded world (tp=4, dcp=2), must decode the same greedy tokens with
the same fp32 logits (1e-4) as the model's own plain forward over the full token sequence.
What cannot be served from a paged cache is refused by name and source line.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dcp_compile
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.models.demo import DemoConfig
from dcp_compile.models.plain import plain_llama
from dcp_compile.verify import run_threaded_program
from dcp_compile.runtime.serving.engine import StepShapes

from helpers import assert_close_report, assert_runs_match, full_forward_reference, prompts_of

TP, DCP, BLOCK = 4, 2, 4
VOCAB = 256
LENGTHS = (1, 6, 12)            # 1-3 vblocks of 8: sequences cross block and rank boundaries
SHAPES = StepShapes(batch=4, context_len=12, max_blocks=4, num_blocks=12)
STEPS = {"decode": 8, "prefill": 1}
ATOL = 1e-4
CFG = DemoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_q_heads=8,
                 num_kv_heads=2, head_dim=8, intermediate_size=96)
HF_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, bos_token_id=None,
               eos_token_id=None, pad_token_id=None, max_position_embeddings=64)


def hf_model(config_name: str, model_name: str, **overrides):
    pytest.importorskip("transformers")
    from test_hf import build
    return build(config_name, model_name, {**HF_BASE, **overrides})


# id -> factory of a model with no cache. HF models get a random-weights config only.
MODELS = {
    "plain-sdpa-is_causal": lambda: plain_llama(CFG, attention="sdpa"),
    "plain-sdpa-bool-mask-enable_gqa-arange": lambda: plain_llama(
        CFG, attention="sdpa_mask", gqa="enable_gqa", position_ids=False),
    "plain-eager-additive-mask": lambda: plain_llama(CFG, attention="eager"),
    # One fused [q; k; v] weight: the placement analysis cuts it segment by segment.
    "plain-sdpa-fused-qkv": lambda: plain_llama(CFG, attention="sdpa", fused_qkv=True),
    "plain-eager-repeat_interleave": lambda: plain_llama(CFG, attention="eager",
                                                         gqa="repeat_interleave"),
    "plain-eager-window-softcap": lambda: plain_llama(CFG, attention="eager", window=4,
                                                      softcap=3.0),
    "hf-llama-sdpa": lambda: hf_model("LlamaConfig", "LlamaForCausalLM",
                                      attn_implementation="sdpa"),
    "hf-qwen2-eager": lambda: hf_model("Qwen2Config", "Qwen2ForCausalLM",
                                       attn_implementation="eager"),
    # Alternating 4-token sliding window and full layers, logit soft-capping, per-layer
    # query_pre_attn_scalar scale: sequences of up to 20 tokens leave the window.
    "hf-gemma2-eager-window-softcap": lambda: hf_model(
        "Gemma2Config", "Gemma2ForCausalLM", attn_implementation="eager", head_dim=8,
        sliding_window=4, attn_logit_softcapping=3.0, query_pre_attn_scalar=16),
}


def transform(model, mode):
    return dcp_compile.transform(model, tp=TP, dcp=DCP, mode=mode, block_size=BLOCK,
                                 shapes=SHAPES, check=False)  # the tests compare every step


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("model_id", list(MODELS))
def test_ordinary_model_matches_its_own_forward(model_id, mode):
    model = MODELS[model_id]()
    program = transform(model, mode)
    inserted = next(r for r in program.history if r.name == "insert_paged_cache")
    assert inserted.matched["layers"] == 2
    spec = program.cache_spec()
    assert (spec.num_layers, spec.head_dim) == (2, 8)

    steps = STEPS[mode]
    prompts = prompts_of(LENGTHS, vocab=VOCAB)
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True)
    ref_tokens, ref_logits = full_forward_reference(model, prompts, steps)
    assert_runs_match(runs, ref_tokens, ref_logits, atol=ATOL)


def test_per_layer_scale():
    """Each layer's own softmax scale is found and kept (eager attention)."""
    model = plain_llama(CFG, attention="eager")
    for i, layer in enumerate(model.layers):
        layer.self_attn.scale = 0.2 + 0.1 * i
    program = transform(model, "decode")
    prompts = prompts_of((5,), vocab=VOCAB)
    runs = run_threaded_program(program, prompts, 3)
    ref_tokens, ref_logits = full_forward_reference(model, prompts, 3)
    assert runs[0].result.tokens == ref_tokens
    for t, got in enumerate(runs[0].result.logits):
        assert_close_report(got[0], ref_logits[0][t], atol=ATOL, what=f"step {t}")


# ---------------------------------------------------------------------------------------
# Refused: every error names the node and the source line.
# ---------------------------------------------------------------------------------------


class TinyAttentionLM(nn.Module):
    """One attention layer whose attention is ``attend(q, k, v, x, input_ids)``."""

    def __init__(self, attend):
        super().__init__()
        self.attend = attend
        self.embed = nn.Embedding(VOCAB, 32)
        self.q, self.k, self.v = (nn.Linear(32, 32, bias=False) for _ in range(3))
        self.o = nn.Linear(32, 32, bias=False)
        self.memory = nn.Parameter(torch.randn(12, 32))
        self.register_buffer("tril", torch.ones(1, 1, 32, 32).tril())   # nanoGPT's mask
        self.head = nn.Linear(32, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        heads = lambda t: t.view(t.shape[0], t.shape[1], -1, 8).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        out = self.attend(self, q, k, v, input_ids)
        return self.head(x + self.o(out.transpose(1, 2).reshape(b, s, -1)))


def _flash_for_cpu(m, q, k, v, ids):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]


def _buffer_mask(m, q, k, v, ids):
    s = ids.shape[1]
    scores = (q @ k.transpose(-2, -1)) / 8 ** 0.5
    scores = scores.masked_fill(m.tril[:, :, :s, :s] == 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("attend", ["_flash_for_cpu", "_buffer_mask", "_memory_kv"])
def test_attention_kernel_and_buffer_mask_forms(attend):
    """The flash kernel called directly, a causal mask read from a registered buffer
    (nanoGPT), and learned memory key/values joined before the sequence's (x-transformers'
    attn_num_mem_kv), on a model whose positions come from nowhere (no RoPE)."""
    torch.manual_seed(0)
    model = TinyAttentionLM(globals()[attend]).eval()
    program = dcp_compile.transform(model, tp=2, dcp=1, mode="decode", block_size=BLOCK,
                                    shapes=SHAPES)
    prompts = prompts_of((3, 9), vocab=VOCAB)
    runs = run_threaded_program(program, prompts, 3)
    ref_tokens, ref_logits = full_forward_reference(model, prompts, 3)
    for run in runs:
        assert run.result.tokens == ref_tokens
        for t, got in enumerate(run.result.logits):
            for b in range(len(prompts)):
                assert_close_report(got[b], ref_logits[b][t], atol=ATOL, what=f"{t} {b}")


def _encoder(m, q, k, v, ids):
    return F.scaled_dot_product_attention(q, k, v)


def _cross(m, q, k, v, ids):
    mem = m.memory.expand(q.shape[0], -1, -1)
    return F.scaled_dot_product_attention(q, m.k(mem).view(q.shape[0], 12, 4, 8).transpose(1, 2),
                                          m.v(mem).view(q.shape[0], 12, 4, 8).transpose(1, 2))


def _token_mask(m, q, k, v, ids):
    s = ids.shape[1]
    keep = torch.ones(s, s, dtype=torch.bool).tril() & (ids != 0)[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _token_shift_keys(m, q, k, v, ids):
    """RWKV-style token shift: token t's key is the previous token's."""
    k = torch.cat([torch.zeros_like(k[:, :, :1]), k[:, :, :-1]], dim=2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _hide_first_token(m, q, k, v, ids):
    s = ids.shape[1]
    i = torch.arange(s)
    keep = (i[None, :] <= i[:, None]) & ((i[None, :] > 0) | (i[:, None] == 0))
    scores = (q @ k.transpose(-2, -1)) * 8 ** -0.5
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def _position_bias(m, q, k, v, ids):
    """A bias of the distance squared: a position bias that is not ALiBi (ALiBi matches:
    tests/frontends/test_alibi.py)."""
    s = ids.shape[1]
    i = torch.arange(s)
    bias = -((i[:, None] - i[None, :]) ** 2).float() * 0.5
    scores = (q @ k.transpose(-2, -1)) * 8 ** -0.5 + bias.masked_fill(i[None, :] > i[:, None],
                                                                     float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _memory_kv(m, q, k, v, ids):
    """x-transformers' attn_num_mem_kv: 2 learned key/value slots joined before the
    sequence's, attended by every query."""
    b, s = q.shape[0], q.shape[2]
    mem = m.memory[:2].view(2, -1, 8).transpose(0, 1)[None].expand(b, -1, -1, -1)
    k, v = torch.cat([mem, k], dim=2), torch.cat([mem, v], dim=2)
    scores = (q @ k.transpose(-2, -1)) * 8 ** -0.5
    hidden = torch.ones(s, s + 2, dtype=torch.bool).triu(3)
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v


REFUSED = {
    "encoder-non-causal-sdpa": (_encoder, "non-causal attention"),
    "cross-attention": (_cross, "cross-attention"),
    "token-dependent-mask": (_token_mask, "depends on the token ids"),
    "token-shifted-keys": (_token_shift_keys, "acts on each token on its own"),
    "causal-mask-hiding-a-token": (_hide_first_token, "not as a sliding window"),
    "position-bias-not-alibi": (_position_bias, "is not ALiBi"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_with_node_and_source_line(case):
    attend, why = REFUSED[case]
    model = TinyAttentionLM(attend).eval()
    with pytest.raises(DCPTransformError, match=why) as e:
        dcp_compile.transform(model, tp=4, dcp=1, mode="decode", block_size=BLOCK,
                              shapes=SHAPES)
    message = str(e.value)
    assert "at node " in message and "test_ordinary_models.py" in message, message
    assert "line " in message, message


class LastLogitsLM(TinyAttentionLM):
    """nanoGPT's inference forward: the LM head over the last position only."""

    def __init__(self, last):
        super().__init__(lambda m, q, k, v, ids: F.scaled_dot_product_attention(
            q, k, v, is_causal=True))
        self.last = last

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        heads = lambda t: t.view(b, s, -1, 8).transpose(1, 2)  # noqa: E731
        out = self.attend(self, heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), None)
        x = x + self.o(out.transpose(1, 2).reshape(b, s, -1))
        return self.head(self.last(x))


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("last", [lambda x: x[:, [-1], :], lambda x: x[:, -1, :]],
                         ids=["x[:, [-1], :]", "x[:, -1, :]"])
def test_last_position_logits_refused_by_name(last, mode):
    """Issue #35: a forward returning the last position's logits only is refused as that
    form (DCPOutputContractError), not as an export failure, and the program's output
    contract is not changed silently; the same model with the head over every position
    matches (the MHA refusal in decode is the spec's tp > kv heads rule)."""
    from dcp_compile import DCPOutputContractError
    model = LastLogitsLM(last).eval()
    with pytest.raises(DCPOutputContractError, match="logits of the last position only") as e:
        dcp_compile.transform(model, tp=TP, dcp=DCP, mode=mode, block_size=BLOCK,
                              shapes=SHAPES, check=False)
    assert "could not capture" not in str(e.value)
    assert "lm_head(x)" in str(e.value)
    model.last = lambda x: x                       # the head over every position
    shapes = StepShapes(batch=4, context_len=12, max_blocks=8, num_blocks=24)   # dcp=1
    program = dcp_compile.transform(model, tp=TP, dcp=1, mode=mode, block_size=BLOCK,
                                    shapes=shapes, check=False)
    prompts = prompts_of(LENGTHS, vocab=VOCAB)
    runs = run_threaded_program(program, prompts, STEPS[mode], poison_garbage=True)
    ref_tokens, ref_logits = full_forward_reference(model, prompts, STEPS[mode])
    assert_runs_match(runs, ref_tokens, ref_logits, atol=ATOL)


def test_paged_signature_without_hooks_still_needs_them():
    class PagedNoHooks(nn.Module):
        def forward(self, input_ids, positions, block_table, kv_caches):
            raise AssertionError("not reached")

    with pytest.raises(DCPTransformError, match="does not describe its KV cache"):
        transform(PagedNoHooks(), "decode")


def test_window_and_softcap_of_the_paged_op_match_dense_attention():
    """dcp.paged_attention(window, softcap) equals dense masked attention over the chunk."""
    from dcp_compile.runtime.kernels.ops import _paged_attention_impl
    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d, window, cap = 2, 10, 4, 2, 8, 3, 2.5
    q, k, v = (torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv))
    positions = torch.arange(s).expand(b, s).clone()
    table = torch.arange(2 * 3).view(b, 3)
    caches = [torch.zeros(7, 4, hkv, d) for _ in range(2)]
    out, _, _ = _paged_attention_impl(q, k, v, *caches, positions, table, 0.3, window, cap)
    i = torch.arange(s)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    kr, vr = (t.repeat_interleave(hq // hkv, dim=2).transpose(1, 2) for t in (k, v))
    scores = q.transpose(1, 2) @ kr.transpose(-2, -1) * 0.3
    scores = (torch.tanh(scores / cap) * cap).masked_fill(~keep, float("-inf"))
    ref = (torch.softmax(scores, dim=-1) @ vr).transpose(1, 2)
    assert_close_report(out, ref, atol=1e-5, what="paged attention with window and softcap")


def test_cli_verify_takes_a_model_factory_and_an_hf_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dcp_compile.cli import main
    base = ["verify", "--tp", "4", "--dcp", "2", "--block-size", "4", "--lengths", "3,9"]
    assert main(base + ["--steps", "2", "--model", "dcp_compile.models.plain:plain_llama"]) == 0
    transformers.Qwen2Config(**HF_BASE).save_pretrained(tmp_path)
    assert main(base + ["--mode", "prefill", "--chunks", "2", "--hf-config",
                        str(tmp_path)]) == 0
