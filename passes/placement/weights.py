"""Weights in the placement analysis: a linear's weight read through casts and transposes
(``WEIGHT_VIEWS``: transformers' ``Conv1D`` weight ``.t()``, a ``weight.float()``) is placed as
its parameter, dims mapped; a parameter combined elementwise with a sharded tensor takes its
cut (``adopt_params``); and which linear reaching the output is a vocab-parallel LM head.
Functions of the :class:`~dcp_compile.passes.placement.analysis.Analysis` they serve."""

from __future__ import annotations

from dataclasses import replace

from torch.fx import Node

import torch

from .lattice import R, Partial, Shard
from .node_args import fake, tensor_args, weight_chain, weight_param
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


def replicated_weight(an, w: Node) -> bool:
    """``w`` reads a parameter another linear decided to run whole on every rank (a module
    called twice: Gemma 3n's AltUp modality router, in predict and in correct)."""
    base, _ = weight_chain(w)
    return base in an.params and an.decided.get(base) == R


def adopt_tied_kind(an, n: Node) -> bool:
    """A linear no role decided whose weight another linear did (a block's tied copy called
    from several layers, Zamba2's / Zamba's shared attention): it is placed from that weight,
    column (its output cut), row (a pending sum) or replicated (whole on every rank); record
    that kind. False: not placed."""
    p = an.P(n)
    if p == R and replicated_weight(an, n.args[1]):
        an._set_linear(n, "replicated")
        return True
    if not isinstance(p, (Shard, Partial)):
        return False
    an._set_linear(n, "row" if isinstance(p, Partial) else "column")
    return True


def _param_behind(a: Node, params) -> Node | None:
    """The parameter ``a`` is computed from through single-input ops, or None."""
    while isinstance(a, Node) and a not in params:
        ins = tensor_args(a) if a.op == "call_function" else []
        if len(ins) != 1:
            return None
        a = ins[0]
    return a if isinstance(a, Node) else None


def adopt_params(an, n: Node, ins) -> None:
    """A parameter combined elementwise with a sharded tensor (a norm weight over all
    heads) takes the same cut."""
    sh = [an.P(a) for a in ins if isinstance(an.P(a), Shard)]
    if not sh:
        return
    out_nd = fake(n).ndim
    a0 = next(a for a in ins if isinstance(an.P(a), Shard))
    j = sh[0].dim + out_nd - fake(a0).ndim
    for a in ins:
        # a weight, a cast of it (OLMo-2's weight.float()) or a function of it alone
        # (Gated DeltaNet's -A_log.float().exp(), cut with the heads it scales)
        base = _param_behind(a, an.params)
        k = j - (out_nd - fake(a).ndim)
        if k < 0 or fake(a).shape[k] == 1:
            continue
        if base is not None and base not in an.decided:
            if a is base:
                an.decide(a, replace(sh[0], dim=k), n)
            else:
                an._adopt_through_views(n, {a: replace(sh[0], dim=k)})
        elif base is None and an.P(a) == R:   # a table's rows (Gemma 4's per-layer inputs)
            an._adopt_through_views(n, {a: replace(sh[0], dim=k)})
