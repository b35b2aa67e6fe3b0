"""lift_positions: positions as a dataflow fact. What a model computes token-wise from its
positions is rewritten as the same function of the step's ``positions [B, S]``.

An ordinary model sees positions ``0 .. S-1``: it writes them ``torch.arange(S)`` (cast,
scaled, turned into RoPE angles, a learned or sinusoidal table's row index...) or slices a
table it made in ``__init__`` by the length (``cos_cached[:S]``, ``freqs_cis[:S]``, which is
``table[arange(S)]``). A paged step's tokens sit at arbitrary positions, one row per
sequence. So:

  * **sources**: ``arange(S)`` (start 0, step 1) and a table sliced by the length (a slice
    ``[0, S)`` of a constant, rewritten to ``index_select(table, dim, arange(S))``, the same
    value). A one-token decode step cannot tell ``table[:1]`` from a literal first row, so
    the tables the model's prompt step sliced by its length are remembered
    (``ModelFacts.position_tables``).
  * **positional values**: every node computed from a source and constants only (no token
    data). Each must keep the token dim whole (the placement rules' ``token_dim``): a value
    that mixes positions across tokens (a sum or a cumsum over them) is refused.
  * **lifting**: the positional subgraph is one function of the positions row; torch's own
    batching rules (``vmap``) rewrite it over ``positions [B, S]`` (a traced ATen graph
    inlined in place of the original nodes).
  * **meeting the batch**: where a positional value meets a batched tensor (a broadcasting
    op: RoPE's ``q * cos``, an embedding sum), its new batch dim goes where the op's output
    has its batch dim, found by the placement rules from ``input_ids`` (dim 0) on; the
    operand's own dim aligned there must have been a broadcast (size 1) dim.

Refused, by name and source line: a positional value that mixes tokens, one that meets the
batch through an op without a broadcasting rule, one whose batch dim cannot be followed.
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

from dcp_compile.runtime.errors import DCPLengthDependentError, DCPTransformError
from dcp_compile.runtime.names import BLOCK_TABLE, POSITIONS, is_cache_input
from dcp_compile.runtime.program.facts import ModelFacts

from .infra import DCPPass, Found, Property, placeholder, source_of, val
from .op_classes import IDENTITY_VIEWS, is_call
from .placement import Refusal, aligned_dim, carried_dim, rule_for
from .placement.rules import POINTWISE

aten = torch.ops.aten


def _fail(n: Node, why: str, fix: str):
    raise DCPTransformError(f"{why}: node {n.name} ({n.target}) at {source_of(n)}. {fix}.")


# -- sources -------------------------------------------------------------------------------

def is_seq_arange(n: Node, tokens: int) -> bool:
    """``arange(S)`` / ``arange(0, S, 1)``: the positions of a chunk that starts at 0."""
    if is_call(n, {aten.arange.default}):
        return n.args[0] == tokens
    if is_call(n, {aten.arange.start, aten.arange.start_step}):
        step = n.args[2] if len(n.args) > 2 else 1
        return n.args[0] == 0 and n.args[1] == tokens and step == 1
    return False


def _constant_root(n: Node, data: set[Node]) -> Node | None:
    """The input (weight, buffer, lifted constant) a token-free value is a view of."""
    while n not in data and is_call(n, IDENTITY_VIEWS | {aten.slice.Tensor}):
        n = n.args[0]
    return n if n.op == "placeholder" and n not in data else None


def _length_slices(g: Graph, tokens: int, data: set[Node], known: set) -> list:
    """(slice node, root input, dim) of each constant table sliced ``[0, S)``."""
    out = []
    for n in g.nodes:
        if not is_call(n, {aten.slice.Tensor}) or n in data:
            continue
        dim = n.args[1] if len(n.args) > 1 else 0
        start = n.args[2] if len(n.args) > 2 else 0
        end = n.args[3] if len(n.args) > 3 else None
        step = n.args[4] if len(n.args) > 4 else 1
        src = n.args[0]
        nd = len(val(src).shape)
        dim %= nd
        if start not in (0, None) or step != 1 or end != tokens \
                or val(src).shape[dim] <= tokens:
            continue
        root = _constant_root(src, data)
        key = (root.name, dim) if root is not None else None
        if tokens > 1 and root is not None or key in known:
            out.append((n, key))
    return out


# -- batch dims through the placement rules ---------------------------------------------

def batch_dims(g: Graph, seeds: dict[Node, int], batch: int) -> dict:
    """Each batched node -> its batch dim (from ``seeds``, by the placement rules)."""
    dims = dict(seeds)
    for n in g.nodes:
        if n.op == "call_function" and n not in dims and \
                any(a in dims for a in n.all_input_nodes):
            try:
                dims[n] = carried_dim(n, dims, batch)
            except Refusal:
                continue
    return dims


# -- the pass ------------------------------------------------------------------------------

class LiftPositions(DCPPass):
    """An ordinary model's paged step (after insert_paged_cache; the ordinary frontend
    builds this pass): its positional values rewritten over the ``positions`` input, read
    through the ``clamp_min(positions, 0)`` the cache insertion made (padding, position -1,
    reads position 0; the attention op zeroes its output). ``token_input``: the token ids
    input (batch dim 0). The tables a prompt step sliced by its length go to the facts
    (``ModelFacts.position_tables``) for the one-token step after it."""

    name = "lift_positions"
    required = frozenset({Property.PAGED_CACHE})
    ensured = frozenset({Property.POSITIONS_LIFTED})

    def __init__(self, ctx, token_input: str):
        super().__init__(ctx)
        self.token_input = token_input

    def call(self, gm):
        ids = placeholder(gm, self.token_input)
        positions = placeholder(gm, POSITIONS)
        clamped = [u for u in positions.users if is_call(u, {aten.clamp_min.default})
                   and u.args[1:] == (0,)]
        if len(clamped) != 1:
            raise DCPTransformError(
                f"lift_positions reads the positions through one clamp_min(positions, 0): "
                f"the graph has {len(clamped)} ({[n.name for n in clamped]}). Run "
                f"insert_paged_cache before lift_positions (dcp_compile.passes.pipeline).")
        tokens = val(positions).shape[1]
        roots = [ids, positions] + [n for n in gm.graph.nodes if n.op == "placeholder"
                                    and (n.name == BLOCK_TABLE or is_cache_input(n.name))]
        data = _depends_on(gm, roots)
        known = set(self.ctx.facts.position_tables or ())
        lifted = lift_positions(gm, clamped[0], tokens, data, {ids: 0}, known)
        self.record(sources=lifted["sources"], positional_values=lifted["values"],
                    position_tables=len(lifted["tables"]))
        # The tables the prompt step sliced by its length (a one-token step cannot tell).
        tables = tuple(lifted["tables"]) if tokens > 1 else None
        return Found(gm, bool(lifted["sources"] or lifted["tables"]),
                     facts=ModelFacts(position_tables=tables))


def _depends_on(gm: GraphModule, roots: list[Node]) -> set[Node]:
    out = set(roots)
    for n in gm.graph.nodes:
        if any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


# -- the rewrite ---------------------------------------------------------------------------

def lift_positions(gm: GraphModule, positions: Node, tokens: int, data: set[Node],
                   seeds: dict[Node, int], known_tables: set) -> dict:
    """Rewrite every positional value of ``gm`` over ``positions`` [B, S] (module doc).
    ``data``: nodes computed from the step's token data (or positions input); ``seeds``:
    batch dim of the data inputs. Returns facts: ``sources`` found, ``tables`` sliced by
    length (for the next step), ``values`` lifted."""
    g = gm.graph
    batch = val(positions).shape[0]
    slices = _length_slices(g, tokens, data, known_tables)
    mode = detect_fake_mode([val(positions)])
    for n, _ in slices:                   # table[:S] is table[arange(S)]: the same value
        with g.inserting_before(n):
            ar = g.call_function(aten.arange.default, (tokens,),
                                 {"device": val(n).device, "dtype": torch.int64})
            sel = g.call_function(aten.index_select.default, (n.args[0], n.args[1], ar))
        with mode:
            ar.meta.update(val=torch.arange(tokens, device=val(n).device), **_src(n))
        sel.meta.update(val=val(n), **_src(n))
        n.replace_all_uses_with(sel)
        g.erase_node(n)
    sources = [n for n in g.nodes if is_seq_arange(n, tokens)]
    facts = {"sources": len(sources), "tables": sorted({k for _, k in slices if k}),
             "values": 0}
    if not sources:
        return facts
    positional = _positional(g, sources, data)
    pos_dims = _check_token_wise(positional, sources, tokens) if tokens > 1 else {}
    frontier = [n for n in g.nodes if n not in positional and
                any(a in positional for a in n.all_input_nodes)]
    outputs = [v for v in positional if any(u in frontier for u in v.users)]
    if not outputs:
        return facts
    lifted = _vmap_inline(g, positional, sources, outputs, positions, frontier[0])
    if pos_dims:     # tokens meet tokens: a value indexed by position lines up with the data's
        tdims = batch_dims(g, {**{s: 1 for s in seeds}, positions: 1}, tokens)
        for n in frontier:
            _check_aligned(n, positional, pos_dims, tdims.get(n))
    bdims = batch_dims(g, {**seeds, positions: 0}, batch)
    for n in frontier:
        _meet_batch(g, n, positional, lifted, bdims)
    for n in reversed(list(positional)):      # the originals, over 0..S-1, are dead now
        if not n.users:
            g.erase_node(n)
    facts["values"] = len(outputs)
    return facts


def _src(n: Node) -> dict:
    return {k: n.meta[k] for k in ("stack_trace", "nn_module_stack") if k in n.meta}


def _positional(g: Graph, sources: list[Node], data: set[Node]) -> dict[Node, None]:
    """Nodes computed from a source and constants only, in graph order."""
    out = dict.fromkeys(sources)
    for n in g.nodes:
        if n.op == "call_function" and n not in data and \
                any(a in out for a in n.all_input_nodes):
            out[n] = None
    return out


def _check_token_wise(positional, sources, tokens: int) -> dict:
    """Each positional value's token (position) dim; refuses one that mixes tokens."""
    dims = {s: 0 for s in sources}
    for n in positional:
        if n in dims:
            continue
        try:
            dims[n] = carried_dim(n, dims, tokens)
        except Refusal as e:
            raise DCPLengthDependentError(
                f"a value computed from the positions mixes tokens ({e}): a function of the "
                f"sequence length or of max(positions) (LongRoPE, dynamic NTK): node "
                f"{n.name} ({n.target}) at {source_of(n)}. Compute position-dependent "
                f"values token by token (RoPE angles, table rows); a reduction or scan over "
                f"the positions cannot be served one decode step at a time (through "
                f"dcp_compile.hf.prepare(max_model_len=...), a LongRoPE switch proven "
                f"constant below max_model_len is folded)") from None
    return dims


