"""tests/support/before_expected.py's normalisation: FX's generated node names become stable names
numbered by order of definition; names a pass chose stay."""

import operator

import torch
from torch.fx import Graph, GraphModule

from before_expected import code, generated_names

aten = torch.ops.aten


def _graph_with_erased_nodes() -> GraphModule:
    """x -> split -> (erased getitems) -> two getitems -> add, plus a node a pass named."""
    g = Graph()
    x = g.placeholder("x")
    parts = g.call_function(aten.split.Tensor, (x, 2))
    for i in range(3):                    # FX counts these even after they are erased
        g.erase_node(g.call_function(operator.getitem, (parts, i)))
    a, b = (g.call_function(operator.getitem, (parts, i)) for i in range(2))
    rank = g.call_function(aten.remainder.Scalar, (x, 2))
    rank.name = "cp_rank"
    g.output(g.call_function(aten.add.Tensor, (g.call_function(aten.add.Tensor, (a, b)),
                                               rank)))
    return GraphModule(torch.nn.Module(), g)


def test_generated_names_are_renumbered_by_definition_order():
    gm = _graph_with_erased_nodes()
    assert [n.name for n in gm.graph.nodes if n.target is operator.getitem] == [
        "getitem_3", "getitem_4"]
    assert generated_names(gm) == {"split_tensor": "split_tensor", "getitem_3": "getitem",
                                   "getitem_4": "getitem_1", "add_tensor": "add_tensor",
                                   "add_tensor_1": "add_tensor_1"}
    assert code(gm) == "\n".join([
        "def forward(self, x):",
        "    split_tensor = aten.split.Tensor(x, 2)",
        "    getitem = split_tensor[0]",
        "    getitem_1 = split_tensor[1]",
        "    cp_rank = aten.remainder.Scalar(x, 2)",
        "    add_tensor = aten.add.Tensor(getitem, getitem_1)",
        "    add_tensor_1 = aten.add.Tensor(add_tensor, cp_rank)",
        "    return add_tensor_1"])


def test_a_name_a_pass_chose_is_never_reused():
    gm = _graph_with_erased_nodes()
    next(n for n in gm.graph.nodes if n.name == "cp_rank").name = "getitem"
    renames = generated_names(gm)
    assert renames["getitem_3"] == "getitem_1" and renames["getitem_4"] == "getitem_2"
    assert "getitem = aten.remainder.Scalar(x, 2)" in code(gm)
