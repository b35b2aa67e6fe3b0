"""attention forms (passes/attention_forms.py, run by canonicalize_ops), Before/Expected: each
library's spelling of attention becomes the one the attention reader reads, and computes the
same (or, for the masks, the same softmax)."""

import math

import pytest
import torch

from dcp_compile.passes.canonical_ops import CanonicalizeOps

from before_expected import aten, assert_code, before, call, code, context, run_alone

MIN = torch.finfo(torch.float32).min
g = torch.Generator().manual_seed(0)
Q, K, V = (torch.randn(2, 4, 3, 8, generator=g) for _ in range(3))      # [B, H, S, D]
KV = torch.randn(2, 2, 3, 8, generator=g)                              # [B, Hkv, S, D]
MASK = torch.full((3, 3), float("-inf")).triu(1)
TRIL = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()


def _pass(constants=None):
    values = constants or {}
    return CanonicalizeOps(context(2, 1, "context"), weights=set(), constants=lambda: values)


def torchtune_gqa(kv):
    """k.unsqueeze(2).expand(b, n_kv, q_per_kv, s, d).flatten(1, 2)."""
    e = aten.expand.default(aten.unsqueeze.default(kv, 2), [2, 2, 2, 3, 8])
    return (aten.flatten.using_ints(e, 1, 2),)


def torchtune_gemma2_gqa(kv):
    """Heads repeated on [B, S, Hkv, 1, D], then moved to [B, H, S, D]."""
    x = aten.view.default(aten.transpose.int(kv, 1, 2), [2, 3, 2, 1, 8])
    r = aten.reshape.default(aten.expand.default(x, [2, 3, 2, 2, 8]), [2, 3, 4, 8])
    return (aten.transpose.int(r, 1, 2),)


def litgpt_mT(q, k):
    return (aten.matmul.default(q, aten.mT.default(k)),)


def x_transformers_einsum(q, k, v):
    s = aten.einsum.default("b h i d, b h j d -> b h i j", [q, k])
    p = aten.softmax.int(s, -1)
    return (aten.einsum.default("b h i j, b h j d -> b h i d", [p, v]),)


def xglm_bmm(q, k, v, mask, c_floor):
    q3, k3, v3 = (aten.reshape.default(t, [8, 3, 8]) for t in (q, k, v))
    w = aten.bmm.default(q3, aten.transpose.int(k3, 1, 2))
    w = aten.add.Tensor(aten.view.default(w, [2, 4, 3, 3]), mask)
    w = aten.max.other(w, c_floor)                 # max(w, finfo.min), a lifted constant
    p = aten.softmax.int(aten.view.default(w, [8, 3, 3]), -1)
    o = aten.bmm.default(aten.dropout.default(p, 0.0, False), v3)
    return (aten.view.default(o, [2, 4, 3, 8]),)


def gpt_neo_where(q, k, tril, mask, c_min):
    s = aten.matmul.default(q, aten.transpose.int(k, -1, -2))
    w = aten.where.self(tril, s, aten.lift_fresh_copy.default(c_min))
    return (aten.softmax.int(aten.add.Tensor(w, mask), -1),)


def mimo_row_max(q, k, mask):
    """Scores minus their row max (keepdim), then the softmax (MiMo-V2-Flash's eager)."""
    s = aten.add.Tensor(aten.matmul.default(q, aten.transpose.int(k, 2, 3)), mask)
    m = aten.max.dim(s, -1, True)[0]
    return (aten.softmax.int(aten.sub.Tensor(s, m), -1),)


def amax_row_max(q, k):
    s = aten.matmul.default(q, aten.transpose.int(k, 2, 3))
    return (aten.softmax.int(aten.sub.Tensor(s, aten.amax.default(s, [-1], True)), -1),)


def gpt_fast_index(table, pos):
    return (aten.index.Tensor(table, [None, None, pos]),)


