"""The names a DCP program and the rank that runs it agree on.

The passes write these names into the graph (``passes.insert_rank``, ``passes.collectives``);
the runtime reads them back when it loads the program on a rank (``runtime.program``,
``runtime.neuron``). They live here, below both, so the runtime never imports the compiler.
"""

from __future__ import annotations

import torch
from torch.fx import Node

# The 0-d int64 program input holding this rank's tensor-parallel rank.
RANK_INPUT = "tp_rank"

# A collective names its group by role (``tp``, ``dcp``, ``world``, ``dcp_tp``, ``cp_kv``)
# through the placeholder group name ``dcp_role:<role>``; loading binds each role to this
# rank's real process-group name, so the graph is the same for every rank.
ROLE_PREFIX = "dcp_role:"
_F = torch.ops._c10d_functional
COLLECTIVE_TARGETS = (_F.all_gather_into_tensor.default, _F.reduce_scatter_tensor.default,
                      _F.all_reduce.default, _F.all_to_all_single.default)


def role_name(role: str) -> str:
    return ROLE_PREFIX + role


def role_of(node: Node) -> str | None:
    """The role a collective node runs on (None for other nodes)."""
    if node.op != "call_function" or node.target not in COLLECTIVE_TARGETS:
        return None
    name = node.args[-1]
    return name[len(ROLE_PREFIX):] if isinstance(name, str) and name.startswith(
        ROLE_PREFIX) else name
