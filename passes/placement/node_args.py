"""What the placement rules read of a node: its fake value, shape, tensor inputs, args."""

from __future__ import annotations

import torch
from torch.fx import Node


def fake(n):
    return n.meta.get("val") if isinstance(n, Node) else None


def shape_of(n) -> tuple[int, ...]:
    return tuple(fake(n).shape)


def tensor_args(n: Node) -> list[Node]:
    """Tensor-valued node inputs in argument order (lists flattened)."""
    out = []
    for a in list(n.args) + list(n.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(x, Node) and isinstance(fake(x), (torch.Tensor, tuple, list)):
                out.append(x)
    return out


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def node_arg(n: Node, i: int, name: str, default=None):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)
