"""An attention mask read as a predicate of positions: ``K(i, j)`` = "query at position i may
attend the key at position j", a sympy formula over symbolic i, j (never sampled values).

The mask's computation is interpreted on symbolic tensors: a :class:`Sym` is a tensor's shape
and ONE sympy expression of its element indices (``x0, x1, ...``), so ``arange(S)`` is
``x0``, ``full((S, S), -inf).triu(1)`` is ``Piecewise((-oo, x1 - x0 >= 1), (0, True))`` and a
comparison of two broadcast position vectors is a relation between two index symbols. The
formula does not contain the captured length: it is the same code at every length, which is
what lets :mod:`dcp_compile.passes.prove.masks` prove it for every position.

Positions: the model's full forward numbers its tokens 0..L-1, so element ``a`` of the token
axis of ``position_ids`` (or of an ``arange``) is position ``a``; after the mask's last two
axes are renamed (query i, key j), K is a predicate of positions. Padding (position -1) is
not the mask's business: the paged op zeroes a padding query and never caches a padding key.

Ops are rules as data (``RULES``: op -> how it maps symbolic tensors); an op not in the
table, a mask read from a buffer or from the token ids, is refused naming the node and its
source line. Index values are taken as non-negative (they come from positions / arange).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch
from torch.fx import Node

from .attention_patterns import MASKED_OUT, Site, fail
from .finite_fills import product_keep
from .symbolic_tensors import (NotAFormula, Sym, _fold, as_bool, as_number, axis,  # noqa: F401
                               broadcast_to, constant, hidden_under_bias, pieces, relation,
                               rename)
from dcp_compile.runtime.names import DISTANCE_TABLE

from .infra import val
from .mask_axis_rules import AXIS_RULES
from .memory import refuse_writes_in_place as _refuse_writes_in_place
from .op_classes import (ADDS, ANDS, ARANGES, CASTS, EXPANDS, FILLS, FILLS_OF_ONE,
                         FILLS_OF_ZERO, MASKED_FILLS, MULS, ORS, PERMUTES, REMAINDERS, RESHAPES,
                         RSUBS, SQUEEZES, SUBS, WHERES, XORS)

aten = torch.ops.aten

# The proven predicate's variables: query position i, key position j.
I, J = sympy.symbols("i j", integer=True, nonnegative=True)


# -- the rules --------------------------------------------------------------------------------


def _out(n: Node) -> tuple[tuple[int, ...], bool]:
    v = val(n)
    return tuple(int(s) for s in v.shape), v.dtype == torch.bool


def _filled(value_at):
    """factory ops: constant tensors (value_at(args) -> the fill value)."""
    def rule(n, args):
        shape, boolean = _out(n)
        return Sym(shape, constant(value_at(args), boolean), boolean)
    return rule


def _arange(n, args):
    shape, boolean = _out(n)
    if n.target == aten.arange.default:
        start, step = 0, 1
    else:
        start, step = args[0], (args[2] if len(args) > 2 else 1)
    if not all(isinstance(x, int) for x in (start, step)):
        raise NotAFormula("arange with non-integer start or step")
    return Sym(shape, sympy.Integer(start) + step * axis(0), boolean)


def _cast(n, args):
    x, (shape, boolean) = args[0], _out(n)
    if boolean:
        return Sym(shape, as_bool(x.expr, x.boolean), True)
    if x.boolean:
        return Sym(shape, as_number(x.expr, True), False)
    if not val(n).is_floating_point() and val(n.args[0]).is_floating_point():
        raise NotAFormula("a float cast to an integer")
    return Sym(shape, x.expr, False)


def _view(n, args):
    """reshape / view / squeeze / unsqueeze: only inserting or removing size-1 axes."""
    x, (shape, _) = args[0], _out(n)
    if shape == x.shape:
        return Sym(shape, x.expr, x.boolean)
    if n.target == aten.unsqueeze.default:
        d = args[1] % (len(x.shape) + 1)
        return Sym(shape, rename(x.expr, {k: axis(k + (k >= d)) for k in range(len(x.shape))}),
                   x.boolean)
    src = [k for k, s in enumerate(x.shape) if s != 1]
    dst = [k for k, s in enumerate(shape) if s != 1]
    if [x.shape[k] for k in src] != [shape[k] for k in dst]:
        raise NotAFormula(f"a reshape from {x.shape} to {shape} that regroups axes")
    mapping = {k: sympy.Integer(0) for k in range(len(x.shape))}
    mapping.update(dict(zip(src, (axis(k) for k in dst))))
    if not dst:     # all ones (a one-token step): keep the axes aligned on the right
        off = len(shape) - len(x.shape)
        mapping = {k: axis(k + off) if k + off >= 0 else sympy.Integer(0)
                   for k in range(len(x.shape))}
    return Sym(shape, rename(x.expr, mapping), x.boolean)


def _expand(n, args):
    shape, _ = _out(n)
    return Sym(shape, broadcast_to(args[0], shape), args[0].boolean)


def _permute(n, args):
    x, (shape, _) = args[0], _out(n)
    rank = len(x.shape)
    if n.target == aten.transpose.int:
        a, b = args[1] % rank, args[2] % rank
        order = list(range(rank))
        order[a], order[b] = order[b], order[a]
    else:
        order = [d % rank for d in args[1]]
    return Sym(shape, rename(x.expr, {src: axis(dst) for dst, src in enumerate(order)}),
               x.boolean)


def _slice(n, args):
    x, (shape, _) = args[0], _out(n)
    dim = (args[1] if len(args) > 1 else 0) % len(x.shape)
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    step = args[4] if len(args) > 4 else 1
    size = x.shape[dim]
    start = min(max(start + size if start < 0 else start, 0), size)
    return Sym(shape, rename(x.expr, {dim: start + step * axis(dim)}), x.boolean)


def _select(n, args):
    x, (shape, _) = args[0], _out(n)
    dim = args[1] % len(x.shape)
    index = args[2] + x.shape[dim] if args[2] < 0 else args[2]
    mapping = {k: axis(k - (k > dim)) for k in range(len(x.shape))}
    mapping[dim] = sympy.Integer(index)
    return Sym(shape, rename(x.expr, mapping), x.boolean)


def _fill(n, args):
    """``fill(x, v)``: x's shape, every element v (a number, or a one-element formula)."""
    shape, boolean = _out(n)
    v = args[1]
    if isinstance(v, Sym):
        if math.prod(v.shape) != 1:
            raise NotAFormula(f"a fill with a value of shape {v.shape}")
        e = rename(v.expr, {k: sympy.Integer(0) for k in range(len(v.shape))})
        return Sym(shape, as_bool(e, v.boolean) if boolean else as_number(e, v.boolean),
                   boolean)
    return Sym(shape, constant(v, boolean), boolean)


