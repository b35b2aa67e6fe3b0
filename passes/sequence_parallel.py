"""Sequence parallelism between layers (spec: "DCP Prefill", Compute Pattern steps 1 and 9).

Prefill only. After :mod:`dcp_compile.passes.shard_tensor_parallel`, every full-TP reduction is an
all-reduce over ``world`` (embedding, MLP down projection) and the O projection's is an
all-reduce over ``dcp_tp``. This pass makes the residual stream between them
sequence-parallel: each rank holds ``S_pad / TP`` tokens of every sequence.

Packing (one layout for the whole prefill program). Tensors between layers are
``[B, S, H]``: batch row b is one sequence's chunk, left-packed (positions
``start, start + 1, ...``, then -1), exactly as the engine builds a step. Sequence
parallelism splits the token dim of *each sequence*: rank r holds tokens
``[r * S_pad/TP, (r + 1) * S_pad/TP)`` of every row, where ``S_pad`` is ``S`` rounded up to a
multiple of TP (the graph pads with zero rows before a reduce-scatter and drops them after
an all-gather; pad rows never reach attention or the logits). Sequences of different
lengths in one chunk are rows with different numbers of -1 positions.

Rewrite:
  * all-reduce(world) of a partial sum [B, S, H]
        -> pad to S_pad, reduce-scatter(world) along tokens -> [B, S_pad/TP, H]
  * all-reduce(dcp_tp) after the O projection
        -> kept, then this rank's SP slice (index_select of its S_pad/TP tokens: local, no
           communication). :class:`dcp_compile.passes.dcp_prefill.DCPPrefill` turns the pair into the
           spec's step 9 reduce-scatter over dcp_tp.
  * the sequence-parallel region — every node reached from those results through token-wise
    ops (residual adds, RMSNorm: pointwise ops and reductions over the hidden dim) — keeps
    its ops; only its token count changes.
  * where the region meets a projection that needs the whole sequence (q/k/v — spec step 1,
    the MLP's column projections, the LM head): all-gather(world) along tokens -> [B, S_pad,
    H], drop the pad rows -> [B, S, H]. One gather per distinct input (q, k and v share one).

Analysis (``plan``) is separate from the rewrite; a node in the region that is not
token-wise (a view with an explicit token count, a reduction over tokens, a token-indexed
side input) is an error naming the node, never a silently wrong graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.names import (Mode, Role, META_NORM_REDUCE, META_SCOPE, RANK_INPUT, ROLE_META, SCOPE_MODEL,
                           SP_GATHER, SP_META, SP_SLICE, SPEC_STEP)

from . import collectives as C
from .infra import (KIND_COLLECTIVE, KIND_SLICE, DCPPass, Property, attention_nodes, placeholder,
                    source_of, val)
from .op_classes import LITERAL_SHAPES
from .placement import Refusal, carried_dim, linears_ahead, token_dim
from .shard_tensor_parallel import _is_linear

aten = torch.ops.aten
F = torch.ops._c10d_functional



def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ------------------------------------------------------------------------------------------
# Token-dim (dim 1) collectives and padding; shapes are passed in (new nodes have no meta).
# ------------------------------------------------------------------------------------------


def all_gather_tokens(g: Graph, x: Node, role: str, size: int, shape) -> tuple[Node, Node]:
    """[B, s, *rest] on each of ``size`` ranks -> [B, size * s, *rest] in rank order."""
    b, s, *rest = shape
    c, w = C.all_gather(g, x, role, size)                               # [size*B, s, ...]
    v = g.call_function(aten.view.default, (w, [size, b, s, *rest]))
    p = g.call_function(aten.permute.default, (v, [1, 0] + list(range(2, 3 + len(rest)))))
    return c, g.call_function(aten.reshape.default, (p, [b, size * s, *rest]))


def reduce_scatter_tokens(g: Graph, x: Node, role: str, size: int, shape
                          ) -> tuple[Node, Node]:
    """Sum [B, S, *rest] over the role; keep this rank's contiguous S/size tokens."""
    b, s, *rest = shape
    v = g.call_function(aten.view.default, (x, [b, size, s // size, *rest]))
    p = g.call_function(aten.permute.default, (v, [1, 0] + list(range(2, 3 + len(rest)))))
    r = g.call_function(aten.reshape.default, (p, [size * b, s // size, *rest]))
    return C.reduce_scatter(g, r, role, size)                            # [B, S/size, ...]


def pad_tokens(g: Graph, x: Node, ndim: int, tokens: int, padded: int) -> Node:
    """Append zero rows along dim 1 (no node when nothing to pad)."""
    if padded == tokens:
        return x
    return g.call_function(aten.constant_pad_nd.default,
                           (x, [0, 0] * (ndim - 2) + [0, padded - tokens], 0.0))


def unpad_tokens(g: Graph, x: Node, tokens: int, padded: int) -> Node:
    if padded == tokens:
        return x
    return g.call_function(aten.slice.Tensor, (x, 1, 0, tokens))


def _sp_role(lin: Node) -> str:
    """qkv | mlp | lm_head, from the role the placement analysis gave the linear."""
    role = lin.meta.get(ROLE_META)
    if role is None:
        raise DCPTransformError(f"linear {lin.name} ({source_of(lin)}) has no tensor-parallel "
                                f"role; run shard_tensor_parallel before sequence_parallel.")
    if role in ("lm_head",):
        return "lm_head"
    if role.startswith("mlp"):
        return "mlp"
    return "qkv"     # q/k/v (fused or not) and other attention column projections


def _in_the_stream(lin: Node) -> bool:
    """A linear run whole on every rank whose output is the residual stream (OPT's
    project_in / project_out: an MLP or the LM head reads it), not a low-rank path into q/k/v
    (MLA's q_a_proj, gathered like the projections it feeds)."""
    if lin.meta.get(ROLE_META) != "replicated":
        return False
    return any(_sp_role(x) != "qkv" for x in linears_ahead(lin))


def layer_of(gm: GraphModule) -> dict[Node, int]:
    """Each node -> index of the last attention node at or before it (-1 before the first)."""
    out, layer = {}, -1
    attn = set(attention_nodes(gm))
    for n in gm.graph.nodes:
        if n in attn:
            layer += 1
        out[n] = layer
    return out


# ------------------------------------------------------------------------------------------
# Analysis
# ------------------------------------------------------------------------------------------


def _experts_inputs(gm) -> set[Node]:
    """Every node a dcp.moe's tokens or routing are computed from."""
    seen: set[Node] = set()
    stack = [a for n in gm.graph.nodes if n.target == torch.ops.dcp.moe.default
             for a in n.args[:3]]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _flattens_tokens(u: Node, plan) -> bool:
    """A view [B, S, *rest] -> [B*S, *rest]."""
    if u.target not in LITERAL_SHAPES:
        return False
    x, out = val(u.args[0]), val(u)
    return tuple(x.shape[:2]) == (plan.batch, plan.tokens) and \
        tuple(out.shape) == (plan.batch * plan.tokens, *x.shape[2:])


def _keeps_rows(u: Node) -> bool:
    """An expand that keeps the batch and token sizes (``-1`` there, no new leading dim:
    HY-V4's ``embeds.unsqueeze(2).expand(-1, -1, hc_mult, -1)``) names no token count: it
    is the same op on S/TP tokens."""
    size = u.args[1] if len(u.args) > 1 else None
    return u.target == aten.expand.default and isinstance(size, (list, tuple)) and \
        len(size) == val(u.args[0]).ndim and tuple(size[:2]) == (-1, -1)


@dataclass
class Reduction:
    all_reduce: Node
    wait: Node
    role: str


@dataclass
class SPPlan:
    batch: int
    tokens: int                       # S: the static chunk length
    padded: int                       # S_pad: S rounded up to a multiple of TP
    reductions: list[Reduction]
    region: list[Node] = field(default_factory=list)
    # region node -> the projections (linears) reading it, which need the whole sequence
    frontier: dict[Node, list[Node]] = field(default_factory=dict)
    roles: dict[Node, str] = field(default_factory=dict)   # frontier linear -> qkv|mlp|lm_head
    # per-token side input (positions' embedding, ...) -> its dim aligned with the tokens:
    # each rank reads its own S/TP rows of it (a local slice, like the stream's).
    side_inputs: dict[Node, int] = field(default_factory=dict)


class SequenceParallel(DCPPass):
    """Prefill: residual stream S/TP per rank; all-gather before projections, reduce-scatter
    after them (Megatron-style sequence parallelism on the spec's world group)."""

    name = "sequence_parallel"
    required = frozenset({Property.TP_SHARDED})
    ensured = frozenset({Property.SEQUENCE_PARALLEL})

    def requires(self, gm):
        if self.ctx.config.mode != Mode.PREFILL:
            raise DCPTransformError(f"sequence parallelism is the prefill layout: mode="
                                    f"{self.ctx.config.mode!r}. Run it for mode={Mode.PREFILL!r}.")
        if not attention_nodes(gm):
            raise DCPTransformError("sequence_parallel needs the canonical dcp.attention "
                                    "nodes (run canonicalize_attention first).")

    def plan(self, gm: GraphModule) -> SPPlan:
        cfg = self.ctx.config
        attn = attention_nodes(gm)
        b, s = val(attn[0].args[5]).shape
        reductions = []
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.target != F.all_reduce.default \
                    or n.meta.get(META_NORM_REDUCE):   # a norm over heads: not TP's sum
                continue
            role = C.role_of(n)
            waits = [u for u in n.users if u.target == F.wait_tensor.default]
            if role not in (Role.WORLD, Role.DCP_TP) or len(waits) != 1 or len(n.users) != 1:
                raise DCPTransformError(
                    f"all-reduce {n.name} on role {role!r} is not one of tensor parallelism's "
                    f"reductions (world after embedding/MLP, dcp_tp after the O projection); "
                    f"sequence parallelism cannot place it. Run shard_tensor_parallel first.")
            shape = tuple(val(n.args[0]).shape)
            if shape[:2] != (b, s):
                raise DCPTransformError(
                    f"all-reduce {n.name} reduces a tensor of shape {shape}, not [batch={b}, "
                    f"tokens={s}, ...]: sequence parallelism splits dim 1 of [B, S, H]. The "
                    f"sum it reduces is computed over tokens flattened to [B*S, H] at "
                    f"{source_of(n.args[0])}; reshape the tokens back to [B, S, H] before "
                    f"that sum leaves the block (prefill), or use mode='decode'.")
            reductions.append(Reduction(n, waits[0], role))
        if not any(r.role == Role.WORLD for r in reductions):
            raise DCPTransformError("no all-reduce over 'world' found: sequence parallelism "
                                    "needs the full-TP reductions of shard_tensor_parallel.")
        plan = SPPlan(b, s, round_up(s, cfg.tp), reductions)
        self._find_region(gm, plan, attn)
        return plan

    def _find_region(self, gm, plan: SPPlan, attn: list[Node]) -> None:
        starts = [r.wait for r in plan.reductions]
        seen, order, stack = set(starts), [], list(starts)
        experts_inputs = _experts_inputs(gm)
        while stack:
            n = stack.pop()
            for u in n.users:
                if u in seen:
                    continue
                if u in experts_inputs and _flattens_tokens(u, plan):
                    # A MoE block flattens [B, S, H] to [B*S, H] for its router and experts
                    # (dcp.moe): they need the whole sequence, like a projection.
                    plan.frontier.setdefault(n, [])
                    if u not in plan.frontier[n]:
                        plan.frontier[n].append(u)
                    plan.roles[u] = "moe"
                    continue
                if _is_linear(u) and u.args[0] is n and _in_the_stream(u):
                    pass    # whole on every rank (OPT's project_in): token-wise, in the region
                elif _is_linear(u):
                    if u.args[0] is not n:
                        raise DCPTransformError(
                            f"linear {u.name} ({source_of(u)}) reads the sequence-parallel "
                            f"tensor {n.name} as a weight or bias; only activations can be "
                            f"gathered.")
                    plan.frontier.setdefault(n, [])
                    if u not in plan.frontier[n]:
                        plan.frontier[n].append(u)
                    plan.roles[u] = _sp_role(u)
                    continue
                if u.op == "output":
                    raise DCPTransformError(
                        f"the sequence-parallel tensor {n.name} reaches the graph output "
                        f"directly: the output must come from a projection (the LM head).")
                seen.add(u)
                order.append(u)
                stack.append(u)
        for u in order:   # once the whole region is known: side inputs are those outside it
            self._check_tokenwise(u, seen, plan)
        plan.region = order

    @staticmethod
    def _drop_identity_views(gm: GraphModule) -> None:
        """A view that names its input's own shape (GPT-BigCode's
        ``hidden_states.view(output_shape)`` after the final norm) is no op at all; on the
        sequence-parallel stream its literal token count would be wrong, so it goes."""
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and n.target in LITERAL_SHAPES and \
                    isinstance(n.args[0], Node) and \
                    tuple(val(n).shape) == tuple(val(n.args[0]).shape):
                n.replace_all_uses_with(n.args[0])
                gm.graph.erase_node(n)

    def _check_tokenwise(self, u: Node, region: set[Node], plan: SPPlan) -> None:
        where = f"node {u.name} ({source_of(u)})"
        if u.op != "call_function":
            raise DCPTransformError(f"{where} consumes the sequence-parallel residual stream "
                                    f"but is not a function call.")
        out = val(u)
        # A split of the stream along another dim (HY-V4's hyper-connection mixes: pre /
        # post weights per token) gives a tuple: each piece must still be [B, S, ...].
        pieces = list(out) if isinstance(out, (tuple, list)) and out else [out]
        bad = next((o for o in pieces if not isinstance(o, torch.Tensor) or o.ndim < 3
                    or o.shape[1] != plan.tokens), None)
        if bad is not None:
            raise DCPTransformError(
                f"{where} turns the residual stream into shape "
                f"{tuple(getattr(bad, 'shape', ()))}; sequence parallelism needs [B, S={plan.tokens},"
                f" ...] tensors between layers (it cuts the tokens of dim 1; a stack of "
                f"residual streams, Gemma 3n's AltUp [streams, B, S, H], has them elsewhere). "
                f"Use a decode-mode program for this model.")
        out = pieces[0]
        target = u.target
        if target in LITERAL_SHAPES and not _keeps_rows(u):
            raise DCPTransformError(
                f"{where} ({target}) names the residual stream's shape literally; with "
                f"sequence parallelism each rank holds S/TP tokens of it. Keep views inside "
                f"attention and the MLP.")
        # Token-wise by the placement rules (dcp_compile.passes.placement): tokens in, tokens out at dim 1.
        try:
            marked = {a: 1 for a in u.all_input_nodes if a in region}
            d = carried_dim(u, marked, plan.tokens) if _is_linear(u) else \
                token_dim(u, marked, plan.tokens)     # a replicated linear: by hand
        except Refusal as e:
            d, why = None, str(e)
        if d != 1 or out.shape[0] != plan.batch:
            raise DCPTransformError(
                f"{where} ({target}) is not token-wise"
                f"{': ' + why if d is None else f' (tokens move to dim {d})'}: the residual "
                f"stream between layers may only pass ops that keep each token apart when it "
                f"is sequence-parallel. Move this op inside a projection, or add its rule to "
                f"dcp_compile.passes.placement.RULES.")
        for a in [u.args[0]] if _is_linear(u) else u.all_input_nodes:   # not its weights
            if a in region:
                continue
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor):
                continue
            aligned = 1 - (out.ndim - v.ndim)   # a's dim that broadcasts against tokens
            if aligned >= 0 and v.shape[aligned] == plan.tokens and \
                    (aligned == 0 or v.shape[aligned - 1] in (1, plan.batch)):
                plan.side_inputs[a] = aligned     # row t is token t's: slice it like the stream
            elif aligned >= 0 and v.shape[aligned] != 1:
                raise DCPTransformError(
                    f"{where} combines the sequence-parallel residual stream with {a.name} of "
                    f"shape {tuple(v.shape)}, which is indexed by token: every rank holds "
                    f"only its S/TP tokens of the stream.")

    # ------------------------------------------------------------------------------------
    # Rewrite
    # ------------------------------------------------------------------------------------

    def call(self, gm):
        cfg, g = self.ctx.config, gm.graph
        self._drop_identity_views(gm)
        plan = self.plan(gm)
        b, s, sp = plan.batch, plan.tokens, plan.padded
        per = sp // cfg.tp
        layers = layer_of(gm)
        rank = placeholder(gm, RANK_INPUT)
        first = next(n for n in g.nodes if n.op != "placeholder")
        # The index lives where the residual stream does (the model's device: it indexes
        # that stream), not on the default device; the rank is a 0-d tensor, usable anywhere.
        device = val(plan.reductions[0].all_reduce.args[0]).device
        with g.inserting_before(first):
            start = g.call_function(aten.mul.Tensor, (rank, per))
            sp_index = g.call_function(aten.add.Tensor, (
                g.call_function(aten.arange.default, (per,),
                                {"dtype": torch.int64, "device": device}), start))
        sp_index._rename("sp_index")
        self.tag(sp_index, KIND_SLICE)

        replaced = {}   # a reduction's wait -> what its users read now
        for red in plan.reductions:
            x = red.all_reduce.args[0]
            shape = tuple(val(x).shape)
            layer = layers[red.all_reduce]
            if red.role == Role.WORLD:
                with g.inserting_before(red.all_reduce):
                    padded = pad_tokens(g, x, len(shape), s, sp)
                    c, w = reduce_scatter_tokens(g, padded, Role.WORLD, cfg.tp,
                                                 (b, sp) + shape[2:])
                self.tag(c, KIND_COLLECTIVE, layer if layer >= 0 else None)
                if layer < 0:  # the embedding's: once per model, not per layer
                    c.meta[META_SCOPE] = SCOPE_MODEL
                red.wait.replace_all_uses_with(w)
                replaced[red.wait] = w
                g.erase_node(red.wait)
                g.erase_node(red.all_reduce)
            else:  # dcp_tp after the O projection: this rank's tokens, until DCPPrefill
                with g.inserting_before(red.wait.next):
                    padded = pad_tokens(g, red.wait, len(shape), s, sp)
                    sliced = g.call_function(aten.index_select.default, (padded, 1, sp_index))
                sliced.meta[SP_SLICE] = True
                self.tag(sliced, KIND_SLICE, layer)
                red.wait.replace_all_uses_with(
                    sliced, delete_user_cb=lambda u: u is not padded and u is not sliced)
                replaced[red.wait] = sliced

        region = set(plan.region)
        sliced_norms = [n for n in plan.region if n.target == F.all_reduce.default
                        and n.meta.get(META_NORM_REDUCE)]
        if sliced_norms:     # its ranks would hold different tokens: the sum would mix them
            n = sliced_norms[0]
            raise DCPTransformError(
                f"a norm's statistic over features cut over the ranks ({n.name}, "
                f"{source_of(n)}) is computed from the sequence-parallel residual stream, "
                f"where each rank holds other tokens: its all-reduce would mix them. Compute "
                f"the norm over features of a projection's output.")
        for a, dim in plan.side_inputs.items():
            nd = val(a).ndim
            with g.inserting_after(a):
                padded = a if sp == s else g.call_function(
                    aten.constant_pad_nd.default, (a, [0, 0] * (nd - 1 - dim) + [0, sp - s], 0.0))
                with g.inserting_after(padded):
                    sliced = g.call_function(aten.index_select.default, (padded, dim, sp_index))
            self.tag(sliced, KIND_SLICE)
            a.replace_all_uses_with(sliced, delete_user_cb=lambda u: u in region)

        counts = {"qkv": 0, "mlp": 0, "lm_head": 0, "moe": 0}
        for node, linears in plan.frontier.items():
            shape = tuple(val(node).shape)
            node = replaced.get(node, node)   # a projection reading a reduction directly
            with g.inserting_before(node.next):
                c, full = all_gather_tokens(g, node, Role.WORLD, cfg.tp,
                                            (b, per) + shape[2:])
                full = unpad_tokens(g, full, s, sp)
            roles = {plan.roles[lin] for lin in linears}
            layer = min(layers[lin] + (1 if "qkv" in roles else 0) for lin in linears)
            self.tag(c, KIND_COLLECTIVE, layer if "lm_head" not in roles else None)
            if "lm_head" in roles:
                c.meta[META_SCOPE] = SCOPE_MODEL
            full.meta[SP_GATHER] = True
            if "qkv" in roles:
                c.meta[SPEC_STEP] = 1
            for lin in linears:
                lin.args = (full,) + tuple(lin.args[1:])
                if plan.roles[lin] == "moe" and lin.target == aten.view.default:
                    lin.target = aten.reshape.default    # the gathered tokens are strided
            for r in roles:
                counts[r] += 1
        gm.meta[SP_META] = {"tokens": s, "padded": sp, "tokens_per_rank": per, "batch": b}
        self.record(tokens=s, padded_tokens=sp, tokens_per_rank=per,
                    region_nodes=len(plan.region),
                    reduce_scatters=sum(r.role == Role.WORLD for r in plan.reductions),
                    token_side_inputs=len(plan.side_inputs),
                    gathers=counts)
        return PassResult(gm, True)

    def ensures(self, gm):
        # A norm's statistic over features cut over world (Gemma 4's per-layer input norm)
        # stays an all-reduce: its tensor holds the whole sequence on every rank (a column
        # projection's output, or a feature-parallel table's rows), not SP's token slice.
        for n in gm.graph.nodes:
            if C.role_of(n) == Role.WORLD and n.target == F.all_reduce.default \
                    and not n.meta.get(META_NORM_REDUCE):
                raise DCPTransformError(f"all-reduce {n.name} over world survived sequence "
                                        f"parallelism.")


__all__ = ["SequenceParallel", "SPPlan", "all_gather_tokens", "reduce_scatter_tokens",
           "pad_tokens", "unpad_tokens", "round_up", "layer_of"]
