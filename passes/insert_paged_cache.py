"""insert_paged_cache: the paged KV cache in an ordinary causal LM's graph.

Input: the torch.export graph of ``forward(input_ids [B, S] (, position_ids [B, S])) ->
logits`` -- a model with no cache and no project API (dcp_compile.frontends.ordinary
captures it).
Output: a graph with the step signature of every other captured model (program.py)::

    (weights..., input_ids, positions, block_table, kv_caches_0, ...) -> (logits, *new caches)

with each attention replaced by one ``dcp.paged_attention`` over the layer's cache
``[num_blocks, block_size, kv_heads, head_dim]``; canonicalize_attention and every later pass
then run unchanged. The layout may differ by layer (Gemma 4's head_dim / KV heads by layer
type: each cache has its own), and a layer whose K and V are an earlier layer's own tensors
(KV shared across layers) reads that layer's cache, with none of its own
(``ModelFacts.kv_layers``; docs/models.md: Per-layer KV layouts).

Attention is found by :mod:`dcp_compile.passes.attention_patterns` (SDPA and its kernels, eager
``softmax(q @ k^T) @ v``; K and V before GQA head repetition: the cache holds kv heads).
Masks are proven, not sampled: each is read as a predicate K(i, j) of positions
(passes/mask_predicate.py) and proven for every position to be causal, or causal within a
window W (passes/prove/masks.py); it is then replaced by the op's causality (and ``window``)
on positions, and its theorem goes to the certificate. Windows a Hugging Face config declares
per layer are checked against the proven mask, and used where the graph has no mask
(``is_causal``); a one-token decode step reuses the windows of the prompt step. A
``position_ids`` input becomes ``clamp_min(positions, 0)``; what the model computes from an
``arange(S)`` is rewritten over that by the next pass, lift_positions (passes/positions.py).
The passes before this one (pipeline.py's capture prologue) dropped export's asserts,
canonicalized linears and slices (canonical_ops.py) and absorbed MLA (one shared K = V).
Refused (DCPTransformError naming the node and its source line): non-causal or bidirectional
attention, masks that are neither causal nor a window or that depend on the tokens, additive
biases (ALiBi), cross-attention (K/V not computed from this step's tokens), K/V that are
not per-token projections (by the placement rules' token dims: e.g. a token shift), dropout.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Callable

import sympy
import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime.errors import DCPKVLayoutError, DCPTransformError
from dcp_compile.runtime.program.facts import KVLayers, KVLayout, ModelFacts
from dcp_compile.runtime.names import BLOCK_TABLE, POSITIONS, cache_input

from .attention_patterns import KERNEL_OF, RESHAPES, Site, fail, find_sites, is_call, site_form
from .finite_fills import fill_condition
from .infra import KIND_ATTENTION, DCPPass, Found, Property, ensure, placeholder, source_of, val
from .layer_sites import looped_layers, twice_over_one_key
from .mask_predicate import I, J, read_mask
from .memory_key_values import memory_rows, split_memory
from .score_bias import DistanceTable, position_bias_of, read_bias
from .sparse_attention import read_index_selection, refuse_top_k_selection
from .placement import Refusal, carried_dim
from .prove.masks import (MaskVerdict, describe, mask_theorem_name, prove_mask,
                          unmasked_theorem)

aten = torch.ops.aten


@dataclass
class Plan:
    sites: list[Site]
    tokens: int
    batch: int
    layouts: list[KVLayout]      # per cache (key/value pair): its kv heads and head_dim
    reads: list[int]             # per layer: the cache it reads (KV shared across layers)
    dtype: torch.dtype
    position_input: Node | None
    kv_shared: bool = False      # K is V (MLA latent): stored once, halves in the two caches
    mask_theorems: tuple = ()    # one per layer (a prompt step only)

    def kv_layers(self) -> KVLayers | None:
        """The facts' per-layer layouts; None for one layout and one cache per layer."""
        kv = KVLayers(tuple(self.layouts), tuple(self.reads))
        return None if kv.uniform else kv


