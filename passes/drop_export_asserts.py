"""Drop torch.export's `_assert_tensor_metadata` checks: no-ops that only clutter dumps."""

from __future__ import annotations

from torch.fx.passes.infra.pass_base import PassResult

from .infra import DCPPass, Property
from .op_classes import EXPORT_ASSERTS


class DropExportAsserts(DCPPass):
    name = "drop_export_asserts"
    required = frozenset({Property.ATEN_GRAPH})
    ensured = frozenset({Property.NO_EXPORT_ASSERTS})

    def call(self, gm):
        dropped = [n for n in gm.graph.nodes
                   if n.op == "call_function" and n.target in EXPORT_ASSERTS and not n.users]
        for n in dropped:
            gm.graph.erase_node(n)
        self.record(dropped=len(dropped))
        return PassResult(gm, bool(dropped))