# name -> (function, its inputs, constants the pass may read, the expected code)
CASES = {
    "gqa-expand-flatten": (torchtune_gqa, dict(kv=KV), {}, """
        def forward(self, kv):
            unsqueeze_default = aten.unsqueeze.default(kv, 2)
            expand_default = aten.expand.default(unsqueeze_default, [2, 2, 2, 3, 8])
            reshape_default = aten.reshape.default(expand_default, [2, 4, 3, 8])
            return (reshape_default,)
        """),
    # kv heads moved back to [B, H, S, D] (the view to [.., 1, D] and its reshape back
    # fold away), then repeated in place as repeat_kv does.
    "gqa-token-major": (torchtune_gemma2_gqa, dict(kv=KV), {}, """
        def forward(self, kv):
            transpose_int = aten.transpose.int(kv, 1, 2)
            transpose_int_1 = aten.transpose.int(transpose_int, 1, 2)
            unsqueeze_default = aten.unsqueeze.default(transpose_int_1, 2)
            expand_default = aten.expand.default(unsqueeze_default, [2, 2, 2, 3, 8])
            reshape_default = aten.reshape.default(expand_default, [2, 4, 3, 8])
            return (reshape_default,)
        """),
    "kt-mT": (litgpt_mT, dict(q=Q, k=K), {}, """
        def forward(self, q, k):
            transpose_int = aten.transpose.int(k, 2, 3)
            matmul_default = aten.matmul.default(q, transpose_int)
            return (matmul_default,)
        """),
    "einsum": (x_transformers_einsum, dict(q=Q, k=K, v=V), {}, """
        def forward(self, q, k, v):
            transpose_int = aten.transpose.int(k, 2, 3)
            matmul_default = aten.matmul.default(q, transpose_int)
            softmax_int = aten.softmax.int(matmul_default, -1)
            matmul_default_1 = aten.matmul.default(softmax_int, v)
            return (matmul_default_1,)
        """),
    "bmm-heads-in-batch": (xglm_bmm, dict(q=Q, k=K, v=V, mask=MASK, c_floor=torch.tensor(MIN)),
                           {"c_floor": torch.tensor(MIN)}, """
        def forward(self, q, k, v, mask, c_floor):
            transpose_int = aten.transpose.int(k, 2, 3)
            matmul_default = aten.matmul.default(q, transpose_int)
            add_tensor = aten.add.Tensor(matmul_default, mask)
            softmax_int = aten.softmax.int(add_tensor, -1)
            matmul_default_1 = aten.matmul.default(softmax_int, v)
            return (matmul_default_1,)
        """),
    "where-then-mask": (gpt_neo_where, dict(q=Q, k=K, tril=TRIL, mask=MASK,
                                            c_min=torch.tensor(MIN)),
                        {"c_min": torch.tensor(MIN)}, """
        def forward(self, q, k, tril, mask, c_min):
            transpose_int = aten.transpose.int(k, -1, -2)
            matmul_default = aten.matmul.default(q, transpose_int)
            where_scalar_other = aten.where.ScalarOther(tril, mask, -3.4028234663852886e+38)
            add_tensor = aten.add.Tensor(matmul_default, where_scalar_other)
            softmax_int = aten.softmax.int(add_tensor, -1)
            return (softmax_int,)
        """),
    "row-max-subtracted": (mimo_row_max, dict(q=Q, k=K, mask=MASK), {}, """
        def forward(self, q, k, mask):
            transpose_int = aten.transpose.int(k, 2, 3)
            matmul_default = aten.matmul.default(q, transpose_int)
            add_tensor = aten.add.Tensor(matmul_default, mask)
            softmax_int = aten.softmax.int(add_tensor, -1)
            return (softmax_int,)
        """),
    "row-amax-subtracted": (amax_row_max, dict(q=Q, k=K), {}, """
        def forward(self, q, k):
            transpose_int = aten.transpose.int(k, 2, 3)
            matmul_default = aten.matmul.default(q, transpose_int)
            softmax_int = aten.softmax.int(matmul_default, -1)
            return (softmax_int,)
        """),
    # positions >= 0 (a constant here; an arange in a model): index_select has no negative
    # indices, so a possibly negative index stays an index.
    "tril-index": (gpt_fast_index, dict(table=TRIL, pos=torch.tensor([2, 0, 1])),
                   {"pos": torch.tensor([2, 0, 1])}, """
        def forward(self, table, pos):
            index_select_default = aten.index_select.default(table, 2, pos)
            return (index_select_default,)
        """),
}


@pytest.mark.parametrize("name", list(CASES))
def test_form_becomes_the_read_form(name):
    fn, inputs, constants, want = CASES[name]
    gm = run_alone(_pass(constants), before(fn, **inputs))
    assert_code(gm, want)


@pytest.mark.parametrize("name", list(CASES))
def test_same_values_as_before(name):
    """Same values; a mask rewrite the same softmax (the masked entries differ before it)."""
    fn, inputs, constants, _ = CASES[name]
    gm = run_alone(_pass(constants), before(fn, **inputs))
    for got, want in zip(call(gm), call(before(fn, **inputs))):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_an_index_that_may_be_negative_stays_an_index():
    """x[..., idx] wraps a negative index; index_select would fail on it: not rewritten."""
    p = _pass()                                        # idx is data: its sign is unknown
    gm = run_alone(p, before(gpt_fast_index, table=TRIL, pos=torch.tensor([2, 0, 1])))
    assert "aten.index.Tensor" in code(gm) and "index_as_index_select" not in p.matched


