"""The prefill DCP rewrite (spec: "DCP Prefill" Compute Pattern, "Model Runner", "Segmented
Attention CP", "cp_rank: Prefill vs Decode").

Requires the sequence-parallel residual stream of :mod:`dcp_compile.passes.sequence_parallel` (run first
as this pass's own first stage when the pass list does not name it). Each layer's attention,
from the step-1 all-gather that SequenceParallel placed before q/k/v, becomes:

  2. h_own   = gather(h, interleave_slice_index)          S -> C tokens this cp_rank owns
  3. q, k, v = projections of h_own (weights sharded over dcp_tp_group, by ShardTensorParallel;
               a low-rank chain, MLA's replicated q_a_proj -> RMSNorm -> q_b_proj, is
               sliced before its first linear and runs on the owned tokens throughout)
  4. caches  = dcp.cache_write(k, v, slot_mapping gathered with the same index)
  5. q_all   = all_gather(q) over cp_kv                    [B, C] -> [B, W*C] (rank-major)
  6. q       = gather(q_all, q_unshuffle_index)            chunk (global) order, [B, S]
  7. out,lse = dcp.partial_attention(q, local prior slots [0, local_filled(start, cp_rank))
               + current own k/v, causal on global positions); lse all_gather over cp_kv;
               dcp.lse_correct (weight exp(local_lse - global_lse))
  8. out     = reduce_scatter over cp_kv along tokens      S_pad -> S_pad/W (contiguous)
  9. O projection on S_pad/W tokens, reduce_scatter over dcp_tp (replacing TP's all-reduce
               and SequenceParallel's slice)             S_pad/W -> S_pad/TP

``cp_rank = tp_rank // (TP/DCP)`` is arithmetic on the rank input; nothing branches on it.

Unaligned prior and padding. A chunk row starts at any position ``start`` (its prior
length), not only at multiples of ``W*I``, and may be shorter than the static ``S``. The spec's
``view(S // (W*I), W, I)[:, R, :]`` keeps R's tokens only for aligned starts and full chunks;
this pass instead keeps, for every start, exactly the positions rank R owns, using the
proven slot maps (``dcp.interleave_slice_index``: R's j-th owned token is the one in local
slot ``local_filled(start, R) + j``, at ``global_position`` of that slot). Their number
varies with start and R, so each rank keeps a static ``C = owned_capacity(S)`` slots per
row (``(S // (W*I)) * I + min(S % (W*I), I)``; exactly S/W when W*I divides S) and pads the
rest with position -1: pad slots write to the garbage block (slot -1), are masked out of
attention (k_pos = -1) and are never selected by the unshuffle. Pad tokens of the chunk
(position -1) are queries that attend to nothing, so they never reach a real token. The
first chunk is ``start = 0``: ``local_filled(0, R) = 0`` masks every prior slot — the same
graph, no branch.

The token dim is followed along the q/k/v paths (``trace_token_dim``: through views that
keep it, transposes and permutes — Hugging Face's [B, H, S, D] around RoPE — and per-head
norms), so views there get C in place of S (and S_pad/W on the O path), and token-indexed side
inputs (RoPE's cos/sin, computed from the full positions) are gathered with the same index,
once for all layers. On the O path, a per-token side input (x-transformers' gate_values: a
sigmoid gate of the hidden state times the attention output) is read at the tokens the
output holds after step 8, this rank's contiguous S_pad/W. An op on those paths that touches
the token dim is an error naming the node.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.kernels.ops import owned_capacity
from dcp_compile.runtime.names import (Mode, Role, StepKind, META_LAYER, META_NORM_REDUCE, PROJECTIONS_META, ROLE_META,
                           SP_GATHER, SP_META, SP_SLICE, SPEC_STEP)

from . import collectives as C
from .dcp_decode import (attention_kwargs, correct_sinks, cp_rank_node, dsa_keep,
                         garbage_kwargs, pop_index, replace_attention)
from .op_classes import SHAPED_VIEWS
from .placement import Refusal, aligned_dim, token_dim
from .prefill_recompute import copy_chain, recompute_chain, retoken_views
from .infra import (KIND_ATTENTION, KIND_CACHE_WRITE, KIND_COLLECTIVE, KIND_LSE, KIND_MASK,
                    KIND_SLICE, DCPPass, Property, attention_nodes, getitem_users, source_of,
                    val)
from .sequence_parallel import pad_tokens, reduce_scatter_tokens
from .sparse_attention import full_chunk_indexer, index_k_linears
from .shard_tensor_parallel import _is_linear

aten = torch.ops.aten
dcp_ops = torch.ops.dcp
F = torch.ops._c10d_functional

# Ops that name sizes literally: on the q/k/v and O paths their token count is rewritten.


def _keeps_leading_dims(in_shape: list[int], d: int, shape: list[int], tokens: int) -> bool:
    """A view keeps the token dim (dim ``d`` of ``in_shape``) whole and the dims before it as
    they are, but for dims of size 1 (GPT-BigCode's multi-query ``unsqueeze(1)`` that a
    ``view(B, S, H, D)`` drops again)."""
    def lead(dims):
        return [x for x in dims if x != 1]
    return any(shape[j] == tokens and lead(shape[:j]) == lead(in_shape[:d])
               for j in range(len(shape)))


def trace_token_dim(path: list[Node], sources: dict[Node, int], tokens: int,
                    what: str) -> tuple[dict[Node, int], dict[Node, list[tuple[Node, int]]]]:
    """Follow the token dim (of size ``tokens``) through ``path`` (graph order), starting
    from ``sources`` (node -> its token dim). Returns (node -> token dim, token-indexed side
    input -> [(user, dim)]). Any op that touches the token dim is an error naming the node:
    slicing, gathering or re-viewing that dim cannot be moved across the interleave slice."""
    td = dict(sources)
    side: dict[Node, list[tuple[Node, int]]] = {}
    for n in path:
        where = f"node {n.name} ({source_of(n)}) on the {what} path"
        out = n.meta.get("val")
        ins = [a for a in n.all_input_nodes if a in td]
        if not ins:
            raise DCPTransformError(f"{where} has no input on the path.")
        src = ins[0]
        d = td[src]
        src_val = val(src)
        src_ndim = (src_val.ndim if isinstance(src_val, torch.Tensor)
                    else out.ndim if isinstance(out, torch.Tensor) else None)
        t = n.target
        if t in SHAPED_VIEWS:
            shape = list(n.args[1])
            in_shape = list(val(src).shape)
            if not _keeps_leading_dims(in_shape, d, shape, tokens):
                raise DCPTransformError(
                    f"{where} views {tuple(in_shape)} as {shape}: the token dim (dim {d}, "
                    f"size {tokens}) and the dims before it must stay as they are.")
        elif t == aten.unflatten.int and n.args[1] % src_ndim <= d:
            raise DCPTransformError(f"{where} unflattens a dim at or before the token dim.")
        if _is_linear(n):   # a chained projection: mixes the features (last dim) only
            if n.args[0] is not src or d == src_ndim - 1:
                raise DCPTransformError(f"{where} projects along the token dim {d}.")
            td[n] = d
            continue
        # Whether the op keeps tokens apart, and where they go: the placement rules
        # (dcp_compile.passes.placement), with the token dim as the sharded one.
        try:
            d = token_dim(n, {a: td[a] for a in ins}, tokens)
        except Refusal as e:
            raise DCPTransformError(f"{where} ({t}) does not keep tokens apart ({e}); the "
                                    f"interleave slice cannot be moved past it.") from None
        if d == 0 or (isinstance(out, torch.Tensor) and isinstance(src_val, torch.Tensor)
                      and src_val.ndim and out.shape[0] != src_val.shape[0]):
            raise DCPTransformError(f"{where} ({t}) moves or reduces the batch dim.")
        if isinstance(out, torch.Tensor):
            for a in n.all_input_nodes:
                v = a.meta.get("val")
                if a in td or not isinstance(v, torch.Tensor):
                    continue
                k = aligned_dim(n, a, d)
                if k is None or v.shape[k] == 1:
                    continue
                if v.shape[k] != tokens or k == 0 or v.shape[0] != out.shape[0]:
                    raise DCPTransformError(
                        f"{where} reads {a.name} of shape {tuple(v.shape)}, which is neither "
                        f"per-token [batch, ..., tokens at dim {k}, ...] nor broadcast over "
                        f"tokens.")
                side.setdefault(a, []).append((n, k))
        td[n] = d
    return td, side


def _reads_projections(side: Node, plan) -> bool:
    """Whether ``side`` is computed from the layer's q/k/v projections (or their path),
    which step 3 moves to the owned tokens; the walk stops at the layer's hidden state."""
    stops = {*plan.projections, *plan.chained, *plan.token_dim}
    stack, seen = [side], set()
    while stack:
        n = stack.pop()
        if n in seen or n is plan.hidden:
            continue
        seen.add(n)
        if n in stops:
            return True
        stack.extend(n.all_input_nodes)
    return False


