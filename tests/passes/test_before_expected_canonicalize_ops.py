"""canonicalize_ops, Before/Expected: an ordinary model's hand-written forms become the ops
the placement rules have rules for -- ``x @ w.T`` a linear, a constant index of consecutive
entries a slice, slices that partition one dim a split, a q/k/v projection fused per KV-head
group [all q; all k; all v] with its rows reordered -- and compute the same."""

import pytest
import torch

from dcp_compile.passes.canonical_ops import CanonicalizeOps
from dcp_compile.passes.op_classes import AUTOCAST_REGIONS
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.names import META_WEIGHT_PERM

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


# transformers' Conv1D (GPT-2, GPT-SW3, OpenAI-GPT): a linear whose weight is stored
# [in, out], written addmm(bias, x.view(-1, nx), weight).view(*x.shape[:-1], nf).
def _conv1d(p_w, p_b, x):
    flat = aten.view.default(x, [-1, 8])
    y = aten.addmm.default(p_b, flat, p_w)
    return (aten.view.default(y, [2, 3, 6]),)


def _conv1d_before(bias_shape=(6,)):
    g = torch.Generator().manual_seed(0)
    return before(_conv1d, p_w=torch.randn(8, 6, generator=g),
                  p_b=torch.randn(*bias_shape, generator=g), x=torch.randn(2, 3, 8, generator=g))


# One linear over x's own dims, its weight read through a transpose; the flattening views die.
CONV1D_EXPECTED = """
    def forward(self, p_w, p_b, x):
        t_default = aten.t.default(p_w)
        linear_default = aten.linear.default(x, t_default, p_b)
        return (linear_default,)
    """


def _conv1d_pass():
    return CanonicalizeOps(context(2, 1, "context"), weights={"p_w", "p_b"},
                           constants=dict)


def test_conv1d_becomes_a_linear_of_the_transposed_weight():
    p = _conv1d_pass()
    gm = run_alone(p, _conv1d_before())
    assert_code(gm, CONV1D_EXPECTED)
    assert p.matched == {"conv1d_as_linear": 1}
    torch.testing.assert_close(call(gm)[0], call(_conv1d_before())[0])


def test_an_addmm_of_a_computed_matrix_stays():
    """addmm's matrix not a weight input (an activation): no linear to make."""
    p = CanonicalizeOps(context(2, 1, "context"), weights={"p_b"}, constants=dict)
    gm = run_alone(p, _conv1d_before())
    assert any(n.target == aten.addmm.default for n in gm.graph.nodes)
    assert p.matched == {}


# OPT's MLP: x.reshape(-1, H), a norm, fc1, relu, fc2, the residual add, .view(B, S, H).
def _opt_mlp(p_ln, p_fc1, p_fc2, x):
    flat = aten.view.default(x, [-1, 8])
    h = aten.layer_norm.default(flat, [8], p_ln)
    h = aten.relu.default(aten.linear.default(h, p_fc1))
    h = aten.add.Tensor(flat, aten.linear.default(h, p_fc2))
    return (aten.view.default(h, [2, 3, 8]),)


def _opt_before(fn=_opt_mlp):
    g = torch.Generator().manual_seed(0)
    return before(fn, p_ln=torch.randn(8, generator=g), p_fc1=torch.randn(16, 8, generator=g),
                  p_fc2=torch.randn(8, 16, generator=g), x=torch.randn(2, 3, 8, generator=g))


# The same ops on [B, S, H]: the flatten and the view back are gone.
OPT_EXPECTED = """
    def forward(self, p_ln, p_fc1, p_fc2, x):
        layer_norm_default = aten.layer_norm.default(x, [8], p_ln)
        linear_default = aten.linear.default(layer_norm_default, p_fc1)
        relu_default = aten.relu.default(linear_default)
        linear_default_1 = aten.linear.default(relu_default, p_fc2)
        add_tensor = aten.add.Tensor(x, linear_default_1)
        return (add_tensor,)
    """


def _opt_pass():
    return CanonicalizeOps(context(2, 1, "context"), weights={"p_ln", "p_fc1", "p_fc2"},
                           constants=dict)


