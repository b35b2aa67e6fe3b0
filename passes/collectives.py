"""Emit functional collectives (`_c10d_functional` + `wait_tensor`) on group *roles*.

A collective names a role (``tp``, ``dcp``, ``world``, ``dcp_tp``, ``cp_kv``) through the
placeholder group name ``dcp_role:<role>``; ``dcp_compile.runtime.serving.rank_program.load`` binds each role to this
rank's real process-group name, so the graph is the same for every rank.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

# The role naming convention and the collectives table are the runtime's (it binds the roles
# when loading a program); arguments are in the order dcp_compile.runtime.distributed.roles.COLLECTIVES describes.
from dcp_compile.runtime.distributed.roles import WAIT_TARGET, role_name, role_of  # noqa: F401
from dcp_compile.runtime.names import META_LAYER, META_PASS

F = torch.ops._c10d_functional


def _emit(g: Graph, target, args: tuple) -> tuple[Node, Node]:
    """The collective and the wait on its result."""
    c = g.call_function(target, args)
    return c, g.call_function(WAIT_TARGET, (c,))


def all_gather(g: Graph, x: Node, role: str, size: int) -> tuple[Node, Node]:
    """Concatenate ``x`` of every rank of the role along dim 0: returns (collective, wait)."""
    return _emit(g, F.all_gather_into_tensor.default, (x, size, role_name(role)))


def reduce_scatter(g: Graph, x: Node, role: str, size: int) -> tuple[Node, Node]:
    """Sum ``x`` over the role and keep this rank's 1/size slice of dim 0."""
    return _emit(g, F.reduce_scatter_tensor.default, (x, "sum", size, role_name(role)))


def all_to_all(g: Graph, x: Node, role: str, size: int, rows: int) -> tuple[Node, Node]:
    """Split dim 0 of ``x`` (``size * rows`` rows) into ``size`` equal parts, send part j to
    rank j of the role, and concatenate the parts received in rank order."""
    splits = [rows] * size
    return _emit(g, F.all_to_all_single.default, (x, splits, splits, role_name(role)))


def all_reduce(g: Graph, x: Node, role: str) -> tuple[Node, Node]:
    return _emit(g, F.all_reduce.default, (x, "sum", role_name(role)))


def collective_summary(gm) -> list[dict]:
    """Every collective of a graph: op, role, layer, bytes sent in and received out."""
    out = []
    for n in gm.graph.nodes:
        role = role_of(n)
        if role is None:
            continue
        src, dst = n.args[0].meta["val"], n.meta["val"]
        out.append({"op": n.target._opname, "role": role, "layer": n.meta.get(META_LAYER),
                    "pass": n.meta.get(META_PASS), "shape_in": tuple(src.shape),
                    "bytes_in": src.numel() * src.element_size(),
                    "bytes_out": dst.numel() * dst.element_size()})
    return out
