"""canonicalize_ops' ``writes_out_of_place``, Before/Expected: a write into a tensor the graph
makes, or into a slice / select of it (litgpt's sliding-window mask: ``full(-inf)``, then
``mask[i, a:b] = 0.0`` row by row), becomes its value computed out of place -- the written
part a ``fill`` / ``masked_fill``, scattered back up the views -- and every later reader
reads that value; a write into an input, or into a tensor whose view was read before the
write, stays (the mask reader refuses it by name). In-place arithmetic and ``copy_`` into a
slice (Gemma 3n's ``c[1:] += y``: ``add_`` into the slice, ``copy_`` of the sum back) become
values the same way; into a whole tensor, ``copy_`` into one allocated without a value (MLA's
key, which absorb_latent_attention reads), or into a same-dtype cast of a tensor another node
reads (the same memory at run time), they stay."""

import torch

from dcp_compile.passes.canonical_ops import CanonicalizeOps

from before_expected import aten, assert_code, before, call, context, run_alone

X = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))


def _pass():
    return CanonicalizeOps(context(2, 1, "context"), weights=set(), constants=lambda: {},
                           forms=("writes_out_of_place",))


def _mask(x):
    m = aten.full_like.default(x, float("-inf"))
    early = aten.gt.Scalar(m, 0.0)                                 # read before the writes
    row = aten.select.int(m, 0, 1)
    aten.fill_.Scalar(aten.slice.Tensor(row, 0, 0, 2), 0.0)        # m[1, 0:2] = 0.0
    aten.masked_fill_.Scalar(m, aten.gt.Scalar(x, 1.0), 5.0)       # m.masked_fill_(x > 1, 5)
    return (aten.add.Tensor(m, x), early)


# The fill of m[1, 0:2] is a fill of that slice, written back by slice_scatter into row 1
# and by select_scatter into m; the masked_fill_ reads that value, and the add reads the
# masked_fill's. The comparison before the writes still reads the first m.
EXPECTED = """
    def forward(self, x):
        full_like_default = aten.full_like.default(x, -inf)
        gt_scalar = aten.gt.Scalar(full_like_default, 0.0)
        select_int = aten.select.int(full_like_default, 0, 1)
        slice_tensor = aten.slice.Tensor(select_int, 0, 0, 2)
        fill_scalar = aten.fill.Scalar(slice_tensor, 0.0)
        slice_scatter_default = aten.slice_scatter.default(select_int, fill_scalar, 0, 0, 2)
        select_scatter_default = aten.select_scatter.default(full_like_default, slice_scatter_default, 0, 1)
        gt_scalar_1 = aten.gt.Scalar(x, 1.0)
        masked_fill_scalar = aten.masked_fill.Scalar(select_scatter_default, gt_scalar_1, 5.0)
        add_tensor = aten.add.Tensor(masked_fill_scalar, x)
        return (add_tensor, gt_scalar)
    """


def test_writes_into_a_made_tensor_and_its_slices_become_values():
    p = _pass()
    gm = run_alone(p, before(_mask, x=X))
    assert_code(gm, EXPECTED)
    assert p.matched == {"writes_out_of_place": 2}