def test_an_mlp_over_flattened_tokens_keeps_the_token_dim():
    p = _opt_pass()
    gm = run_alone(p, _opt_before())
    assert_code(gm, OPT_EXPECTED)
    assert p.matched == {"token_flatten_dropped": 1}
    torch.testing.assert_close(call(gm)[0], call(_opt_before())[0])


def test_flattened_tokens_that_meet_a_non_row_wise_op_stay_flattened():
    """A sum over the flattened rows mixes tokens: nothing is rewritten."""
    def mixes(p_ln, p_fc1, p_fc2, x):
        flat = aten.view.default(x, [-1, 8])
        h = aten.linear.default(aten.layer_norm.default(flat, [8], p_ln), p_fc1)
        s = aten.sum.dim_IntList(h, [0], True)
        return (aten.view.default(aten.linear.default(h + s, p_fc2), [2, 3, 8]),)
    p = _opt_pass()
    gm = run_alone(p, _opt_before(mixes))
    assert p.matched == {} and sum(n.target == aten.view.default for n in gm.graph.nodes) == 2


# -- autocast regions ----------------------------------------------------------------------

class _Autocast(torch.nn.Module):
    """torchtitan's router: its gate under ``autocast(dtype=float32)``."""

    def __init__(self, dtype=torch.float32, enabled=True, device="cpu"):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4, bias=False)
        self.dtype, self.enabled, self.device = dtype, enabled, device

    def forward(self, x):
        with torch.autocast(device_type=self.device, dtype=self.dtype, enabled=self.enabled):
            scores = self.gate(x)
        return (scores.softmax(-1),)


