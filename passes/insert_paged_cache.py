"""Insert the paged KV cache into an ordinary causal LM's graph.

Input: the torch.export graph of ``forward(input_ids [B, S] (, position_ids [B, S])) ->
logits`` -- a model with no cache and no project API (dcp_compile.frontends.ordinary
captures it).
Output: a graph with the step signature of every other captured model (program.py)::

    (weights..., input_ids, positions, block_table, kv_caches_0, ...) -> (logits, *new caches)

with each attention replaced by one ``dcp.paged_attention`` over the layer's cache
``[num_blocks, block_size, kv_heads, head_dim]``; canonicalize_attention and every later pass
then run unchanged.

Attention is found by :mod:`dcp_compile.passes.attention_patterns` (SDPA and its kernels, eager
``softmax(q @ k^T) @ v``; K and V before GQA head repetition: the cache holds kv heads).
Masks are checked by evaluating them (they may depend only on the positions, constants and
buffers): causal, or causal within a sliding window, is accepted and replaced by the op's
causality (and ``window``) on positions. Windows a Hugging Face config declares per layer are
used too (a window no shorter than the captured chunk leaves no trace in the mask), and a
one-token decode step reuses the windows found in the prompt step. Positions come from the
``position_ids`` input or an ``arange(S).unsqueeze(0)`` in the graph.
Refused (DCPTransformError naming the node and its source line): non-causal or bidirectional
attention, masks that are neither causal nor a window or that depend on the tokens, additive
biases (ALiBi), cross-attention (K/V not computed from this step's tokens), K/V that are
not per-token projections (_PER_TOKEN_RULES: e.g. a token shift), dropout.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

import dcp_compile.runtime.ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.facts import LatentAttention, ModelFacts
from dcp_compile.runtime.names import BLOCK_TABLE, POSITIONS, cache_input

from .absorb_latent_attention import absorb_latent_attention
from .attention_patterns import (KERNEL_OF, MASKED_OUT, RESHAPES, Site, fail, find_sites,
                                 is_call, site_form)
from .infra import KIND_ATTENTION, DCPPass, Found, ensure, placeholder, val

aten = torch.ops.aten


@dataclass
class Plan:
    sites: list[Site]
    tokens: int
    batch: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    position_input: Node | None
    kv_shared: bool = False      # K is V (MLA latent): stored once, halves in the two caches


class InsertPagedCache(DCPPass):
    """Ordinary causal LM graph -> paged step graph (see module doc)."""

    name = "insert_paged_cache"

    def __init__(self, ctx, *, token_input: str, position_input: str | None,
                 num_blocks: int, max_blocks: int,
                 constants: Callable[[], dict] | None = None,
                 windows: list[int] | None = None):
        super().__init__(ctx)
        self.num_blocks, self.max_blocks = num_blocks, max_blocks   # the caches' shapes
        # Per-layer sliding windows the model declares (Hugging Face config): a window no
        # shorter than the captured chunk leaves no trace in the graph's mask.
        self.windows = windows
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
        shapes = set()
        # Windows: declared by the config, or found in an earlier step's mask (a one-token
        # decode step's mask cannot show one).
        declared = self.windows if self.windows is not None else self.ctx.facts.windows
        if declared is not None and len(declared) != len(sites):
            raise DCPTransformError(
                f"the model declares {len(declared)} attention layers (config layer_types / "
                f"num_hidden_layers, or an earlier step) but this step's graph has "
                f"{len(sites)} attention sites. Every layer must attend once through SDPA or "
                f"eager attention.")
        for layer, s in enumerate(sites):
            self._check_site(s, per_token, batch, tokens, pos)
            self._set_window(s, declared[layer] if declared else 0, layer, tokens)
            shapes.add(self._cache_row(s))
        if len(shapes) != 1:
            raise DCPTransformError(
                f"attention layers disagree on (kv heads, head_dim) and dtype: "
                f"{sorted(map(str, shapes))}. DCP needs one KV cache layout for every layer.")
        (kv_heads, head_dim), dtype, shared = shapes.pop()
        return Plan(sites=sites, tokens=tokens, batch=batch, kv_heads=kv_heads,
                    head_dim=head_dim, dtype=dtype, position_input=pos, kv_shared=shared)

    @staticmethod
    def _cache_row(s: Site):
        """((kv heads, head_dim of each cache), dtype, K is V). A tensor that is both the key
        and the value (MLA's [latent ; k_pe]) is stored once: its halves in the two caches."""
        heads, width = val(s.k).shape[1], val(s.k).shape[3]
        shared = s.k is s.v
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
        for what, t in (("query", s.q), ("key", s.k), ("value", s.v)):
            shape = val(t).shape
            if len(shape) != 4 or shape[0] != batch:
                fail(s.node, f"attention {what} {t.name} has shape {tuple(shape)}, not "
                     f"[batch={batch}, heads, tokens, head_dim]", "Attention must be over "
                     "[B, H, S, D] tensors of this step's tokens")
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
        if s.mask is not None:
            self._check_mask(s, tokens, pos)
        elif not s.causal and tokens > 1:
            fail(s.node, f"non-causal attention (is_causal=False, no mask) over {tokens} "
                 f"tokens: every token attends to later ones (an encoder)",
                 "Only causal decoders can be served from a KV cache")
        # tokens == 1 with no mask: one query, one key -- causal and full attention agree.

    def _check_per_token(self, s: Site, what: str, t: Node, per_token: set, batch: int,
                         tokens: int) -> None:
        """K/V must be per-token projections: walking back from them to the linears that
        produce them, every op acts on each token on its own (a cache holds one K/V row per
        token, computed once, when the token is in the step)."""
        stack, seen = [t], set()
        while stack:
            n = stack.pop()
            if n in seen or n not in per_token or n.op != "call_function":
                continue
            seen.add(n)
            if n.target == aten.linear.default:
                continue                                       # the projection
            if n.target == aten.embedding.default:
                fail(s.node, f"the {what} reaches the token embedding {n.name} without a "
                     f"projection", "K and V must be linear projections of the hidden state")
            rule = _PER_TOKEN_RULES.get(n.target)
            pointwise = torch.Tag.pointwise in getattr(n.target, "tags", ())
            if not pointwise and (rule is None or not rule(n, batch, tokens)):
                fail(n, f"the {what} of attention {s.node.name} is computed through "
                     f"{n.target}, which this compiler cannot show acts on each token on its "
                     f"own", "K and V must be per-token projections (linear, RoPE, per-head "
                     "norms, views): an op that mixes tokens (shift, convolution, cumsum over "
                     "the sequence) cannot be served from a KV cache")
            stack.extend(n.all_input_nodes)

    # -- masks -----------------------------------------------------------------------------

    def _check_mask(self, s: Site, tokens: int, pos) -> None:
        allowed = self._evaluate_mask(s, tokens, pos)
        causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
        if allowed.shape[-2:] != causal.shape:
            fail(s.mask, f"attention mask of shape {tuple(allowed.shape)} for {tokens} "
                 f"queries and keys", "Use a [..., S, S] causal mask")
        if bool((allowed == causal).all()):
            return
        i = torch.arange(tokens)
        for w in range(1, tokens):
            if bool((allowed == (causal & (i[:, None] - i[None, :] < w))).all()):
                s.window = w
                return
        rows = allowed.reshape(-1, tokens, tokens)
        if bool(rows.all()):
            why = "a bidirectional mask (every token sees every token, an encoder)"
        elif bool((rows <= causal).all()) and bool(rows.diagonal(dim1=-2, dim2=-1).all()):
            why = ("a causal mask that also hides some earlier tokens, not as a sliding "
                   "window (the same for every query)")
        else:
            why = "a mask that is not causal"
        fail(s.mask, f"attention {s.node.name} applies {why}",
             "The paged cache replaces the mask by causality (and a sliding window) on "
             "positions; other masks are not supported: use a causal decoder")

    def _set_window(self, s: Site, declared: int, layer: int, tokens: int) -> None:
        if not declared:
            return
        if s.window and s.window != declared:
            fail(s.node, f"layer {layer}'s mask is a window of {s.window} tokens but the "
                 f"config declares sliding_window={declared}", "Fix the config")
        if not s.window and declared < tokens and (s.mask is not None or tokens > 1):
            fail(s.node, f"the config declares sliding_window={declared} for layer {layer} "
                 f"but its mask over {tokens} tokens is fully causal", "Fix the config")
        s.window = declared

    def _evaluate_mask(self, s: Site, tokens: int, pos) -> torch.Tensor:
        """The mask's value at positions 0..S-1, as 'query i may attend key j' booleans."""
        need, stack = [], [s.mask]
        seen = set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            need.append(n)
            stack.extend(n.all_input_nodes)
        order = {n: i for i, n in enumerate(s.mask.graph.nodes)}
        env = {}
        for n in sorted(need, key=order.get):
            if n.op == "placeholder":
                env[n] = self._placeholder_value(n, s, tokens, pos)
            elif n.op == "call_function":
                args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                if "device" in kwargs:
                    kwargs = {**kwargs, "device": torch.device("cpu")}
                try:
                    env[n] = n.target(*args, **kwargs)
                except Exception as e:
                    fail(n, f"the attention mask of {s.node.name} could not be evaluated "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                         "Build the mask from positions or torch.arange only")
            else:
                fail(n, f"attention mask built from {n.op} {n.target}", "Build the mask "
                     "from positions or torch.arange only")
        m = env[s.mask]
        if s.mask_kind == "keep":
            return m.bool()
        if s.mask_kind == "drop":
            return ~m.bool()
        if not m.is_floating_point():
            fail(s.mask, f"additive attention mask of dtype {m.dtype}", "Use a float mask")
        bias = ~((m == 0) | (m <= MASKED_OUT))
        if bool(bias.any()):
            fail(s.mask, f"the attention mask of {s.node.name} adds values other than 0 and "
                 f"-inf (e.g. {m[bias].flatten()[0].item():g}): a position bias such as "
                 f"ALiBi", "The paged op has no attention bias: use a model without one")
        return m == 0

    def _placeholder_value(self, n: Node, s: Site, tokens: int, pos):
        if n.name == self.token_input:
            fail(s.mask, f"the attention mask of {s.node.name} depends on the token ids "
                 f"(data-dependent mask)", "Masks may depend only on positions: padding is "
                 "expressed by position -1 in a DCP program")
        if pos is not None and n is pos:
            b = val(n).shape[0]
            return torch.arange(tokens).expand(b, tokens).clone()
        if self._constants is None and self.constants is not None:
            self._constants = self.constants()
        t = (self._constants or {}).get(n.name)
        if t is None or t.is_meta:
            fail(s.mask, f"the attention mask of {s.node.name} reads {n.name}, whose value "
                 f"is not available here (meta device or not a weight/buffer)",
                 "Build causal masks from torch.arange, or transform a model with real "
                 "weights")
        return t.detach().cpu()

    # -- rewrite ---------------------------------------------------------------------------

    def call(self, gm):
        g = gm.graph
        for n in list(g.nodes):  # export's metadata asserts would hold dead values alive
            if is_call(n, {aten._assert_tensor_metadata.default}):
                g.erase_node(n)
        latent = absorb_latent_attention(gm)    # MLA -> one shared latent head (no-op else)
        plan = self.plan(gm)
        ids = placeholder(gm, self.token_input)
        mode = detect_fake_mode([n.meta["val"] for n in g.nodes if n.op == "placeholder"])
        cfg = self.ctx.config
        num_blocks, max_blocks = self.num_blocks, self.max_blocks
        device = val(ids).device
        cache_shape = (num_blocks, cfg.block_size, plan.kv_heads, plan.head_dim)

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
        for i in range(2 * len(plan.sites)):
            last = new_input(cache_input(i), cache_shape, plan.dtype, last)
            caches.append(last)

        new_caches = []
        for layer, s in enumerate(plan.sites):
            with g.inserting_before(s.out):
                q, k, v = (self._bshd(g, t) for t in (s.q, s.k, s.v))
                if plan.kv_shared:          # halves of the one K = V tensor
                    h = plan.head_dim
                    k, v = (g.call_function(aten.slice.Tensor, (k, 3, a, a + h))
                            for a in (0, h))
                params = {k: x for k, x in (("window", s.window), ("softcap", s.softcap),
                                            ("kv_shared", plan.kv_shared)) if x}
                attn = g.call_function(torch.ops.dcp.paged_attention.default,
                                       (q, k, v, caches[2 * layer], caches[2 * layer + 1],
                                        positions, table, s.scale), params)
                out, kc, vc = (g.call_function(operator.getitem, (attn, i)) for i in range(3))
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
            new_caches += [kc, vc]
            self.tag(attn, KIND_ATTENTION, layer)
        output = next(n for n in g.nodes if n.op == "output")
        logits = output.args[0]
        logits = logits[0] if isinstance(logits, (tuple, list)) else logits
        output.args = ((logits, *new_caches),)
        _drop_dead(g)           # masks and repeated K/V die with the attention they fed
        first_op = next(n for n in g.nodes if n.op != "placeholder")
        with g.inserting_before(first_op):
            # Padding (position -1) gets the embedding of position 0; the op zeroes its output.
            clamped = g.call_function(aten.clamp_min.default, (positions, 0))
        if plan.position_input is not None:
            plan.position_input.replace_all_uses_with(clamped)
        self._replace_aranges(g, plan, clamped)
        if plan.position_input is not None:
            g.erase_node(plan.position_input)
        # A one-token step's mask shows no window: it keeps the prompt step's.
        windows = tuple(s.window for s in plan.sites) \
            if plan.tokens > 1 or self.ctx.facts.windows is None else None
        found = ModelFacts(num_layers=len(plan.sites), cache_dtype=plan.dtype,
                           windows=windows,
                           mla=LatentAttention(**latent[0]) if latent else None)
        self.record(layers=len(plan.sites), kv_heads=plan.kv_heads, head_dim=plan.head_dim,
                    forms=sorted({site_form(s) for s in plan.sites}), mla_layers=len(latent),
                    positions="position_ids" if plan.position_input is not None else "arange")
        return Found(gm, True, facts=found)

    @staticmethod
    def _bshd(g, t: Node) -> Node:
        """[B, H, S, D] -> [B, S, H, D]; a transpose(1, 2) the model made is undone, not
        stacked (keeps the token dim at 1 for the prefill passes)."""
        if is_call(t, {aten.transpose.int}) and {d % 4 for d in t.args[1:]} == {1, 2}:
            return t.args[0]
        return g.call_function(aten.transpose.int, (t, 1, 2))

    def _replace_aranges(self, g, plan: Plan, clamped: Node) -> None:
        """A surviving ``arange(S)`` (start 0, step 1) is the model's positions: its
        ``unsqueeze(0)`` becomes the positions input; any other use is refused."""
        for n in list(g.nodes):
            if not _is_seq_arange(n, plan.tokens):
                continue
            for u in list(n.users):
                if is_call(u, {aten.unsqueeze.default}) and u.args[1] == 0:
                    with g.inserting_before(u):
                        cast = g.call_function(aten.to.dtype, (clamped, val(u).dtype))
                    u.replace_all_uses_with(cast)
                    g.erase_node(u)
                else:
                    fail(u, f"torch.arange({plan.tokens}) (positions over the sequence) is "
                         f"used by {u.target}", "Pass position_ids to forward, or build "
                         "positions as torch.arange(S).unsqueeze(0)")
            g.erase_node(n)

    def ensures(self, gm):
        left = [n.name for n in gm.graph.nodes if is_call(n, KERNEL_OF)]
        ensure(not left, self.name, "attention kernels left without a paged cache", left)


def _keeps_tokens(n: Node, batch: int, tokens: int) -> bool:
    """A view-like op whose result still has the batch first and a dim of the token count
    (it only regroups features of each token)."""
    shape = tuple(val(n).shape)
    return len(shape) >= 2 and shape[0] == batch and tokens in shape[1:3]


def _on_last_dim(index: int):
    """An op slicing / joining / reducing over the dim at args[index] (default -1): per
    token only when that is the last (feature) dim."""
    def rule(n: Node, batch: int, tokens: int) -> bool:
        src = n.args[0][0] if isinstance(n.args[0], (list, tuple)) else n.args[0]
        dims = n.args[index] if len(n.args) > index else n.kwargs.get("dim", -1)
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        ndim = len(val(src).shape)
        return all(isinstance(d, int) and d % ndim == ndim - 1 for d in dims)
    return rule


def _view_rule(n: Node, batch: int, tokens: int) -> bool:
    return _keeps_tokens(n, batch, tokens)


# Non-pointwise ops allowed between a K/V projection and attention (per-token rules).
_PER_TOKEN_RULES = {
    **{t: _view_rule for t in (*RESHAPES, aten.transpose.int, aten.permute.default,
                               aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default,
                               aten.clone.default, aten.contiguous.default, aten.alias.default,
                               aten.detach.default, aten.to.dtype, aten._to_copy.default,
                               aten.to.dtype_layout, aten.type_as.default)},
    aten.slice.Tensor: _on_last_dim(1),
    aten.chunk.default: _on_last_dim(2),
    aten.split.Tensor: _on_last_dim(2),
    aten.split_with_sizes.default: _on_last_dim(2),
    aten.cat.default: _on_last_dim(1),
    aten.mean.dim: _on_last_dim(1),
    aten.sum.dim_IntList: _on_last_dim(1),
    aten.var.correction: _on_last_dim(1),
    aten.pow.Tensor_Scalar: _view_rule,
    operator.getitem: lambda n, b, t: True,     # an item of chunk / split (checked there)
}


def _is_seq_arange(n: Node, tokens: int) -> bool:
    if is_call(n, {aten.arange.default}):
        return n.args[0] == tokens
    if is_call(n, {aten.arange.start, aten.arange.start_step}):
        step = n.args[2] if len(n.args) > 2 else 1
        return n.args[0] == 0 and n.args[1] == tokens and step == 1
    return False


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