def _written_back(x: Sym, src: Sym, inside, at: dict) -> Sym:
    """x with the part where ``inside`` holds replaced by src read at ``at`` (axis -> its
    index in src): the value of a slice or select written back (slice_scatter, ...)."""
    if src.boolean != x.boolean:
        raise NotAFormula("a part written back with another dtype kind")
    part = rename(src.expr, at)
    if x.boolean:
        return Sym(x.shape, sympy.Or(sympy.And(inside, part),
                                     sympy.And(sympy.Not(inside), x.expr)), True)
    return Sym(x.shape, _fold(sympy.Piecewise((part, inside), (x.expr, True))), False)


def _slice_scatter(n, args):
    """``slice_scatter(x, src, dim, start, end, step)``: x, with src on its slice."""
    x, src = args[0], args[1]
    dim = (args[2] if len(args) > 2 else 0) % len(x.shape)
    size = x.shape[dim]
    start = args[3] if len(args) > 3 and args[3] is not None else 0
    end = args[4] if len(args) > 4 and args[4] is not None else None
    step = args[5] if len(args) > 5 else 1
    start = min(max(start + size if start < 0 else start, 0), size)
    if step != 1:
        raise NotAFormula("a slice written back with a step")
    a = axis(dim)
    at = {k: axis(k) for k in range(len(x.shape))}
    at[dim] = a - start
    # ``x[a:]`` (an end past the tensor) is written to its end at every length; an end
    # within it is a bound of the formula
    inside = a >= start if end is None or end > size else sympy.And(
        a >= start, a < (end + size if end < 0 else end))
    return _written_back(x, src, inside, at)


