"""Insert the paged KV cache into an ordinary causal LM's graph.

Input: the torch.export graph of ``forward(input_ids [B, S] (, position_ids [B, S])) ->
logits`` -- a model with no cache and no project API (dcp_compile.ordinary captures it).
Output: a graph with the step signature of every other captured model (program.py)::

    (weights..., input_ids, positions, block_table, kv_caches_0, ...) -> (logits, *new caches)

with each attention replaced by one ``dcp.paged_attention`` over the layer's cache
``[num_blocks, block_size, kv_heads, head_dim]``; canonicalize_attention and every later pass
then run unchanged.

Recognised attention (rules as data: KERNELS, CASTS, RESHAPES):
  * ``aten.scaled_dot_product_attention`` (is_causal, an explicit mask, enable_gqa) and the
    flash / efficient / cudnn kernels;
  * eager attention: ``q @ k^T`` (* or / a constant scale) (soft-cap ``tanh(s / c) * c``)
    (+ additive mask, masked_fill or where) -> softmax over the last dim in any dtype (casts
    around it) -> ``@ v``.
  K and V are taken before GQA head repetition (expand + reshape, repeat_interleave, or
  none): the cache holds kv heads. Masks are checked by evaluating them (they may depend only
  on the positions, constants and buffers): causal, or causal within a sliding window, is
  accepted and replaced by the op's causality (and ``window``) on positions. Windows a
  Hugging Face config declares per layer are used too (a window no shorter than the captured
  chunk leaves no trace in the mask), and a one-token decode step reuses the windows found
  in the prompt step. Positions come from the ``position_ids`` input or an
  ``arange(S).unsqueeze(0)`` in the graph.
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
from torch.fx.operator_schemas import normalize_function
from torch.fx.passes.infra.pass_base import PassResult

import dcp_compile.ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.errors import DCPTransformError

from .absorb_latent_attention import absorb_latent_attention
from .infra import KIND_ATTENTION, DCPPass, source_of, val

aten = torch.ops.aten

# SDPA-family kernels: name -> (mask argument, result is a tuple whose item 0 is the output).
KERNELS = {
    "scaled_dot_product_attention": ("attn_mask", False),
    "_scaled_dot_product_flash_attention": (None, True),
    "_scaled_dot_product_flash_attention_for_cpu": ("attn_mask", True),
    "_scaled_dot_product_efficient_attention": ("attn_bias", True),
    "_scaled_dot_product_cudnn_attention": ("attn_bias", True),
}
_KERNEL_OF = {getattr(aten, name).default: name for name in KERNELS if hasattr(aten, name)}

# Ops that leave a value's meaning unchanged on the attention path (dtype casts, copies).
CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.clone.default,
         aten.contiguous.default, aten.alias.default, aten.detach.default, aten.type_as.default}
SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
MATMUL = {aten.matmul.default}
# Additive masks below this are "masked out": exp underflows to exactly 0 in any float dtype.
MASKED_OUT = -1e4


@dataclass
class Site:
    """One attention: q [B, Hq, S, D]; k, v [B, Hkv, S, D] (before head repetition)."""

    node: Node                   # reported in errors
    out: Node                    # the node producing the [B, Hq, S, D] attention output
    q: Node
    k: Node
    v: Node
    scale: float
    causal: bool                 # is_causal=True (no mask)
    mask: Node | None = None     # see mask_kind
    mask_kind: str = ""          # "additive" | "keep" (bool, True attends) | "drop"
    softcap: float = 0.0         # scores -> tanh(scores / softcap) * softcap
    window: int = 0              # keys with q_pos - k_pos < window (0: no window)


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


def _fail(node: Node, why: str, fix: str):
    raise DCPTransformError(f"{why} at node {node.name} ({source_of(node)}). {fix}.")


def _call(n, targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _skip_casts(n: Node) -> Node:
    while _call(n, CASTS):
        n = n.args[0]
    return n


def _is_dropout_noop(n: Node) -> bool:
    return _call(n, {aten.dropout.default}) and (n.args[1] == 0 or n.args[2] is False)


def _strip_repeat(n: Node) -> Node:
    """K/V before GQA head repetition (the cache stores kv heads, not q heads)."""
    n = _skip_casts(n)
    # repeat_kv: x[:, :, None].expand(B, Hkv, g, S, D).reshape(B, Hkv * g, S, D)
    if _call(n, RESHAPES):
        e = _skip_casts(n.args[0])
        if _call(e, {aten.expand.default}):
            u = e.args[0]
            if _call(u, {aten.unsqueeze.default}) and u.args[1] == 2 and len(val(e).shape) == 5:
                b, h, g, s, d = val(e).shape
                if tuple(val(n).shape) == (b, h * g, s, d):   # heads repeated, nothing else
                    return _skip_casts(u.args[0])
    if _call(n, {aten.repeat_interleave.self_int}):
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        if dim == 1:
            return _skip_casts(n.args[0])
    return n


def _kwargs(n: Node) -> dict:
    pair = normalize_function(n.target, n.args, n.kwargs, normalize_to_only_use_kwargs=True)
    if pair is None:
        _fail(n, f"cannot read the arguments of {n.target}", "Report this model")
    return pair.kwargs


def _number(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


class InsertPagedCache(DCPPass):
    """Ordinary causal LM graph -> paged step graph (see module doc)."""

    name = "insert_paged_cache"

    def __init__(self, ctx, *, token_input: str, position_input: str | None,
                 constants: Callable[[], dict] | None = None,
                 windows: list[int] | None = None):
        super().__init__(ctx)
        # Per-layer sliding windows the model declares (Hugging Face config): a window no
        # shorter than the captured chunk leaves no trace in the graph's mask.
        self.windows = windows
        self.token_input = token_input
        self.position_input = position_input
        self.constants = constants          # placeholder -> tensor, for evaluating masks
        self._constants = None

    # -- analysis --------------------------------------------------------------------------

    def plan(self, gm: GraphModule) -> Plan:
        ids = next(n for n in gm.graph.nodes if n.op == "placeholder"
                   and n.name == self.token_input)
        batch, tokens = val(ids).shape
        pos = None
        if self.position_input is not None:
            pos = next(n for n in gm.graph.nodes if n.op == "placeholder"
                       and n.name == self.position_input)
        per_token = self._depends_on(gm, ids)
        sites = []
        for n in gm.graph.nodes:
            if _call(n, _KERNEL_OF):
                sites.append(self._sdpa_site(n))
            elif _call(n, SOFTMAX):
                site = self._eager_site(n)
                if site is not None:        # None: a softmax that does not feed `@ v`
                    sites.append(site)
        if not sites:
            raise DCPTransformError(
                "the model has no attention this compiler recognises (no "
                "scaled_dot_product_attention and no q @ k^T -> softmax -> @ v): there is "
                "nothing to put a KV cache under. Use a causal decoder with SDPA or eager "
                "attention.")
        shapes = set()
        # Windows: declared by the config, or found in an earlier step's mask (a one-token
        # decode step's mask cannot show one).
        declared = self.windows if self.windows is not None else \
            self.ctx.model_facts.get("windows")
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
            _fail(s.node, f"attention {s.node.name} uses one tensor {s.k.name} as key and "
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

    def _sdpa_site(self, n: Node) -> Site:
        name = _KERNEL_OF[n.target]
        mask_arg, is_tuple = KERNELS[name]
        kw = _kwargs(n)
        if kw.get("dropout_p", 0.0):
            _fail(n, f"attention with dropout_p={kw['dropout_p']}",
                  "Put the model in eval mode (model.eval()) without attention dropout")
        out = n
        if is_tuple:
            items = {}
            for u in n.users:
                if u.target is not operator.getitem:
                    _fail(n, f"{name} result used whole", "Use its output only")
                items[u.args[1]] = u
            used = sorted(i for i, u in items.items() if i != 0 and u.users)
            if used:
                _fail(n, f"{name} outputs {used} (log-sum-exp, ...) are used",
                      "Only the attention output can be kept with a paged cache")
            if 0 not in items:
                _fail(n, f"{name} output unused", "Remove the dead attention")
            out = items[0]
        q, k, v = kw["query"], kw["key"], kw["value"]
        dim = val(q).shape[-1]
        scale = kw.get("scale")
        mask = kw.get(mask_arg) if mask_arg else None
        if isinstance(mask, Node):
            kind = "keep" if val(mask).dtype == torch.bool else "additive"
        else:
            kind = ""
        return Site(node=n, out=out, q=q, k=_strip_repeat(k), v=_strip_repeat(v),
                    scale=float(scale) if scale is not None else dim ** -0.5,
                    causal=bool(kw.get("is_causal", False)), mask=mask if kind else None,
                    mask_kind=kind)

    def _eager_site(self, sm: Node) -> Site | None:
        if not self._feeds_matmul(sm):
            return None
        if sm.args[1] not in (-1, len(val(sm).shape) - 1):
            _fail(sm, f"softmax over dim {sm.args[1]}", "Attention softmax must be over the "
                  "keys (the last dim)")
        # Forward: casts / no-op dropout, then `@ v`.
        probs, user = sm, None
        while True:
            users = list(probs.users)
            if len(users) != 1:
                _fail(sm, f"attention probabilities used by {len(users)} nodes "
                      f"({[u.name for u in users]})", "Only `softmax(...) @ v` is recognised "
                      "(do not return attention weights)")
            user = users[0]
            if _call(user, CASTS) or _is_dropout_noop(user):
                probs = user
                continue
            break
        if _call(user, {aten.dropout.default}):
            _fail(user, "attention dropout in training mode", "Call model.eval()")
        if not _call(user, MATMUL) or user.args[0] is not probs:
            _fail(sm, f"softmax feeds {user.target}, not `probs @ v`", "Attention must be "
                  "softmax(scores) @ v")
        v = user.args[1]
        # Backward: scale, mask, casts, down to `q @ k^T`.
        x, scale, mask, kind, softcap = _skip_casts(sm.args[0]), 1.0, None, "", 0.0
        while not _call(x, MATMUL):
            cap = _softcap_of(x)
            if cap is not None:
                if scale != 1.0:
                    _fail(x, "scores scaled after soft-capping", "Scale before the tanh cap")
                softcap, x = cap
            elif _call(x, {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}):
                a, b = x.args
                c = _number(b) if isinstance(a, Node) else _number(a)
                if x.target in (aten.div.Tensor, aten.div.Scalar) and not isinstance(a, Node):
                    c = None                                  # number / scores: not a scale
                if c is None:
                    _fail(x, f"attention scores scaled by a tensor ({x.target})",
                          "Scale scores by a Python number (a per-layer constant)")
                scale *= (1.0 / c) if x.target in (aten.div.Tensor, aten.div.Scalar) else c
                x = a if isinstance(a, Node) else b
            elif softcap and _call(x, {aten.add.Tensor, aten.masked_fill.Scalar,
                                       aten.where.self, aten.where.ScalarOther}):
                _fail(x, "attention mask applied before soft-capping (masked scores become "
                      "-cap, not -inf)", "Apply the mask after tanh(scores / c) * c")
            elif _call(x, {aten.add.Tensor}) and mask is None:
                a, b = x.args
                if not (isinstance(a, Node) and isinstance(b, Node)):
                    _fail(x, "a constant added to the attention scores", "Remove it")
                x, mask = (a, b) if self._reaches_matmul(a) else (b, a)
                kind = "additive"
            elif _call(x, {aten.masked_fill.Scalar}) and mask is None:
                if _number(x.args[2]) is None or x.args[2] > MASKED_OUT:
                    _fail(x, f"masked_fill of the scores with {x.args[2]}", "Fill with -inf")
                x, mask, kind = x.args[0], x.args[1], "drop"
            elif _call(x, {aten.where.self, aten.where.ScalarOther}) and mask is None:
                other = x.args[2]
                if not isinstance(x.args[1], Node) or isinstance(other, Node) \
                        or other > MASKED_OUT:
                    _fail(x, "where() on the scores with a non -inf alternative", "Use -inf")
                x, mask, kind = x.args[1], x.args[0], "keep"
            elif _call(x, CASTS):
                x = x.args[0]
            elif _call(x, {aten.tanh.default}):
                _fail(x, "tanh on the attention scores that is not soft-capping "
                      "(tanh(s / c) * c)", "Write the cap as tanh(scores / c) * c")
            else:
                _fail(x, f"unrecognised op {x.target} between `q @ k^T` and softmax",
                      "Only a constant scale, a causal mask and dtype casts are recognised")
        q, kt = x.args
        kt = _skip_casts(kt)
        dims = kt.args[1:] if _call(kt, {aten.transpose.int}) else None
        nd = len(val(kt).shape)
        if dims is None or {d % nd for d in dims} != {nd - 2, nd - 1}:
            _fail(x, "the right operand of `q @ k` is not k.transpose(-2, -1)",
                  "Write scores as q @ k.transpose(-2, -1)")
        return Site(node=sm, out=user, q=_skip_casts(q), k=_strip_repeat(kt.args[0]),
                    v=_strip_repeat(v), scale=scale, causal=False, mask=mask,
                    mask_kind=kind, softcap=softcap)

    @staticmethod
    def _feeds_matmul(sm: Node) -> bool:
        n = sm
        while len(n.users) == 1:
            (n,) = n.users
            if _call(n, MATMUL):
                return True
            if not (_call(n, CASTS) or _call(n, {aten.dropout.default})):
                return False
        return any(_call(u, MATMUL) for u in n.users)

    def _reaches_matmul(self, n: Node) -> bool:
        while True:
            n = _skip_casts(n)
            if _call(n, MATMUL):
                return True
            if _call(n, {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar,
                         aten.tanh.default}):
                n = n.args[0] if isinstance(n.args[0], Node) else n.args[1]
                continue
            return False

    def _check_site(self, s: Site, per_token: set, batch: int, tokens: int, pos) -> None:
        for what, t in (("query", s.q), ("key", s.k), ("value", s.v)):
            shape = val(t).shape
            if len(shape) != 4 or shape[0] != batch:
                _fail(s.node, f"attention {what} {t.name} has shape {tuple(shape)}, not "
                      f"[batch={batch}, heads, tokens, head_dim]", "Attention must be over "
                      "[B, H, S, D] tensors of this step's tokens")
            if shape[2] != tokens or t not in per_token:
                _fail(s.node, f"cross-attention: the {what} ({t.name}, shape "
                      f"{tuple(shape)}) is not computed from this step's {tokens} tokens",
                      "A paged KV cache holds the keys and values of the sequence's own "
                      "tokens; only causal self-attention can be cached")
        for what, t in (("key", s.k), ("value", s.v)):
            self._check_per_token(s, what, t, per_token, batch, tokens)
        hq, hkv = val(s.q).shape[1], val(s.k).shape[1]
        if val(s.v).shape[1] != hkv or hq % hkv:
            _fail(s.node, f"head counts q={hq}, k={hkv}, v={val(s.v).shape[1]} are not a "
                  f"GQA grouping", "K and V need the same heads, dividing Q's")
        if s.mask is not None:
            self._check_mask(s, tokens, pos)
        elif not s.causal and tokens > 1:
            _fail(s.node, f"non-causal attention (is_causal=False, no mask) over {tokens} "
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
                _fail(s.node, f"the {what} reaches the token embedding {n.name} without a "
                      f"projection", "K and V must be linear projections of the hidden state")
            rule = _PER_TOKEN_RULES.get(n.target)
            pointwise = torch.Tag.pointwise in getattr(n.target, "tags", ())
            if not pointwise and (rule is None or not rule(n, batch, tokens)):
                _fail(n, f"the {what} of attention {s.node.name} is computed through "
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
            _fail(s.mask, f"attention mask of shape {tuple(allowed.shape)} for {tokens} "
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
        _fail(s.mask, f"attention {s.node.name} applies {why}",
              "The paged cache replaces the mask by causality (and a sliding window) on "
              "positions; other masks are not supported: use a causal decoder")

    def _set_window(self, s: Site, declared: int, layer: int, tokens: int) -> None:
        if not declared:
            return
        if s.window and s.window != declared:
            _fail(s.node, f"layer {layer}'s mask is a window of {s.window} tokens but the "
                  f"config declares sliding_window={declared}", "Fix the config")
        if not s.window and declared < tokens and (s.mask is not None or tokens > 1):
            _fail(s.node, f"the config declares sliding_window={declared} for layer {layer} "
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
                    _fail(n, f"the attention mask of {s.node.name} could not be evaluated "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                          "Build the mask from positions or torch.arange only")
            else:
                _fail(n, f"attention mask built from {n.op} {n.target}", "Build the mask "
                      "from positions or torch.arange only")
        m = env[s.mask]
        if s.mask_kind == "keep":
            return m.bool()
        if s.mask_kind == "drop":
            return ~m.bool()
        if not m.is_floating_point():
            _fail(s.mask, f"additive attention mask of dtype {m.dtype}", "Use a float mask")
        bias = ~((m == 0) | (m <= MASKED_OUT))
        if bool(bias.any()):
            _fail(s.mask, f"the attention mask of {s.node.name} adds values other than 0 and "
                  f"-inf (e.g. {m[bias].flatten()[0].item():g}): a position bias such as "
                  f"ALiBi", "The paged op has no attention bias: use a model without one")
        return m == 0

    def _placeholder_value(self, n: Node, s: Site, tokens: int, pos):
        if n.name == self.token_input:
            _fail(s.mask, f"the attention mask of {s.node.name} depends on the token ids "
                  f"(data-dependent mask)", "Masks may depend only on positions: padding is "
                  "expressed by position -1 in a DCP program")
        if pos is not None and n is pos:
            b = val(n).shape[0]
            return torch.arange(tokens).expand(b, tokens).clone()
        if self._constants is None and self.constants is not None:
            self._constants = self.constants()
        t = (self._constants or {}).get(n.name)
        if t is None or t.is_meta:
            _fail(s.mask, f"the attention mask of {s.node.name} reads {n.name}, whose value "
                  f"is not available here (meta device or not a weight/buffer)",
                  "Build causal masks from torch.arange, or transform a model with real "
                  "weights")
        return t.detach().cpu()

    # -- rewrite ---------------------------------------------------------------------------

    def call(self, gm):
        g = gm.graph
        for n in list(g.nodes):  # export's metadata asserts would hold dead values alive
            if _call(n, {aten._assert_tensor_metadata.default}):
                g.erase_node(n)
        latent = absorb_latent_attention(gm)    # MLA -> one shared latent head (no-op else)
        plan = self.plan(gm)
        ids = next(n for n in g.nodes if n.op == "placeholder" and n.name == self.token_input)
        mode = detect_fake_mode([n.meta["val"] for n in g.nodes if n.op == "placeholder"])
        cfg = self.ctx.config
        num_blocks = self.ctx.model_facts["num_blocks"]
        max_blocks = self.ctx.model_facts["max_blocks"]
        device = val(ids).device
        cache_shape = (num_blocks, cfg.block_size, plan.kv_heads, plan.head_dim)

        def new_input(name, shape, dtype, anchor):
            with g.inserting_after(anchor):
                p = g.placeholder(name)
            with mode:
                p.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
            return p

        anchor = plan.position_input or ids
        positions = new_input("positions", (plan.batch, plan.tokens), torch.int64, anchor)
        table = new_input("block_table", (plan.batch, max_blocks), torch.int64, positions)
        caches, last = [], table
        for i in range(2 * len(plan.sites)):
            last = new_input(f"kv_caches_{i}", cache_shape, plan.dtype, last)
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
        if plan.tokens > 1 or "windows" not in self.ctx.model_facts:
            self.ctx.model_facts["windows"] = [s.window for s in plan.sites]
        self.ctx.model_facts.update(num_layers=len(plan.sites), num_kv_heads=plan.kv_heads,
                                    head_dim=plan.head_dim, cache_dtype=plan.dtype,
                                    kv_shared=plan.kv_shared)
        if latent:
            self.ctx.model_facts["mla"] = latent[0]
        self.record(layers=len(plan.sites), kv_heads=plan.kv_heads, head_dim=plan.head_dim,
                    forms=sorted({_form(s) for s in plan.sites}), mla_layers=len(latent),
                    positions="position_ids" if plan.position_input is not None else "arange")
        return PassResult(gm, True)

    @staticmethod
    def _bshd(g, t: Node) -> Node:
        """[B, H, S, D] -> [B, S, H, D]; a transpose(1, 2) the model made is undone, not
        stacked (keeps the token dim at 1 for the prefill passes)."""
        if _call(t, {aten.transpose.int}) and {d % 4 for d in t.args[1:]} == {1, 2}:
            return t.args[0]
        return g.call_function(aten.transpose.int, (t, 1, 2))

    def _replace_aranges(self, g, plan: Plan, clamped: Node) -> None:
        """A surviving ``arange(S)`` (start 0, step 1) is the model's positions: its
        ``unsqueeze(0)`` becomes the positions input; any other use is refused."""
        for n in list(g.nodes):
            if not _is_seq_arange(n, plan.tokens):
                continue
            for u in list(n.users):
                if _call(u, {aten.unsqueeze.default}) and u.args[1] == 0:
                    with g.inserting_before(u):
                        cast = g.call_function(aten.to.dtype, (clamped, val(u).dtype))
                    u.replace_all_uses_with(cast)
                    g.erase_node(u)
                else:
                    _fail(u, f"torch.arange({plan.tokens}) (positions over the sequence) is "
                          f"used by {u.target}", "Pass position_ids to forward, or build "
                          "positions as torch.arange(S).unsqueeze(0)")
            g.erase_node(n)

    def ensures(self, gm):
        assert not any(_call(n, _KERNEL_OF) for n in gm.graph.nodes)


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


def _softcap_of(x: Node):
    """``tanh(y / c) * c`` (or ``tanh(y * (1/c)) * c``) -> (c, y); anything else -> None."""
    if not _call(x, {aten.mul.Tensor, aten.mul.Scalar}):
        return None
    a, c = x.args if isinstance(x.args[0], Node) else x.args[::-1]
    t = _skip_casts(a) if isinstance(a, Node) else None
    if _number(c) is None or not _call(t, {aten.tanh.default}):
        return None
    d = t.args[0]
    if _call(d, {aten.div.Tensor, aten.div.Scalar}) and _number(d.args[1]) is not None:
        inner = d.args[1]
    elif _call(d, {aten.mul.Tensor, aten.mul.Scalar}) and _number(d.args[1]) is not None \
            and d.args[1] != 0:
        inner = 1.0 / d.args[1]
    else:
        return None
    if abs(inner - c) > 1e-6 * abs(c):
        _fail(x, f"tanh(scores / {inner:g}) * {c:g}: cap inside and outside differ",
              "Use one soft-capping constant")
    return float(c), d.args[0]


def _is_seq_arange(n: Node, tokens: int) -> bool:
    if _call(n, {aten.arange.default}):
        return n.args[0] == tokens
    if _call(n, {aten.arange.start, aten.arange.start_step}):
        step = n.args[2] if len(n.args) > 2 else 1
        return n.args[0] == 0 and n.args[1] == tokens and step == 1
    return False


def _fold_layout_noops(bhsd: Node, bshd: Node | None, shape: tuple) -> None:
    """Users of the [B, H, S, D] output that only undo it: an identity reshape (Hugging
    Face's SDPA path) reads ``bhsd`` itself, a transpose(1, 2) reads the op's own [B, S, H, D]
    output. Keeps the token dim at 1 on the output path, as the prefill passes need."""
    for u in list(bhsd.users):
        if _call(u, RESHAPES) and tuple(val(u).shape) == shape:
            u.replace_all_uses_with(bhsd)
    for u in list(bhsd.users) if bshd is not None else []:
        if _call(u, {aten.transpose.int}) and {d % 4 for d in u.args[1:]} == {1, 2}:
            u.replace_all_uses_with(bshd)


def _drop_dead(g) -> None:
    """Remove nodes nothing reads; the ops torch calls impure only because they are seeded
    (dropout, the SDPA kernels) die with what they read."""
    removable = {aten.dropout.default, *_KERNEL_OF}
    changed = True
    while changed:
        changed = False
        for n in reversed(list(g.nodes)):
            if n.op == "call_function" and not n.users and (not n.is_impure()
                                                            or n.target in removable):
                g.erase_node(n)
                changed = True


def _form(s: Site) -> str:
    kind = "sdpa" if s.node.target in _KERNEL_OF else "eager"
    mask = "is_causal" if s.causal else (f"{s.mask_kind} mask" if s.mask is not None
                                        else "one token")
    extra = "".join(f", {k}" for k, x in (("window", s.window), ("softcap", s.softcap)) if x)
    return f"{kind} ({mask}{extra})"
