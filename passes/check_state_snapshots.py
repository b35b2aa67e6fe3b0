"""Refuse a step that keeps recurrent state snapshots while a recurrent op does not read them.

A width-K decode step (speculative verification) and, with ``StepShapes.state_checkpoints``,
a decode program's context step take ``state_snapshot_slot [B, S]`` (docs/hybrid.md,
"Speculative decoding, prefix caching and program files"): every recurrent op keeps the
state after each token there, so the engine resumes a row from the snapshot of its last
accepted draft, or a prefix-cache hit from a vblock's checkpoint. An op that does not read
that input keeps only its end state; the engine then resumes its layer from a stale state
and nothing fails, the logits are just wrong (Falcon-H1's swap once left the slots out:
speculative decode off by 3.7). So such a graph is refused here, naming the op, its layer,
its source line and the fix, before anything is sharded or run.

Vacuous for a graph without the snapshot input (one-token decode, prefill, a model without
recurrent layers).
"""

from __future__ import annotations

import re

from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from dcp_compile.runtime.errors import DCPHybridError
from dcp_compile.runtime.names import STATE_SNAPSHOT_SLOT

from .infra import DCPPass, Property, source_of
from .op_classes import RECURRENT_OPS

# The recurrent ops' argument that takes the step's snapshot slots (runtime/kernels/recurrent.py).
SNAPSHOT_ARGUMENT = "snapshot_slot"


def op_argument(node: Node, name: str):
    """``node``'s argument ``name`` by its op's schema (positional or keyword), or None."""
    names = [a.name for a in node.target._schema.arguments]
    i = names.index(name)
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def reads(node, source: Node) -> bool:
    """Whether ``node`` is ``source`` or computed from it."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is source:
            return True
        if isinstance(n, Node) and n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def mixer_of(node: Node) -> tuple[str, str]:
    """(the module path ``node`` was made under, its decoder layer or "layer unknown")."""
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else "module unknown"
    found = re.findall(r"layers\.(\d+)", path)
    return path, f"layer {found[-1]}" if found else "layer unknown"


def unread_snapshots(gm: GraphModule) -> list[Node]:
    """The recurrent op nodes of ``gm`` that do not read its ``state_snapshot_slot`` input
    ([] when the graph has none)."""
    snapshot = next((n for n in gm.graph.nodes
                     if n.op == "placeholder" and n.name == STATE_SNAPSHOT_SLOT), None)
    if snapshot is None:
        return []
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in RECURRENT_OPS
            and not reads(op_argument(n, SNAPSHOT_ARGUMENT), snapshot)]


class CheckStateSnapshots(DCPPass):
    """A step with ``state_snapshot_slot``: every recurrent op reads it (module doc)."""

    name = "check_state_snapshots"
    required = frozenset({Property.ATEN_GRAPH})
    ensured = frozenset({Property.STATE_SNAPSHOTS_READ})

    def call(self, gm: GraphModule):
        unread = unread_snapshots(gm)
        if unread:
            n = unread[0]
            path, layer = mixer_of(n)
            raise DCPHybridError(
                f"recurrent op {n.name} ({n.target._opname}, {layer}: {path}) at "
                f"{source_of(n)} does not read the step's {STATE_SNAPSHOT_SLOT} input "
                f"({len(unread)} of the graph's recurrent ops do not): this "
                f"{self.ctx.step} step keeps the state after each token for speculative "
                f"roll back or prefix-cache checkpoints, and without its snapshots the engine "
                f"would resume that layer from a stale state. Pass the step's snapshot slots "
                f"as the op's {SNAPSHOT_ARGUMENT} argument (`*states.snap()` last in the "
                f"mixer's swapped forward, dcp_compile/frontends/recurrent_mixers.py).")
        return PassResult(gm, False)
