"""ALiBi under DCP (issue #38): a per-head score bias slope_h * (k_pos - q_pos).

The mask reader proves the bias a model adds is ALiBi for every position and head, with the
slopes an uninterpreted per-head table of the model's own (passes/score_bias.alibi_of);
the paged op adds ``alibi_bias`` on global positions, so each rank biases the keys it holds
and the LSE combine is unchanged; TP cuts the slopes by the rank's q heads and decode DCP
gathers them with q. Programs are compared with the model's own plain forward: fp32, 1e-4,
greedy tokens, lengths around the interleave period, mixed-length batches, GQA.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dcp_compile
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.verify import run_threaded_program

from full_runs import full
from helpers import (assert_close_report, assert_live_kernel_matches_reference,  # noqa: E402
                     assert_runs_match, full_forward_reference, prompts_of)

VOCAB, BLOCK, ATOL = 256, 4, 1e-4
STEPS = {"decode": 6, "prefill": 1}


def slopes_of(heads: int) -> torch.Tensor:
    """Press et al.'s slopes (Bloom's build_alibi_tensor), any head count."""
    p = 2 ** math.floor(math.log2(heads))
    base = 2 ** (-(2 ** -(math.log2(p) - 3)))
    out = [base ** (i + 1) for i in range(p)]
    if p != heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * p) - 3)))
        out += [extra ** (2 * i + 1) for i in range(heads - p)]
    return torch.tensor(out)


class AlibiLM(nn.Module):
    """A GQA decoder with ALiBi and no position embedding, in one of the forms models write
    the bias (``form``): Bloom's ``slope * k_pos``, MPT's ``slope * (k_pos - (S - 1))`` as a
    second term beside a bool mask, Falcon's bias folded into the additive mask and scaled
    after, the symmetric ``-slope * |i - j|`` under a causal mask, and that with slopes for
    half the heads padded with zeros and the mask built by a pad (x-transformers'
    ``alibi_num_heads``: a pad of a table is a table; a constant pad is a formula)."""

    def __init__(self, form: str, heads: int = 8, kv_heads: int = 2, layers: int = 2,
                 slope_table: str = "buffer"):
        super().__init__()
        torch.manual_seed(0)
        self.form, self.heads, self.kv_heads, self.d = form, heads, kv_heads, 8
        hidden = 64
        self.embed = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            q=nn.Linear(hidden, heads * 8, bias=False),
            k=nn.Linear(hidden, kv_heads * 8, bias=False),
            v=nn.Linear(hidden, kv_heads * 8, bias=False),
            o=nn.Linear(heads * 8, hidden, bias=False),
            up=nn.Linear(hidden, 96, bias=False), down=nn.Linear(96, hidden, bias=False)))
            for _ in range(layers))
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.slope_table = slope_table
        self.register_buffer("slopes", slopes_of(heads))
        for p in self.parameters():
            nn.init.normal_(p, std=0.1)

    def _slopes(self) -> torch.Tensor:
        if self.slope_table == "computed":   # MPT: 1 / 2^(8 (h + 1) / H), built in forward
            base = torch.arange(1, self.heads + 1, dtype=torch.float32) * (8 / self.heads)
            return 1.0 / torch.pow(2, base)
        return self.slopes

    def _attend(self, q, k, v):
        b, h, s, d = q.shape
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
        i = torch.arange(s)
        slopes = self._slopes().view(1, h, 1, 1)
        later = i[None, :] > i[:, None]                      # [S, S]: key after query
        scores = q @ k.transpose(-2, -1)
        if self.form == "bloom":     # slope * k_pos, additive mask
            bias = slopes * i.view(1, 1, 1, s).float()
            mask = torch.zeros(s, s).masked_fill(later, float("-inf"))
            scores = scores * d ** -0.5 + bias + mask
        elif self.form == "mpt":     # slope * (k_pos - (S - 1)) as its own term, bool mask
            bias = slopes * torch.arange(1 - s, 1).view(1, 1, 1, s).float()
            scores = (scores * d ** -0.5 + bias).masked_fill(later, torch.finfo(q.dtype).min)
        elif self.form == "falcon":  # the bias folded into the mask, both scaled after
            mask = torch.zeros(s, s).masked_fill(later, float("-inf"))
            scores = (scores + (slopes * i.view(1, 1, 1, s).float() + mask)) * d ** -0.5
        elif self.form == "symmetric":   # -slope * |i - j|: ALiBi where the mask keeps
            dist = (i[:, None] - i[None, :]).abs().float()
            scores = (scores * d ** -0.5 - slopes * dist).masked_fill(later, float("-inf"))
        elif self.form == "padded":      # x-transformers: slopes for half the heads, zero
            half = self._slopes()[: h // 2].view(h // 2, 1, 1)     # for the rest (a pad);
            slopes = F.pad(half, (0, 0, 0, 0, 0, h - h // 2))      # the causal mask padded
            dist = (i[:, None] - i[None, :]).abs().float()         # on the left: key 0 is
            hide = F.pad(torch.ones(s, s - 1, dtype=torch.bool).triu(0), (1, 0),  # never
                         value=False)                                              # hidden
            scores = (scores * d ** -0.5 - slopes * dist).masked_fill(hide, float("-inf"))
        elif self.form == "quadratic":   # not ALiBi: refused
            dist = (i[:, None] - i[None, :]).float() ** 2
            scores = (scores * d ** -0.5 - slopes * dist).masked_fill(later, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        for L in self.layers:
            split = lambda t, n: t.view(b, s, n, self.d).transpose(1, 2)  # noqa: E731
            out = self._attend(split(L["q"](x), self.heads), split(L["k"](x), self.kv_heads),
                               split(L["v"](x), self.kv_heads))
            x = x + L["o"](out.transpose(1, 2).reshape(b, s, -1))
            x = x + L["down"](torch.relu(L["up"](x)))
        return self.head(x)


def run(model, mode, tp, dcp, lengths):
    blocks = 24 // (BLOCK * dcp) + 2
    shapes = StepShapes(batch=len(lengths), context_len=max(lengths), max_blocks=blocks,
                        num_blocks=blocks * len(lengths) + 2)
    program = dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, block_size=BLOCK,
                                    shapes=shapes, check=False)
    steps = STEPS[mode]
    prompts = prompts_of(lengths, vocab=VOCAB)
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True)
    ref_tokens, ref_logits = full_forward_reference(model, prompts, steps)
    assert_runs_match(runs, ref_tokens, ref_logits, atol=ATOL, lengths=lengths)
    return program


# vblock = BLOCK * dcp = 8 at dcp=2 (16 at dcp=4): lengths inside, at and past its edges,
# one batch of mixed lengths.
CASES = [("bloom", 4, 2, (1, 7, 8, 9, 17)), ("mpt", 4, 2, (3, 8, 16)),
         ("falcon", 4, 2, (2, 9, 15)), ("symmetric", 4, 2, (1, 8, 13)),
         ("bloom", 8, 4, (1, 15, 16, 17)), ("padded", 4, 2, (1, 8, 13))]
MATRIX = [(c, m) for c in CASES for m in ("decode", "prefill")]
# The slice (DCP_ALIBI_FULL=1 runs the matrix): both modes, both (tp, dcp), four forms
# (falcon in prefill: its form is read the same in either mode, prefill runs one step).
SLICE = [(CASES[0], "decode"), (CASES[1], "prefill"), (CASES[2], "prefill"),
         (CASES[4], "prefill"), (CASES[5], "decode")]


@pytest.mark.parametrize("case,mode", MATRIX if full("DCP_ALIBI_FULL") else SLICE,
                         ids=lambda x: x if isinstance(x, str) else f"{x[0]}-tp{x[1]}-dcp{x[2]}")
def test_alibi_matches_its_own_forward(case, mode):
    form, tp, dcp, lengths = case
    program = run(AlibiLM(form), mode, tp, dcp, lengths)
    forms = next(r for r in program.history if r.name == "insert_paged_cache").matched["forms"]
    assert any("alibi" in f for f in forms), forms


# The slice: prefill (the slopes node read as the table); decode (the same node, gathered
# with q like every decode case's slopes) with DCP_ALIBI_FULL=1.
@pytest.mark.parametrize("mode", ["decode", "prefill"] if full("DCP_ALIBI_FULL") else ["prefill"])
def test_alibi_slopes_computed_in_forward(mode):
    """MPT builds its slopes every forward (arange, pow, reciprocal): the table is that node."""
    run(AlibiLM("mpt", slope_table="computed"), mode, 4, 2, (5, 9))


def test_alibi_non_power_of_two_heads_mqa():
    """12 heads (Bloom's interleaved slopes), one KV head: tp=4 cuts 3 heads per rank."""
    run(AlibiLM("bloom", heads=12, kv_heads=1), "decode", 4, 2, (4, 9))


def test_not_alibi_refused_by_name():
    with pytest.raises(DCPTransformError, match="is not ALiBi") as e:
        dcp_compile.transform(AlibiLM("quadratic"), tp=4, dcp=2, mode="prefill",
                              block_size=BLOCK, shapes=StepShapes(batch=2, context_len=8,
                                                                  max_blocks=4, num_blocks=10))
    assert "test_alibi.py" in str(e.value), str(e.value)


def test_alibi_bias_of_the_op_matches_dense_attention():
    """dcp.paged_attention(alibi_slopes) equals dense attention with slope * (j - i)."""
    from dcp_compile.runtime.kernels.ops import _paged_attention_impl
    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 2, 10, 4, 2, 8
    q, k, v = (torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv))
    positions = torch.arange(s).expand(b, s).clone()
    table = torch.arange(2 * 3).view(b, 3)
    caches = [torch.zeros(7, 4, hkv, d) for _ in range(2)]
    slopes = slopes_of(hq)
    out, _, _ = _paged_attention_impl(q, k, v, *caches, positions, table, 0.3,
                                      alibi_slopes=slopes)
    i = torch.arange(s)
    kr, vr = (t.repeat_interleave(hq // hkv, dim=2).transpose(1, 2) for t in (k, v))
    scores = q.transpose(1, 2) @ kr.transpose(-2, -1) * 0.3 \
        + slopes.view(1, hq, 1, 1) * (i[None, :] - i[:, None]).float()
    scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
    ref = (torch.softmax(scores, dim=-1) @ vr).transpose(1, 2)
    assert_close_report(out, ref, atol=1e-5, what="paged attention with ALiBi")


def test_live_kernel_adds_the_same_bias():
    """The eager kernel (partial_attention_live) and the reference agree with ALiBi."""
    assert_live_kernel_matches_reference(alibi_slopes=slopes_of(4))


# transformers' Bloom itself (eager; its attention is baddbmm(alibi, q, k^T) on heads
# flattened into the batch, the alibi a per-head [H, 1, S] repeated over the batch): read as
# matmuls on [B, H, S, T] (passes/attention_forms.heads_unflattened_from_batch), its bias
# proven ALiBi. Prefill at tp=4/dcp=2 and tp=8/dcp=4 (8 heads), prompts past the vblock;
# decode is multi-head attention, refused as such (decode DCP needs tp > kv heads).
BLOOM = [(4, 2), (8, 4)] if full("DCP_ALIBI_FULL") else [(8, 4)]


@pytest.mark.parametrize("tp,dcp", BLOOM, ids=[f"tp{t}-dcp{d}" for t, d in BLOOM])
def test_transformers_bloom_prefill_matches(tp, dcp, monkeypatch):
    pytest.importorskip("transformers")
    import hf_corpus as C
    monkeypatch.setattr(C, "LENGTHS", (1, 7, 9, 17))
    out = C.run_model(C.build("bloom", "eager"), "prefill", tp=tp, dcp=dcp)
    assert out.kind == "matches", f"{out.cell()}: {out.message[:500]}"


def test_transformers_bloom_decode_is_refused_as_mha():
    pytest.importorskip("transformers")
    import hf_corpus as C
    out = C.run_model(C.build("bloom", "eager"), "decode")
    assert out.cell() == "refused: MHA: decode DCP needs tp > kv heads", out.message[:300]