def _select_scatter(n, args):
    """``select_scatter(x, src, dim, index)``: x, with src (one dim fewer) at that index."""
    x, src = args[0], args[1]
    dim = args[2] % len(x.shape)
    index = args[3] + x.shape[dim] if args[3] < 0 else args[3]
    at = {k: axis(k + (k >= dim)) for k in range(len(src.shape))}
    return _written_back(x, src, sympy.Eq(axis(dim), index), at)


def _index(n, args):
    """Advanced indexing ``x[idx_0, ..., idx_{m-1}]``; a None index keeps its dim (gpt-fast's
    ``causal_mask[None, None, input_pos]`` indexes the unsqueezed tril buffer so). The
    broadcast index dims stand where the tensor indices stood when those are adjacent, and
    first otherwise (numpy's rule, which torch follows)."""
    x, indices, (shape, _) = args[0], list(args[1]), _out(n)
    used = [k for k, t in enumerate(indices) if t is not None]
    if not used or any(not isinstance(indices[k], Sym) for k in used):
        raise NotAFormula("indexing with slices or non-tensor indices")
    lead = tuple(torch.broadcast_shapes(*(indices[k].shape for k in used)))
    at = used[0] if used == list(range(used[0], used[-1] + 1)) else 0
    kept = [k for k in range(len(x.shape)) if k not in used]
    # output dims: the kept dims before `at`, the broadcast index dims, the other kept dims
    out_axis = {k: i if k < at else i + len(lead) for i, k in enumerate(kept)}
    shift = {i: axis(i + at) for i in range(len(lead))}
    mapping = {k: rename(broadcast_to(indices[k], lead), shift) for k in used}
    mapping.update({k: axis(out_axis[k]) for k in kept})
    if len(shape) != len(lead) + len(kept):
        raise NotAFormula(f"indexing {x.shape} gives {shape}, not {len(lead) + len(kept)} dims")
    return Sym(shape, rename(x.expr, mapping), x.boolean)


def _index_select(n, args):
    """``index_select(x, d, idx)``: x's axis d read at idx (a 1-D index, on output axis d)."""
    x, d, idx = args[0], args[1] % len(args[0].shape), args[2]
    shape, _ = _out(n)
    if not isinstance(idx, Sym) or len(idx.shape) != 1:
        raise NotAFormula("index_select with an index that is not a 1-D formula")
    return Sym(shape, rename(x.expr, {d: rename(idx.expr, {0: axis(d)})}), x.boolean)


def _operands(n, args):
    shape, boolean = _out(n)
    ops = []
    for a in args:
        if isinstance(a, Sym):
            ops.append((broadcast_to(a, shape), a.boolean))
        else:
            ops.append((constant(a, isinstance(a, bool)), isinstance(a, bool)))
    return shape, boolean, ops


def _arith(fn):
    def rule(n, args):
        alpha = n.kwargs.get("alpha", 1)
        shape, boolean, ops = _operands(n, args[:2])
        (a, ab), (b, bb) = ops
        if boolean:
            raise NotAFormula("arithmetic with a boolean result")
        return Sym(shape, _fold(fn(as_number(a, ab), alpha * as_number(b, bb))), False)
    return rule


def _unary(fn):
    def rule(n, args):
        shape, boolean, ((a, ab),) = _operands(n, args[:1])
        if boolean:                                   # logical / bitwise not
            return Sym(shape, sympy.Not(as_bool(a, ab)), True)
        return Sym(shape, _fold(fn(as_number(a, ab))), False)
    return rule


def _compare(op):
    def rule(n, args):
        shape, _, ((a, ab), (b, bb)) = _operands(n, args[:2])
        return Sym(shape, relation(op, as_number(a, ab), as_number(b, bb)), True)
    return rule


