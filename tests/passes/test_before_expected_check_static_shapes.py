"""check_static_shapes, Before/Expected: a static graph passes unchanged; a symbolic size
anywhere is refused naming the node."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dcp_compile import DCPTransformError
from dcp_compile.passes.check_static_shapes import CheckStaticShapes

from before_expected import aten, assert_code, before, code, context, run_alone


def _f(x, w):
    return aten.relu.default(aten.linear.default(x, w))


def test_static_graph_is_left_as_it_is():
    gm = before(_f, x=torch.randn(2, 4), w=torch.randn(3, 4))
    unchanged = code(gm)
    p = CheckStaticShapes(context(2, 1, "decode"))
    assert not p(gm).modified
    gm = run_alone(CheckStaticShapes(context(2, 1, "decode")), gm)
    assert code(gm) == unchanged
    assert_code(gm, """
        def forward(self, x, w):
            linear_default = aten.linear.default(x, w)
            relu_default = aten.relu.default(linear_default)
            return relu_default
        """)


def test_symbolic_size_is_refused_naming_the_input():
    gm = make_fx(_f, tracing_mode="symbolic")(torch.randn(2, 4), torch.randn(3, 4))
    with pytest.raises(DCPTransformError, match=r"input or node x_1 has a dynamic shape "
                                                r"\(s\d+, s\d+\): DCP programs have static"):
        run_alone(CheckStaticShapes(context(2, 1, "decode")), gm)


def test_data_dependent_size_is_refused_naming_the_node_and_the_fix():
    def masked(x):
        return aten.index.Tensor(x, [aten.gt.Scalar(x, 0)])

    gm = make_fx(masked, tracing_mode="real")(torch.randn(4))
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True) as mode:
        torch.fx.passes.fake_tensor_prop.FakeTensorProp(gm, mode).propagate(
            mode.from_tensor(torch.randn(4)))
    with pytest.raises(DCPTransformError, match=r"node index\w* has a dynamic shape \(u\d+,\) "
                                                r"that depends on the data .*torch\.where"):
        run_alone(CheckStaticShapes(context(2, 1, "decode")), gm)
