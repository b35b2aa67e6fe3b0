"""Prefill DCP (passes/dcp_prefill.py): an O-path side input computed from the layer's
projections, computed again on the O projection's tokens.

Qwen3-Next / Qwen3.5's gated attention (and any ``[q ; gate]`` q projection) multiplies the
attention output by ``sigmoid(gate)`` before ``o_proj``. The rewrite moves ``q_proj`` to the
rank's owned (interleaved) tokens, while the attention output reaches ``o_proj`` on the
rank's contiguous ``S_pad/W`` tokens after the reduce-scatter. The gate is token-wise, so it
shards with those tokens: the chain from the layer's hidden state to the gate
(``recompute_chain``) is copied to read the hidden state gathered at the O path's tokens
(``copy_chain``), its views given their token count. No collective; the projection's cost
once more on ``S_pad/W`` tokens (docs/hybrid.md, "Linear-attention hybrids").
"""

from __future__ import annotations

from torch.fx import Graph, Node

from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.names import META_LAYER

from .op_classes import SHAPED_VIEWS


def recompute_chain(side: Node, plan, tokens: int, trace_token_dim
                    ) -> tuple[list[Node], dict[Node, int], set[Node]]:
    """The nodes from ``plan.hidden`` to ``side`` (graph order, ``side`` last), their token
    dims and those that read ``plan.hidden`` (the projections): a side input
    of the O path computed from the layer's projections, to be computed again on the O
    path's tokens. Token-wise throughout (``trace_token_dim``, an error naming the node
    otherwise: dcp_prefill's, passed in), and reading no other token-indexed tensor."""
    up, stack = set(), [side]
    while stack:
        n = stack.pop()
        if n in up or n is plan.hidden or n.op != "call_function":
            continue
        up.add(n)
        stack.extend(n.all_input_nodes)
    down, stack = set(), [plan.hidden]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in up and u not in down:
                down.add(u)
                stack.append(u)
    order = {n: i for i, n in enumerate(side.graph.nodes)}
    chain = sorted(down, key=order.__getitem__)
    what = f"output gate {side.name} (layer {plan.layer})"
    td, others = trace_token_dim(chain, {plan.hidden: 1}, tokens, what)
    if others or td.get(side) is None:
        raise DCPTransformError(
            f"the {what} reads token-indexed inputs {sorted(a.name for a in others)} besides "
            f"the hidden state: it cannot be computed again on the O projection's tokens.")
    return chain, td, {n for n in chain if plan.hidden in n.all_input_nodes}


def _retoken(view: Node, n: Node, token_dim: dict[Node, int], count: int) -> None:
    """A view (``view``, or the copy of ``n``) names the token count explicitly: give it
    ``count``."""
    if n.target in SHAPED_VIEWS:
        shape = list(view.args[1])
        shape[token_dim[n]] = count
        view.args = (view.args[0], shape) + tuple(view.args[2:])


def retoken_views(path: list[Node], token_dim: dict[Node, int], count: int) -> None:
    """Views on a path name the token count explicitly: give them the new count."""
    for n in path:
        _retoken(n, n, token_dim, count)


def copy_chain(g: Graph, recomputed, picked: Node, count: int, layer: int) -> Node:
    """Copy the chain of ``recomputed`` (``recompute_chain``; its projections read the
    owned tokens by now) reading ``picked`` (the hidden state at ``count`` tokens), its views
    given ``count`` tokens; the last copy."""
    chain, td, roots = recomputed
    env = {}
    for n in chain:
        c = g.node_copy(n, lambda a: env.get(a, a))
        if n in roots:
            c.args = (picked,) + tuple(c.args[1:])
        _retoken(c, n, td, count)
        c.meta[META_LAYER] = layer
        env[n] = c
    return env[chain[-1]]


__all__ = ["copy_chain", "recompute_chain", "retoken_views"]