def _logic(fn):
    def rule(n, args):
        shape, _, ((a, ab), (b, bb)) = _operands(n, args[:2])
        return Sym(shape, fn(as_bool(a, ab), as_bool(b, bb)), True)
    return rule


def _where(n, args):
    shape, boolean, ((c, cb), (a, ab), (b, bb)) = _operands(n, args[:3])
    c = as_bool(c, cb)
    if boolean:
        return Sym(shape, sympy.Or(sympy.And(c, as_bool(a, ab)),
                                   sympy.And(sympy.Not(c), as_bool(b, bb))), True)
    return Sym(shape, sympy.Piecewise((as_number(a, ab), c), (as_number(b, bb), True)), False)


def _masked_fill(n, args):
    return _where(n, [args[1], args[2], args[0]])


def _triangle(upper: bool):
    """triu(x, k): keeps x where col - row >= k; tril: where col - row <= k."""
    def rule(n, args):
        x, (shape, boolean) = args[0], _out(n)
        k = args[1] if len(args) > 1 else 0
        r = len(shape)
        d = axis(r - 1) - axis(r - 2)
        keep = d >= k if upper else d <= k
        if boolean:
            return Sym(shape, sympy.And(keep, x.expr), True)
        return Sym(shape, sympy.Piecewise((x.expr, keep), (0, True)), False)
    return rule


RULES = {
    **dict.fromkeys(ARANGES, _arange),
    aten.full.default: _filled(lambda a: a[1]), aten.new_full.default: _filled(lambda a: a[2]),
    aten.full_like.default: _filled(lambda a: a[1]), aten.scalar_tensor.default:
        _filled(lambda a: a[0]),
    **dict.fromkeys(FILLS_OF_ONE, _filled(lambda a: 1)),
    **dict.fromkeys(FILLS_OF_ZERO, _filled(lambda a: 0)),
    **dict.fromkeys(CASTS, _cast),
    **dict.fromkeys(RESHAPES | SQUEEZES, _view),
    **dict.fromkeys(EXPANDS, _expand),
    **dict.fromkeys(PERMUTES, _permute),
    aten.slice.Tensor: _slice, aten.select.int: _select, aten.index.Tensor: _index,
    aten.index_select.default: _index_select,
    **dict.fromkeys(FILLS, _fill),
    aten.slice_scatter.default: _slice_scatter, aten.select_scatter.default: _select_scatter,
    **dict.fromkeys(ADDS, _arith(lambda a, b: a + b)),
    **dict.fromkeys(SUBS, _arith(lambda a, b: a - b)),
    **dict.fromkeys(RSUBS, _arith(lambda a, b: b - a)),
    **dict.fromkeys(MULS, _arith(lambda a, b: a * b)),
    aten.floor_divide.default: _arith(lambda a, b: sympy.floor(a / b)),
    aten.pow.Tensor_Scalar: _arith(lambda a, b: a ** b),
    aten.div.Tensor: _arith(lambda a, b: a / b),
    **dict.fromkeys(REMAINDERS, _arith(lambda a, b: sympy.Mod(a, b))),
    aten.neg.default: _unary(lambda a: -a), aten.abs.default: _unary(sympy.Abs),
    aten.bitwise_not.default: _unary(lambda a: -a - 1),
    aten.logical_not.default: _unary(lambda a: sympy.Integer(1) - a),
    **{getattr(aten, name).Tensor: _compare(op) for name, op in (
        ("lt", sympy.Lt), ("le", sympy.Le), ("gt", sympy.Gt), ("ge", sympy.Ge),
        ("eq", sympy.Eq), ("ne", sympy.Ne))},
    **{getattr(aten, name).Scalar: _compare(op) for name, op in (
        ("lt", sympy.Lt), ("le", sympy.Le), ("gt", sympy.Gt), ("ge", sympy.Ge),
        ("eq", sympy.Eq), ("ne", sympy.Ne))},
    **dict.fromkeys(ANDS, _logic(sympy.And)),
    **dict.fromkeys(ORS, _logic(sympy.Or)),
    **dict.fromkeys(XORS, _logic(sympy.Xor)),
    **dict.fromkeys(WHERES, _where),
    **dict.fromkeys(MASKED_FILLS, _masked_fill),
    aten.triu.default: _triangle(upper=True), aten.tril.default: _triangle(upper=False),
    **AXIS_RULES,
}