def _expanded_over(v: Node, k: int) -> bool:
    """``v`` is ``expand`` of a value of the same rank with size 1 at dim ``k``."""
    if not is_call(v, {aten.expand.default}):
        return False
    inner = val(v.args[0]).shape
    return len(inner) == val(v).dim() and inner[k] == 1


def _check_aligned(n: Node, positional, pos_dims: dict, t_out) -> None:
    """A positional operand's position dim must meet the data's token dim (a constant
    sliced ``[0, S)`` on a feature dim that happens to equal S is not a table of positions)."""
    if not isinstance(t_out, int):
        return
    for v in [a for a in n.all_input_nodes if a in positional]:
        k = aligned_dim(n, v, t_out)
        if k != pos_dims.get(v):
            _fail(n, f"the position-dependent value {v.name} has its positions on dim "
                  f"{pos_dims.get(v)} but meets the tokens of {n.name} (dim {t_out}) on "
                  f"its dim {k}", "Index tables by position along the dim that lines up with "
                  "the tokens, or pass position_ids to forward")


def _vmap_inline(g: Graph, positional, sources, outputs, positions, before: Node) -> dict:
    """Trace the positional subgraph as a function of one positions row under ``vmap`` and
    inline the batched ATen graph before ``before``; returns {original output: lifted}."""
    consts = [a for n in positional for a in n.all_input_nodes
              if a not in positional]
    consts = list(dict.fromkeys(consts))
    order = {n: i for i, n in enumerate(g.nodes)}
    late = [c for c in consts if order[c] > order[before]]
    if late:
        _fail(late[0], f"a position-dependent value reads {late[0].name}, computed after "
              f"the positions first meet the tokens at {before.name}", "Compute positional "
              "tables before the first layer uses them")

    def row_function(pos_row, *const_values):
        env = dict(zip(consts, const_values))
        for s in sources:
            env[s] = pos_row.to(val(s).dtype)
        for n in positional:
            if n in env:
                continue
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = n.target(*args, **kwargs)
        return tuple(env[o] for o in outputs)

    mode = detect_fake_mode([val(positions)])
    batched = torch.func.vmap(row_function, in_dims=(0,) + (None,) * len(consts))
    try:
        with mode:
            traced = make_fx(batched)(val(positions), *[val(c) for c in consts])
    except Exception as e:   # an op torch cannot batch: name the first positional op
        _fail(sources[0], f"the values computed from these positions cannot be batched "
              f"over the step's positions ({type(e).__name__}: {str(e).splitlines()[0]})",
              "Compute positional values with elementwise ops, views and table lookups")
    env = {}
    inputs = [positions, *consts]
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for p, a in zip(placeholders, inputs):
        env[p] = a
    lifted = {}
    with g.inserting_before(before):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                for o, new in zip(outputs, n.args[0]):
                    lifted[o] = env[new]
                continue
            if n.op != "call_function":
                _fail(sources[0], f"lifting the positions produced a {n.op} node",
                      "Report this model")
            new = g.node_copy(n, env.__getitem__)
            new.meta.update(_src(sources[0]))
            env[n] = new
    return lifted


