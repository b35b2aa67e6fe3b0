"""Soundness (issue #35 item 1): a program equals the model, or transform() refuses by name.

* Length-dependent positions: Phi-3's LongRoPE switches every position to its long factors
  once ``max(positions)`` passes ``original_max_position_embeddings``; the cache cannot
  follow. Refused (DCPLengthDependentError naming the rope type) unless proven constant
  below the program's max_model_len, where it runs on the short factors and matches the
  model. A mutation test shows the refusal stands between the user and a wrong program.
* Token mixing outside attention (x-transformers' ``shift_tokens``, a roll, pad + slice, a
  cumsum, a convolution over the sequence): refused by the token-wise analysis
  (DCPTokenMixingError naming the node and line), with a mutation test likewise.
* transform() raises only DCPError: anything else escaping a pass or a capture is a
  DCPCompilerBug naming the stage.
* Keys wider than values (MLA not absorbed, torchtitan's DeepSeek-V3): served with the
  values padded to the keys' head_dim, not a crash in shape propagation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dcp_compile
from dcp_compile.runtime.errors import (DCPCompilerBug, DCPError, DCPLengthDependentError,
                                        DCPTokenMixingError, DCPTransformError)
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.verify import run_threaded_program

from helpers import assert_runs_match, full_forward_reference, prompts_of, seeded_weights

TP, DCP, BLOCK = 4, 2, 4
VOCAB = 256
# The block table addresses max_blocks * BLOCK * DCP = 32 positions.
SHAPES = StepShapes(batch=4, context_len=12, max_blocks=4, num_blocks=12)
ATOL = 1e-4


def matches_own_forward(model, program, lengths=(1, 6, 12), steps=4) -> bool:
    """An ordinary model's program against its own full forward (greedy tokens, logits)."""
    prompts = prompts_of(lengths, vocab=VOCAB)
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True)
    try:
        assert_runs_match(runs, *full_forward_reference(model, prompts, steps), atol=ATOL)
    except AssertionError:
        return False
    return True


def transform(model, mode="decode", **kw):
    return dcp_compile.transform(model, tp=TP, dcp=DCP, mode=mode, block_size=BLOCK,
                                 shapes=SHAPES, **{"check": False, **kw})


# -- length-dependent positions: LongRoPE -------------------------------------------------

HEAD_DIM = 8


