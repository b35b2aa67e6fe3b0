"""Weights in the placement analysis: a linear's weight read through casts and transposes
(``WEIGHT_VIEWS``: transformers' ``Conv1D`` weight ``.t()``, a ``weight.float()``) is placed as
its parameter, dims mapped; and which linear reaching the output is a vocab-parallel LM head.
Functions of the :class:`~dcp_compile.passes.placement.analysis.Analysis` they serve."""

from __future__ import annotations

from torch.fx import Node

from .lattice import R
from .node_args import weight_chain, weight_param
from .plan import EMBEDDING, reaches_output_directly
from .rules import rule_for


def weight_placement(an, n: Node, w: Node, strict: bool):
    """A linear's weight as the linear ``n`` reads it: its parameter's decision (None while
    undecided), mapped through the casts and transposes on the way (a Conv1D weight.t())."""
    base, chain = weight_chain(w)
    if base not in an.params:
        return an.P(w)            # computed from something else: its own placement
    p = an.decided.get(base)
    if p is None:                 # a router's weight.float() runs whole on every rank
        return R if strict or an.linears.get(n) == "replicated" else None
    for c in reversed(chain):
        p = rule_for(c.target).forward(c, lambda a, p=p: p)
    return p


def decide_weight(an, n: Node, w: Node, p) -> None:
    """Decide the parameter a linear's weight ``w`` reads (through casts and transposes) as
    the cut ``p`` of ``w``, the cut mapped back through those ops."""
    base, chain = weight_chain(w)
    for c in chain:
        p = rule_for(c.target).backward(c, p).get(c.args[0])
    an.decide(base, p, n)


def plain_lm_head(n: Node) -> bool:
    """An LM head that must be vocab-parallel, never a row-parallel down projection (OPT's,
    behind project_out): its logits are returned as they are (a pending sum cannot be), or
    its weight is tied to a token embedding (cut by vocab rows)."""
    w = weight_param(n.args[1])
    return reaches_output_directly(n) and (
        any(u.op == "output" for u in n.users)
        or any(u.target == EMBEDDING for u in w.users))
