"""Refuse what a paged step cannot compute: token mixing outside attention, and position
functions of the sequence length.

A paged step computes each of its tokens once, beside the cached keys and values of the
tokens before it: every op outside attention must compute a token's row from that token's
row alone. Followed from the step's token data and positions through the placement rules,
with the token dim as the "sharded" one (:func:`passes.placement.tokens.follow_tokens`):

  * an op that mixes token data along the sequence (a token shift, a roll, a pad + slice,
    a convolution or a cumsum over it) is a :class:`DCPTokenMixingError`;
  * a value of the positions reduced over the tokens (``max(positions)``: LongRoPE's switch
    to its long factors, dynamic NTK's rescaling) is a :class:`DCPLengthDependentError`,
    unless what it decides is proven constant for every position the program serves (below
    ``max_model_len``, and what the block table addresses): then it is that constant.

The proof reads the decision as data: from an extremum of the positions (``LENGTH_SOURCES``:
its value lies in the positions' range), through affine scalar arithmetic and comparisons
(``AFFINE``), to a ``where`` whose condition is the same at both ends of the range (affine
maps are monotone, so a comparison that agrees at both ends agrees in between). That
``where`` is replaced by the branch it always takes; anything else is refused by name.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime.errors import (DCPLengthDependentError, DCPTokenMixingError,
                                        DCPTransformError)

from .infra import DCPPass, Property, attention_nodes, placeholder, source_of, val
from .op_classes import (ADDS, CASTS, EXTREMA, GREATER, GREATER_EQUAL, LESS, LESS_EQUAL, MULS,
                         SUBS, TENSOR_WHERES, is_call)
from .placement.tokens import Rows, TokenMixing, follow_tokens

aten = torch.ops.aten

# Ops whose value lies in the range of their input (an extremum of the positions).
LENGTH_SOURCES = EXTREMA


def _add(ab, c, alpha=1):
    return ab[0], ab[1] + alpha * c


def _sub(ab, c, alpha=1):
    return ab[0], ab[1] - alpha * c


def _mul(ab, c):
    return ab[0] * c, ab[1] * c


# Affine scalar arithmetic: (a, b) of a*m + b -> with a Python number c.
AFFINE = {**dict.fromkeys(ADDS, _add), **dict.fromkeys(SUBS, _sub),
          **dict.fromkeys(MULS, _mul)}
COMPARISONS = {**dict.fromkeys(GREATER, operator.gt), **dict.fromkeys(GREATER_EQUAL, operator.ge),
               **dict.fromkeys(LESS, operator.lt), **dict.fromkeys(LESS_EQUAL, operator.le)}
WHERE = TENSOR_WHERES


class CheckTokenWise(DCPPass):
    """Every op outside attention acts on each token on its own (module doc)."""

    name = "check_token_wise"
    required = frozenset({Property.CANONICAL_ATTENTION, Property.POSITIONS_LIFTED})
    ensured = frozenset({Property.TOKEN_WISE})

    def __init__(self, ctx, token_input: str):
        super().__init__(ctx)
        self.token_input = token_input

    def call(self, gm: GraphModule) -> PassResult:
        g = gm.graph
        ids = placeholder(gm, self.token_input)
        positions = {a.args[5] for a in attention_nodes(gm)
                     if isinstance(a.args[5], Node) and a.args[5].op == "placeholder"}
        hi = self._last_position(gm)
        folded = []
        for n in [n for n in g.nodes if is_call(n, LENGTH_SOURCES)]:
            if _reads(n, positions) and not _reads(n, {ids}):
                folded += fold_if_constant(n, lo=-1, hi=hi)
        batch, tokens = val(ids).shape[:2]
        checked = 0
        if tokens > 1:      # one token cannot show a mix of tokens; the prompt step did
            seeds = {ids: Rows(1, tokens), **{p: Rows(1, tokens) for p in positions}}
            try:
                checked = len(follow_tokens(list(g.nodes), seeds, tokens))
            except TokenMixing as e:
                raise self._refusal(e.node, e.reason, ids, hi, e.unknown) from None
        self.record(length_decisions_folded=len(folded), token_wise_values=checked,
                    max_position=hi)
        return PassResult(gm, bool(folded))

    def _last_position(self, gm: GraphModule) -> int:
        """The largest position the program serves: what the block table addresses, and the
        model's own max_model_len when it has one."""
        cfg = self.ctx.config
        tables = {a.args[6] for a in attention_nodes(gm) if isinstance(a.args[6], Node)}
        widths = [val(t).shape[-1] for t in tables]
        addressed = max(widths) * cfg.block_size * cfg.dcp if widths else None
        bounds = [b for b in (addressed, self.ctx.facts.max_model_len) if b]
        return min(bounds) - 1 if bounds else 2 ** 62

    def _refusal(self, n: Node, reason: str, ids: Node, hi: int, unknown: bool = False):
        where = f"node {n.name} ({n.target}) at {source_of(n)}"
        # An op without a rule is not shown to mix tokens, nor to keep them apart; an
        # extremum of everything (max(positions)) does reduce over the tokens.
        if unknown and not is_call(n, LENGTH_SOURCES):
            return DCPTransformError(
                f"dcp_compile cannot show that an op outside attention computes each token "
                f"from that token alone: {where} ({reason}). A paged step computes each "
                f"token once, beside the cached keys of the tokens before it. If the op acts "
                f"on each token on its own, it needs a placement rule "
                f"(dcp_compile.passes.placement.rules): report the model.")
        if _reads(n, {ids}):
            return DCPTokenMixingError(
                f"an op outside attention mixes tokens along the sequence: {where} "
                f"({reason}). A paged step computes each token once, beside the cached keys "
                f"of the tokens before it; it cannot read their hidden states back. Compute "
                f"every value outside attention token by token (no token shift, roll, "
                f"pad + slice, convolution or cumsum over the sequence).")
        rope = self.ctx.facts.rope_type
        named = f" (the model's rope_type={rope!r})" if rope else ""
        until = constant_until(n) if is_call(n, LENGTH_SOURCES) else None
        proven = f"; it is constant only while max_model_len <= {until + 1}" \
            if until is not None and until >= 0 else ""
        return DCPLengthDependentError(
            f"a position function depends on the sequence length or on max(positions){named}: "
            f"{where} reduces the positions over the tokens ({reason}), and what it decides "
            f"is not proven constant for positions up to {hi}{proven}. Keys already in the "
            f"KV cache were computed at their own position and cannot follow a change of "
            f"the function. Serve a max_model_len (hf.prepare(max_model_len=...), "
            f"StepShapes.max_blocks) within which it is constant, or use a position "
            f"function of each token's own position (rope_type 'default', 'linear', "
            f"'llama3', 'yarn').")