class InsertPagedCache(DCPPass):
    """Ordinary causal LM graph -> paged step graph (see module doc)."""

    name = "insert_paged_cache"
    # Export's metadata asserts would hold dead values alive; an MLA key is stored once.
    required = frozenset({Property.NO_EXPORT_ASSERTS, Property.LATENT_ABSORBED})
    ensured = frozenset({Property.PAGED_CACHE})

    def __init__(self, ctx, *, token_input: str, position_input: str | None,
                 num_blocks: int, max_blocks: int,
                 constants: Callable[[], dict] | None = None,
                 windows: list[int] | None = None, chunks: list[int] | None = None):
        super().__init__(ctx)
        self.num_blocks, self.max_blocks = num_blocks, max_blocks   # the caches' shapes
        # Per-layer sliding windows the model declares (Hugging Face config): a window no
        # shorter than the captured chunk leaves no trace in the graph's mask.
        self.windows = windows
        # ... and attention chunks (Llama 4's attention_chunk_size): checked against the
        # proven masks; a mask-less site (is_causal) takes the config's.
        self.chunks = chunks
        self.token_input = token_input
        self.position_input = position_input
        self.constants = constants          # placeholder -> tensor, for evaluating masks
        self._constants = None

    # -- analysis --------------------------------------------------------------------------

    def plan(self, gm: GraphModule) -> Plan:
        ids = placeholder(gm, self.token_input)
        batch, tokens = val(ids).shape
        pos = None
        if self.position_input is not None:
            pos = placeholder(gm, self.position_input)
        per_token = self._depends_on(gm, ids)
        sites = find_sites(gm)
        if not sites:
            raise DCPTransformError(
                "the model has no attention this compiler recognises (no "
                "scaled_dot_product_attention and no q @ k^T -> softmax -> @ v): there is "
                "nothing to put a KV cache under. Use a causal decoder with SDPA or eager "
                "attention.")
        rows = []
        # Windows: a one-token decode step's mask cannot show one, so it takes the prompt
        # step's (proven, and checked against the config there); a prompt step checks the
        # config's against its proven masks.
        earlier = self.ctx.facts.windows
        declared = earlier if tokens == 1 and earlier is not None else \
            self.windows if self.windows is not None else earlier
        if declared is not None and len(declared) != len(sites):
            twice_over_one_key(sites, len(declared))
            looped_layers(sites, len(declared))
            raise DCPTransformError(
                f"the model declares {len(declared)} attention layers (config layer_types / "
                f"num_hidden_layers, or an earlier step) but this step's graph has "
                f"{len(sites)} attention sites. Every layer must attend once through SDPA or "
                f"eager attention.")
        # Chunks likewise: a one-token step takes the prompt step's proven chunks.
        chunks = self.ctx.facts.chunks if tokens == 1 and self.ctx.facts.chunks is not None \
            else self.chunks
        theorems, indexers = [], {}
        for layer, s in enumerate(sites):
            # DeepSeek Sparse Attention: the indexer's selection off the mask (its causal
            # side is proven below); each indexer feeds one layer.
            s.index = read_index_selection(s)
            if s.index is not None and indexers.setdefault(s.index.node, layer) != layer:
                # GLM-5's "shared" layers reuse an earlier layer's selection: the indexer's
                # K is cached once, beside that layer's latent.
                s.index = replace(s.index, shared=True)
            self._check_site(s, per_token, batch, tokens, pos)
            verdict = self._prove_mask(s, layer, tokens, pos) if s.mask is not None else None
            self._set_window(s, declared[layer] if declared else 0, layer, verdict)
            self._set_chunk(s, chunks[layer] if chunks and layer < len(chunks) else 0, layer,
                            verdict)
            if tokens > 1:
                theorems.append(verdict.theorem if verdict else
                                unmasked_theorem(layer, s.causal, s.window, s.node.name))
            rows.append(self._cache_row(s))
        # The layout may differ by layer (Gemma 4's head_dim by layer type: one cache group
        # per layout); the dtype and how K and V are stored may not.
        kinds = {(dtype, shared) for _, dtype, shared in rows}
        if len(kinds) != 1:
            raise DCPTransformError(
                f"attention layers disagree on the KV cache dtype or on storing K = V once "
                f"(latent attention): {sorted(map(str, kinds))}. DCP keeps one cache dtype "
                f"and one K/V storage for every layer. Build the model in one dtype.")
        (dtype, shared), = kinds
        layouts, reads = _cache_owners(sites, [KVLayout(*row[0]) for row in rows])
        return Plan(sites=sites, tokens=tokens, batch=batch, layouts=layouts, reads=reads,
                    dtype=dtype, position_input=pos, kv_shared=shared,
                    mask_theorems=tuple(theorems))

    @staticmethod
    def _cache_row(s: Site):
        """((kv heads, head_dim of each cache), dtype, K is V). A tensor that is both the key
        and the value (MLA's [latent ; k_pe]) is stored once: its halves in the two caches.
        Values narrower than the keys (MLA not absorbed: v_head_dim < qk_head_dim) are
        stored padded with zeros to the keys' width; the output is cut back to theirs."""
        heads, width = val(s.k).shape[1], val(s.k).shape[3]
        shared = s.k is s.v
        if s.index is not None and not s.index.shared:   # DSA: the indexer's K beside it
            width += s.index.width
        if not shared and val(s.v).shape[3] > width:
            fail(s.node, f"attention {s.node.name}'s values are wider ({val(s.v).shape[3]}) "
                 f"than its keys ({width}): the paged cache holds one head_dim for both",
                 "Use a value head_dim no larger than the key head_dim")
        if shared and width % 2:
            fail(s.node, f"attention {s.node.name} uses one tensor {s.k.name} as key and "
                  f"value, of odd width {width}: it is stored once, split in halves over the "
                  f"key and value caches", "Use an even kv_lora_rank + qk_rope_head_dim")
        return (heads, width // 2 if shared else width), val(s.k).dtype, shared

    @staticmethod
    def _depends_on(gm, root: Node) -> set[Node]:
        out = {root}
        for n in gm.graph.nodes:
            if any(a in out for a in n.all_input_nodes):
                out.add(n)
        return out

    def _check_site(self, s: Site, per_token: set, batch: int, tokens: int, pos) -> None:
        split_memory(s, per_token, tokens, token_input=self.token_input, position_input=pos,
                     constants=self._constant_values)
        for what, t in (("query", s.q), ("key", s.k), ("value", s.v)):
            shape = val(t).shape
            if len(shape) != 4 or shape[0] != batch:
                fail(s.node, f"attention {what} {t.name} has shape {tuple(shape)}, not "
                     f"[batch={batch}, heads, tokens, head_dim]", "Attention must be over "
                     "[B, H, S, D] tensors of this step's tokens")
            if what != "query" and shape[2] != tokens:
                _memory_key_values(s, what, t, per_token)
            if shape[2] != tokens or t not in per_token:
                fail(s.node, f"cross-attention: the {what} ({t.name}, shape "
                     f"{tuple(shape)}) is not computed from this step's {tokens} tokens",
                     "A paged KV cache holds the keys and values of the sequence's own "
                     "tokens; only causal self-attention can be cached")
        for what, t in (("key", s.k), ("value", s.v)):
            self._check_per_token(s, what, t, per_token, batch, tokens)
        hq, hkv = val(s.q).shape[1], val(s.k).shape[1]
        if val(s.v).shape[1] != hkv or hq % hkv:
            fail(s.node, f"head counts q={hq}, k={hkv}, v={val(s.v).shape[1]} are not a "
                 f"GQA grouping", "K and V need the same heads, dividing Q's")
        if s.mask is None and not s.causal and tokens > 1:
            fail(s.node, f"non-causal attention (is_causal=False, no mask) over {tokens} "
                 f"tokens: every token attends to later ones (an encoder)",
                 "Only causal decoders can be served from a KV cache")
        # tokens == 1 with no mask: one query, one key -- causal and full attention agree.

    def _check_per_token(self, s: Site, what: str, t: Node, per_token: set, batch: int,
                         tokens: int) -> None:
        """K/V must be per-token projections: walking back from them to the linears that
        produce them, every op acts on each token on its own (a cache holds one K/V row per
        token, computed once, when the token is in the step). Shown by the placement rules
        (``carried_dim``): from the projection's token dim (1 of the [B, S, F] stream), every
        op keeps the token dim whole, and K/V end with tokens at dim 2 ([B, H, S, D]). A
        one-token step cannot show a mix of tokens: the prompt step of the same model (S > 1)
        did."""
        stack, path, linears = [t], set(), []
        while stack:
            n = stack.pop()
            if n in path or n not in per_token or n.op != "call_function":
                continue
            path.add(n)
            if n.target == aten.linear.default:
                linears.append(n)                               # the projection
                continue
            if n.target == aten.embedding.default:
                fail(s.node, f"the {what} reaches the token embedding {n.name} without a "
                     f"projection", "K and V must be linear projections of the hidden state")
            stack.extend(n.all_input_nodes)
        if tokens == 1:
            return
        order = {n: i for i, n in enumerate(t.graph.nodes)}
        dims = {lin: 1 for lin in linears if val(lin).dim() == 3}
        for n in sorted(path - set(linears), key=order.get):
            try:
                dims[n] = carried_dim(n, dims, tokens)
            except Refusal as e:
                fail(n, f"the {what} of attention {s.node.name} is computed through "
                     f"{n.target}, which this compiler cannot show acts on each token on its "
                     f"own ({e})", "K and V must be per-token projections (linear, RoPE, "
                     "per-head norms, views): an op that mixes tokens (shift, convolution, "
                     "cumsum over the sequence) cannot be served from a KV cache")
        if dims.get(t) != 2:
            fail(s.node, f"the {what} {t.name} of attention {s.node.name} has its tokens at "
                 f"dim {dims.get(t)}, not 2 of [B, H, S, D]", "Pass attention [B, H, S, D] "
                 "tensors of per-token projections")

    # -- masks (passes/mask_predicate.py reads them, passes/prove/masks.py proves them) -----

    def _prove_mask(self, s: Site, layer: int, tokens: int, pos) -> MaskVerdict | None:
        """The site's mask proven causal (within a window W) for every position; sets
        ``s.window``. A one-token step's mask only has to keep its one key (its window comes
        from the prompt step or the config)."""
        refuse_top_k_selection(s)      # DeepSeek Sparse Attention, by name
        read = read_mask(s, tokens, token_input=self.token_input, position_input=pos,
                         constants=self._constant_values)
        keep = read.keep
        self._read_alibi(s, tokens, pos, read)
        if tokens == 1:
            if not bool(keep.subs({I: 0, J: 0})):
                fail(s.mask, f"attention {s.node.name}'s one-token mask hides the token's "
                     f"own key", "Use a causal mask")
            return None
        verdict = prove_mask(keep, name=mask_theorem_name(layer),
                             where=f"layer {layer} ({s.mask.name}, {source_of(s.mask)})")
        if not verdict.proven:
            past = verdict.theorem.counterexample or {}
            edge = (f" (past the captured length {tokens}: a mask written at fixed "
                    f"positions, e.g. row by row by a Python loop as litgpt's sliding window "
                    f"is, is in the graph at that length only, and past it is what it was "
                    f"before the writes)") if past.get("i", 0) >= tokens else ""
            fail(s.mask, f"attention {s.node.name} applies {_what_mask(verdict)}: "
                 f"{verdict.why}{_example(verdict)}{edge}", "The paged cache replaces the "
                 "mask by causality (and a sliding window) on positions; other masks are not "
                 "supported: use a causal decoder, its mask a tensor expression of positions")
        s.window = verdict.window
        s.chunk = verdict.chunk
        if s.fill is not None:
            verdict = replace(verdict, theorem=replace(
                verdict.theorem, statement=verdict.theorem.statement + fill_condition(s)))
        return verdict

    def _read_alibi(self, s: Site, tokens: int, pos, read) -> None:
        """The score bias the site adds (its own term, MPT; or inside its additive mask,
        Falcon) proven ALiBi for every position and head (``score_bias.alibi_of``);
        sets ``s.alibi``."""
        bias, tables = read.bias, dict(read.tables or {})
        if s.bias is not None:
            extra, more = read_bias(s, tokens, token_input=self.token_input,
                                    position_input=pos, constants=self._constant_values)
            # Two readings name their tables table_0, table_1, ...: keep them apart.
            renamed = {f: sympy.Function(f"bias_{f}") for f in more}
            for f, g in renamed.items():
                extra = extra.replace(f, g)
                tables[g] = more[f]
            bias = bias + extra * s.bias_scale
        s.alibi = position_bias_of(s, bias, tables)

    def _set_window(self, s: Site, declared: int, layer: int, verdict) -> None:
        """Config windows (Hugging Face layer_types / sliding_window) checked against the
        proven mask; a site without a mask (is_causal, one token) takes the config's."""
        if verdict is None:
            s.window = declared or s.window
            return
        if declared and declared != verdict.window:
            wrong = prove_mask(verdict.keep, name="", where="", expected=declared)
            fail(s.node, f"layer {layer}'s mask, proven for every position, keeps key j for "
                 f"query i iff {describe(verdict.window)}, but the config declares "
                 f"sliding_window={declared}{_example(wrong)}", "Fix the config "
                 "(sliding_window / layer_types) or the mask")


    def _set_chunk(self, s: Site, declared: int, layer: int, verdict) -> None:
        """Config chunks (Llama 4's attention_chunk_size on its chunked_attention layers)
        checked against the proven mask; a site without a mask (is_causal, one token) takes
        the config's (or the prompt step's)."""
        if verdict is None:
            s.chunk = declared or s.chunk
            return
        if declared and declared != verdict.chunk:
            fail(s.node, f"layer {layer}'s mask, proven for every position, keeps key j for "
                 f"query i iff {describe(verdict.window, verdict.chunk)}, but the config "
                 f"declares attention_chunk_size={declared} on it", "Fix the config "
                 "(attention_chunk_size / layer_types) or the mask")

    def _constant_values(self) -> dict:
        """Input name -> the model's tensor (weights, buffers, lifted constants), once."""
        if self._constants is None and self.constants is not None:
            self._constants = self.constants()
        return self._constants or {}

    # -- rewrite ---------------------------------------------------------------------------

    def call(self, gm):
        g = gm.graph
        plan = self.plan(gm)
        ids = placeholder(gm, self.token_input)
        mode = detect_fake_mode([n.meta["val"] for n in g.nodes if n.op == "placeholder"])
        cfg = self.ctx.config
        num_blocks, max_blocks = self.num_blocks, self.max_blocks
        device = val(ids).device
        def new_input(name, shape, dtype, anchor):
            with g.inserting_after(anchor):
                p = g.placeholder(name)
            with mode:
                p.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
            return p

        anchor = plan.position_input or ids
        positions = new_input(POSITIONS, (plan.batch, plan.tokens), torch.int64, anchor)
        table = new_input(BLOCK_TABLE, (plan.batch, max_blocks), torch.int64, positions)
        caches, last = [], table
        for i, lay in enumerate(plan.layouts):    # one key and one value cache each
            shape = (num_blocks, cfg.block_size, lay.kv_heads, lay.head_dim)
            for j in (2 * i, 2 * i + 1):
                last = new_input(cache_input(j), shape, plan.dtype, last)
                caches.append(last)

        new_caches = []
        for layer, s in enumerate(plan.sites):
            c = plan.reads[layer]
            head_dim = plan.layouts[c].head_dim
            with g.inserting_before(s.out):
                q, k, v = (self._bshd(g, t) for t in (s.q, s.k, s.v))
                if s.index is not None and not s.index.shared:   # [latent ; k_pe ; index K]
                    k = v = _with_index_k(g, k, s.index, val(s.k).dtype)
                if plan.kv_shared:          # halves of the one K = V tensor
                    h = head_dim
                    k, v = (g.call_function(aten.slice.Tensor, (k, 3, a, a + h))
                            for a in (0, h))
                v_width = val(s.v).shape[3]
                if not plan.kv_shared and v_width < head_dim:
                    v = _pad_values(g, v, head_dim - v_width)
                params = {k: x for k, x in (("window", s.window), ("softcap", s.softcap),
                                            ("kv_shared", plan.kv_shared),
                                            ("attention_chunk", s.chunk)) if x}
                if s.sinks is not None:
                    params["sinks"] = s.sinks
                if s.mem is not None:   # memory key/values, [1, M, Hkv, D] like k's rows
                    params["mem_k"], params["mem_v"] = (memory_rows(g, t) for t in s.mem)
                if isinstance(s.alibi, DistanceTable):
                    params["distance_table"] = _distance_table(g, s.alibi, val(s.q).shape[1])
                elif s.alibi is not None:
                    params["alibi_slopes"] = _slopes(g, s.alibi, val(s.q).shape[1])
                if s.index is not None:
                    params.update(index_q=s.index.q, index_weights=s.index.weights,
                                  index_scale=s.index.scale, index_topk=s.index.topk,
                                  index_width=0 if s.index.shared else s.index.width)
                # A layer sharing another layer's K/V reads that layer's cache (the same
                # inputs); the DCP rewrites write each cache once (its owner's write).
                attn = g.call_function(torch.ops.dcp.paged_attention.default,
                                       (q, k, v, caches[2 * c], caches[2 * c + 1],
                                        positions, table, s.scale), params)
                out, kc, vc = (g.call_function(operator.getitem, (attn, i)) for i in range(3))
                if not plan.kv_shared and v_width < head_dim:   # the values' own width
                    out = g.call_function(aten.slice.Tensor, (out, 3, 0, v_width))
                bhsd = g.call_function(aten.transpose.int, (out, 1, 2))
            if val(s.out).dtype != val(s.q).dtype:
                with g.inserting_after(bhsd):
                    bhsd = g.call_function(aten.to.dtype, (bhsd, val(s.out).dtype))
            for n in (q, k, v, attn, out, kc, vc, bhsd):  # errors downstream name the source
                for key in ("stack_trace", "nn_module_stack"):
                    if key in s.node.meta and key not in n.meta:
                        n.meta[key] = s.node.meta[key]
            s.out.replace_all_uses_with(bhsd)
            _fold_layout_noops(bhsd, out if bhsd.args[0] is out else None,
                               tuple(val(s.out).shape))
            if plan.reads.index(c) == layer:      # the cache's owner returns it
                new_caches += [kc, vc]
            self.tag(attn, KIND_ATTENTION, layer)
        output = next(n for n in g.nodes if n.op == "output")
        logits, *rest = output.args[0] if isinstance(output.args[0], (tuple, list)) \
            else (output.args[0],)
        # A hybrid step's state caches stay outputs, after the KV caches (frontends/hybrid.py)
        output.args = ((logits, *new_caches, *rest),)
        _drop_dead(g)           # masks and repeated K/V die with the attention they fed
        first_op = next(n for n in g.nodes if n.op != "placeholder")
        with g.inserting_before(first_op):
            # Padding (position -1) gets the embedding of position 0; the op zeroes its output.
            # What the model computes from positions reads this (lift_positions).
            clamped = g.call_function(aten.clamp_min.default, (positions, 0))
        if plan.position_input is not None:
            plan.position_input.replace_all_uses_with(clamped)
            g.erase_node(plan.position_input)
        # A one-token step's mask shows no window: it keeps the prompt step's. The prompt
        # step's mask theorems go to the certificate (validate_and_prove).
        windows = tuple(s.window for s in plan.sites) \
            if plan.tokens > 1 or self.ctx.facts.windows is None else None
        chunks = tuple(s.chunk for s in plan.sites) \
            if plan.tokens > 1 or self.ctx.facts.chunks is None else None
        found = ModelFacts(num_layers=len(plan.sites), cache_dtype=plan.dtype,
                           windows=windows, chunks=chunks,
                           mask_theorems=plan.mask_theorems or None,
                           kv_layers=plan.kv_layers())
        heads, dims = (sorted({getattr(x, f) for x in plan.layouts})
                       for f in ("kv_heads", "head_dim"))
        self.record(layers=len(plan.sites), caches=len(plan.layouts),    # one value each
                    kv_heads=heads if len(heads) > 1 else heads[0],      # for one layout
                    head_dim=dims if len(dims) > 1 else dims[0],
                    forms=sorted({site_form(s) for s in plan.sites}),
                    positions="position_ids" if plan.position_input is not None else "arange")
        return Found(gm, True, facts=found)

    @staticmethod
    def _bshd(g, t: Node) -> Node:
        """[B, H, S, D] -> [B, S, H, D]; a transpose(1, 2) the model made is undone, not
        stacked (keeps the token dim at 1 for the prefill passes)."""
        if is_call(t, {aten.transpose.int}) and {d % 4 for d in t.args[1:]} == {1, 2}:
            return t.args[0]
        return g.call_function(aten.transpose.int, (t, 1, 2))

    def ensures(self, gm):
        left = [n.name for n in gm.graph.nodes if is_call(n, KERNEL_OF)]
        ensure(not left, self.name, "attention kernels left without a paged cache", left)


def _cache_owners(sites: list[Site], layouts: list[KVLayout]
                  ) -> tuple[list[KVLayout], list[int]]:
    """(each cache's layout, the cache each layer reads). A layer whose key and value are
    an earlier layer's own tensors (Gemma 4's ``num_kv_shared_layers``: the last layers
    attend the K/V of the last layer of their type that computed them) reads that layer's
    cache: no second copy. A layer sharing only one of K and V is refused by name."""
    caches, reads, owner_of = [], [], {}
    for layer, s in enumerate(sites):
        owner = owner_of.get((s.k, s.v))
        if owner is None:
            for (k, v), o in owner_of.items():
                if s.k is k or s.v is v:
                    what = "key" if s.k is k else "value"
                    raise DCPKVLayoutError(
                        f"attention {s.node.name} (layer {layer}, {source_of(s.node)}) shares "
                        f"its {what} with layer {o} but not its "
                        f"{'value' if what == 'key' else 'key'}: a layer reads another "
                        f"layer's KV cache whole (KV shared across layers) or has its own, "
                        f"and a cache holds one key and one value per token. Share both K "
                        f"and V, or neither.")
            owner_of[(s.k, s.v)] = layer
            reads.append(len(caches))
            caches.append(layouts[layer])
        else:
            reads.append(reads[owner])
    return caches, reads


def _what_mask(verdict: MaskVerdict) -> str:
    """The kind of mask a failed verdict is about, from its counterexample."""
    example = verdict.theorem.counterexample
    if verdict.keep == sympy.true:
        return "a bidirectional mask (every token sees every token, an encoder)"
    if example and example["mask"] and example["j"] > example["i"]:
        return "a mask that is not causal (a query attends a later key)"
    if example is None:
        return "a mask that is not causal within a window"
    return ("a causal mask that also hides some earlier tokens, not as a sliding window "
            "(the same for every query)")


def _example(verdict: MaskVerdict) -> str:
    e = verdict.theorem.counterexample
    if not e:
        return ""
    return (f" (at query position i={e['i']}, key position j={e['j']} the mask "
            f"{'keeps' if e['mask'] else 'hides'} the key)")


def _slopes(g, alibi, heads: int) -> Node:
    """ALiBi's [heads] slopes from the model's own table node (proven by
    score_bias.alibi_of): reshaped (or expanded, one slope for all heads) and scaled."""
    t = alibi.table
    if t is None:     # one slope for every head
        return g.call_function(aten.full.default, ([heads], alibi.coefficient),
                               {"dtype": torch.float32})
    flat = g.call_function(aten.reshape.default, (t, [-1]))
    if val(t).numel() == 1:
        flat = g.call_function(aten.expand.default, (flat, [heads]))
    elif val(t).numel() != heads:
        fail(t, f"ALiBi slope table {t.name} of shape {tuple(val(t).shape)} for {heads} "
             f"heads", "Give one slope per query head")
    flat = g.call_function(aten.to.dtype, (flat, torch.float32))
    return g.call_function(aten.mul.Tensor, (flat, alibi.coefficient))


def _with_index_k(g, k: Node, sel, dtype: torch.dtype) -> Node:
    """The MLA latent [B, S, 1, L + dr] with the indexer's K [B, S, d] after it (DeepSeek
    Sparse Attention): one vector per token, cached once by its owner in the layer's
    latent cache (runtime/kernels/sparse_attention.py ``index_columns``)."""
    ik = g.call_function(aten.unsqueeze.default, (sel.k, 2))
    if val(sel.k).dtype != dtype:
        ik = g.call_function(aten.to.dtype, (ik, dtype))
    return g.call_function(aten.cat.default, ([k, ik], -1))


def _distance_table(g, bias: DistanceTable, heads: int) -> Node:
    """A distance table [heads, L] (proven by score_bias.distance_table_of), float32, scaled
    by its coefficient."""
    t = bias.table
    if val(t).dim() != 2 or val(t).shape[0] != heads:
        fail(t, f"distance table {t.name} of shape {tuple(val(t).shape)} for {heads} heads",
             "Give one row per query head")
    t = g.call_function(aten.to.dtype, (t, torch.float32))
    return t if bias.coefficient == 1.0 else \
        g.call_function(aten.mul.Tensor, (t, bias.coefficient))


def _pad_values(g, v: Node, extra: int) -> Node:
    """V [B, S, H, Dv] -> [B, S, H, Dv + extra], zeros after: softmax(q k^T) @ [v, 0] is
    [out, 0], so keys and values share one cache head_dim (unabsorbed MLA, Dv < Dqk)."""
    return g.call_function(aten.constant_pad_nd.default, (v, [0, extra], 0.0))


def _fold_layout_noops(bhsd: Node, bshd: Node | None, shape: tuple) -> None:
    """Users of the [B, H, S, D] output that only undo it: an identity reshape (Hugging
    Face's SDPA path) reads ``bhsd`` itself, a transpose(1, 2) reads the op's own [B, S, H, D]
    output. Keeps the token dim at 1 on the output path, as the prefill passes need."""
    for u in list(bhsd.users):
        if is_call(u, RESHAPES) and tuple(val(u).shape) == shape:
            u.replace_all_uses_with(bhsd)
    for u in list(bhsd.users) if bshd is not None else []:
        if is_call(u, {aten.transpose.int}) and {d % 4 for d in u.args[1:]} == {1, 2}:
            u.replace_all_uses_with(bshd)


def _drop_dead(g) -> None:
    """Remove nodes nothing reads; the ops torch calls impure only because they are seeded
    (dropout, the SDPA kernels) die with what they read."""
    removable = {aten.dropout.default, *KERNEL_OF}
    changed = True
    while changed:
        changed = False
        for n in reversed(list(g.nodes)):
            if n.op == "call_function" and not n.users and (not n.is_impure()
                                                            or n.target in removable):
                g.erase_node(n)
                changed = True
