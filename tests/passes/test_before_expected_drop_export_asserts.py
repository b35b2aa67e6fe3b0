"""drop_export_asserts, Before/Expected: export's `_assert_tensor_metadata` checks go, the
computation stays (and computes the same)."""

import torch

from dcp_compile.passes.drop_export_asserts import DropExportAsserts

from before_expected import aten, assert_code, before, call, context, run_alone


def _before():
    def f(x, w):
        aten._assert_tensor_metadata.default(x, dtype=torch.float32)
        y = aten.linear.default(x, w)
        aten._assert_tensor_metadata.default(y, dtype=torch.float32)
        return aten.relu.default(y)
    torch.manual_seed(0)
    return before(f, x=torch.randn(2, 4), w=torch.randn(3, 4))


def test_asserts_are_dropped():
    p = DropExportAsserts(context(2, 1, "decode"))
    gm = run_alone(p, _before())
    assert_code(gm, """
        def forward(self, x, w):
            linear_default = aten.linear.default(x, w)
            relu_default = aten.relu.default(linear_default)
            return relu_default
        """)
    assert p.matched == {"dropped": 2}


def test_same_values_as_before():
    gm = run_alone(DropExportAsserts(context(2, 1, "decode")), _before())
    torch.testing.assert_close(call(gm), call(_before()), rtol=0, atol=0)


def test_graph_without_asserts_is_unmodified():
    def f(x):
        return aten.relu.default(x)
    gm = before(f, x=torch.randn(2))
    p = DropExportAsserts(context(2, 1, "decode"))
    result = p(gm)
    assert not result.modified and p.matched == {"dropped": 0}
