"""OpenAI-GPT's product mask, ``scores * b + F * (1 - b)`` (passes/attention_patterns.py's
``product_mask``, passes/mask_predicate.py's ``_product_keep``).

b is read as a predicate of positions and proven a 0/1 causal mask for every position (a
value of b other than 0 or 1 would scale the scores: refused with the value); F, a finite
fill, must be masked out (F <= MASKED_OUT = -1e4). The model's own softmax then gives a
future key the weight exp(F - m), m the query's largest kept score: exactly 0 once
m > F + underflow_margin(dtype), the condition the mask theorem states (docs/guarantees.md,
"Finite fills"). A fill above MASKED_OUT (-5) keeps future keys in the model's softmax, which
no KV cache holds: refused, naming F. masked_fill / where with a finite fill state the same
condition on their theorems. Matches compare with the model's own forward (fp32
1e-4, greedy tokens) through the corpus cell (tests/support/hf_corpus.run_model).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dcp_compile
import hf_corpus as C
from dcp_compile.passes.attention_patterns import MASKED_OUT
from dcp_compile.passes.finite_fills import underflow_margin
from dcp_compile.runtime.errors import DCPTransformError

pytestmark = pytest.mark.filterwarnings("ignore")

VOCAB = C.TINY["vocab_size"]


class ProductMaskLM(nn.Module):
    """One grouped-query attention layer (8 q heads, 2 KV heads: decode DCP applies) masked
    as OpenAI-GPT masks: ``w * b + fill * (1 - b)``, b a stored [1, 1, N, N] table (or,
    ``computed``, ``(j <= i).float()`` from arange)."""

    def __init__(self, fill: float = -1e4, table=None, n: int = 64, computed: bool = False,
                 form: str = "product"):
        super().__init__()
        self.fill, self.computed, self.form = fill, computed, form
        table = torch.tril(torch.ones(n, n)) if table is None else table(n)
        self.register_buffer("b", table.view(1, 1, n, n))
        self.embed = nn.Embedding(VOCAB, 64)
        self.q, self.o = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)
        self.k, self.v = nn.Linear(64, 16, bias=False), nn.Linear(64, 16, bias=False)
        self.head = nn.Linear(64, VOCAB, bias=False)
        gen = torch.Generator().manual_seed(0)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen) * 0.5

    def forward(self, input_ids):
        x = self.embed(input_ids)
        bsz, s, _ = x.shape
        heads = lambda t: t.view(bsz, s, -1, 8).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        k, v = (t.repeat_interleave(4, dim=1) for t in (k, v))
        w = q @ k.transpose(-2, -1) / math.sqrt(8)
        if self.computed:      # b from positions, not a stored table
            i = torch.arange(s)
            b = (i[None, :] <= i[:, None]).to(w.dtype)
        else:
            b = self.b[:, :, :s, :s]
        if self.form == "masked_fill":
            w = w.masked_fill(b == 0, self.fill)
        elif self.form == "where":
            w = torch.where(b != 0, w, self.fill)
        else:
            w = w * b + self.fill * (1 - b)
        out = torch.softmax(w, dim=-1) @ v
        return self.head(x + self.o(out.transpose(1, 2).reshape(bsz, s, -1)))


def _own(model, ids):
    return model(ids)


def _run(model, mode, tp=4, dcp=2):
    return C.run_model(model, mode, logits_of=_own, tp=tp, dcp=dcp)


@pytest.mark.parametrize("mode,computed", [("decode", False), ("prefill", False),
                                           ("prefill", True)],
                         ids=["decode-tril-buffer", "prefill-tril-buffer",
                              "prefill-b-from-arange"])
def test_product_mask_matches_its_own_forward(mode, computed):
    out = _run(ProductMaskLM(computed=computed).eval(), mode)
    assert out.kind == "matches", out


def test_openai_gpt_prefill_matches_and_its_decode_is_refused_as_mha():
    out = C.run_model(C.build("openai-gpt", "eager"), "prefill", tp=4, dcp=2)
    assert out.kind == "matches", out
    out = C.run_model(C.build("openai-gpt", "eager"), "decode", tp=4, dcp=2)
    assert out.kind == "refused" and "multi-head attention" in out.message, out


def test_the_mask_theorem_states_the_underflow_condition():
    program = dcp_compile.transform(C.build("openai-gpt", "eager"), tp=4, dcp=2,
                                    mode="prefill", block_size=4, check=False)
    theorem = program.certificate["mask_layer_0"]
    assert theorem.proven and "iff j <= i, for all positions" in theorem.statement
    bound = -1e4 + underflow_margin(torch.float32)
    assert "finite F=-10000" in theorem.statement
    assert f"m > F + 103.97 = {bound:.6g}" in theorem.statement, theorem.statement


@pytest.mark.parametrize("form,fill,stated", [
    ("masked_fill", -1e4, "F=-10000 (masked_fill(mask, F))"),
    ("where", -1e9, "F=-1e+09 (where(mask, scores, F))"),
    ("masked_fill", float("-inf"), None),
], ids=["masked-fill-finite", "where-finite", "masked-fill-inf-states-nothing"])
def test_a_finite_fill_in_place_of_the_scores_is_stated_on_its_theorem(form, fill, stated):
    model = ProductMaskLM(fill=fill, form=form).eval()
    program = dcp_compile.transform(model, tp=4, dcp=2, mode="prefill", block_size=4,
                                    check=False)
    statement = program.certificate["mask_layer_0"].statement
    if stated is None:
        assert "finite F" not in statement, statement
    else:
        assert stated in statement and "not -inf: equal to this mask where" in statement


# ---------------------------------------------------------------------------------------
# Mutations: a fill that does not vanish, a b that is not 0/1, a b that is not causal.
# ---------------------------------------------------------------------------------------


def test_a_fill_that_does_not_vanish_is_refused_naming_it():
    model = ProductMaskLM(fill=-5.0).eval()
    # It would be silently wrong: the model's softmax gives the future keys real weight.
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(ids) - ProductMaskLM(fill=-1e4).eval()(ids)).abs().max() > 1e-2
    with pytest.raises(DCPTransformError, match=r"a finite mask fill F=-5 \(scores \* mask "
                       r"\+ F \* \(1 - mask\)\): future tokens keep weight exp\(F - m\)"):
        dcp_compile.transform(model, tp=4, dcp=2, mode="prefill", block_size=4, check=False)


@pytest.mark.parametrize("table,names", [
    (lambda n: torch.tril(torch.ones(n, n)) * 0.5, r"takes the value 0\.5"),
    (lambda n: torch.ones(n, n), r"bidirectional"),
    (lambda n: torch.tril(torch.ones(n, n), diagonal=1), r"not causal"),
], ids=["b-half-not-0-1", "b-all-ones-bidirectional", "b-attends-next-token"])
def test_a_product_mask_that_is_not_a_causal_0_1_predicate_is_refused(table, names):
    model = ProductMaskLM(table=table).eval()
    with pytest.raises(DCPTransformError, match=names):
        dcp_compile.transform(model, tp=4, dcp=2, mode="prefill", block_size=4, check=False)


# ---------------------------------------------------------------------------------------
# The condition itself: the margin is where exp rounds to 0, and the product mask equals
# the -inf mask exactly above it and not below.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_underflow_margin_is_where_exp_rounds_to_zero(dtype):
    margin = underflow_margin(dtype)
    exp = lambda x: torch.exp(torch.tensor(x, dtype=torch.float64)).to(dtype)  # noqa: E731
    assert exp(-margin - 1e-3) == 0 and exp(-margin + 1e-2) > 0


@pytest.mark.parametrize("offset,equal", [(1.0, True), (-1.0, False)],
                         ids=["row-max-above-bound", "row-max-below-bound"])
def test_the_fill_vanishes_exactly_when_the_row_max_is_above_the_bound(offset, equal):
    s = 6
    b = torch.tril(torch.ones(s, s))
    scores = torch.full((s, s), MASKED_OUT + underflow_margin(torch.float32) + offset)
    product = torch.softmax(scores * b + MASKED_OUT * (1 - b), dim=-1)
    causal = torch.softmax(scores.masked_fill(b == 0, float("-inf")), dim=-1)
    assert torch.equal(product, causal) is equal


def test_an_infinite_product_fill_is_refused():
    """``-inf * (1 - b)`` is NaN where b = 1: the model's own forward is NaN there."""
    with pytest.raises(DCPTransformError, match=r"an infinite fill times 0 is NaN"):
        dcp_compile.transform(ProductMaskLM(fill=float("-inf")).eval(), tp=4, dcp=2,
                              mode="prefill", block_size=4, check=False)