@dataclass
class LayerPlan:
    layer: int
    attn: Node
    projections: tuple[Node, ...]             # q, k, v linears reading the hidden state
    #                                           (q only: the layer reads another's KV)
    hidden: Node                              # their common full-sequence input (step 1)
    qkv_path: list[Node]                      # projections -> attention q/k/v, graph order
    token_dim: dict[Node, int] = field(default_factory=dict)      # path node -> token dim
    side_inputs: dict[Node, list[tuple[Node, int]]] = field(default_factory=dict)
    o_path: list[Node] = field(default_factory=list)              # attention out -> o_proj
    o_token_dim: dict[Node, int] = field(default_factory=dict)
    o_side_inputs: dict[Node, list[tuple[Node, int]]] = field(default_factory=dict)
    o_proj: Node | None = None
    o_reduce: list[Node] = field(default_factory=list)   # all_reduce, wait, [pad], sp slice
    # Linears after the first one of a low-rank chain (MLA's q_b_proj after q_a_proj -> norm):
    # on the q/k/v path, they run on the owned tokens too.
    chained: list[Node] = field(default_factory=list)
    # O-path side inputs computed from the projections (an output gate in q_proj's rows):
    # side -> (the nodes from the hidden state to it, graph order; their token dims; those
    # reading the hidden state), computed again on the O path's tokens.
    o_recomputed: dict[Node, tuple[list[Node], dict[Node, int], set[Node]]] = field(
        default_factory=dict)