# -- reading a site's mask ----------------------------------------------------------------------


@dataclass(frozen=True)
class MaskPredicate:
    """K(i, j) of one attention site, and where it came from."""

    keep: sympy.Basic          # a sympy Boolean over I, J
    node: Node                 # the mask node (errors and the certificate name it)
    bias: sympy.Basic = sympy.Integer(0)   # the score bias it adds where it keeps (Falcon)
    tables: dict | None = None             # the bias's per-head tables (``_interpret``)


def _interpret(root: Node, s: Site, tokens: int, token_input: str, position_input,
               constants) -> tuple[Sym, dict]:
    """``root``'s value as a Sym. A value computed without the token ids or positions (a
    per-head constant: ALiBi's slopes, built with pow / reciprocal / a lifted tensor) is read
    as an uninterpreted function of its one varying axis, ``table_k(x)`` (``HEAD_TABLES``),
    whatever the ops computing it: a formula proven for any ``table_k`` holds for its value.
    Returns (the Sym, {table function: the node computing the table})."""
    env: dict[Node, object] = {}
    free: set[Node] = set()          # nodes that read neither token ids nor positions
    opaque: set[Node] = set()        # free nodes no rule reads: tables, once consumed
    tables: dict = {}
    ancestors = _ancestors(root)
    _refuse_writes_in_place(s, ancestors)

    def table(n: Node) -> Sym:
        shape, boolean = _out(n)
        varying = [k for k, x in enumerate(shape) if x != 1]
        if boolean or len(varying) > 1:
            raise NotAFormula(f"{n.name} ({n.target}, shape {shape}) is computed without "
                              f"positions by ops the mask reader has no rule for, and a "
                              f"constant table read so (ALiBi's slopes) must be a float "
                              f"varying along one axis")
        f = sympy.Function(f"table_{len(tables)}")
        tables[f] = n
        arg = axis(varying[0]) if varying else sympy.Integer(0)
        return Sym(shape, f(arg), False)

    def read(a):
        if isinstance(a, Node) and a in opaque:
            if a not in env:
                env[a] = table(a)
            return env[a]
        return env[a]

    for n in ancestors:
        if n.op == "placeholder" and DISTANCE_TABLE in n.name:
            # A [H, L] table of the key-query distance (frontends/module_position_bias.py):
            # an uninterpreted function of (head, distance), proven so by its reader
            # (score_bias.distance_table_of).
            free.add(n)
            f = sympy.Function(f"distance_{len(tables)}")
            tables[f] = n
            env[n] = Sym(_out(n)[0], f(axis(0), axis(1)), False)
            continue
        if n.op == "placeholder":
            if n.name != token_input and n is not position_input:
                free.add(n)
                if sum(x != 1 for x in _out(n)[0]) <= 1 and not _is_diagonal(n, constants):
                    opaque.add(n)   # a weight/buffer of one axis: a table (ALiBi's slopes)
                    continue
            env[n] = _placeholder(n, s, tokens, token_input, position_input, constants)
            continue
        if n.op != "call_function":
            fail(n, f"the attention mask of {s.node.name} is built from {n.op} {n.target}",
                 "Build the mask from positions or torch.arange only")
        is_free = all(a in free for a in n.all_input_nodes)
        if is_free:
            free.add(n)
        if is_free and n.all_input_nodes and all(a in opaque for a in n.all_input_nodes) \
                and _is_table_shaped(n):
            opaque.add(n)     # a function of tables only, of one axis: itself a table (slopes
            continue          # padded to every head: x-transformers' ALiBi)
        rule = RULES.get(n.target)
        if rule is None:
            if is_free:           # a constant no rule reads: a table, if it is consumed
                opaque.add(n)
                continue
            fail(n, f"the attention mask of {s.node.name} is computed with {n.target}, which "
                 f"the mask reader has no rule for (passes/mask_predicate.py RULES)",
                 "Build the mask from positions or torch.arange with comparisons, "
                 "triu/tril, where or masked_fill")
        try:
            args = torch.fx.node.map_arg(n.args, read)
            env[n] = rule(n, args)
        except NotAFormula as e:
            if is_free:
                opaque.add(n)
                continue
            fail(n, f"the attention mask of {s.node.name} cannot be read as a formula of "
                 f"positions at {n.target}: {e}", "Build the mask from positions or "
                 "torch.arange with comparisons, triu/tril, where or masked_fill")
    try:
        return read(root), tables
    except NotAFormula as e:
        fail(root, f"the attention mask or bias of {s.node.name} cannot be read as a formula "
             f"of positions: {e}", "Build masks and biases from positions or torch.arange")


