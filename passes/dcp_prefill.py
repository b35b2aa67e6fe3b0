"""The prefill DCP rewrite (spec: "DCP Prefill" Compute Pattern, "Model Runner", "Segmented
Attention CP", "cp_rank: Prefill vs Decode").

Requires the sequence-parallel residual stream of :mod:`passes.sequence_parallel` (run first
as this pass's own first stage when the pass list does not name it). Each layer's attention,
from the step-1 all-gather that SequenceParallel placed before q/k/v, becomes:

  2. h_own   = gather(h, interleave_slice_index)          S -> C tokens this cp_rank owns
  3. q, k, v = projections of h_own (weights sharded over dcp_tp_group, by ShardTensorParallel)
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

Token-indexed side inputs of the q/k/v paths (RoPE's cos/sin, computed from the full
positions) are gathered with the same index; view shapes on those paths get C (and S_pad/W
on the O path) in place of S. Anything else on those paths that is not token-wise is an error
naming the node.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from dcp_compile.errors import DCPTransformError
from dcp_compile.ops import owned_capacity

from . import collectives as C
from .dcp_decode import cp_rank_node, replace_attention
from .infra import (KIND_ATTENTION, KIND_CACHE_WRITE, KIND_COLLECTIVE, KIND_LSE, KIND_MASK,
                    KIND_SLICE, DCPPass, attention_nodes, getitem_users, source_of, val)
from .sequence_parallel import (SP_GATHER, SP_META, SP_SLICE, SPEC_STEP, SequenceParallel,
                                pad_tokens, reduce_scatter_tokens)
from .shard_tensor_parallel import _backward_sources, _forward_linears, _is_linear

aten = torch.ops.aten
dcp_ops = torch.ops.dcp
F = torch.ops._c10d_functional

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# Ops that keep dim 1 as the token dim when their dim arguments (at ``_DIM_ARG``) avoid it.
_DIM_ARG = {aten.chunk.default: 2, aten.split.Tensor: 2, aten.split_with_sizes.default: 2,
            aten.cat.default: 1, aten.slice.Tensor: 1, aten.select.int: 1,
            aten.narrow.default: 1, aten.unsqueeze.default: 1, aten.squeeze.dim: 1,
            aten.transpose.int: (1, 2), aten.permute.default: 1}
_TOKENWISE = {aten.to.dtype, aten._to_copy.default, aten.clone.default,
              aten.contiguous.default, operator.getitem}


@dataclass
class LayerPlan:
    layer: int
    attn: Node
    projections: tuple[Node, Node, Node]      # q, k, v linears
    hidden: Node                              # their common full-sequence input (step 1)
    qkv_path: list[Node]                      # projections -> attention q/k/v, graph order
    side_inputs: dict[Node, list[Node]] = field(default_factory=dict)  # token input -> users
    o_path: list[Node] = field(default_factory=list)              # attention out -> o_proj
    o_proj: Node | None = None
    o_reduce: list[Node] = field(default_factory=list)   # all_reduce, wait, [pad], sp slice


class DCPPrefill(DCPPass):
    """Rewrite every attention block into the spec's nine-step prefill DCP pattern."""

    name = "dcp_prefill"

    def requires(self, gm):
        if self.ctx.config.mode != "prefill":
            raise DCPTransformError(f"dcp_prefill rewrites prefill programs: mode="
                                    f"{self.ctx.config.mode!r}.")
        if not attention_nodes(gm):
            raise DCPTransformError("dcp_prefill found no dcp.attention node to rewrite.")

    # -- analysis --------------------------------------------------------------------------

    def plan(self, gm: GraphModule) -> list[LayerPlan]:
        sp = gm.meta[SP_META]
        s = sp["tokens"]
        plans = []
        for layer, attn in enumerate(attention_nodes(gm)):
            projs = []
            for i, what in enumerate("qkv"):
                lin, _ = _backward_sources(attn.args[i])
                if len(lin) != 1:
                    raise DCPTransformError(
                        f"{what} of attention {attn.name} ({source_of(attn)}) comes from "
                        f"{len(lin)} projections; expected one linear each for q, k, v.")
                projs.append(lin.pop())
            hidden = {p.args[0] for p in projs}
            if len(hidden) != 1 or not next(iter(hidden)).meta.get(SP_GATHER):
                raise DCPTransformError(
                    f"q/k/v projections of attention {attn.name} ({source_of(attn)}) do not "
                    f"read one sequence-parallel all-gather: {sorted(h.name for h in hidden)}."
                    f" Run sequence_parallel before dcp_prefill.")
            plan = LayerPlan(layer, attn, tuple(projs), hidden.pop(),
                             self._path(projs, [attn.args[i] for i in range(3)]))
            for n in plan.qkv_path:
                self._check_path_node(n, s, plan, set(plan.qkv_path) | set(projs))
            self._plan_output(plan, s)
            plans.append(plan)
        return plans

    @staticmethod
    def _path(sources: list[Node], sinks: list[Node]) -> list[Node]:
        """Nodes on some path from ``sources`` to ``sinks`` (excluding sources), graph order."""
        down, stack = set(), list(sources)
        while stack:
            n = stack.pop()
            for u in n.users:
                if u not in down and u.op == "call_function" \
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

    def _check_path_node(self, n: Node, s: int, plan: LayerPlan, path: set[Node]) -> None:
        where = f"node {n.name} ({source_of(n)}) on the q/k/v path of layer {plan.layer}"
        out = n.meta.get("val")
        if isinstance(out, torch.Tensor) and (out.ndim < 2 or out.shape[1] != s):
            raise DCPTransformError(f"{where} has shape {tuple(out.shape)}: the interleave "
                                    f"slice needs [B, S={s}, ...] on the whole path.")
        if n.target in _VIEWS:
            shape = n.args[1]
            if not (isinstance(shape, (list, tuple)) and len(shape) >= 2 and shape[1] == s):
                raise DCPTransformError(f"{where} views to {shape}, which does not keep the "
                                        f"token dim (S={s}) at dim 1.")
            return
        if n.target in _DIM_ARG:
            self._check_dims(n, where)
        elif not (torch.Tag.pointwise in getattr(n.target, "tags", ())
                  or n.target in _TOKENWISE):
            raise DCPTransformError(f"{where} ({n.target}) is not token-wise; the interleave "
                                    f"slice cannot be moved past it.")
        for a in n.all_input_nodes:
            if a in path:
                continue
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor) or not isinstance(out, torch.Tensor):
                continue
            aligned = 1 - (out.ndim - v.ndim)
            if aligned == 1 and v.shape[1] == s:
                plan.side_inputs.setdefault(a, []).append(n)
            elif aligned >= 0 and v.shape[aligned] != 1:
                raise DCPTransformError(f"{where} reads {a.name} of shape {tuple(v.shape)}, "
                                        f"which is neither per-token [B, S, ...] nor "
                                        f"broadcast over tokens.")

    @staticmethod
    def _check_dims(n: Node, where: str) -> None:
        src = n.args[0][0] if n.target == aten.cat.default else n.args[0]
        ndim = val(src).ndim + (1 if n.target == aten.unsqueeze.default else 0)
        idx = _DIM_ARG[n.target]
        if n.target == aten.permute.default:
            perm = [d % ndim for d in n.args[1]]
            if perm[:2] != [0, 1]:
                raise DCPTransformError(f"{where} permutes the batch or token dim: {perm}.")
            return
        dims = [n.args[i] if len(n.args) > i else 0 for i in (idx if isinstance(idx, tuple)
                                                                else (idx,))]
        if any(d % ndim <= 1 for d in dims):
            raise DCPTransformError(f"{where} acts on dims {dims} (batch or token).")

    def _plan_output(self, plan: LayerPlan, s: int) -> None:
        attn = plan.attn
        out = getitem_users(attn).get(0)
        o_lin, _ = _forward_linears(out) if out is not None else (set(), False)
        if len(o_lin) != 1:
            raise DCPTransformError(f"the output of attention {attn.name} ({source_of(attn)}) "
                                    f"reaches {len(o_lin)} linears; expected one O projection.")
        plan.o_proj = o_lin.pop()
        plan.o_path = [] if plan.o_proj.args[0] is out else self._path(
            [out], [plan.o_proj.args[0]])
        for n in plan.o_path:
            where = f"node {n.name} ({source_of(n)}) between attention and O projection"
            if n.target in _VIEWS:
                if not (len(n.args[1]) >= 2 and n.args[1][1] == s):
                    raise DCPTransformError(f"{where} views to {n.args[1]}; expected the token "
                                            f"dim S={s} at dim 1.")
            elif not (torch.Tag.pointwise in getattr(n.target, "tags", ())
                      or n.target in _TOKENWISE):
                raise DCPTransformError(f"{where} ({n.target}) is not token-wise.")
        ar = list(plan.o_proj.users)
        if len(ar) != 1 or ar[0].target != F.all_reduce.default or C.role_of(ar[0]) != "dcp_tp":
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
        if SP_META not in gm.meta:
            # transform.passes_for names DCPPrefill alone: sequence parallelism is its stage 1.
            from .manager import run_passes
            sp = SequenceParallel(self.ctx)
            gm, _ = run_passes(gm, [sp], step=self.ctx.step)
            self.inserted.update(sp.inserted)
            self.matched["sequence_parallel"] = dict(sp.matched)
        cfg, g = self.ctx.config, gm.graph
        W, I, B, tp = cfg.dcp, cfg.interleave_size, cfg.block_size, cfg.tp
        sp = gm.meta[SP_META]
        b, s, s_pad = sp["batch"], sp["tokens"], sp["padded"]
        cap = owned_capacity(s, dcp=W, interleave=I)
        plans = self.plan(gm)

        cp = cp_rank_node(gm, self)
        meta_nodes: dict[tuple[Node, Node], dict[str, Node]] = {}
        gathered: dict[Node, Node] = {}
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

            # 2. interleave slice of the gathered hidden state (S -> C owned tokens)
            h = plan.hidden
            with g.inserting_before(h.next):
                h_own = self._token_gather(g, h, m["index"], tuple(val(h).shape), cap)
            self._step(h_own, 2, KIND_SLICE, layer)
            for lin in plan.projections:   # 3. QKV projection on the owned tokens
                lin.args = (h_own,) + tuple(lin.args[1:])
                lin.meta[SPEC_STEP] = 3
                lin.meta["dcp_layer"] = layer
            for n in plan.qkv_path:
                if n.target in _VIEWS:
                    n.args = (n.args[0], [n.args[1][0], cap, *n.args[1][2:]]) + n.args[2:]
            for side, users in plan.side_inputs.items():
                if side not in gathered:   # RoPE's cos/sin: sliced once, shared by layers
                    with g.inserting_before(users[0]):
                        gathered[side] = self._token_gather(
                            g, side, m["index"], tuple(val(side).shape), cap)
                    self.tag(gathered[side], KIND_SLICE)
                for user in users:
                    user.replace_input_with(side, gathered[side])

            with g.inserting_before(attn):
                # 4. KV cache write of owned positions only
                cw = self._step(g.call_function(dcp_ops.cache_write.default,
                                                (kc, vc, k, v, m["slots"])),
                                4, KIND_CACHE_WRITE, layer)
                kc2 = g.call_function(operator.getitem, (cw, 0))
                vc2 = g.call_function(operator.getitem, (cw, 1))
                # 5. Q all-gather over cp_kv: [B, C] per rank -> [B, W*C] rank-major
                if W > 1:
                    c, qw = C.all_gather(g, q, "cp_kv", W)
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
                pa = self._step(g.call_function(
                    dcp_ops.partial_attention.default,
                    (q_full, positions, k, v, m["k_pos"], kc2, vc2, table, m["prior"], cp, W,
                     I, scale)), 7, KIND_ATTENTION, layer)
                out = g.call_function(operator.getitem, (pa, 0))
                if W > 1:
                    lse = g.call_function(operator.getitem, (pa, 1))
                    c, lse_w = C.all_gather(g, lse, "cp_kv", W)             # [W*B, S, hq]
                    self._step(c, 7, KIND_COLLECTIVE, layer)
                    lse_all = g.call_function(aten.view.default, (lse_w, [W, b, s, hq]))
                    out = self._step(g.call_function(dcp_ops.lse_correct.default,
                                                     (out, lse, lse_all)), 7, KIND_LSE, layer)
                    # 8. reduce-scatter over cp_kv: sum the partials, keep S_pad/W tokens
                    padded = pad_tokens(g, out, 4, s, s_pad)
                    c, out = reduce_scatter_tokens(g, padded, "cp_kv", W, (b, s_pad, hq, d))
                    self._step(c, 8, KIND_COLLECTIVE, layer)
                else:
                    out = pad_tokens(g, out, 4, s, s_pad)
                out = g.call_function(aten.to.dtype, (out, dtype))
            replace_attention(attn, out, kc2, vc2)

            for n in plan.o_path:
                if n.target in _VIEWS:
                    n.args = (n.args[0], [n.args[1][0], s_pad // W, *n.args[1][2:]]) \
                        + n.args[2:]
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
            n.name = name
        return {"index": index, "k_pos": k_pos, "unshuffle": unshuffle, "slots": slots,
                "prior": prior}

    @staticmethod
    def _token_gather(g: Graph, x: Node, index: Node, shape, count: int) -> Node:
        """x[b, index[b, j], ...] for j < count: rows of dim 1 picked per batch row."""
        b, _, *rest = shape
        ix = g.call_function(aten.view.default, (index, [b, count] + [1] * len(rest)))
        ix = g.call_function(aten.expand.default, (ix, [b, count, *rest]))
        return g.call_function(aten.gather.default, (x, 1, ix))

    def _rewrite_o_reduction(self, g: Graph, plan: LayerPlan, b: int, tokens: int) -> None:
        """9. TP's all-reduce(dcp_tp) + SP slice -> reduce-scatter(dcp_tp) along tokens."""
        cfg = self.ctx.config
        group = cfg.tp // cfg.dcp
        o = plan.o_proj
        hidden = val(o).shape[-1]
        o.meta[SPEC_STEP] = 9
        o.meta["dcp_layer"] = plan.layer
        with g.inserting_before(plan.o_reduce[0]):
            if group > 1:
                c, result = reduce_scatter_tokens(g, o, "dcp_tp", group, (b, tokens, hidden))
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
            if n.target == F.all_reduce.default or n.meta.get(SP_SLICE):
                raise DCPTransformError(f"{n.name} should have become a reduce-scatter.")


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


__all__ = ["DCPPrefill", "LayerPlan", "owned_capacity", "Graph", "GraphModule", "_is_linear"]
