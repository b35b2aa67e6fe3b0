"""Tensor-parallel sharding (spec: "Weight Loading"), following the placement analysis.

:func:`dcp_compile.passes.placement.analyze` decides, before anything changes, how every tensor is laid
out over the ranks (see its docstring for where the roles come from: q/k/v column-parallel
by heads — segment by segment for fused projections —, O and MLP-down row-parallel, MLP
column projections, vocab-parallel embedding and LM head). This pass only follows it:
  * every sharded parameter gets its shard's shape; the pass returns how to cut each
    rank's shard on the host (``ShardSpec``: a fused weight's shard is the concatenation of
    its slice of each segment);
  * literal sizes along a sharded dim (view/reshape/expand/unflatten shapes, split sizes,
    chunk counts, slice bounds) become the local ones;
  * a pending sum (row-parallel linear, a mean/sum over a sharded dim such as RMSNorm over
    all heads) is all-reduced at once: local mean x local/global count (/ replicas) summed;
  * embedding: masked lookup + all-reduce; LM head: all-gather of the vocab shards.
Decode shards attention over full TP (all-reduce role ``tp``); prefill over dcp_tp_group
(``dcp_tp``), the MLP and vocab over full TP (``world``). Any refusal happens in the analysis,
so a graph is never partly rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.kernels.moe import ARG
from dcp_compile.runtime.program.facts import ModelFacts
from dcp_compile.runtime.program.shards import ShardSpec
from dcp_compile.runtime.names import (Mode, Role, META_FULL_SHAPE, META_WEIGHT_PERM,
                                       POSITION_BIAS_KWARGS,
                                       META_NORM_REDUCE, META_SCOPE, PROJECTIONS_META,
                                       RANK_INPUT, ROLE_META, SCOPE_MODEL)

from . import collectives as C
from .infra import (KIND_COLLECTIVE, KIND_MASK, KIND_SHARD, DCPPass, Found, Property,
                    attention_nodes, placeholder, source_of, val)
from .op_classes import SHAPED_VIEWS, SPLITS
from .placement import (Partial, PlacementPlan, Shard, analyze, slice_bounds, split_ranges,
                        weight_param)
from .placement.recurrent import HEAD_CUT_META, LAYOUT_META, module_path as _module_path

aten = torch.ops.aten
LINEAR = aten.linear.default
EMBEDDING = aten.embedding.default


def spec_of(placement: Shard, group: int, param: Node | None = None) -> ShardSpec:
    """How the program cuts a weight the placement analysis shards (``placement``) over a
    group of ``group`` ranks; of its indices reordered along a dim first, when ``param``
    records that (``META_WEIGHT_PERM``: passes/untile_kv_heads.py)."""
    first = placement.segs[0]
    segments = () if len(placement.segs) == 1 else tuple(
        (s.size, s.pieces, s.replicas) for s in placement.segs)
    perm = _perm_of(param, placement.dim)
    return ShardSpec(placement.dim, first.pieces, group, first.replicas, segments, perm)


def _perm_of(param: Node | None, dim: int) -> tuple[int, ...]:
    """The reordering ``param`` is read with along ``dim`` (() if none); a weight reordered
    along one dim and cut along another is refused (a shard is boxes along one dim)."""
    if param is None or META_WEIGHT_PERM not in param.meta:
        return ()
    perm_dim, perm = param.meta[META_WEIGHT_PERM]
    if perm_dim != dim:
        raise DCPTransformError(
            f"weight {param.name} is read with its dim {perm_dim} reordered (K/V heads tiled, "
            f"read as GQA with the query heads permuted) but cut along dim {dim}: a rank's "
            f"shard would not be boxes of one dim. Repeat each kv head in place "
            f"(k.repeat_interleave(r, dim=1)).")
    return tuple(perm)


@dataclass
class ShardPlan:
    placements: PlacementPlan
    roles: dict[str, str]               # linear/embedding name -> what it was found to be


def _is_linear(n: Node) -> bool:
    return n.op == "call_function" and n.target == LINEAR \
        and weight_param(n.args[1]).op == "placeholder"



def _local_shape(n: Node, p) -> list[int]:
    shape = list(val(n).shape)
    if isinstance(p, Shard):
        shape[p.dim] = p.local
    return shape


class ShardTensorParallel(DCPPass):
    name = "shard_tensor_parallel"
    required = frozenset({Property.PROVEN, Property.RANK_INPUT})
    ensured = frozenset({Property.TP_SHARDED})

    def plan(self, gm: GraphModule) -> ShardPlan:
        placements = analyze(gm, self.ctx.config)
        return ShardPlan(placements, placements.roles)

    def _role(self, axis: str) -> str:
        if self.ctx.config.mode == Mode.DECODE:
            return Role.TP
        return Role.DCP_TP if axis == "attn" else Role.WORLD

    def _group(self, axis: str) -> int:
        cfg = self.ctx.config
        return cfg.attention_shard if axis == "attn" else cfg.tp

    # -- rewrite ---------------------------------------------------------------------------

    def call(self, gm):
        cfg = self.ctx.config
        plan = self.plan(gm)
        pl = self._placements = plan.placements
        self.shards: dict[str, ShardSpec] = {}    # returned: how the program cuts weights
        mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes
                                 if n.op == "placeholder"])
        g = gm.graph
        rank = placeholder(gm, RANK_INPUT)

        # Each rank's KV caches hold only its KV heads: the cache inputs take that shape
        # (each its own layout's; a cache layers share is cut once).
        caches = dict.fromkeys(c for attn in attention_nodes(gm) for c in attn.args[3:5])
        for cache in caches:
            full = cache.meta["val"]
            heads = cfg.kv_heads_per_layout(full.shape[2])
            if full.shape[2] != heads:
                with mode:
                    cache.meta["val"] = torch.empty((*full.shape[:2], heads, *full.shape[3:]),
                                                    dtype=full.dtype, device=full.device)
                cache.meta[META_FULL_SHAPE] = tuple(full.shape)

        self._recurrent_head_cut(gm, mode)

        for p, shard in pl.params.items():
            self._shard_param(p, spec_of(shard, self._group(shard.axis), p), mode)
        # A weight read reordered but not cut is still reordered when a rank loads it.
        for p in g.nodes:
            if p.op == "placeholder" and META_WEIGHT_PERM in p.meta and p.name not in self.shards:
                dim = p.meta[META_WEIGHT_PERM][0]
                self.shards[p.name] = ShardSpec(dim, 1, 1, perm=_perm_of(p, dim))

        for n in list(g.nodes):
            if n.op != "call_function":
                continue
            self._localize(n, pl)
        for n in list(g.nodes):
            p = pl.of(n)
            # A pending sum read by pending sums only (an experts' sum on its way to the
            # block's one all-reduce) is reduced where it is read reduced.
            if isinstance(p, Partial) and not all(isinstance(pl.of(u), Partial)
                                                  for u in n.users):
                self._reduce(g, n, p)
            elif pl.linears.get(n) == "lm_head":
                self._gather_vocab(g, n)
        for emb in pl.embeddings:
            self._vocab_embedding(g, emb, rank)
        self._expert_shard_rank(g, rank, cfg.expert_parallel)
        self._alibi_heads(gm, rank, pl)

        # What later passes (sequence_parallel, dcp_prefill) need to know of the roles.
        for lin in pl.linears:
            lin.meta[ROLE_META] = plan.roles[lin.name]
        for attn, sites in pl.attention.items():
            attn.meta[PROJECTIONS_META] = {
                k: (v.name if isinstance(v, Node) else None) if k == "o"
                else [x.name for x in v] for k, v in sites.items()}
        # MQA: the one KV head's projection runs whole on every rank (required replicated).
        self.replicated = {n.name for n, k in pl.linears.items() if k == "replicated"}
        self.record(**{k: v for k, v in sorted(plan.roles.items())})
        self.matched = {"projections": dict(sorted(plan.roles.items()))}
        # one entry per mixer (Jamba's and RecurrentGemma's run two ops each)
        layout = tuple(dict.fromkeys((_module_path(n), n.meta[LAYOUT_META]) for n in g.nodes
                                     if LAYOUT_META in n.meta))
        return Found(gm, True, shards=self.shards,
                     facts=ModelFacts(recurrent_layout=layout) if layout else None)

    def _recurrent_head_cut(self, gm, mode) -> None:
        """A recurrent op cut by heads (passes/placement/recurrent.py): its state cache inputs
        take the rank's shape (its heads and channels only) and its head counts the rank's."""
        for n in gm.graph.nodes:
            cut = n.meta.pop(HEAD_CUT_META, None)    # used once: a program file stores none
            if n.op != "call_function" or cut is None:
                continue
            for i in cut.states:
                cache = n.args[i]
                if META_FULL_SHAPE in cache.meta:
                    continue
                full = cache.meta["val"]
                with mode:
                    cache.meta["val"] = torch.empty(_local_shape(cache, cut.inputs[i]),
                                                    dtype=full.dtype, device=full.device)
                cache.meta[META_FULL_SHAPE] = tuple(full.shape)
            args = list(n.args)
            for i, local in cut.local_ints.items():
                args[i] = local
            n.args = tuple(args)

    def _localize(self, n: Node, pl: PlacementPlan) -> None:
        """Literal sizes along a sharded dim -> this rank's sizes."""
        t, out = n.target, pl.of(n)
        if t in SHAPED_VIEWS and isinstance(out, Shard):
            n.args = (n.args[0], _local_shape(n, out)) + tuple(n.args[2:])
        elif t == aten.unflatten.int and isinstance(out, Shard):
            d = n.args[1] % val(n.args[0]).ndim
            local = _local_shape(n, out)
            n.args = (n.args[0], d, local[d:d + len(n.args[2])])
        elif t in SPLITS:
            x = pl.of(n.args[0])
            d, bounds = split_ranges(n)
            if isinstance(x, Shard) and d == x.dim:
                # A piece made only of whole replicated segments (an MQA K or V of a fused
                # QKV) is Replicate: every rank keeps all of it.
                n.target = aten.split_with_sizes.default
                n.args = (n.args[0], [o.local if isinstance(o, Shard) else end - start
                                      for o, (start, end) in zip(out, bounds)], x.dim)
                n.kwargs = {}
        elif t in (aten.slice.Tensor, aten.narrow.default):
            x = pl.of(n.args[0])
            d, start, end, _ = slice_bounds(n)
            if isinstance(x, Shard) and d == x.dim:
                pos, local_start = 0, 0
                for s in x.segs:          # whole segments before ``start`` (the analysis
                    if pos >= start:      # refused any cut inside one)
                        break
                    pos += s.size
                    local_start += s.local
                n.target = aten.slice.Tensor
                width = out.local if isinstance(out, Shard) else end - start  # Replicate:
                n.args = (n.args[0], d, local_start, local_start + width)      # whole piece
                n.kwargs = {}

    def _reduce(self, g, n: Node, p: Partial) -> None:
        """A pending sum: scale the local value, all-reduce it (bias of a row linear after)."""
        is_linear = n.target == LINEAR
        bias = n.args[2] if is_linear and len(n.args) > 2 else None
        if bias is not None:  # add the bias once, after the reduction
            n.args = (n.args[0], n.args[1])
        with g.inserting_before(n.next):
            x = first = n
            if p.scale != 1.0:
                x = first = g.call_function(aten.mul.Tensor, (n, p.scale))
            c, w = C.all_reduce(g, x, self._role(p.axis))
            self.tag(c, KIND_COLLECTIVE)
            if not is_linear and not p.experts:   # a norm's statistic, not TP's sum
                c.meta[META_NORM_REDUCE] = True
            result = w
            if bias is not None:
                result = g.call_function(aten.add.Tensor, (w, bias))
        keep = {c, first} | {u for u in n.users if isinstance(self._placements.of(u), Partial)}
        n.replace_all_uses_with(result, delete_user_cb=lambda u: u not in keep)

    def _gather_vocab(self, g, lin: Node) -> None:
        cfg = self.ctx.config
        shape = list(val(lin).shape)
        vocab = shape[-1]
        with g.inserting_before(lin.next):
            c, w = C.all_gather(g, lin, self._role("mlp"), cfg.tp)   # [tp*B, ..., V/tp]
            self.tag(c, KIND_COLLECTIVE)
            c.meta[META_SCOPE] = SCOPE_MODEL
            v = g.call_function(aten.view.default,
                                (w, [cfg.tp] + shape[:-1] + [vocab // cfg.tp]))
            nd = len(shape)
            perm = list(range(1, nd)) + [0, nd]
            p = g.call_function(aten.permute.default, (v, perm))
            full = g.call_function(aten.reshape.default, (p, shape))
        lin.replace_all_uses_with(full, delete_user_cb=lambda u: u is not c)

    def _vocab_embedding(self, g, emb: Node, rank: Node) -> None:
        cfg = self.ctx.config
        weight, ids = emb.args[0], emb.args[1]
        vocab = weight.meta.get(META_FULL_SHAPE, val(weight).shape)[0]
        per = vocab // cfg.tp
        with g.inserting_before(emb):
            start = g.call_function(aten.mul.Tensor, (rank, per))
            local = g.call_function(aten.sub.Tensor, (ids, start))
            ge = g.call_function(aten.ge.Scalar, (local, 0))
            lt = g.call_function(aten.lt.Scalar, (local, per))
            inside = self.tag(g.call_function(aten.logical_and.default, (ge, lt)), KIND_MASK)
            safe = g.call_function(aten.where.ScalarOther, (inside, local, 0))
        emb.args = (weight, safe) + tuple(emb.args[2:])
        with g.inserting_before(emb.next):
            keep = g.call_function(aten.unsqueeze.default, (inside, -1))
            masked = g.call_function(aten.mul.Tensor, (emb, keep))
            c, w = C.all_reduce(g, masked, self._role("mlp"))
        self.tag(c, KIND_COLLECTIVE)
        c.meta[META_SCOPE] = SCOPE_MODEL
        emb.replace_all_uses_with(w, delete_user_cb=lambda u: u is not masked)

    def _alibi_heads(self, gm, rank: Node, pl: PlacementPlan) -> None:
        """ALiBi slopes [q_heads] and a distance table [q_heads, L] are whole constants
        (replicated): each rank keeps the rows of its own q heads, the piece q's placement
        gives it (ShardSpec.index: ``(rank % group) // replicas``), taken with rank
        arithmetic (rank is data)."""
        g = gm.graph
        for attn in attention_nodes(gm):
            q = pl.of(attn.args[0])
            if not isinstance(q, Shard):
                continue
            for key in POSITION_BIAS_KWARGS:
                whole = attn.kwargs.get(key)
                if whole is None:
                    continue
                seg = q.segs[0]
                group = self._group(q.axis)
                rest = list(val(whole).shape[1:])
                with g.inserting_before(attn):
                    piece = g.call_function(aten.floor_divide.default, (
                        g.call_function(aten.remainder.Scalar, (rank, group)), seg.replicas))
                    table = g.call_function(aten.view.default,
                                            (whole, [seg.pieces, seg.local, *rest]))
                    mine = g.call_function(aten.index_select.default, (
                        table, 0, g.call_function(aten.view.default, (piece, [1]))))
                    local = g.call_function(aten.view.default, (mine, [seg.local, *rest]))
                attn.kwargs = {**attn.kwargs, key: local}

    def _expert_shard_rank(self, g, rank: Node, expert_parallel: bool) -> None:
        """Which shard of the experts this rank holds is data, the rank input (dcp.moe,
        runtime/kernels/moe.py): expert parallel, rank r holds experts [r * E/tp, (r + 1) * E/tp)
        (``expert_rank``); tensor parallel, slice r of every expert's intermediate dim
        (``inner_rank``: only slice 0 adds the down bias, counted once by the all-reduce)."""
        operand = ARG["expert_rank"] if expert_parallel else ARG["inner_rank"]
        for n in list(g.nodes):
            if n.op != "call_function" or n.target != torch.ops.dcp.moe.default:
                continue
            if not expert_parallel and n.args[ARG["down_bias"]] is None:
                continue                  # no down bias: nothing depends on the slice
            old = n.args[operand]
            args = list(n.args)
            args[operand] = rank
            n.args = tuple(args)
            if isinstance(old, Node) and not old.users and old.op == "call_function":
                g.erase_node(old)

    def _shard_param(self, p: Node, spec: ShardSpec, mode) -> None:
        if p.op != "placeholder":
            raise DCPTransformError(f"weight {p.name} is not a parameter input; cannot shard.")
        prev = self.shards.get(p.name)
        if prev is not None:
            if prev != spec:
                raise DCPTransformError(f"weight {p.name} is used with two different shards "
                                        f"({prev} and {spec}); tied weights are not "
                                        f"supported. Untie them.")
            return
        full = p.meta["val"]
        for size, pieces, _ in spec.segments_of(full.shape[spec.dim]):
            if size % pieces:
                raise DCPTransformError(f"weight {p.name} of shape {tuple(full.shape)} does "
                                        f"not split into {pieces} pieces along dim "
                                        f"{spec.dim}. Pick a tp that divides it.")
        with mode:
            p.meta["val"] = torch.empty(spec.shape(full.shape), dtype=full.dtype,
                                        device=full.device)
        p.meta[META_FULL_SHAPE] = tuple(full.shape)
        self.shards[p.name] = spec
        self.tag(p, KIND_SHARD)

    def ensures(self, gm):
        for n in gm.graph.nodes:
            if _is_linear(n) and weight_param(n.args[1]).name not in self.shards \
                    and n.name not in self.replicated:
                raise DCPTransformError(f"linear {n.name} ({source_of(n)}) was left "
                                        f"unsharded.")


__all__ = ["ShardTensorParallel", "ShardPlan", "spec_of"]