def _is_table_shaped(n: Node) -> bool:
    """A float value varying along at most one axis (what a table may be)."""
    shape, boolean = _out(n)
    return not boolean and sum(x != 1 for x in shape) <= 1


def read_mask(s: Site, tokens: int, *, token_input: str, position_input: Node | None,
              constants=lambda: {}) -> MaskPredicate:
    """The site's mask as K(i, j) (see module doc); refuses what it cannot read.
    ``constants()``: placeholder name -> tensor, for masks read from a buffer. An additive
    mask may also carry a score bias (Falcon adds ALiBi to its mask): its kept pieces'
    common value, returned as ``bias`` (over the scores' axes, i and j renamed)."""
    m, tables = _interpret(s.mask, s, tokens, token_input, position_input, constants)
    shape = m.shape
    if len(shape) < 2 or (tokens > 1 and shape[-2:] != (tokens, tokens)):
        fail(s.mask, f"attention mask of shape {shape} for {tokens} queries and keys",
             "Use a [..., S, S] causal mask")
    keep, bias = _keep(s, m)
    read_as_table = [tables[f].name for f in tables if keep.has(f)]
    if read_as_table:
        fail(s.mask, f"the attention mask of {s.node.name} reads {read_as_table}, computed "
             f"without positions by ops the mask reader has no rule for", "Build the mask "
             "from positions or torch.arange with comparisons, triu/tril, where or "
             "masked_fill")
    r = len(shape)
    leading = {axis(k) for k in range(r - 2)} & keep.free_symbols
    if leading:
        fail(s.mask, f"the attention mask of {s.node.name} differs across batch rows or "
             f"heads (it depends on axes {sorted(map(str, leading))})", "Use one causal mask "
             "for every row and head")
    keep = rename(keep, {r - 2: I, r - 1: J})
    return MaskPredicate(keep=keep, node=s.mask, bias=_scores_axes(bias, shape),
                         tables=tables)


def _scores_axes(expr, shape: tuple[int, ...]):
    """A formula over a [..., S, S]-aligned tensor's axes, on the scores' [B, H, i, j]:
    numpy broadcasting aligns it on the right."""
    r = len(shape)
    mapping = {k: (axis(k + 4 - r) if k + 4 - r >= 0 else sympy.Integer(0))
               for k in range(r)}
    mapping.update({r - 2: I, r - 1: J})
    for k in range(r - 2):
        if shape[k] == 1:
            mapping[k] = sympy.Integer(0)
    return rename(expr, mapping)


def _keep(s: Site, m: Sym):
    """(the mask as "keep" booleans, the score bias it carries): bool masks by their kind
    (no bias), additive masks by their pieces (<= MASKED_OUT drops; the others keep, and
    must all add the same value: 0, or a bias such as ALiBi, read by ``alibi_of``)."""
    if s.mask_kind in ("keep", "drop"):
        k = as_bool(m.expr, m.boolean)
        return (k if s.mask_kind == "keep" else sympy.Not(k)), sympy.Integer(0)
    if s.mask_kind == "product":
        return product_keep(s, m), sympy.Integer(0)
    if m.boolean:
        fail(s.mask, "a boolean tensor added to the attention scores", "Use a float mask")
    kept, values = [], []
    for value, cond in pieces(m.expr):
        if value.is_number and (value == -sympy.oo or float(value) <= MASKED_OUT):
            continue
        if hidden_under_bias(value):
            continue
        kept.append(cond)
        if not any(sympy.simplify(value - v) == 0 for v in values):
            values.append(value)
    if len(values) > 1:
        fail(s.mask, f"the attention mask of {s.node.name} adds different values where it "
             f"keeps keys ({values[:3]}): a bias that is not one formula", "Add 0 (or one "
             "bias formula such as ALiBi's) wherever the mask keeps a key")
    return sympy.Or(*kept), (values[0] * s.mask_scale if values else sympy.Integer(0))


