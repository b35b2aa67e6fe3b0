"""The decode DCP rewrite (spec: "DCP Decode", "Decode Compute Pattern", "dcp_active_mask").

Each `dcp.attention` node of the one-token decode step becomes, on group role ``dcp``:

  slots   = dcp.slot_mapping(positions, block_table, cp_rank)   # -1 unless this rank owns it
  caches  = dcp.cache_write(caches, k, v, slots)                # non-owners -> garbage block
  q_all   = all_gather(q) over dcp -> [B, 1, W*hq, D]           # 2. AllGather Q
  prior   = dcp.local_filled(N, cp_rank)                        # prior_mask: slots [0, prior)
  active  = dcp.active_mask(N, cp_rank)                         # active slot gated
  out,lse = dcp.partial_attention(q_all, ..., k_pos = active ? N : -1)   # 3-4
  lse_all = all_gather(lse) over dcp                            # 5. AllGather LSE
  out     = dcp.lse_correct(out, lse, lse_all)                  # 6-7. exp(local - global)
  out     = reduce_scatter(out by head groups) over dcp         # 8. combine, scatter heads

That is ``combine="all_gather"`` (the default, 3 DCP collectives per layer). With
``combine="all_to_all"`` steps 5-8 are one all-to-all of the partial outputs (head group j
to rank j) packed with their LSEs, then ``dcp.lse_merge`` locally (2 per layer).
``combine_dtype="model"`` sends the partial outputs in the model's dtype (LSE stays float32).

`cp_rank = tp_rank % dcp` is arithmetic on the rank input. With dcp = 1 the same nodes are
emitted without the collectives (plain tensor parallelism).

The context step (the decode engine's own first prompt chunk, ``DCPContext``) keeps plain TP
attention — every rank of a replica set computes the same K/V — and writes only the positions
the rank owns, so decode continues from the DCP layout.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.garbage_block import LAST
from dcp_compile.runtime.names import (META_KIND, POSITION_BIAS_KWARGS, RANK_INPUT, Mode,
                                       Role)

from . import collectives as C
from .infra import (KIND_ATTENTION, KIND_CACHE_WRITE, KIND_COLLECTIVE, KIND_LSE, KIND_MASK,
                    DCPPass, Property, attention_nodes, ensure, getitem_users, placeholder,
                    val)

aten = torch.ops.aten
dcp_ops = torch.ops.dcp


def cp_rank_node(gm: GraphModule, pass_: DCPPass) -> Node:
    """cp_rank as data: decode tp_rank % DCP, prefill tp_rank // (TP / DCP)."""
    cfg = pass_.ctx.config
    rank = placeholder(gm, RANK_INPUT)
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        if cfg.mode == Mode.DECODE:
            node = gm.graph.call_function(aten.remainder.Scalar, (rank, cfg.dcp))
        else:
            node = gm.graph.call_function(aten.floor_divide.default,
                                          (rank, cfg.tp // cfg.dcp))
    node._rename("cp_rank")             # through the graph namespace: names stay unique
    return pass_.tag(node, KIND_MASK)


def masked_cache_write(p: DCPPass, g: Graph, attn: Node, slots: Node, layer: int,
                       written: dict):
    """Write k/v only where this rank owns the position (spec: slot_mapping -1 elsewhere);
    ``slots`` is the step's slot mapping (one node for every layer). A layer that reads
    another layer's cache (KV shared across layers) reads that layer's written cache and
    writes nothing: ``written`` maps each cache pair written so far to its new caches."""
    q, k, v, kc, vc = attn.args[:5]
    if (kc, vc) in written:
        return written[(kc, vc)]
    write = p.tag(g.call_function(dcp_ops.cache_write.default, (kc, vc, k, v, slots),
                                  garbage_kwargs(p.ctx.config)),
                  KIND_CACHE_WRITE, layer)
    written[(kc, vc)] = (g.call_function(operator.getitem, (write, 0)),
                         g.call_function(operator.getitem, (write, 1)))
    return written[(kc, vc)]


def step_inputs(gm: GraphModule, layers: list[Node]) -> list[tuple[Node, Node]]:
    """The distinct (positions, block_table) pairs the attention nodes read: one per step
    (every layer reads the step's inputs), so the layout metadata below is built once per
    step, not once per layer."""
    pairs: list[tuple[Node, Node]] = []
    for attn in layers:
        pair = tuple(attn.args[5:7])
        if pair not in pairs:
            pairs.append(pair)
    return pairs


def build_step_metadata(p: DCPPass, gm: GraphModule, cp: Node, layers: list[Node],
                        build) -> dict[tuple[Node, Node], dict[str, Node]]:
    """``build(g, positions, table, cp) -> {name: node}`` once per (positions, table) pair,
    at the graph's input side (right after cp_rank); every layer then reads those nodes."""
    g, out, anchor = gm.graph, {}, cp
    for positions, table in step_inputs(gm, layers):
        after = anchor.next
        with g.inserting_before(after):            # in order, after the anchor
            nodes = build(g, positions, table, cp)
        for name, n in nodes.items():
            n._rename(name)     # through the graph's namespace: names stay unique
            if META_KIND not in n.meta:
                p.tag(n, KIND_MASK)
        anchor = after.prev
        out[(positions, table)] = nodes
    return out


def replace_attention(attn: Node, out: Node, kc: Node, vc: Node) -> None:
    users = getitem_users(attn)
    for idx, new in ((0, out), (1, kc), (2, vc)):
        if idx in users:
            users[idx].replace_all_uses_with(new)
            attn.graph.erase_node(users[idx])
    attn.graph.erase_node(attn)


def garbage_kwargs(cfg) -> dict:
    """The cache ops' ``garbage_block`` keyword: none for the default (the last block), so
    the graphs of a default program read as before; ``garbage_block=0`` for vLLM's layout."""
    return {} if cfg.garbage_block == LAST else {"garbage_block": cfg.garbage_block}


def attention_kwargs(attn: Node, cfg) -> tuple[dict, Node | None]:
    """dcp.attention's keyword arguments for partial_attention (window, softcap, kv_shared,
    and the config's garbage block) and its sinks, which never go to a rank's partial
    attention: the sink joins the softmax denominator once, after the combine
    (dcp.sink_correct on the global LSE)."""
    kwargs = dict(attn.kwargs) | garbage_kwargs(cfg)
    return kwargs, kwargs.pop("sinks", None)


def correct_sinks(p: DCPPass, g: Graph, out: Node, global_lse: Node, sinks: Node | None,
                  layer: int, dtype) -> Node:
    """out * sigmoid(global_lse - sink) when the layer has sinks, else out."""
    if sinks is None:
        return out
    fixed = p.tag(g.call_function(dcp_ops.sink_correct.default, (out, global_lse, sinks)),
                  KIND_LSE, layer)
    return g.call_function(aten.to.dtype, (fixed, dtype))


def wire_dtype(cfg, model_dtype: torch.dtype) -> torch.dtype:
    """dtype the partial outputs travel in (combine_dtype); the LSE is always float32."""
    return torch.float32 if cfg.combine_dtype == "float32" else model_dtype


def combine_all_gather(p: DCPPass, g: Graph, out: Node, lse: Node, layer: int, shape,
                       model_dtype, sinks: Node | None = None, cp: Node | None = None) -> Node:
    """Spec steps 5-8: all-gather the LSEs, correct locally, reduce-scatter the heads."""
    W, (b, s, hq, d) = p.ctx.config.dcp, shape
    c, lse_w = C.all_gather(g, lse, Role.DCP, W)                            # [W*b, 1, W*hq]
    p.tag(c, KIND_COLLECTIVE, layer)
    lse_all = g.call_function(aten.view.default, (lse_w, [W, b, s, W * hq]))
    fixed = p.tag(g.call_function(dcp_ops.lse_correct.default, (out, lse, lse_all)),
                  KIND_LSE, layer)
    fixed = g.call_function(aten.to.dtype, (fixed, wire_dtype(p.ctx.config, model_dtype)))
    # Heads of replica-set rank j are the j-th group of W*hq: move them to dim 0 so that the
    # reduce-scatter sums over ranks and hands group j to j.
    f5 = g.call_function(aten.view.default, (fixed, [b, s, W, hq, d]))
    f5 = g.call_function(aten.permute.default, (f5, [2, 0, 1, 3, 4]))
    rs_in = g.call_function(aten.reshape.default, (f5, [W * b, s, hq, d]))
    c, summed = C.reduce_scatter(g, rs_in, Role.DCP, W)                      # [b, 1, hq, d]
    p.tag(c, KIND_COLLECTIVE, layer)
    summed = g.call_function(aten.to.dtype, (summed, model_dtype))
    if sinks is None:
        return summed
    # This rank's heads are group cp_rank of the W*hq (the q all-gather's order): their
    # global LSE, from the LSEs already gathered (no extra collective).
    glob = g.call_function(aten.logsumexp.default, (lse_all, [0]))        # [b, s, W*hq]
    glob = g.call_function(aten.view.default, (glob, [b, s, W, hq]))
    own = g.call_function(aten.index_select.default,
                          (glob, 2, g.call_function(aten.view.default, (cp, [1]))))
    own = g.call_function(aten.view.default, (own, [b, s, hq]))
    return correct_sinks(p, g, summed, own, sinks, layer, model_dtype)


def bitcast(g: Graph, x: Node, src: torch.dtype, dst: torch.dtype) -> Node:
    """Reinterpret the bits of ``x``'s (``src``) last dim as ``dst``; nothing if equal."""
    if src == dst:
        return x
    x = g.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
    return g.call_function(aten.view.dtype, (x, dst))


def combine_all_to_all(p: DCPPass, g: Graph, out: Node, lse: Node, layer: int, shape,
                       model_dtype, sinks: Node | None = None, cp: Node | None = None) -> Node:
    """One all-to-all hands rank j every rank's partial output and LSE of head group j
    (packed in one tensor: the float32 LSE bit-cast to the wire dtype's width), merged
    locally by exp(lse - logsumexp(lses)) (cf. vLLM's DCP all-to-all combine)."""
    W, (b, s, hq, d) = p.ctx.config.dcp, shape
    wire = wire_dtype(p.ctx.config, model_dtype)
    lse_width = 4 // wire.itemsize                  # wire elements holding one float32
    o5 = g.call_function(aten.view.default, (out, [b, s, W, hq, d]))
    o5 = g.call_function(aten.permute.default, (o5, [2, 0, 1, 3, 4]))     # [W, b, s, hq, d]
    o5 = g.call_function(aten.to.dtype, (o5, wire))
    l5 = g.call_function(aten.view.default, (lse, [b, s, W, hq, 1]))
    l5 = g.call_function(aten.permute.default, (l5, [2, 0, 1, 3, 4]))     # [W, b, s, hq, 1]
    l5 = bitcast(g, l5, torch.float32, wire)                              # [.., lse_width]
    packed = g.call_function(aten.cat.default, ([o5, l5], -1))
    send = g.call_function(aten.reshape.default, (packed, [W * b, s, hq, d + lse_width]))
    c, recv = C.all_to_all(g, send, Role.DCP, W, b)            # dim 0: source rank, then row
    p.tag(c, KIND_COLLECTIVE, layer)
    r5 = g.call_function(aten.view.default, (recv, [W, b, s, hq, d + lse_width]))
    parts = g.call_function(aten.slice.Tensor, (r5, -1, 0, d))
    lse_bits = g.call_function(aten.slice.Tensor, (r5, -1, d, d + lse_width))
    lses = bitcast(g, lse_bits, wire, torch.float32)                      # [W, b, s, hq, 1]
    lses = g.call_function(aten.reshape.default, (lses, [W, b, s, hq]))
    merged = p.tag(g.call_function(dcp_ops.lse_merge.default, (parts, lses)), KIND_LSE,
                   layer)
    merged = g.call_function(aten.to.dtype, (merged, model_dtype))
    if sinks is None:
        return merged
    glob = g.call_function(aten.logsumexp.default, (lses, [0]))            # [b, s, hq]
    return correct_sinks(p, g, merged, glob, sinks, layer, model_dtype)


# dcp.attention's DeepSeek Sparse Attention keywords (insert_paged_cache sets them).
INDEX_KWARGS = ("index_q", "index_weights", "index_scale", "index_topk", "index_width")


def pop_index(kwargs: dict) -> dict | None:
    """The DSA selection's keywords taken out of ``kwargs`` (partial_attention gets
    ``keep`` and ``index_width`` instead); None for an attention without an indexer."""
    found = {k: kwargs.pop(k) for k in INDEX_KWARGS if k in kwargs}
    return found if found.get("index_topk") else None


def dsa_keep(p: DCPPass, g: Graph, index: dict, *, k: Node, v: Node, kc: Node, vc: Node,
             k_pos: Node, table: Node, prior: Node, q_pos: Node, cp: Node, layer: int,
             group: int, current: int, role: str = Role.DCP) -> Node:
    """DeepSeek Sparse Attention's exact selection under DCP (runtime/kernels/
    sparse_attention.py), as partial_attention's ``keep`` [b, i, T] on its key axis:

      scores, pos = dcp.index_scores(index_q, w, index K of the current keys, k_pos,
                                     index K columns of the written cache, ...)  # local keys
      cand        = dcp.index_candidates(scores, pos, topk)   # this rank's first topk
      all         = all_gather(cand) over dcp                 # one collective, packed
      thr         = dcp.index_threshold(all, topk)            # identical on every rank
      keep        = selected(scores, pos, thr)                # this rank's own keys

    ``group`` ranks hold the keys (the DCP degree, over ``role``); 1: every key is local
    (the decode engine's prompt step), no collective. ``current``: how many current keys
    the step holds per row (k's token count). The indexer's q and head weights are
    replicated (placement), the same on every rank of the group, for every query."""
    W, cfg = group, p.ctx.config
    width = index["index_width"]
    if not width:   # the layer reuses an earlier layer's selection (GLM-5 "shared")
        return p.selections[index["index_q"]]
    cols = lambda a, b: g.call_function(aten.slice.Tensor, (
        g.call_function(aten.cat.default, ([a, b], -1)), -1, -width, None))
    sc = p.tag(g.call_function(dcp_ops.index_scores.default, (
        index["index_q"], index["index_weights"], cols(k, v), k_pos, cols(kc, vc), table,
        prior, q_pos, cp, cfg.dcp, cfg.interleave_size, index["index_scale"]),
        garbage_kwargs(cfg)), KIND_MASK, layer)
    scores, pos = (g.call_function(operator.getitem, (sc, i)) for i in range(2))
    cand = p.tag(g.call_function(dcp_ops.index_candidates.default,
                                 (scores, pos, index["index_topk"])), KIND_MASK, layer)
    c_s, c_p = (g.call_function(operator.getitem, (cand, i)) for i in range(2))
    b, i = val(q_pos).shape[:2]
    if W > 1:
        # One all-gather: the float32 scores' bits and the positions as int32 side by side.
        # A position (< 2**31, as DSA_ORDER's key requires) narrows to int32 exactly; a
        # bit-cast of int64 to two int32 words would not lower (torch-mlir has no
        # width-changing aten.view.dtype).
        n = min(index["index_topk"],
                val(table).shape[1] * cfg.block_size + current)    # index_candidates' width
        packed = g.call_function(aten.cat.default, (
            [bitcast(g, c_s, torch.float32, torch.int32),
             g.call_function(aten._to_copy.default, (c_p,), {"dtype": torch.int32})], -1))
        c, got = C.all_gather(g, packed, role, W)                          # [W*b, i, 2n]
        p.tag(c, KIND_COLLECTIVE, layer)
        got = g.call_function(aten.view.default, (got, [W, b, i, 2 * n]))
        all_s = bitcast(g, g.call_function(aten.slice.Tensor, (got, -1, 0, n)),
                        torch.int32, torch.float32)
        all_p = g.call_function(aten._to_copy.default, (
            g.call_function(aten.slice.Tensor, (got, -1, n, 2 * n)),), {"dtype": torch.int64})
    else:
        all_s, all_p = (g.call_function(aten.unsqueeze.default, (x, 0)) for x in (c_s, c_p))
    thr = p.tag(g.call_function(dcp_ops.index_threshold.default,
                                (all_s, all_p, index["index_topk"])), KIND_MASK, layer)
    t_s, t_p = (g.call_function(operator.getitem, (thr, i)) for i in range(2))
    # selected(): at or before the threshold pair in DSA_ORDER, and selectable.
    above = g.call_function(aten.gt.Tensor, (scores, t_s))
    tie = g.call_function(aten.logical_and.default, (
        g.call_function(aten.eq.Tensor, (scores, t_s)),
        g.call_function(aten.le.Tensor, (pos, t_p))))
    keep = g.call_function(aten.logical_and.default, (
        g.call_function(aten.ge.Scalar, (pos, 0)),
        g.call_function(aten.logical_or.default, (above, tie))))
    # Per step, every layer's key axis is the same [local prior slots ; current keys]: a
    # later layer reading this indexer's selection (GLM-5's "shared" layers) reuses it.
    p.selections[index["index_q"]] = keep
    return keep


# DCPConfig.combine -> how the partial outputs of a replica set are combined.
COMBINES = {"all_gather": combine_all_gather, "all_to_all": combine_all_to_all}


def all_attention_rewritten(pass_name: str, gm) -> None:
    """Post-condition of the attention rewrites: no dcp.attention node is left."""
    left = [n.name for n in attention_nodes(gm)]
    ensure(not left, pass_name, "dcp.attention nodes left unrewritten", left)


class DCPDecode(DCPPass):
    """Rewrite the decode step's attention into the spec's DCP decode pattern (one token
    per row), or its width-K form (up to K tokens per row, each query bounded per rank)."""

    name = "dcp_decode"
    required = frozenset({Property.TP_SHARDED})
    ensured = frozenset({Property.DCP_REWRITTEN})

    def requires(self, gm):
        from .prove.theorems import MAX_DECODE_LEN
        for attn in attention_nodes(gm):
            width = val(attn.args[0]).shape[1]
            if not 1 <= width <= MAX_DECODE_LEN:
                raise DCPTransformError(
                    f"decode step width outside what the layout proof covers: attention "
                    f"{attn.name} has q of shape {tuple(val(attn.args[0]).shape)} (width "
                    f"{width}), query_local_bound is proven for widths 1..{MAX_DECODE_LEN}. "
                    f"Build the program with StepShapes(decode_len <= {MAX_DECODE_LEN}).")

    def call(self, gm):
        self.selections: dict = {}   # DSA: indexer q -> its keep (dsa_keep)
        cfg, g = self.ctx.config, gm.graph
        W, I, B = cfg.dcp, cfg.interleave_size, cfg.block_size
        cp = cp_rank_node(gm, self)
        layers = attention_nodes(gm)
        step = build_step_metadata(self, gm, cp, layers, self._step_keys)
        written: dict = {}          # cache pair -> its written caches (each written once)
        for layer, attn in enumerate(layers):
            q, k, v, kc, vc, positions, table, scale = attn.args
            b, s, hq, d = val(q).shape
            m = step[(positions, table)]
            with g.inserting_before(attn):
                kc2, vc2 = masked_cache_write(self, g, attn, m["slot_mapping"], layer,
                                              written)
                if W > 1:
                    c, q_w = C.all_gather(g, q, Role.DCP, W)                 # [W*b, 1, hq, d]
                    self.tag(c, KIND_COLLECTIVE, layer)
                    q5 = g.call_function(aten.view.default, (q_w, [W, b, s, hq, d]))
                    q5 = g.call_function(aten.permute.default, (q5, [1, 2, 0, 3, 4]))
                    q_all = g.call_function(aten.reshape.default, (q5, [b, s, W * hq, d]))
                else:
                    q_all = q
                kwargs, sinks = attention_kwargs(attn, self.ctx.config)
                index = pop_index(kwargs)
                if index is not None:     # DeepSeek Sparse Attention: the exact selection
                    kwargs["keep"] = dsa_keep(
                        self, g, index, k=k, v=v, kc=kc2, vc=vc2,
                        k_pos=m["current_key_positions"], table=table,
                        prior=m["prior_local"], q_pos=positions, cp=cp, layer=layer, group=W,
                        current=s)
                    kwargs["index_width"] = index["index_width"]
                for key in POSITION_BIAS_KWARGS if W > 1 else ():
                    if kwargs.get(key) is None:
                        continue
                    # ALiBi's slopes, a distance table: the gathered q's heads need their
                    # rows, gathered alike ([W*hq] / [W*hq, L]).
                    c, rows_w = C.all_gather(g, kwargs[key], Role.DCP, W)
                    self.tag(c, KIND_COLLECTIVE, layer)
                    kwargs[key] = rows_w
                pa = self.tag(g.call_function(
                    dcp_ops.partial_attention.default,
                    (q_all, positions, k, v, m["current_key_positions"], kc2, vc2, table,
                     m["prior_local"], cp, W, I, scale), kwargs),
                    KIND_ATTENTION, layer)   # window, softcap
                out = g.call_function(operator.getitem, (pa, 0))
                if W > 1:
                    lse = g.call_function(operator.getitem, (pa, 1))
                    out = COMBINES[cfg.combine](self, g, out, lse, layer, (b, s, hq, d),
                                                val(q).dtype, sinks, cp)
                elif sinks is not None:   # one rank: its LSE is the global one
                    lse = g.call_function(operator.getitem, (pa, 1))
                    out = correct_sinks(self, g, out, lse, sinks, layer, val(q).dtype)
            replace_attention(attn, out, kc2, vc2)
        self.record(layers=len(layers), dcp=W, interleave_size=I, block_size=B,
                    combine=cfg.combine, combine_dtype=cfg.combine_dtype)
        return PassResult(gm, True)

    def _step_keys(self, g, positions, table, cp) -> dict[str, Node]:
        """The step's layout metadata (every layer reads it): the slot mapping, each row's
        (or query's) local prior bound, and the current keys' positions."""
        W, I, B = self.ctx.config.dcp, self.ctx.config.interleave_size, \
            self.ctx.config.block_size
        slots = g.call_function(dcp_ops.slot_mapping.default, (positions, table, cp, W, I, B))
        width = val(positions).shape[1]
        prior, k_pos = (self._one_token_keys if width == 1 else self._width_k_keys)(
            g, positions, cp)
        return {"slot_mapping": slots, "prior_local": prior, "current_key_positions": k_pos}

    def _one_token_keys(self, g, positions, cp):
        """The spec's pattern: prior slots [0, local_filled(N)), the active token as a
        current key on its owner only (dcp_active_mask)."""
        W, I, B = self.ctx.config.dcp, self.ctx.config.interleave_size, \
            self.ctx.config.block_size
        n = g.call_function(aten.select.int, (positions, 1, 0))
        prior = g.call_function(dcp_ops.local_filled.default, (n, cp, W, I, B))
        active = g.call_function(dcp_ops.active_mask.default, (positions, cp, W, I, B))
        owned = g.call_function(aten.eq.Scalar, (active, 1))
        return prior, g.call_function(aten.where.ScalarOther, (owned, positions, -1))

    def _width_k_keys(self, g, positions, cp):
        """Width K > 1: the owners have written this step's tokens into their shards, so
        every key is read from the cache, query t up to its own local bound
        (layout.query_local_bound, theorem query_local_bound_is_causal); no current key."""
        W, I, B = self.ctx.config.dcp, self.ctx.config.interleave_size, \
            self.ctx.config.block_size
        bound = g.call_function(dcp_ops.query_bound.default, (positions, cp, W, I, B))
        return bound, g.call_function(aten.full_like.default, (positions, -1))

    def ensures(self, gm):
        all_attention_rewritten(self.name, gm)


class DCPContext(DCPPass):
    """Decode engine's prompt step: plain TP attention, owner-only cache writes, no prior."""

    name = "dcp_context"
    required = frozenset({Property.TP_SHARDED})
    ensured = frozenset({Property.DCP_REWRITTEN})

    def call(self, gm):
        self.selections: dict = {}   # DSA: indexer q -> its keep (dsa_keep)
        cfg, g = self.ctx.config, gm.graph
        W, I = cfg.dcp, cfg.interleave_size
        cp = cp_rank_node(gm, self)
        layers = attention_nodes(gm)
        step = build_step_metadata(self, gm, cp, layers, self._step_keys)
        written: dict = {}          # cache pair -> its written caches (each written once)
        for layer, attn in enumerate(layers):
            q, k, v, kc, vc, positions, table, scale = attn.args
            m = step[(positions, table)]
            with g.inserting_before(attn):
                kc2, vc2 = masked_cache_write(self, g, attn, m["slot_mapping"], layer,
                                              written)
                kwargs, sinks = attention_kwargs(attn, self.ctx.config)
                index = pop_index(kwargs)
                if index is not None:     # every key of the prompt is local: no collective
                    kwargs["keep"] = dsa_keep(
                        self, g, index, k=k, v=v, kc=kc2, vc=vc2, k_pos=positions,
                        table=table, prior=m["no_prior"], q_pos=positions, cp=cp,
                        layer=layer, group=1, current=val(positions).shape[1])
                    kwargs["index_width"] = index["index_width"]
                if kwargs.get("mem_k") is not None:   # every key is local: this rank adds
                    kwargs["mem_split"] = False       # the memory key/values itself
                pa = self.tag(g.call_function(
                    dcp_ops.partial_attention.default,
                    (q, positions, k, v, positions, kc2, vc2, table, m["no_prior"], cp, W, I,
                     scale), kwargs), KIND_ATTENTION, layer)
                out = g.call_function(operator.getitem, (pa, 0))
                if sinks is not None:   # every key of the prompt is local: global LSE
                    lse = g.call_function(operator.getitem, (pa, 1))
                    out = correct_sinks(self, g, out, lse, sinks, layer, val(q).dtype)
            replace_attention(attn, out, kc2, vc2)
        self.record(layers=len(layers))
        return PassResult(gm, True)

    def _step_keys(self, g, positions, table, cp) -> dict[str, Node]:
        """The step's slot mapping and its (empty) prior: the first chunk has none."""
        cfg = self.ctx.config
        slots = g.call_function(dcp_ops.slot_mapping.default,
                                (positions, table, cp, cfg.dcp, cfg.interleave_size,
                                 cfg.block_size))
        n = g.call_function(aten.select.int, (positions, 1, 0))
        return {"slot_mapping": slots, "no_prior": g.call_function(aten.mul.Tensor, (n, 0))}

    def ensures(self, gm):
        all_attention_rewritten(self.name, gm)
