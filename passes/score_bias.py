"""A score bias read as a formula of positions and heads and proven a bias of the key-query
distance: ALiBi (``slope_h * (j - i)``) or a distance table (``table(h, i - j)``).

:mod:`dcp_compile.passes.attention_patterns` finds the bias an eager attention adds to its
scores (a second term beside the mask, MPT's ``position_bias``; or the value an additive mask
adds where it keeps a key, Falcon's form); :mod:`dcp_compile.passes.mask_predicate` reads it
on symbolic tensors, the per-head slopes an uninterpreted ``table(h)``; ``alibi_of`` proves it
is ``slope_h * (j - i)`` plus a per-query constant at every key a causal mask keeps, or
refuses it naming the site. The paged op then adds ``alibi_bias`` on global positions.

A distance table (x-transformers' T5 bucketed bias and its MLP of the distance, computed at
transform time by frontends/module_position_bias.py as a ``[H, max_model_len]`` buffer whose
name holds ``DISTANCE_TABLE``) is read by the mask reader as an uninterpreted function of
(head, index), ``distance_k(h, d)``; ``distance_table_of`` proves that the bias at a key
``back`` positions before its query is ``coefficient * distance_k(h, back)`` plus a
per-query constant, for every query and head: a function of the distance only. The paged op
then adds ``table[h, q_pos - k_pos]`` (``live_attention.distance_bias``, the definition it
shares with ALiBi).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
from torch.fx import Node

from .attention_patterns import Site, fail
from .mask_predicate import I, J, _interpret, _scores_axes
from .symbolic_tensors import axis


def read_bias(s: Site, tokens: int, *, token_input: str, position_input: Node | None,
              constants=lambda: {}) -> tuple[sympy.Basic, dict]:
    """The site's score bias (``s.bias``, MPT's position_bias) as a formula over the scores'
    axes (batch x0, head x1, query i, key j) and its tables (see ``_interpret``)."""
    b, tables = _interpret(s.bias, s, tokens, token_input, position_input, constants)
    if b.boolean:
        fail(s.bias, "a boolean tensor added to the attention scores", "Use a float bias")
    return _scores_axes(b.expr, b.shape), tables


@dataclass(frozen=True)
class Alibi:
    """A score bias proven to be ``coefficient * table(h) * (j - i)`` plus a per-query
    constant (softmax ignores it) at every key the causal mask keeps: ALiBi, with slopes
    ``coefficient * table`` (``table`` None: one slope, ``coefficient``, for every head)."""

    table: Node | None           # the [.., H, ..] (or one-element) node holding the slopes
    coefficient: float


# j = i - BACK: a key BACK >= 0 positions before its query (the causal mask hides the rest).
BACK = sympy.Symbol("back", integer=True, nonnegative=True)


@dataclass(frozen=True)
class DistanceTable:
    """A score bias proven to be ``coefficient * table[h, i - j]`` plus a per-query constant
    at every key the causal mask keeps: the model's ``[H, L]`` table of the distance."""

    table: Node                  # the [H, L] buffer (frontends/module_position_bias.py)
    coefficient: float


def is_distance_function(f) -> bool:
    """Whether ``f`` (a key of the mask reader's tables) is a distance table's function."""
    return str(f).startswith(("distance_", "bias_distance_"))


def distance_table_of(s: Site, bias, tables: dict) -> DistanceTable:
    """``bias`` (over x0 batch, x1 head, i, j), which reads a distance table, proven
    ``coefficient * table(h, back)`` plus a per-query constant at every key ``back = i - j
    >= 0`` positions before its query, or refused naming the site."""
    h = axis(1)
    e = sympy.simplify(sympy.piecewise_fold(bias).subs(J, I - BACK))
    used = [f for f in tables if e.has(f)]
    why = None
    if axis(0) in e.free_symbols:
        why = "it differs across batch rows"
    elif len(used) != 1 or not is_distance_function(used[0]):
        why = f"it reads {len(used)} tables (one distance table, or ALiBi's slopes, is read)"
    else:
        f, at = used[0], sympy.Symbol("table_at_distance")
        rest = e.subs(f(h, BACK), at)
        c = sympy.simplify(sympy.diff(rest, at))
        rest = sympy.simplify(rest - c * at)
        if not c.is_number or c == 0 or rest.has(BACK) or rest.has(f(h, BACK)) \
                or any(a.has(BACK) for a in rest.atoms(sympy.Function)):
            why = (f"keys back positions before their query get {e}, not table(h, back) "
                   f"plus a per-query constant")
        else:
            return DistanceTable(table=tables[f], coefficient=float(c))
    fail(s.bias if s.bias is not None else s.mask, f"the score bias of attention "
         f"{s.node.name} is not a bias of the key-query distance ({why})", "The paged op "
         "adds ALiBi's slope_h * (k_pos - q_pos) or a distance table's table[h, q_pos - "
         "k_pos] to the scores: remove other biases")


def position_bias_of(s: Site, bias, tables: dict) -> Alibi | DistanceTable | None:
    """The site's score bias proven ALiBi or a distance table (None: no bias at all)."""
    if any(is_distance_function(f) and bias.has(f) for f in tables):
        return distance_table_of(s, bias, tables)
    return alibi_of(s, bias, tables)


def alibi_of(s: Site, bias, tables: dict) -> Alibi | None:
    """``bias`` (a formula over the scores' axes, x0 batch, x1 head, i, j) proven ALiBi at
    every key j <= i (the only keys a causal mask keeps), or None when it is constant along
    the keys (softmax-invariant: no bias at all). Anything else is refused naming the site."""
    h = axis(1)
    bias = sympy.piecewise_fold(bias)
    # How much the bias changes from the query's own key back to a key BACK before it.
    d = sympy.simplify(bias.subs(J, I - BACK) - bias.subs(J, I))
    if d == 0:
        return None
    used = [f for f in tables if d.has(f)]
    why = None
    if axis(0) in d.free_symbols:
        why = "it differs across batch rows"
    elif len(used) > 1:
        why = f"it reads {len(used)} per-head tables (one slope table is ALiBi)"
    if why is None:
        f = used[0] if used else None
        table_of = sympy.Integer(1) if f is None else \
            f(h) if d.has(f(h)) else f(sympy.Integer(0))
        k = sympy.simplify(-d / (BACK * table_of))
        if not k.is_number or sympy.simplify(d + k * table_of * BACK) != 0:
            why = (f"keys back positions before their query get {d} plus a per-query "
                   f"constant, not -slope(h) * back")
        else:
            return Alibi(table=tables[f] if f is not None else None, coefficient=float(k))
    fail(s.bias if s.bias is not None else s.mask, f"the score bias of attention "
         f"{s.node.name} is not ALiBi ({why})", "The paged op adds only ALiBi's "
         "slope_h * (k_pos - q_pos) to the scores: remove other biases")
