"""Collective roles: how a program names the process group each collective runs on.

A collective names a role (``tp``, ``dcp``, ``world``, ``dcp_tp``, ``cp_kv``) through the
placeholder group name ``dcp_role:<role>`` (``runtime.names.ROLE_PREFIX``); loading a program
on a rank (``runtime.program``, ``runtime.neuron``) binds each role to a real group, so the
graph is the same for every rank. The passes emit these names (``passes.collectives``); the
runtime reads them, so they live here, below both.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from .names import ROLE_PREFIX

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