def _exported(module, x):
    """The region as torch.export captures it (a wrap_with_autocast over a subgraph)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # CPU autocast to float32 disables itself
        gm = torch.export.export(module, (x,), strict=False).graph_module
    gm.meta["example_inputs"] = {"p_gate_weight": module.gate.weight, "x": x}
    return gm


def _autocast_pass():
    return CanonicalizeOps(context(2, 1, "context"), weights={"p_gate_weight"},
                           constants=lambda: {})


# The region's linear inline; the higher-order op, its getitem and its subgraph gone.
EXPECTED_AUTOCAST = """
    def forward(self, p_gate_weight, x):
        linear_1 = aten.linear.default(x, p_gate_weight)
        softmax = aten.softmax.int(linear_1, -1)
        return (softmax,)
    """


def _enabled(gm):
    """The region as a GPU capture holds it: autocast to float32 enabled (on CPU torch
    disables it itself, so export records enabled=False)."""
    region, = [n for n in gm.graph.nodes if n.target in AUTOCAST_REGIONS]
    region.args = region.args[:2] + (True,) + region.args[3:]
    return gm


@pytest.mark.parametrize("enable", [True, False], ids=["enabled-float32", "disabled"])
def test_an_autocast_region_that_changes_nothing_is_inlined(enable):
    x = torch.randn(3, 8)
    module = _Autocast()
    with torch.no_grad():
        want = module.gate(x).softmax(-1)
    before_gm = _exported(module, x)
    before_gm = _enabled(before_gm) if enable else before_gm
    p = _autocast_pass()
    gm = run_alone(p, before_gm)
    assert_code(gm, EXPECTED_AUTOCAST)
    assert p.matched == {"autocast_inlined": 1}
    torch.testing.assert_close(call(gm)[0], want, rtol=0, atol=0)


def test_an_autocast_region_that_casts_is_refused_naming_it():
    """Autocast to bfloat16 over float32 values casts them: not inlined, and refused there
    (its ops would run in a dtype the captured graph does not show)."""
    x = torch.randn(3, 8)
    with pytest.raises(DCPTransformError, match=r"torch.autocast\(enabled=True\) region"):
        run_alone(_autocast_pass(), _exported(_Autocast(dtype=torch.bfloat16), x))


# -- torchtitan's wqkv: [q heads; k; v] per KV head -> [all q; all k; all v] ---------------
# 2 KV heads of 4 query heads each, head_dim 2: rows per group [q0..q3; k; v] (12 rows).


def _per_group_qkv(p_wqkv, p_bqkv, x):
    y = aten.view.default(aten.linear.default(x, p_wqkv, p_bqkv), [2, 3, 2, 6, 2])
    q, k, v = aten.split_with_sizes.default(y, [4, 1, 1], -2)
    return (aten.reshape.default(q, [2, 3, 8, 2]), aten.reshape.default(k, [2, 3, 2, 2]),
            aten.reshape.default(v, [2, 3, 2, 2]))


def _per_group_before():
    g = torch.Generator().manual_seed(0)
    return before(_per_group_qkv, p_wqkv=torch.randn(24, 8, generator=g),
                  p_bqkv=torch.randn(24, generator=g), x=torch.randn(2, 3, 8, generator=g))


def _per_group_pass():
    return CanonicalizeOps(context(2, 1, "context"), weights={"p_wqkv", "p_bqkv"},
                           constants=dict, forms=("qkv_per_group_regrouped",))


# The linear's output split by [all q | all k | all v] widths, each part viewed as its heads;
# the per-group view, split and merges die. The weight and bias carry the row order.
EXPECTED_PER_GROUP = """
    def forward(self, p_wqkv, p_bqkv, x):
        linear_default = aten.linear.default(x, p_wqkv, p_bqkv)
        split_with_sizes_default = aten.split_with_sizes.default(linear_default, [16, 4, 4], -1)
        getitem = split_with_sizes_default[0]
        view_default = aten.view.default(getitem, [2, 3, 8, 2])
        getitem_1 = split_with_sizes_default[1]
        view_default_1 = aten.view.default(getitem_1, [2, 3, 2, 2])
        getitem_2 = split_with_sizes_default[2]
        view_default_2 = aten.view.default(getitem_2, [2, 3, 2, 2])
        return (view_default, view_default_1, view_default_2)
    """


def test_qkv_fused_per_group_is_read_as_all_q_all_k_all_v():
    p = _per_group_pass()
    gm = run_alone(p, _per_group_before())
    assert_code(gm, EXPECTED_PER_GROUP)
    assert p.matched == {"qkv_per_group_regrouped": 1}
    perms = {n.name: n.meta.get(META_WEIGHT_PERM) for n in gm.graph.nodes
             if n.op == "placeholder"}
    # group 0's q rows 0-7, group 1's q rows 12-19, then k of each group, then v of each
    assert perms["p_wqkv"] == perms["p_bqkv"] == (0, (*range(0, 8), *range(12, 20),
                                                      8, 9, 20, 21, 10, 11, 22, 23))
    assert perms["x"] is None


def test_qkv_regrouped_computes_the_same_with_its_rows_reordered():
    """The rewritten graph on the weight reordered (as ShardSpec.perm reads it) gives the
    model's q, k and v exactly; on the weight as stored it would not."""
    gm = run_alone(_per_group_pass(), _per_group_before())
    want = call(_per_group_before())
    inputs = _per_group_before().meta["example_inputs"]
    perm = torch.tensor(next(n.meta[META_WEIGHT_PERM] for n in gm.graph.nodes
                             if n.name == "p_wqkv")[1])
    got = call(gm, p_wqkv=inputs["p_wqkv"][perm], p_bqkv=inputs["p_bqkv"][perm])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert not torch.equal(call(gm)[0], want[0])


def test_a_fused_weight_read_elsewhere_stays():
    """A weight tied to another use cannot be reordered for this linear alone."""
    def tied(p_wqkv, p_bqkv, x):
        return (*_per_group_qkv(p_wqkv, p_bqkv, x), aten.sum.default(p_wqkv))
    g = torch.Generator().manual_seed(0)
    p = _per_group_pass()
    run_alone(p, before(tied, p_wqkv=torch.randn(24, 8, generator=g),
                        p_bqkv=torch.randn(24, generator=g), x=torch.randn(2, 3, 8, generator=g)))
    assert p.matched == {}