def _placeholder(n: Node, s: Site, tokens: int, token_input: str, position_input, constants):
    if n.name == token_input:
        fail(s.mask, f"the attention mask of {s.node.name} depends on the token ids "
             f"(data-dependent mask)", "Masks may depend only on positions: padding is "
             "expressed by position -1 in a DCP program")
    if position_input is not None and n is position_input:
        shape, _ = _out(n)
        if len(shape) != 2:
            fail(s.mask, f"position_ids of shape {shape}", "Pass position_ids as [B, S]")
        return Sym(shape, axis(1), False)      # element (b, a) is position a
    table = constants().get(n.name)
    if table is None or table.is_meta:
        fail(s.mask, f"the attention mask of {s.node.name} reads {n.name}, whose value is not "
             f"available here (meta device or not a weight/buffer)", "Build causal masks "
             "from torch.arange, or transform a model with real weights")
    shape, boolean = _out(n)
    try:
        return Sym(shape, _diagonal_formula(table.detach().cpu(), boolean), boolean)
    except NotAFormula as e:
        fail(s.mask, f"the attention mask of {s.node.name} reads the table {n.name} of shape "
             f"{shape}, which is not a formula of positions: {e}", "Build the mask from "
             "torch.arange or position_ids (comparisons, triu/tril), or store a table whose "
             "value depends only on key - query (tril / triu / band)")


def _is_diagonal(n: Node, constants) -> bool:
    table = constants().get(n.name)
    if table is None or table.is_meta or table.dim() < 2:
        return False
    try:
        _diagonal_formula(table.detach().cpu(), table.dtype == torch.bool)
    except NotAFormula:
        return False
    return True


def _diagonal_formula(table: torch.Tensor, boolean: bool):
    """A stored [..., M, N] table (nanoGPT's ``tril`` buffer) as a formula of its last two
    indices: it must be constant along every diagonal (its value depends only on
    d = column - row), and is then a step function of d, written as a Piecewise over runs.
    Exact on the whole table; a model cannot index past it, so beyond is never read."""
    if table.dim() < 2 or any(x != 1 for x in table.shape[:-2]):
        raise NotAFormula(f"a table of shape {tuple(table.shape)}, not [..., M, N]")
    t = table.reshape(table.shape[-2:])
    m, cols = t.shape
    runs = []                                   # (last d of the run, value)
    for d in range(-(m - 1), cols):
        diag = t.diagonal(d)
        if not bool((diag == diag[0]).all()):
            raise NotAFormula(f"its values vary along the diagonal column - row = {d}")
        value = constant(diag[0].item(), boolean)
        if runs and runs[-1][1] == value:
            runs[-1] = (d, value)
        else:
            runs.append((d, value))
    r = table.dim()
    d = axis(r - 1) - axis(r - 2)
    if boolean:
        return sympy.Or(*(sympy.And(d <= last, d > (runs[k - 1][0] if k else -sympy.oo), v)
                          for k, (last, v) in enumerate(runs[:-1])),
                        sympy.And(d > runs[-2][0], runs[-1][1]) if len(runs) > 1
                        else runs[-1][1])
    return sympy.Piecewise(*((v, d <= last) for last, v in runs[:-1]), (runs[-1][1], True))


def _ancestors(root: Node) -> list[Node]:
    seen, stack = set(), [root]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(root.graph.nodes)}
    return sorted(seen, key=order.get)
