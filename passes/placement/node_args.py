"""What the placement rules read of a node: its fake value, shape, tensor inputs, args."""

from __future__ import annotations

import torch
from torch.fx import Node

from ..op_classes import WEIGHT_VIEWS, is_call


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


def weight_chain(w: Node) -> tuple[Node, list[Node]]:
    """The node ``w`` reads a weight through (a cast, a transpose: ``WEIGHT_VIEWS``), and the
    ops on the way, nearest the weight last: ``(base, [w, ..])``; ``(w, [])`` for a plain one."""
    chain = []
    while is_call(w, WEIGHT_VIEWS) and isinstance(w.args[0], Node):
        chain.append(w)
        w = w.args[0]
    return w, chain


def weight_param(w: Node) -> Node:
    """The weight ``w`` is read from, through casts and transposes."""
    return weight_chain(w)[0]


def reads_input(n: Node, name: str) -> bool:
    """Whether ``n`` is computed from the graph input called ``name``."""
    seen, stack = set(), [n]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder" and x.name == name:
            return True
        stack.extend(x.all_input_nodes)
    return False