class DCPPrefill(DCPPass):
    """Rewrite every attention block into the spec's nine-step prefill DCP pattern."""

    name = "dcp_prefill"
    required = frozenset({Property.SEQUENCE_PARALLEL})
    ensured = frozenset({Property.DCP_REWRITTEN})

    def requires(self, gm):
        if self.ctx.config.mode != Mode.PREFILL:
            raise DCPTransformError(f"dcp_prefill rewrites prefill programs: mode="
                                    f"{self.ctx.config.mode!r}.")
        if not attention_nodes(gm):
            raise DCPTransformError("dcp_prefill found no dcp.attention node to rewrite.")
        if SP_META not in gm.meta:
            raise DCPTransformError(
                f"dcp_prefill needs sequence_parallel's token layout: the graph has no "
                f"gm.meta[{SP_META!r}]. Run sequence_parallel before dcp_prefill "
                f"(dcp_compile.passes.pipeline.PIPELINE[{StepKind.PREFILL!r}]).")

    # -- analysis --------------------------------------------------------------------------

    def plan(self, gm: GraphModule) -> list[LayerPlan]:
        sp = gm.meta[SP_META]
        s = sp["tokens"]
        plans = []
        by_name = {n.name: n for n in gm.graph.nodes}
        owned_caches = set()
        for layer, attn in enumerate(attention_nodes(gm)):
            sites = attn.meta.get(PROJECTIONS_META)
            if sites is None:
                raise DCPTransformError(f"attention {attn.name} has no projections recorded; "
                                        f"run shard_tensor_parallel before dcp_prefill.")
            # A layer reading another layer's cache (KV shared across layers) reads that
            # layer's K/V, already on the owned tokens: only its q moves (step 3).
            caches = tuple(attn.args[3:5])
            reads = "q" if caches in owned_caches else "qkv"
            owned_caches.add(caches)
            projs, chained = [], []
            # DSA: the indexer's K joins the latent (insert_paged_cache): its projection is
            # not the layer's k; the indexer runs on the full chunk (full_chunk_indexer).
            indexer = index_k_linears(attn)
            for i, what in enumerate(reads):
                lin = [by_name[x] for x in sites[what] if by_name[x] not in indexer]
                if len(lin) != 1:
                    raise DCPTransformError(
                        f"{what} of attention {attn.name} ({source_of(attn)}) comes from "
                        f"{len(lin)} projections; expected one linear each for q, k, v.")
                root, chain = _chain_root(lin.pop())
                projs.append(root)
                chained += [c for c in chain if c not in chained]
            hidden = {p.args[0] for p in projs}
            if len(hidden) != 1 or not next(iter(hidden)).meta.get(SP_GATHER):
                raise DCPTransformError(
                    f"q/k/v projections of attention {attn.name} ({source_of(attn)}) do not "
                    f"read one sequence-parallel all-gather: {sorted(h.name for h in hidden)}."
                    f" Run sequence_parallel before dcp_prefill.")
            plan = LayerPlan(layer, attn, tuple(projs), hidden.pop(),
                             self._path(projs, [attn.args[i] for i in range(len(reads))],
                                        chained),
                             chained=chained)
            plan.token_dim, plan.side_inputs = trace_token_dim(
                plan.qkv_path, {p: 1 for p in projs}, s, f"q/k/v (layer {layer})")
            for i, what in enumerate(reads):
                if plan.token_dim.get(attn.args[i], 1) != 1:
                    raise DCPTransformError(
                        f"{what} reaches attention {attn.name} with its tokens at dim "
                        f"{plan.token_dim[attn.args[i]]}; dcp.attention takes [B, S, H, D].")
            self._plan_output(plan, s, by_name.get(sites["o"]))
            plans.append(plan)
        return plans

    @staticmethod
    def _path(sources: list[Node], sinks: list[Node], through: list[Node] = ()) -> list[Node]:
        """Nodes on some path from ``sources`` to ``sinks`` (excluding sources), graph order;
        the only linears on it are those of ``through``."""
        down, stack = set(), list(sources)
        while stack:
            n = stack.pop()
            for u in n.users:
                if u not in down and u.op == "call_function" and (
                        not _is_linear(u) or u in through) \
                        and u.target != dcp_ops.attention.default:
                    down.add(u)
                    stack.append(u)
        up, stack = set(), [x for x in sinks if x in down]
        while stack:
            n = stack.pop()
            if n in up:
                continue
            up.add(n)
            stack.extend(a for a in n.all_input_nodes if a in down)
        order = {n: i for i, n in enumerate(sources[0].graph.nodes)}
        return sorted(up, key=order.__getitem__)

    def _plan_output(self, plan: LayerPlan, s: int, o_proj: Node | None) -> None:
        attn = plan.attn
        out = getitem_users(attn).get(0)
        if o_proj is None or out is None:
            raise DCPTransformError(f"the output of attention {attn.name} ({source_of(attn)}) "
                                    f"does not reach exactly one row-parallel O projection.")
        plan.o_proj = o_proj
        plan.o_path = [] if plan.o_proj.args[0] is out else self._path(
            [out], [plan.o_proj.args[0]])
        plan.o_token_dim, side = trace_token_dim(plan.o_path, {out: 1}, s,
                                                 f"attention output (layer {plan.layer})")
        # A per-token input on the way (x-transformers' gate_values: the output times a
        # sigmoid gate of the hidden state) is read at the tokens the output holds there.
        # Only one computed from the full-sequence stream: one computed from the q/k/v
        # projections (a gate in the q rows) runs on the owned tokens, in their order.
        # One computed from the projections is computed again on the O path's tokens
        # (prefill_recompute: the hidden state gathered there, its chain copied).
        plan.o_side_inputs = side
        for a in side:
            if _reads_projections(a, plan):
                plan.o_recomputed[a] = recompute_chain(a, plan, s, trace_token_dim)
        if any(len({k for _, k in users}) != 1 for users in side.values()) \
                or plan.o_token_dim.get(plan.o_proj.args[0], 1) != 1:
            raise DCPTransformError(
                f"the output of attention {attn.name} reaches its O projection "
                f"{plan.o_proj.name} through token-indexed inputs "
                f"{sorted(a.name for a in side)} or with tokens off dim 1; the O projection "
                f"runs on this rank's S/W tokens.")
        ar = list(plan.o_proj.users)
        if len(ar) != 1 or ar[0].target != F.all_reduce.default or C.role_of(ar[0]) != Role.DCP_TP:
            raise DCPTransformError(
                f"O projection {plan.o_proj.name} ({source_of(plan.o_proj)}) is not followed by "
                f"tensor parallelism's all-reduce over dcp_tp: {[u.name for u in ar]}.")
        chain, n = [ar[0]], ar[0]
        while not n.meta.get(SP_SLICE):
            users = [u for u in n.users if u.op == "call_function"]
            if len(users) != 1:
                raise DCPTransformError(
                    f"the O projection's reduction {ar[0].name} does not end in "
                    f"sequence_parallel's slice (at {n.name}: users {[u.name for u in users]}).")
            n = users[0]
            chain.append(n)
        plan.o_reduce = chain

    # -- rewrite ---------------------------------------------------------------------------

    def call(self, gm):
        self.selections: dict = {}   # DSA: indexer q -> its keep (dsa_keep)
        cfg, g = self.ctx.config, gm.graph
        W, I, B, tp = cfg.dcp, cfg.interleave_size, cfg.block_size, cfg.tp
        sp = gm.meta[SP_META]
        b, s, s_pad = sp["batch"], sp["tokens"], sp["padded"]
        cap = owned_capacity(s, dcp=W, interleave=I)
        plans = self.plan(gm)

        cp = cp_rank_node(gm, self)
        meta_nodes: dict[tuple[Node, Node], dict[str, Node]] = {}
        gathered: dict[Node, Node] = {}
        written: dict = {}          # cache pair -> its written caches
        for plan in plans:
            attn, layer = plan.attn, plan.layer
            q, k, v, kc, vc, positions, table, scale = attn.args
            _, _, hq, d = val(q).shape
            dtype = val(q).dtype
            key = (positions, table)
            if key not in meta_nodes:
                with g.inserting_before(cp.next):
                    meta_nodes[key] = self._chunk_metadata(g, positions, table, cp, cap, layer)
            m = meta_nodes[key]

            if attn.kwargs.get("index_topk"):   # before step 3 moves the shared q chain
                full_chunk_indexer(g, plan)
            # 2. interleave slice of the gathered hidden state (S -> C owned tokens)
            h = plan.hidden
            with g.inserting_before(h.next):
                h_own = self._token_gather(g, h, m["index"], tuple(val(h).shape), cap)
            self._step(h_own, 2, KIND_SLICE, layer)
            for lin in plan.projections:   # 3. QKV projection on the owned tokens
                lin.args = (h_own,) + tuple(lin.args[1:])
            for lin in (*plan.projections, *plan.chained):
                lin.meta[SPEC_STEP] = 3
                lin.meta[META_LAYER] = layer
            retoken_views(plan.qkv_path, plan.token_dim, cap)
            for side, users in plan.side_inputs.items():
                dim = users[0][1]
                if any(k != dim for _, k in users):
                    raise DCPTransformError(f"{side.name} is read with its tokens at dims "
                                            f"{sorted({k for _, k in users})}.")
                if side not in gathered:   # RoPE's cos/sin: sliced once, shared by layers
                    with g.inserting_before(users[0][0]):
                        gathered[side] = self._token_gather(
                            g, side, m["index"], tuple(val(side).shape), cap, dim)
                    self.tag(gathered[side], KIND_SLICE)
                for user, _ in users:
                    user.replace_input_with(side, gathered[side])

            with g.inserting_before(attn):
                # 4. KV cache write of owned positions only; a layer reading another
                # layer's cache (KV shared across layers) reads it as written, once.
                if (kc, vc) not in written:
                    cw = self._step(g.call_function(dcp_ops.cache_write.default,
                                                    (kc, vc, k, v, m["slots"]),
                                                    garbage_kwargs(self.ctx.config)),
                                    4, KIND_CACHE_WRITE, layer)
                    written[(kc, vc)] = (g.call_function(operator.getitem, (cw, 0)),
                                         g.call_function(operator.getitem, (cw, 1)))
                kc2, vc2 = written[(kc, vc)]
                # 5. Q all-gather over cp_kv: [B, C] per rank -> [B, W*C] rank-major
                if W > 1:
                    c, qw = C.all_gather(g, q, Role.CP_KV, W)
                    self._step(c, 5, KIND_COLLECTIVE, layer)
                    q5 = g.call_function(aten.view.default, (qw, [W, b, cap, hq, d]))
                    q5 = g.call_function(aten.permute.default, (q5, [1, 0, 2, 3, 4]))
                    q_all = g.call_function(aten.reshape.default, (q5, [b, W * cap, hq, d]))
                else:
                    q_all = q
                # 6. unshuffle Q to global (chunk) order
                q_full = self._token_gather(g, q_all, m["unshuffle"], (b, W * cap, hq, d), s)
                self._step(q_full, 6, KIND_SLICE, layer)
                # 7. segmented attention: full Q x (local prior cache + own current k/v)
                kwargs, sinks = attention_kwargs(attn, self.ctx.config)
                index = pop_index(kwargs)
                if index is not None:   # DSA: every query of the chunk over the own keys
                    kwargs["keep"] = dsa_keep(
                        self, g, index, k=k, v=v, kc=kc2, vc=vc2, k_pos=m["k_pos"],
                        table=table, prior=m["prior"], q_pos=positions, cp=cp, layer=layer,
                        group=W, current=cap, role=Role.CP_KV)
                    kwargs["index_width"] = index["index_width"]
                pa = self._step(g.call_function(
                    dcp_ops.partial_attention.default,
                    (q_full, positions, k, v, m["k_pos"], kc2, vc2, table, m["prior"], cp, W,
                     I, scale), kwargs), 7, KIND_ATTENTION, layer)  # window, softcap
                out = g.call_function(operator.getitem, (pa, 0))
                lse = g.call_function(operator.getitem, (pa, 1)) \
                    if W > 1 or sinks is not None else None
                if W > 1:
                    c, lse_w = C.all_gather(g, lse, Role.CP_KV, W)             # [W*B, S, hq]
                    self._step(c, 7, KIND_COLLECTIVE, layer)
                    lse_all = g.call_function(aten.view.default, (lse_w, [W, b, s, hq]))
                    out = self._step(g.call_function(dcp_ops.lse_correct.default,
                                                     (out, lse, lse_all)), 7, KIND_LSE, layer)
                    if sinks is not None:   # the sink once, on the global LSE, before the sum
                        glob = g.call_function(aten.logsumexp.default, (lse_all, [0]))
                        out = correct_sinks(self, g, out, glob, sinks, layer, torch.float32)
                    # 8. reduce-scatter over cp_kv: sum the partials, keep S_pad/W tokens
                    padded = pad_tokens(g, out, 4, s, s_pad)
                    c, out = reduce_scatter_tokens(g, padded, Role.CP_KV, W, (b, s_pad, hq, d))
                    self._step(c, 8, KIND_COLLECTIVE, layer)
                else:
                    out = correct_sinks(self, g, out, lse, sinks, layer, dtype)
                    out = pad_tokens(g, out, 4, s, s_pad)
                out = g.call_function(aten.to.dtype, (out, dtype))
            replace_attention(attn, out, kc2, vc2)

            retoken_views(plan.o_path, plan.o_token_dim, s_pad // W)
            self._slice_o_side_inputs(g, plan, cp, b, s, s_pad // W)
            self._rewrite_o_reduction(g, plan, b, s_pad // W)

        _erase_unused(gm, [n for n in g.nodes if n.name == "sp_index"])
        self.record(layers=len(plans), dcp=W, interleave_size=I, block_size=B, tokens=s,
                    padded_tokens=s_pad, owned_capacity=cap, tokens_per_rank=s_pad // tp,
                    side_inputs_sliced=len(gathered))
        return PassResult(gm, True)

    def _chunk_metadata(self, g: Graph, positions: Node, table: Node, cp: Node, cap: int,
                        layer: int) -> dict[str, Node]:
        """Per-step index tensors every layer shares (what the spec's model runner builds on
        the host from the same formulas)."""
        cfg = self.ctx.config
        W, I, B = cfg.dcp, cfg.interleave_size, cfg.block_size
        raw = self.tag(g.call_function(dcp_ops.interleave_slice_index.default,
                                       (positions, cp, cap, W, I, B)), KIND_SLICE)
        own = self.tag(g.call_function(aten.ge.Scalar, (raw, 0)), KIND_MASK)
        index = g.call_function(aten.clamp.default, (raw, 0))
        k_pos = g.call_function(aten.where.ScalarOther, (
            own, g.call_function(aten.gather.default, (positions, 1, index)), -1))
        unshuffle = self.tag(g.call_function(dcp_ops.q_unshuffle_index.default,
                                             (positions, cap, W, I, B)), KIND_SLICE)
        # The full S-sized slot mapping, then the owned entries with the same interleave
        # pattern (spec: Model Runner, "Slot Mapping for DCP Prefill").
        full = self.tag(g.call_function(dcp_ops.slot_mapping.default,
                                        (positions, table, cp, W, I, B)), KIND_MASK)
        slots = self.tag(g.call_function(aten.where.ScalarOther, (
            own, g.call_function(aten.gather.default, (full, 1, index)), -1)), KIND_MASK)
        start = g.call_function(aten.select.int, (positions, 1, 0))
        prior = self.tag(g.call_function(dcp_ops.local_filled.default,
                                         (start, cp, W, I, B)), KIND_MASK)
        for name, n in (("interleave_index", raw), ("owned_index", index),
                        ("owned_positions", k_pos), ("unshuffle_index", unshuffle),
                        ("owned_slot_mapping", slots), ("prior_local", prior)):
            n._rename(name)                    # through the graph namespace: unique
        return {"index": index, "k_pos": k_pos, "unshuffle": unshuffle, "slots": slots,
                "prior": prior}

    @staticmethod
    def _token_gather(g: Graph, x: Node, index: Node, shape, count: int, dim: int = 1
                      ) -> Node:
        """Pick ``index[b, j]`` (j < count) along the token dim ``dim`` of batch row b."""
        view = [shape[0]] + [1] * (len(shape) - 1)
        view[dim] = count
        full = list(shape)
        full[dim] = count
        ix = g.call_function(aten.view.default, (index, view))
        ix = g.call_function(aten.expand.default, (ix, full))
        return g.call_function(aten.gather.default, (x, dim, ix))

    def _slice_o_side_inputs(self, g: Graph, plan: LayerPlan, cp: Node, b: int, s: int,
                             count: int) -> None:
        """A per-token input of the O path ([B, .., S at dim k, ..], all S tokens) read at the
        tokens the attention output holds after step 8: this rank's contiguous ``count`` of
        the padded sequence (padding rows read the last token; they are dropped later). One
        computed from the projections (``plan.o_recomputed``) is computed again from the
        hidden state read at those tokens."""
        for side, users in plan.o_side_inputs.items():
            dim = users[0][1]
            chain = plan.o_recomputed.get(side)
            source = plan.hidden if chain else side
            with g.inserting_before(users[0][0]):
                start = g.call_function(aten.mul.Tensor, (cp, count))
                ar = g.call_function(aten.arange.default, (count,),
                                     {"dtype": torch.int64, "device": val(side).device})
                ix = g.call_function(aten.clamp.default, (
                    g.call_function(aten.add.Tensor, (ar, start)), 0, s - 1))
                ix = g.call_function(aten.expand.default, (
                    g.call_function(aten.view.default, (ix, [1, count])), [b, count]))
                picked = self.tag(self._token_gather(
                    g, source, ix, tuple(val(source).shape), count, 1 if chain else dim),
                    KIND_SLICE)
                if chain:
                    picked = copy_chain(g, chain, picked, count, plan.layer)
            for user, _ in users:
                user.replace_input_with(side, picked)
            if chain:   # the original chain, on the owned tokens, is read by nothing now
                _erase_unused(g.owning_module, [side])

    def _rewrite_o_reduction(self, g: Graph, plan: LayerPlan, b: int, tokens: int) -> None:
        """9. TP's all-reduce(dcp_tp) + SP slice -> reduce-scatter(dcp_tp) along tokens."""
        cfg = self.ctx.config
        group = cfg.tp // cfg.dcp
        o = plan.o_proj
        hidden = val(o).shape[-1]
        o.meta[SPEC_STEP] = 9
        o.meta[META_LAYER] = plan.layer
        with g.inserting_before(plan.o_reduce[0]):
            if group > 1:
                c, result = reduce_scatter_tokens(g, o, Role.DCP_TP, group, (b, tokens, hidden))
                self._step(c, 9, KIND_COLLECTIVE, plan.layer)
            else:
                result = o
        plan.o_reduce[-1].replace_all_uses_with(result)
        for n in reversed(plan.o_reduce):
            g.erase_node(n)

    def _step(self, node: Node, step: int, kind: str, layer: int) -> Node:
        node.meta[SPEC_STEP] = step
        return self.tag(node, kind, layer)

    def ensures(self, gm):
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            if n.target == dcp_ops.attention.default:
                raise DCPTransformError(f"attention {n.name} was not rewritten.")
            if (n.target == F.all_reduce.default and not n.meta.get(META_NORM_REDUCE)) \
                    or n.meta.get(SP_SLICE):
                raise DCPTransformError(f"{n.name} should have become a reduce-scatter.")


def _chain_root(lin: Node, limit: int = 8) -> tuple[Node, list[Node]]:
    """The first linear of a low-rank projection chain ending in ``lin`` (MLA's q_a_proj ->
    RMSNorm -> q_b_proj: q_a_proj), and the chain's later linears. A chain link is a
    replicated linear (role "replicated": every rank computes it whole) that is the only
    linear behind the next one's input, through token-wise ops; the root reads the
    sequence-parallel all-gather. ``lin`` itself when its input is that gather."""
    chain = []
    for _ in range(limit):
        x = lin.args[0]
        if x.meta.get(SP_GATHER):
            return lin, chain
        behind, seen, stack = [], set(), [x]
        while stack:
            n = stack.pop()
            if n in seen or n.op != "call_function":
                continue
            seen.add(n)
            if _is_linear(n):
                behind.append(n)
            else:
                stack.extend(n.all_input_nodes)
        if len(behind) != 1 or behind[0].meta.get(ROLE_META) != "replicated":
            return lin, chain   # not a chain: the caller's gather check names it
        chain.insert(0, lin)
        lin = behind[0]
    raise DCPTransformError(f"projection {lin.name} ({source_of(lin)}) ends a chain of more "
                            f"than {limit} linears; expected q_a_proj -> norm -> q_b_proj.")


def _erase_unused(gm: GraphModule, nodes: list[Node]) -> None:
    """Erase ``nodes`` and then their inputs while nothing uses them (the SP slice index
    once every O projection's slice became a reduce-scatter)."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n.users or n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        stack.extend(inputs)


__all__ = ["DCPPrefill", "LayerPlan"]
