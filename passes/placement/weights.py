"""Weights in the placement analysis: a linear's weight read through casts and transposes
(``WEIGHT_VIEWS``: transformers' ``Conv1D`` weight ``.t()``, a ``weight.float()``) is placed as
its parameter, dims mapped; and which linear reaching the output is a vocab-parallel LM head.
Functions of the :class:`~dcp_compile.passes.placement.analysis.Analysis` they serve."""

from __future__ import annotations

from torch.fx import Node

import torch

from .lattice import R, Partial, Shard
from .node_args import weight_chain, weight_param
from .plan import EMBEDDING, LINEAR, reaches_output_directly
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


def lora_up(n: Node) -> bool:
    """``n`` is the up half of a low-rank adapter added to a projection of the same input,
    ``W x + B(A x)`` (Zamba2's shared-block adapters): not an MLP's down projection. The add's
    requirement reaches it from ``W x`` (B cut like W, column-parallel; A replicated)."""
    a = n.args[0]
    if not (isinstance(a, Node) and a.target == LINEAR):
        return False
    for add in n.users:
        if add.target != torch.ops.aten.add.Tensor:
            continue
        other = next((o for o in add.args if o is not n), None)
        if isinstance(other, Node) and other.target == LINEAR and other.args[0] is a.args[0]:
            return True
    return False


def adopt_tied_kind(an, n: Node) -> bool:
    """A linear no role decided whose weight another linear did (a block's tied copy called
    from several layers, Zamba2's / Zamba's shared attention): it is placed from that weight,
    column (its output cut) or row (a pending sum); record that kind. False: not placed."""
    p = an.P(n)
    if not isinstance(p, (Shard, Partial)):
        return False
    an._set_linear(n, "row" if isinstance(p, Partial) else "column")
    return True