def longrope_phi3(original: int):
    """A tiny Phi-3 with LongRoPE: short factors 1, long factors 4 past ``original``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, max_position_embeddings=64,
        original_max_position_embeddings=original,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * (HEAD_DIM // 2),
                          long_factor=[4.0] * (HEAD_DIM // 2)))
    return seeded_weights(transformers.Phi3ForCausalLM(config).eval(), 0)


def hf_generate_reference(model, prompts, steps):
    from test_hf import hf_reference
    return hf_reference(model, prompts, steps)


def test_longrope_past_its_switch_is_refused_naming_the_rope_type():
    from dcp_compile import hf
    wrapper = hf.prepare(longrope_phi3(original=8))       # the table addresses 32 positions
    with pytest.raises(DCPLengthDependentError) as e:
        transform(wrapper)
    msg = str(e.value)
    assert "rope_type='longrope'" in msg and "max(positions)" in msg
    assert "constant only while max_model_len <= 8" in msg
    assert "modeling_phi3.py" in msg or "rope" in msg     # the source line (or module)


def test_longrope_within_its_short_range_is_folded_and_matches_the_model():
    from dcp_compile import hf
    model = longrope_phi3(original=16)
    program = transform(hf.prepare(model, max_model_len=16))
    folded = [r for r in program.history if r.name == "check_token_wise"]
    assert any(r.matched["length_decisions_folded"] == 1 for r in folded)
    assert all(r.matched["max_position"] == 15 for r in folded)
    prompts = prompts_of((1, 6, 9), vocab=VOCAB)          # 9 + 6 decoded tokens <= 16
    runs = run_threaded_program(program, prompts, 6, poison_garbage=True)
    ref_tokens, ref_logits = hf_generate_reference(model, prompts, 6)
    assert_runs_match(runs, ref_tokens, ref_logits, atol=ATOL)


def test_mutation_without_the_length_refusal_longrope_compiles_wrong(monkeypatch):
    """The refusal is what stands between the user and a wrong program: with the token-wise
    check switched off, LongRoPE past its switch compiles, and differs from the model."""
    from dcp_compile import hf
    from dcp_compile.passes import check_token_wise
    model = longrope_phi3(original=8)
    monkeypatch.setattr(check_token_wise, "follow_tokens", lambda *a, **k: {})
    program = transform(hf.prepare(model))
    prompts = prompts_of((1, 6, 12), vocab=VOCAB)
    runs = run_threaded_program(program, prompts, 6, poison_garbage=True)
    ref_tokens, ref_logits = hf_generate_reference(model, prompts, 6)
    with pytest.raises(AssertionError):
        assert_runs_match(runs, ref_tokens, ref_logits, atol=ATOL)


def test_a_length_decision_that_is_not_affine_is_refused():
    """Dynamic-NTK-like: the frequencies are a smooth function of max(positions) (no
    comparison to prove constant): refused, never folded."""

    class ScaledByLength(nn.Module):
        num_layers = 1

        def __init__(self):
            super().__init__()
            from model_grammar import ModelSpec, build
            self.inner = build(ModelSpec(8, 2))

        def kv_cache_shape(self, num_blocks, block_size):
            return self.inner.kv_cache_shape(num_blocks, block_size)

        def forward(self, input_ids, positions, block_table, kv_caches):
            scale = (positions.max() + 1).float() / 16.0      # NTK: base grows with length
            self.inner.inv_freq.copy_(1.0 / (10000.0 * scale) ** (
                torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
            return self.inner(input_ids, positions, block_table, kv_caches)

    with pytest.raises(DCPLengthDependentError, match=r"node max_?\w* \(aten\.max"):
        transform(ScaledByLength())


# -- token mixing outside attention --------------------------------------------------------


class ShiftTokensLM(nn.Module):
    """x-transformers' ``shift_tokens=1`` in plain PyTorch: before attention, half of each
    token's features are replaced by the previous token's (pad + negative pad)."""

    def __init__(self, mix: str = "shift"):
        super().__init__()
        self.mix = mix
        self.embed = nn.Embedding(VOCAB, 64)
        self.q = nn.Linear(64, 64, bias=False)
        self.k, self.v = (nn.Linear(64, 16, bias=False) for _ in range(2))   # 2 KV heads
        self.o = nn.Linear(64, 64, bias=False)
        self.head = nn.Linear(64, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        if self.mix == "no_rule":                       # token-wise, but no placement rule
            h = x + torch.special.i0(x)
        elif self.mix == "shift":
            a, rest = x[..., :32], x[..., 32:]
            a = F.pad(a, (0, 0, 1, -1))                      # x-transformers shift()
            h = torch.cat([a, rest], dim=-1)
        else:
            h = x
        heads = lambda t: t.view(b, s, -1, 8).transpose(1, 2)  # noqa: E731
        out = F.scaled_dot_product_attention(heads(self.q(h)), heads(self.k(h)),
                                             heads(self.v(h)), is_causal=True,
                                             enable_gqa=True)
        return self.head(x + self.o(out.transpose(1, 2).reshape(b, s, -1)))


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_token_shift_is_refused_naming_the_node_and_line(mode):
    model = seeded_weights(ShiftTokensLM("shift"), 0).eval()
    with pytest.raises(DCPTokenMixingError) as e:
        dcp_compile.transform(model, tp=TP, dcp=DCP, mode=mode, block_size=BLOCK,
                              shapes=SHAPES, check=False)
    msg = str(e.value)
    assert "mixes tokens along the sequence" in msg
    assert "node pad" in msg and "test_soundness.py" in msg


def test_mutation_without_the_token_wise_check_a_shift_compiles_wrong(monkeypatch):
    from dcp_compile.passes import check_token_wise
    model = seeded_weights(ShiftTokensLM("shift"), 0).eval()
    monkeypatch.setattr(check_token_wise, "follow_tokens", lambda *a, **k: {})
    program = dcp_compile.transform(model, tp=TP, dcp=DCP, mode="decode", block_size=BLOCK,
                                    shapes=SHAPES, check=False)
    assert not matches_own_forward(model, program)


def test_the_same_model_without_the_shift_matches():
    model = seeded_weights(ShiftTokensLM("none"), 0).eval()
    program = dcp_compile.transform(model, tp=TP, dcp=DCP, mode="decode", block_size=BLOCK,
                                    shapes=SHAPES, check=False)
    assert matches_own_forward(model, program)


def test_an_op_without_a_rule_is_refused_as_unknown_not_as_token_mixing():
    """An op the analysis has no rule for is not shown to mix tokens: refused as what it is
    (a DCPTransformError naming the op), not as a DCPTokenMixingError."""
    model = seeded_weights(ShiftTokensLM("no_rule"), 0).eval()
    with pytest.raises(DCPTransformError) as e:
        transform(model, mode="prefill")
    assert not isinstance(e.value, DCPTokenMixingError)
    assert "cannot show" in str(e.value) and "special_i0" in str(e.value)


@pytest.mark.parametrize("kind", ["shift", "roll", "pad_slice", "cumsum", "conv"])
def test_every_grammar_token_mix_is_refused(kind):
    from model_grammar import ModelSpec, build
    model = build(ModelSpec(4, 1, token_mix=kind))
    with pytest.raises(DCPTokenMixingError, match="mixes tokens along the sequence"):
        dcp_compile.transform(model, tp=4, dcp=2, mode="prefill", block_size=BLOCK,
                              shapes=SHAPES, check=False)


# -- only DCPError escapes transform() ----------------------------------------------------


def test_a_pass_that_crashes_is_a_compiler_bug_naming_the_pass(monkeypatch):
    from dcp_compile.passes.canonicalize_moe import CanonicalizeMoE
    from model_grammar import ModelSpec, build

    def crash(self, gm):
        raise RuntimeError("mm shape error, say")
    monkeypatch.setattr(CanonicalizeMoE, "call", crash)
    with pytest.raises(DCPCompilerBug) as e:
        transform(build(ModelSpec(8, 2)))
    msg = str(e.value)
    assert "pass canonicalize_moe (step 'context')" in msg
    assert "RuntimeError: mm shape error, say" in msg and "please report" in msg
    assert isinstance(e.value.original, RuntimeError) and isinstance(e.value, DCPError)


def test_a_capture_that_crashes_is_a_compiler_bug_naming_the_capture(monkeypatch):
    from dcp_compile.frontends.paged import PagedFrontend
    from model_grammar import ModelSpec, build

    def crash(self, step, config):
        raise KeyError("lost")
    monkeypatch.setattr(PagedFrontend, "capture", crash)
    with pytest.raises(DCPCompilerBug, match=r"PagedFrontend\.capture of step 'context'"):
        transform(build(ModelSpec(8, 2)))


def test_refusals_stay_refusals():
    """A DCPTransformError is not wrapped: its type and message reach the user."""
    model = seeded_weights(ShiftTokensLM("shift"), 0).eval()
    with pytest.raises(DCPTransformError) as e:
        transform(model)
    assert not isinstance(e.value, DCPCompilerBug)


# -- keys wider than values (MLA not absorbed) ---------------------------------------------


class WideKeysLM(nn.Module):
    """Attention whose keys are 12 wide per head and values 8 (DeepSeek-V3 before MLA
    absorption: qk_head_dim = nope + rope > v_head_dim)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.q, self.k = nn.Linear(64, 8 * 12, bias=False), nn.Linear(64, 2 * 12, bias=False)
        self.v = nn.Linear(64, 2 * 8, bias=False)
        self.o = nn.Linear(64, 64, bias=False)
        self.head = nn.Linear(64, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        q, k = (t.view(b, s, -1, 12).transpose(1, 2) for t in (self.q(x), self.k(x)))
        v = self.v(x).view(b, s, 2, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(x + self.o(out.transpose(1, 2).reshape(b, s, -1)))


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_values_narrower_than_keys_are_padded_and_match(mode):
    model = seeded_weights(WideKeysLM(), 0).eval()
    program = dcp_compile.transform(model, tp=TP, dcp=DCP, mode=mode, block_size=BLOCK,
                                    shapes=SHAPES, check=False)
    assert program.cache_spec().head_dim == 12
    assert matches_own_forward(model, program, steps=4 if mode == "decode" else 1)


# -- programs that pass transform() run: the kernels' layouts are their fakes' -------------


class NanoGPTLike(nn.Module):
    """nanoGPT's attention: multi-head (every head its own KV head), SDPA, then
    ``y.transpose(1, 2).contiguous().view(B, T, C)`` -- a view that needs the attention
    output laid out as its fake says."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.c_attn = nn.Linear(64, 3 * 64)
        self.c_proj = nn.Linear(64, 64)
        self.head = nn.Linear(64, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(64, dim=2)
        q, k, v = (z.view(b, t, 8, 8).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.head(x + self.c_proj(y))


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_multi_head_attention_output_view_runs_and_matches(mode):
    """Ran into ``view size is not compatible with input tensor's size and stride`` at run
    time (tp=2, dcp=1): partial attention's kernel returned a transposed tensor where its
    fake said contiguous."""
    model = seeded_weights(NanoGPTLike(), 0).eval()
    program = dcp_compile.transform(model, tp=2, dcp=1, mode=mode, block_size=BLOCK,
                                    shapes=SHAPES, check=False)
    assert matches_own_forward(model, program, steps=4 if mode == "decode" else 1)


def test_a_dcp_op_returns_contiguous_tensors_kernel_and_fake_alike():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dcp_compile.runtime.kernels.op_defs import dcp_op

    @dcp_op("test_transposed_output", mutates_args=())
    def transposed(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).clone().transpose(0, 1)      # same shape, strides (1, 2)

    @transposed.register_fake
    def _(x):
        return torch.empty_like(x.transpose(0, 1)).transpose(0, 1)

    x = torch.randn(2, 3)
    assert torch.ops.dcp.test_transposed_output(x).is_contiguous()
    with FakeTensorMode() as mode:
        assert torch.ops.dcp.test_transposed_output(mode.from_tensor(x)).is_contiguous()


# -- masks written in place ----------------------------------------------------------------


class InPlaceMaskLM(nn.Module):
    """An additive causal mask written in place. ``hides-key-0``: ``full(-inf).triu(1)``,
    then ``fill_`` into a slice (litgpt's form) that also hides key 0 from every later query
    -- more than causal, which a reader that ignores the write would take for plain causal.
    ``causal``: litgpt's own causal mask, ``ones.triu(1)`` then ``masked_fill_`` of -inf where
    it is 1. ``transposed``: the first, written through a transpose (no out-of-place form)."""

    def __init__(self, write: str = "hides-key-0"):
        super().__init__()
        self.write = write
        self.embed = nn.Embedding(VOCAB, 64)
        self.q = nn.Linear(64, 64, bias=False)
        self.k, self.v = (nn.Linear(64, 16, bias=False) for _ in range(2))
        self.o = nn.Linear(64, 64, bias=False)
        self.head = nn.Linear(64, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        if self.write == "causal":
            mask = torch.ones(s, s).triu(1)
            mask.masked_fill_(mask.bool(), float("-inf"))
        else:
            mask = torch.full((s, s), float("-inf")).triu(1)
            if self.write == "transposed":
                mask.t()[0, 1:].fill_(float("-inf"))            # a write through .t()
            else:
                mask[1:, 0].fill_(float("-inf"))                # hides key 0 from later queries
        heads = lambda t: t.view(b, s, -1, 8).transpose(1, 2)  # noqa: E731
        out = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)),
                                             heads(self.v(x)), attn_mask=mask,
                                             enable_gqa=True)
        return self.head(x + self.o(out.transpose(1, 2).reshape(b, s, -1)))


def test_a_mask_written_in_place_is_read_with_the_write():
    """The write is part of the mask: it hides key 0 from every later query, which is not
    causal, refused with a counterexample the write makes (at the write's source line)."""
    model = seeded_weights(InPlaceMaskLM(), 0).eval()
    with pytest.raises(DCPTransformError, match=r"hides some earlier tokens.*the mask "
                       r"differs from it \(at query position i=\d+, key position j=\d+") as e:
        transform(model)
    assert "test_soundness.py" in str(e.value) and "mask[1:, 0].fill_" not in str(e.value)


def test_a_causal_mask_written_in_place_is_read_and_matches_its_model():
    model = seeded_weights(InPlaceMaskLM("causal"), 0).eval()
    assert matches_own_forward(model, transform(model))


def test_a_write_with_no_out_of_place_form_is_refused_naming_it():
    model = seeded_weights(InPlaceMaskLM("transposed"), 0).eval()
    with pytest.raises(DCPTransformError, match=r"is written in place: aten\.fill_") as e:
        transform(model)
    assert "test_soundness.py" in str(e.value)


def test_mutation_a_reader_blind_to_in_place_writes_compiles_a_wrong_program(monkeypatch):
    """Without the out-of-place form and the refusal, the mask is read without its write
    (plain causal) and the program differs from the model."""
    from dcp_compile.passes import canonical_ops, mask_predicate
    model = seeded_weights(InPlaceMaskLM(), 0).eval()
    monkeypatch.delitem(canonical_ops.CANONICAL_FORMS, "writes_out_of_place")
    monkeypatch.setattr(mask_predicate, "_refuse_writes_in_place", lambda *a: None)
    program = transform(model)
    assert not matches_own_forward(model, program)


def test_longrope_through_the_ordinary_frontend_is_refused_as_length_dependent():
    """The model itself (no hf.prepare): its max(position_ids) is a positional value that
    mixes tokens (passes/positions.py), refused with the same type."""
    model = longrope_phi3(original=8)
    with pytest.raises(DCPLengthDependentError, match=r"max\(positions\)"):
        transform(model)


# -- the token-wise analysis, op by op -----------------------------------------------------

B, S, H = 2, 5, 6
KEEP_TOKENS_APART = {
    "flatten-batch-and-tokens": lambda x: x.reshape(B * S, H).relu().reshape(B, S, H),
    "topk-over-features": lambda x: x.topk(2, dim=-1).values,
    "gather-within-rows": lambda x: x.gather(-1, x.topk(2, dim=-1).indices),
    "softmax-over-features": lambda x: x.softmax(-1),
    "repeat_interleave-features": lambda x: x.repeat_interleave(2, dim=-1),
    "scatter-within-rows": lambda x: torch.zeros_like(x).scatter(-1, x.argmax(-1, True), 1.0),
}
MIX_TOKENS = {
    "cumsum-over-tokens": lambda x: x.cumsum(1),
    "roll": lambda x: x.roll(1, 1),
    "pad-tokens": lambda x: F.pad(x, (0, 0, 1, 0))[:, :-1],
    "fold-features-into-tokens": lambda x: x.reshape(B, S * H).relu().reshape(B, S, H),
    "max-over-tokens": lambda x: x.amax(1, keepdim=True) + x,
    "topk-over-tokens": lambda x: x.topk(2, dim=1).values,
}


def _rows_of(fn):
    from torch.fx.experimental.proxy_tensor import make_fx

    from dcp_compile.passes.placement.tokens import Rows, follow_tokens
    gm = make_fx(fn, tracing_mode="fake")(torch.randn(B, S, H))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    return follow_tokens(list(gm.graph.nodes), {x: Rows(1, S)}, S)


@pytest.mark.parametrize("name", list(KEEP_TOKENS_APART))
def test_token_wise_analysis_follows_ops_that_keep_tokens_apart(name):
    assert _rows_of(KEEP_TOKENS_APART[name])


@pytest.mark.parametrize("name", list(MIX_TOKENS))
def test_token_wise_analysis_refuses_ops_that_mix_tokens(name):
    from dcp_compile.passes.placement.tokens import TokenMixing
    with pytest.raises(TokenMixing):
        _rows_of(MIX_TOKENS[name])