def _reads(n: Node, roots: set) -> bool:
    seen, stack = set(), [n]
    while stack:
        x = stack.pop()
        if x in roots:
            return True
        if x not in seen:
            seen.add(x)
            stack.extend(x.all_input_nodes)
    return False


# -- proving a length decision constant ----------------------------------------------------

def _decisions(source: Node):
    """(where node, its condition's (comparison, a, b, c)) for each ``where`` the extremum
    ``source`` decides through affine arithmetic; None if it reaches anything else."""
    affine = {source: (1, 0)}
    out = []
    for n in _users_in_order(source):
        if n in affine:
            continue
        if not any(a in affine for a in n.all_input_nodes):
            continue
        if is_call(n, CASTS) and n.args[0] in affine:
            affine[n] = affine[n.args[0]]
        elif n.target in AFFINE and n.args[0] in affine and _number(n.args[1]):
            affine[n] = AFFINE[n.target](affine[n.args[0]], n.args[1],
                                         **{k: v for k, v in n.kwargs.items()
                                            if k == "alpha"})
        elif n.target in COMPARISONS and n.args[0] in affine and _number(n.args[1]):
            affine[n] = (COMPARISONS[n.target], *affine[n.args[0]], n.args[1])
        elif is_call(n, WHERE) and n.args[0] in affine and len(affine[n.args[0]]) == 4 \
                and not any(a in affine for a in n.args[1:]):
            out.append((n, affine[n.args[0]]))
        else:
            return None
    return out


def _users_in_order(source: Node) -> list[Node]:
    down, stack = set(), [source]
    while stack:
        x = stack.pop()
        for u in x.users:
            if u not in down and u.op == "call_function":
                down.add(u)
                stack.append(u)
    return [n for n in source.graph.nodes if n in down]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _decides(cond, lo: int, hi: int) -> bool | None:
    """The comparison's value over m in [lo, hi] if it is the same at both ends (affine:
    monotone), else None."""
    op, a, b, c = cond
    at_lo, at_hi = op(a * lo + b, c), op(a * hi + b, c)
    return at_lo if at_lo == at_hi else None


def fold_if_constant(source: Node, *, lo: int, hi: int) -> list[Node]:
    """Replace each ``where`` that ``source`` decides by the branch it takes for every
    source value in [lo, hi]; nothing if any decision is not proven constant."""
    decisions = _decisions(source)
    if not decisions:
        return []
    taken = [_decides(cond, lo, hi) for _, cond in decisions]
    if any(t is None for t in taken):
        return []
    g = source.graph
    for (w, _), t in zip(decisions, taken):
        w.replace_all_uses_with(w.args[1] if t else w.args[2])
    for n in reversed([source, *_users_in_order(source)]):
        if not n.users:
            g.erase_node(n)
    return [w for w, _ in decisions]


def constant_until(source: Node) -> int | None:
    """The largest last position for which every decision of ``source`` is constant (from
    position -1 on), or None when it decides through anything but affine comparisons."""
    decisions = _decisions(source)
    if not decisions:
        return None
    lo, top = -1, 2 ** 40
    if any(_decides(c, lo, lo) is None for _, c in decisions):
        return None
    while lo < top:                   # constant over [-1, hi] is monotone in hi
        mid = (lo + top + 1) // 2
        if all(_decides(c, -1, mid) is not None for _, c in decisions):
            lo = mid
        else:
            top = mid - 1
    return lo
