"""canonicalize_ops, Before/Expected: an ordinary model's hand-written forms become the ops
the placement rules have rules for -- ``x @ w.T`` a linear, a constant index of consecutive
entries a slice, slices that partition one dim a split -- and compute the same."""

import torch

from dcp_compile.passes.canonical_ops import CanonicalizeOps

from before_expected import aten, assert_code, before, call, context, run_alone

IDX = torch.tensor([4, 5])          # consecutive: the slice [4, 6)


def _pass(constants=None):
    values = {"c_idx": IDX} if constants is None else constants
    return CanonicalizeOps(context(2, 1, "context"), weights={"p_w", "c_idx"},
                           constants=lambda: values)


def _forms(p_w, c_idx, x):
    y = aten.matmul.default(x, aten.t.default(p_w))             # FalconLinear: x @ w.T
    picked = aten.index.Tensor(x, [None, None, c_idx])          # x[..., [4, 5]]
    head = aten.slice.Tensor(y, 2, 0, 2)                        # y[..., :2]
    tail = aten.slice.Tensor(y, 2, 2, 6)                        # y[..., 2:]
    return (picked, head, tail)


def _before():
    g = torch.Generator().manual_seed(0)
    return before(_forms, p_w=torch.randn(6, 8, generator=g), c_idx=IDX,
                  x=torch.randn(2, 3, 8, generator=g))


# The matmul is a linear of the weight; the index a slice [4, 6) of x's last dim; the two
# slices that partition y's last dim a split_with_sizes [2, 4] read by getitems; the
# transpose and the index die.
EXPECTED = """
    def forward(self, p_w, c_idx, x):
        linear_default = aten.linear.default(x, p_w)
        split_with_sizes_default = aten.split_with_sizes.default(linear_default, [2, 4], 2)
        getitem = split_with_sizes_default[0]
        getitem_1 = split_with_sizes_default[1]
        slice_tensor = aten.slice.Tensor(x, 2, 4, 6)
        return (slice_tensor, getitem, getitem_1)
    """


def test_matmul_index_and_slices_become_linear_slice_and_split():
    p = _pass()
    gm = run_alone(p, _before())
    assert_code(gm, EXPECTED)
    assert p.matched == {"linear_from_matmul": 1, "constant_index_as_slice": 1,
                         "slices_as_split": 1}


def test_same_values_as_before():
    gm = run_alone(_pass(), _before())
    for got, want in zip(call(gm), call(_before())):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_an_index_that_is_not_consecutive_stays_a_gather():
    """[5, 4] is no slice: it stays a gather, written as index_select (the one spelling of a
    single 1-D index; the placement rules refuse or replicate it)."""
    p = _pass({"c_idx": torch.tensor([5, 4])})
    gm = run_alone(p, _before())
    assert [n.args[1:] for n in gm.graph.nodes if n.target == aten.index_select.default] \
        == [(2, next(n for n in gm.graph.nodes if n.name == "c_idx"))]
    assert "constant_index_as_slice" not in p.matched


def test_a_graph_without_these_forms_is_unmodified():
    def f(p_w, c_idx, x):
        return (aten.linear.default(x, p_w),)
    p = _pass()
    gm = before(f, p_w=torch.randn(6, 8), c_idx=IDX, x=torch.randn(2, 3, 8))
    assert not p(gm).modified and p.matched == {}