def _meet_batch(g: Graph, n: Node, positional, lifted, bdims: dict) -> None:
    """Give each positional operand of ``n`` its batch dim where ``n``'s output has it."""
    rule = rule_for(n.target)
    broadcasting = rule is not None and (rule is POINTWISE or rule.aligned is not None)
    b_out = bdims.get(n)
    for v in [a for a in n.all_input_nodes if a in positional]:
        if not broadcasting:
            _fail(n, f"the position-dependent value {v.name} meets the tokens' data through "
                  f"{n.target}, which has no broadcasting rule (only elementwise ops and "
                  f"matmuls add the batch dim to positions)", "Combine positional values "
                  "with the hidden states by elementwise ops (RoPE, added embeddings)")
        if not isinstance(b_out, int):
            _fail(n, f"the batch dim of {n.name} cannot be followed from input_ids through "
                  f"the placement rules, so the positions of {v.name} have nowhere to go",
                  "Report this model")
        shape = list(val(v).shape)
        k = aligned_dim(n, v, b_out)
        with g.inserting_before(n):
            new = lifted[v]
            if k is None:       # v is broadcast over the batch: leading size-1 dims
                pad = val(n).dim() - b_out - 1 - len(shape)
                new = g.call_function(aten.view.default, (new, [-1] + [1] * pad + shape))
            elif shape[k] != 1 and not _expanded_over(v, k):
                _fail(n, f"the position-dependent value {v.name} of shape {tuple(shape)} "
                      f"has {shape[k]} entries where {n.name} has its batch dim",
                      "Broadcast positional values over the batch (size 1), as "
                      "arange(S)[None] does")
            else:
                # Size 1 there, or expanded to the batch from size 1 (Llama 4's NoPE
                # temperature: view(1, S, 1, 1).expand(B, S, 1, 1)): every entry is the same.
                new = g.call_function(aten.squeeze.dim, (new, k + 1)) if shape[k] == 1 else \
                    g.call_function(aten.select.int, (new, k + 1, 0))
                if k:
                    perm = list(range(1, k + 1)) + [0] + list(range(k + 1, len(shape)))
                    new = g.call_function(aten.permute.default, (new, perm))
        new.meta.update(_src(n))
        n.replace_input_with(v, new)