def test_same_values_as_before():
    gm = run_alone(_pass(), before(_mask, x=X))
    for got, want in zip(call(gm), call(before(_mask, x=X))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _into_input(x):
    aten.fill_.Scalar(aten.slice.Tensor(x, 0, 0, 2), 0.0)          # x is the caller's
    return (aten.add.Tensor(x, x),)


def _view_read_before(x):
    m = aten.full_like.default(x, 1.0)
    t = aten.t.default(m)                                          # a view of m, made first
    aten.fill_.Scalar(aten.select.int(m, 0, 0), 0.0)
    return (aten.add.Tensor(t, x),)


def test_writes_into_an_input_or_under_an_earlier_view_stay():
    for fn in (_into_input, _view_read_before):
        p = _pass()
        gm = run_alone(p, before(fn, x=X.clone()))
        assert aten.fill_.Scalar in {n.target for n in gm.graph.nodes}, fn.__name__
        assert p.matched == {}, fn.__name__


# -- writes of a computed value into a slice (Gemma 3n's AltUp: ``c[1:] += y``) -------------

END = 9223372036854775807


def _altup(x):
    c = aten.mul.Tensor(x, 2.0)                                    # the corrected streams
    first = aten.clone.default(aten.select.int(c, 0, 0))           # c[0].clone(), before
    y = aten.mul.Tensor(first, 3.0)
    s = aten.slice.Tensor(c, 0, 1, END)
    total = aten.add_.Tensor(s, y)                                 # c[1:] += y: add_ ...
    aten.copy_.default(aten.slice.Tensor(c, 0, 1, END), total)     # ... and its copy back
    return (aten.add.Tensor(c, 1.0),)


# add_ into c[1:] is an add, scattered into c; the copy back writes the same sum into a
# slice of that value (a second scatter of the same part); the reader after reads the last.
# The select read before the writes (and read by nothing after them) keeps reading c.
EXPECTED_ALTUP = """
    def forward(self, x):
        mul_tensor = aten.mul.Tensor(x, 2.0)
        select_int = aten.select.int(mul_tensor, 0, 0)
        clone_default = aten.clone.default(select_int)
        mul_tensor_1 = aten.mul.Tensor(clone_default, 3.0)
        slice_tensor = aten.slice.Tensor(mul_tensor, 0, 1, 9223372036854775807)
        add_tensor = aten.add.Tensor(slice_tensor, mul_tensor_1)
        slice_scatter_default = aten.slice_scatter.default(mul_tensor, add_tensor, 0, 1, 9223372036854775807)
        slice_scatter_default_1 = aten.slice_scatter.default(slice_scatter_default, add_tensor, 0, 1, 9223372036854775807)
        add_tensor_1 = aten.add.Tensor(slice_scatter_default_1, 1.0)
        return (add_tensor_1,)
    """


def test_an_add_into_a_slice_and_its_copy_back_become_values():
    p = _pass()
    gm = run_alone(p, before(_altup, x=X))
    assert_code(gm, EXPECTED_ALTUP)
    assert p.matched == {"writes_out_of_place": 2}
    for got, want in zip(call(gm), call(before(_altup, x=X))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _view_read_after(x):
    c = aten.mul.Tensor(x, 2.0)
    first = aten.select.int(c, 0, 0)                               # a view, read after
    aten.add_.Tensor(aten.slice.Tensor(c, 0, 0, 2), aten.slice.Tensor(x, 0, 0, 2))
    return (aten.add.Tensor(first, 1.0),)


def _copy_into_new_empty(x):
    k = aten.new_empty.default(x, [4, 4])                          # MLA's key: no value
    aten.copy_.default(aten.slice.Tensor(k, 1, 0, 4), x)
    return (aten.add.Tensor(k, 1.0),)


def _add_into_a_whole_tensor(x):
    c = aten.mul.Tensor(x, 2.0)
    aten.add_.Tensor(c, x)                                         # no slice: as before
    return (aten.add.Tensor(c, 1.0),)


def _into_a_cast_shared_with_another_reader(x):
    c = aten.mul.Tensor(x, 2.0)
    same = aten.type_as.default(c, x)                              # c itself at run time
    aten.add_.Tensor(aten.slice.Tensor(same, 0, 0, 2), aten.slice.Tensor(x, 0, 0, 2))
    return (aten.add.Tensor(c, 1.0),)                              # sees the write


def test_writes_of_values_read_by_an_earlier_view_into_no_value_or_no_slice_stay():
    for fn, op in ((_view_read_after, aten.add_.Tensor),
                   (_copy_into_new_empty, aten.copy_.default),
                   (_add_into_a_whole_tensor, aten.add_.Tensor),
                   (_into_a_cast_shared_with_another_reader, aten.add_.Tensor)):
        p = _pass()
        gm = run_alone(p, before(fn, x=X.clone()))
        assert op in {n.target for n in gm.graph.nodes}, fn.__name__
        assert p.matched == {}, fn.__name__