def test_an_einsum_that_is_no_matmul_stays():
    """A contraction over two letters is neither form: left for the placement to refuse."""
    def f(q, k):
        return (aten.einsum.default("b h i d, b h i d -> b h", [q, k]),)
    p = _pass()
    gm = run_alone(p, before(f, q=Q, k=K))
    assert "einsum" in code(gm) and "einsum_as_matmul" not in p.matched


def test_a_where_whose_fill_is_not_masked_out_stays():
    """where(c, s, 0) + mask is no mask on the scores: not rewritten (the reader refuses)."""
    def f(q, k, tril, mask):
        s = aten.matmul.default(q, aten.transpose.int(k, -1, -2))
        return (aten.softmax.int(aten.add.Tensor(aten.where.ScalarOther(tril, s, 0.0), mask), -1),)
    p = _pass()
    run_alone(p, before(f, q=Q, k=K, tril=TRIL, mask=MASK))
    assert "where_then_additive_mask" not in p.matched


def test_a_mask_built_by_where_is_left_to_the_reader():
    """HF's additive mask ``where(causal, zeros, min)`` added to the scores is the mask, not
    the scores: not rewritten (the reader reads it as it is)."""
    def f(q, k, tril, zeros):
        s = aten.matmul.default(q, aten.transpose.int(k, -1, -2))
        mask = aten.where.ScalarOther(tril, zeros, MIN)
        return (aten.softmax.int(aten.add.Tensor(s, mask), -1),)
    p = _pass()
    run_alone(p, before(f, q=Q, k=K, tril=TRIL, zeros=torch.zeros(1, 1, 3, 3)))
    assert "where_then_additive_mask" not in p.matched


@pytest.mark.parametrize("dim,keepdim", [(-2, True), (1, True)],
                         ids=["max-over-the-query-dim", "max-over-the-heads"])
def test_a_max_that_is_not_the_row_max_stays(dim, keepdim):
    """Subtracting a max over another dim than the softmax's changes the
    softmax: not rewritten."""
    def f(q, k):
        s = aten.matmul.default(q, aten.transpose.int(k, 2, 3))
        m = aten.amax.default(s, [dim], keepdim)
        return (aten.softmax.int(aten.sub.Tensor(s, m), -1),)
    p = _pass()
    gm = run_alone(p, before(f, q=Q, k=K))
    assert "aten.sub.Tensor" in code(gm) and "row_max_subtracted" not in p.matched


def test_scale_is_kept_through_the_rewrites():
    """A scale between einsum and softmax stays where it was."""
    def f(q, k, v):
        s = aten.mul.Tensor(aten.einsum.default("bhid,bhjd->bhij", [q, k]), 1 / math.sqrt(8))
        return (aten.einsum.default("bhij,bhjd->bhid", [aten.softmax.int(s, -1), v]),)
    gm = run_alone(_pass(), before(f, q=Q, k=K, v=V))
    assert "aten.mul.Tensor(matmul_default, 0.35355" in code(gm)


@pytest.mark.parametrize("at", [2, 3], ids=["index-the-rows", "index-the-columns"])
def test_the_mask_reader_reads_an_index_after_nones(at):
    """gpt-fast's ``causal_mask[None, None, input_pos]`` when input_pos may be negative (it
    stays an index): read element by element as torch indexes (the None dims kept)."""
    import itertools
    import types

    import sympy

    from dcp_compile.passes import mask_predicate as mp
    m, s = 5, 3
    tril = mp.Sym((1, 1, m, m), sympy.Le(mp.axis(3), mp.axis(2)), True)
    pos = mp.Sym((s,), mp.axis(0) + 1, False)                       # positions 1..s
    want = torch.ones(m, m, dtype=torch.bool).tril()[None, None][
        (slice(None),) * at + (torch.arange(s) + 1,)]
    node = types.SimpleNamespace(name="index", meta={"val": torch.empty(want.shape,
                                                                         dtype=torch.bool)})
    got = mp._index(node, [tril, [None] * at + [pos]])
    assert got.shape == tuple(want.shape)
    for ix in itertools.product(*map(range, want.shape)):
        assert bool(got.expr.subs({mp.axis(k): v for k, v in enumerate(ix)})) == bool(want[ix])
