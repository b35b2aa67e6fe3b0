"""Attention forms in an ordinary model's graph, found and read into a :class:`Site` (q, k, v,
scale, mask, soft-cap); :mod:`dcp_compile.passes.insert_paged_cache` checks the sites and puts the
paged KV cache under them.

Recognised attention (rules as data: RECOGNISERS, KERNELS, CASTS, RESHAPES):
  * ``aten.scaled_dot_product_attention`` (is_causal, an explicit mask, enable_gqa) and the
    flash / efficient / cudnn kernels;
  * eager attention: ``q @ k^T`` (* or / a constant scale) (soft-cap ``tanh(s / c) * c``)
    (+ additive mask, masked_fill or where, or OpenAI-GPT's product ``s * b + F * (1 - b)``)
    -> softmax over the last dim in any dtype (casts around it) -> ``@ v``;
  * attention sinks (gpt-oss's eager form): the scores ``cat``'ed with one logit per q head
    (``sinks.reshape(1, -1, 1, 1).expand(...)``) on the last dim, the row max subtracted
    (optional), softmax, the sink column sliced off, ``@ v``.
  K and V are taken before GQA head repetition (expand + reshape, repeat_interleave, or
  none): the cache holds kv heads.
A form read only in part (dropout, a tensor scale, an unknown op between ``q @ k^T`` and the
softmax, attention weights returned) is a DCPTransformError naming the node.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.operator_schemas import normalize_function

from dcp_compile.runtime.errors import DCPTransformError

from .infra import source_of, val
# RESHAPES and is_call are re-exported: insert_paged_cache reads them from here.
from .op_classes import (CASTS, CONVOLUTIONS, DIVS, MATMUL, MULS, RESHAPES,  # noqa: F401
                         RSUBS, SOFTMAX, is_call, skip_casts)

aten = torch.ops.aten

# SDPA-family kernels: name -> (mask argument, result is a tuple whose item 0 is the output).
KERNELS = {
    "scaled_dot_product_attention": ("attn_mask", False),
    "_scaled_dot_product_flash_attention": (None, True),
    "_scaled_dot_product_flash_attention_for_cpu": ("attn_mask", True),
    "_scaled_dot_product_efficient_attention": ("attn_bias", True),
    "_scaled_dot_product_cudnn_attention": ("attn_bias", True),
}
KERNEL_OF = {getattr(aten, name).default: name for name in KERNELS if hasattr(aten, name)}

# Fills at or below this are "masked out" (the finite fills: additive masks, masked_fill,
# where, OpenAI-GPT's product): a masked key's weight exp(F + ... - m) rounds to 0 once the
# query's largest kept score m is above F + finite_fills.underflow_margin(dtype)
# (docs/guarantees.md, "Finite fills"); a fill above it (-5) keeps future keys in the
# softmax: refused.
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
    mask_kind: str = ""          # "additive" | "keep" (bool, True attends) | "drop" |
    #                              "product" (scores * mask + fill * (1 - mask), mask 0/1)
    fill: float | None = None    # a finite fill in place of hidden scores (product, drop,
    #                              keep kinds), as the softmax sees it: finite_fills states it
    softcap: float = 0.0         # scores -> tanh(scores / softcap) * softcap
    window: int = 0              # keys with q_pos - k_pos < window (0: no window)
    chunk: int = 0               # keys of the query's own chunk of C positions (0: none)
    sinks: Node | None = None    # [Hq] logits in every softmax's denominator (gpt-oss)
    # A second tensor added to the scores besides the mask (MPT's ALiBi position_bias), and
    # the constant both it and an additive mask are multiplied by before the softmax (a
    # scale applied after them: Falcon scales ``scores + alibi``). Read by
    # score_bias.read_bias as a formula of positions and heads.
    bias: Node | None = None
    bias_scale: float = 1.0
    mask_scale: float = 1.0
    alibi: object = None         # score_bias.Alibi, once the bias is proven ALiBi
    index: object = None         # sparse_attention.IndexSelection (DeepSeek Sparse Attention)
    # Memory key/values (x-transformers' attn_num_mem_kv): the learned [B, Hkv, M, D] keys
    # and values joined before the sequence's, once insert_paged_cache has split them off.
    mem: tuple[Node, Node] | None = None


def fail(node: Node, why: str, fix: str):
    raise DCPTransformError(f"{why} at node {node.name} ({source_of(node)}). {fix}.")


def _is_dropout_noop(n: Node) -> bool:
    return is_call(n, {aten.dropout.default}) and (n.args[1] == 0 or n.args[2] is False)


def repeated_heads(n: Node):
    """(x [B, Hkv, S, D], the dim the copies go to) when ``n`` is ``x`` with each head
    repeated g times by ``x.unsqueeze(d).expand(...).reshape(B, Hkv * g, S, D)``: d = 2 puts
    a head's copies side by side (q head h reads kv head h // g, ``repeat_kv``), d = 1 tiles
    the heads (h reads h % Hkv, einops' ``'b kvh n d -> b (r kvh) n d'``). Else None."""
    if not is_call(n, RESHAPES):
        return None
    e = skip_casts(n.args[0])
    if not (is_call(e, {aten.expand.default}) and val(e).dim() == 5):
        return None
    u = e.args[0]
    if not (is_call(u, {aten.unsqueeze.default}) and u.args[1] in (1, 2)):
        return None
    b, *mid, s, d = val(e).shape
    if tuple(val(n).shape) != (b, mid[0] * mid[1], s, d):   # heads repeated, nothing else
        return None
    return skip_casts(u.args[0]), u.args[1]


def strip_repeat(n: Node) -> Node:
    """K/V before GQA head repetition (the cache stores kv heads, not q heads)."""
    n = skip_casts(n)
    repeated = repeated_heads(n)
    if repeated is not None:
        x, dim = repeated
        if dim == 1 and val(x).shape[1] > 1:
            fail(n, f"K/V heads tiled (q head h reads kv head h % {val(x).shape[1]}, as "
                 f"einops' 'b kvh n d -> b (r kvh) n d' repeats them)", "dcp.attention "
                 "groups q heads as h // q_per_kv (repeat_kv's order): repeat each kv head "
                 "in place ('b kvh n d -> b (kvh r) n d', k.repeat_interleave(r, dim=1))")
        return x
    if is_call(n, {aten.repeat_interleave.self_int}):
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        if dim == 1:
            return skip_casts(n.args[0])
    return n


def _kwargs(n: Node) -> dict:
    pair = normalize_function(n.target, n.args, n.kwargs, normalize_to_only_use_kwargs=True)
    if pair is None:
        fail(n, f"cannot read the arguments of {n.target}", "Report this model")
    return pair.kwargs


def number(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def softcap_of(x: Node):
    """``tanh(y / c) * c`` (or ``tanh(y * (1/c)) * c``) -> (c, y); anything else -> None."""
    if not is_call(x, MULS):
        return None
    a, c = x.args if isinstance(x.args[0], Node) else x.args[::-1]
    t = skip_casts(a) if isinstance(a, Node) else None
    if number(c) is None or not is_call(t, {aten.tanh.default}):
        return None
    d = t.args[0]
    if is_call(d, DIVS) and number(d.args[1]) is not None:
        inner = d.args[1]
    elif is_call(d, MULS) and number(d.args[1]) is not None \
            and d.args[1] != 0:
        inner = 1.0 / d.args[1]
    else:
        return None
    if abs(inner - c) > 1e-6 * abs(c):
        fail(x, f"tanh(scores / {inner:g}) * {c:g}: cap inside and outside differ",
             "Use one soft-capping constant")
    return float(c), d.args[0]


# ------------------------------------------------------------------------------------------
# The forms
# ------------------------------------------------------------------------------------------


def sdpa_site(n: Node) -> Site:
    """``scaled_dot_product_attention`` or one of its kernels (KERNELS)."""
    name = KERNEL_OF[n.target]
    mask_arg, is_tuple = KERNELS[name]
    kw = _kwargs(n)
    if kw.get("dropout_p", 0.0):
        fail(n, f"attention with dropout_p={kw['dropout_p']}",
             "Put the model in eval mode (model.eval()) without attention dropout")
    out = n
    if is_tuple:
        items = {}
        for u in n.users:
            if u.target is not operator.getitem:
                fail(n, f"{name} result used whole", "Use its output only")
            items[u.args[1]] = u
        used = sorted(i for i, u in items.items() if i != 0 and u.users)
        if used:
            fail(n, f"{name} outputs {used} (log-sum-exp, ...) are used",
                 "Only the attention output can be kept with a paged cache")
        if 0 not in items:
            fail(n, f"{name} output unused", "Remove the dead attention")
        out = items[0]
    q, k, v = kw["query"], kw["key"], kw["value"]
    dim = val(q).shape[-1]
    scale = kw.get("scale")
    mask = kw.get(mask_arg) if mask_arg else None
    if isinstance(mask, Node):
        kind = "keep" if val(mask).dtype == torch.bool else "additive"
    else:
        kind = ""
    return Site(node=n, out=out, q=q, k=strip_repeat(k), v=strip_repeat(v),
                scale=float(scale) if scale is not None else dim ** -0.5,
                causal=bool(kw.get("is_causal", False)), mask=mask if kind else None,
                mask_kind=kind)


def eager_site(sm: Node) -> Site | None:
    """``softmax(q @ k^T * scale (+ mask)) @ v`` read from its softmax; None when the softmax
    does not feed a matmul (not attention)."""
    if not _feeds_matmul(sm):
        return None
    if sm.args[1] not in (-1, len(val(sm).shape) - 1):
        fail(sm, f"softmax over dim {sm.args[1]}", "Attention softmax must be over the "
             "keys (the last dim)")
    # Forward: casts / no-op dropout (the sink column sliced off), then `@ v`.
    probs, user, sink_slice = sm, None, None
    while True:
        users = list(probs.users)
        if len(users) != 1:
            fail(sm, f"attention probabilities used by {len(users)} nodes "
                 f"({[u.name for u in users]})", "Only `softmax(...) @ v` is recognised "
                 "(do not return attention weights)")
        user = users[0]
        if is_call(user, CASTS) or _is_dropout_noop(user):
            probs = user
            continue
        if sink_slice is None and _drops_last_column(user, probs):
            probs = sink_slice = user
            continue
        break
    if is_call(user, {aten.dropout.default}):
        fail(user, "attention dropout in training mode", "Call model.eval()")
    if not is_call(user, MATMUL) or user.args[0] is not probs:
        fail(sm, f"softmax feeds {user.target}, not `probs @ v`", "Attention must be "
             "softmax(scores) @ v")
    v = user.args[1]
    x, sinks = skip_casts(sm.args[0]), None
    if sink_slice is not None:
        x, sinks = sink_scores(sm, x)
    # Backward: scale, mask, casts, down to `q @ k^T`.
    x, scale, mask, kind, softcap, fill = skip_casts(x), 1.0, None, "", 0.0, None
    bias, bias_scale, mask_scale = None, 1.0, 1.0
    while not is_call(x, MATMUL):
        cap = softcap_of(x)
        if cap is not None:
            if scale != 1.0:
                fail(x, "scores scaled after soft-capping", "Scale before the tanh cap")
            softcap, x = cap
        elif is_call(x, MULS | DIVS):
            a, b = x.args
            c = number(b) if isinstance(a, Node) else number(a)
            if x.target in DIVS and not isinstance(a, Node):
                c = None                                  # number / scores: not a scale
            if c is None:
                fail(x, f"attention scores scaled by a tensor ({x.target})",
                     "Scale scores by a Python number (a per-layer constant)")
            scale *= (1.0 / c) if x.target in DIVS else c
            x = a if isinstance(a, Node) else b
        elif softcap and is_call(x, {aten.add.Tensor, aten.masked_fill.Scalar,
                                     aten.where.self, aten.where.ScalarOther}):
            fail(x, "attention mask applied before soft-capping (masked scores become "
                 "-cap, not -inf)", "Apply the mask after tanh(scores / c) * c")
        elif mask is None and (product := product_mask(x)) is not None:
            refuse_visible_fill(x, product[2] * scale)
            (x, mask, fill), kind, mask_scale = product, "product", scale
            fill *= scale
        elif is_call(x, {aten.add.Tensor}) and mask is None:
            scores_mixed(x)          # another layer's scores, or heads mixed: named limits
            a, b = x.args
            if not (isinstance(a, Node) and isinstance(b, Node)):
                fail(x, "a constant added to the attention scores", "Remove it")
            x, mask = (a, b) if reaches_matmul(a) else (b, a)
            kind, mask_scale = "additive", scale
        elif is_call(x, {aten.add.Tensor}) and bias is None \
                and all(isinstance(a, Node) for a in x.args[:2]) \
                and x.kwargs.get("alpha", 1) == 1:
            # A mask was found nearer the softmax: this second term is a score bias.
            scores_mixed(x)
            a, b = x.args[:2]
            x, bias = (a, b) if reaches_matmul(a) else (b, a)
            bias_scale = scale
        elif is_call(x, {aten.sub.Tensor}) and bias is None \
                and all(isinstance(a, Node) for a in x.args[:2]) \
                and x.kwargs.get("alpha", 1) == 1 and reaches_matmul(x.args[0]):
            x, bias, bias_scale = x.args[0], x.args[1], -scale   # scores - bias
        elif is_call(x, {aten.masked_fill.Scalar}) and mask is None:
            if number(x.args[2]) is None or x.args[2] > MASKED_OUT:
                fail(x, f"masked_fill of the scores with {x.args[2]}", "Fill with -inf")
            fill = replacing_fill(x.args[2], scale)
            x, mask, kind = x.args[0], x.args[1], "drop"
        elif is_call(x, {aten.where.self, aten.where.ScalarOther}) and mask is None:
            other = x.args[2]
            if not isinstance(x.args[1], Node) or isinstance(other, Node) \
                    or other > MASKED_OUT:
                fail(x, "where() on the scores with a non -inf alternative", "Use -inf")
            fill = replacing_fill(other, scale)
            x, mask, kind = x.args[1], x.args[0], "keep"
        elif is_call(x, CASTS):
            x = x.args[0]
        elif is_call(x, {aten.tanh.default}):
            fail(x, "tanh on the attention scores that is not soft-capping "
                 "(tanh(s / c) * c)", "Write the cap as tanh(scores / c) * c")
        else:
            scores_mixed(x)
            fail(x, f"unrecognised op {x.target} between `q @ k^T` and softmax",
                 "Only a constant scale, a causal mask and dtype casts are recognised")
    q, kt = x.args
    kt = skip_casts(kt)
    dims = kt.args[1:] if is_call(kt, {aten.transpose.int}) else None
    nd = len(val(kt).shape)
    if dims is None or {d % nd for d in dims} != {nd - 2, nd - 1}:
        fail(x, "the right operand of `q @ k` is not k.transpose(-2, -1)",
             "Write scores as q @ k.transpose(-2, -1)")
    return Site(node=sm, out=user, q=skip_casts(q), k=strip_repeat(kt.args[0]),
                v=strip_repeat(v), scale=scale, causal=False, mask=mask,
                mask_kind=kind, softcap=softcap, sinks=sinks, bias=bias,
                bias_scale=bias_scale, mask_scale=mask_scale, fill=fill)


def product_mask(x: Node):
    """(scores, b, F) when ``x`` is OpenAI-GPT's ``scores * b + F * (1 - b)`` (either
    operand order of each product; ``1 - b`` as ``rsub(b, 1)``) with F a number; else None.
    That b is a 0/1 causal predicate is the mask prover's to show (``mask_predicate``)."""
    if not is_call(x, {aten.add.Tensor}) or x.kwargs.get("alpha", 1) != 1 \
            or not all(isinstance(a, Node) for a in x.args[:2]):
        return None
    for kept, filled in (x.args[:2], x.args[1::-1]):
        if not (is_call(kept, MULS) and is_call(filled, MULS)):
            continue
        for comp, fill in (filled.args[:2], filled.args[1::-1]):
            if not (is_call(comp, RSUBS) and number(fill) is not None
                    and len(comp.args) > 1 and comp.args[1] == 1
                    and comp.kwargs.get("alpha", 1) == 1):
                continue
            b = comp.args[0]
            for scores, other in (kept.args[:2], kept.args[1::-1]):
                if other is b and isinstance(scores, Node) and reaches_matmul(scores):
                    return scores, b, float(fill)
    return None


def replacing_fill(fill, scale: float) -> float | None:
    """The finite fill a masked_fill / where puts in place of a hidden score, as the softmax
    sees it (times the scale applied after it); None for -inf (nothing to state)."""
    return None if math.isinf(fill) else float(fill) * scale


def refuse_visible_fill(x: Node, fill: float) -> None:
    """A product mask's fill must be masked out (<= MASKED_OUT): above it the model's own
    softmax gives every future key weight exp(F - m), and a KV cache holds no future key."""
    if math.isinf(fill):
        fail(x, f"scores * mask + {fill:g} * (1 - mask): an infinite fill times 0 is NaN "
             f"where the mask keeps a key", "Fill with torch.finfo(dtype).min, or use "
             "masked_fill(~mask, -inf)")
    if fill > MASKED_OUT:
        fail(x, f"a finite mask fill F={fill:g} (scores * mask + F * (1 - mask)): future "
             f"tokens keep weight exp(F - m) (m the query's largest score), which no KV "
             f"cache holds (a fill vanishes only at F <= {MASKED_OUT:g})",
             "Fill with -inf or torch.finfo(dtype).min (masked_fill / where on the scores)")


def _score_sources(n: Node) -> tuple[set[Node], bool]:
    """The score matmuls (``q @ k^T``) ``n`` is computed from within its attention (not
    through a linear, so not through the layers before), and whether a convolution is on the
    way."""
    found, conv, seen, stack = set(), False, set(), [n]
    while stack:
        x = stack.pop()
        if x in seen or not isinstance(x, Node) or x.op != "call_function":
            continue
        seen.add(x)
        if x.target == aten.linear.default:
            continue
        if is_call(x, MATMUL):
            if tuple(val(x).shape) == tuple(val(n).shape):     # scores, not probs @ v
                found.add(x)
            continue
        conv = conv or is_call(x, CONVOLUTIONS)
        stack.extend(x.all_input_nodes)
    return found, conv


def scores_mixed(x: Node) -> None:
    """Refuse by name, as the real limits they are, the two score forms of x-transformers that
    mix what DCP keeps apart: the scores of another layer added to these (residual
    attention), and the heads' scores mixed before the softmax (talking heads). Anything
    else returns (and is refused as an unrecognised op)."""
    if not is_call(x, {aten.add.Tensor}) or not all(isinstance(a, Node) for a in x.args):
        return
    own = [a for a in x.args if reaches_matmul(a)]
    mine = set().union(*(_score_sources(a)[0] for a in own)) if own else set()
    for other in x.args:
        if other in own and len(own) == 1:
            continue
        sources, conv = _score_sources(other)
        if sources - mine:
            fail(x, "the scores of another attention layer are added to this one's before its "
                 "softmax (residual attention: x-transformers' residual_attn) -- a real limit: "
                 "a paged attention kernel (dcp.attention, vLLM's, FlashAttention's) never "
                 "materialises a layer's scores for the next, and under DCP a rank holds only "
                 "its share of the keys", "Build the model without residual attention")
        if sources and conv:
            fail(x, "the heads' scores are mixed across heads before the softmax (talking "
                 "heads: x-transformers' pre_talking_heads, a 1x1 convolution over the heads) "
                 "-- a real limit: attention is cut by heads over the ranks (decode DCP "
                 "shards the query heads over all tp ranks), so no rank holds the other "
                 "heads' scores, which never leave the attention kernel", "Build the model "
                 "without pre-softmax talking heads")


def _drops_last_column(n: Node, src: Node) -> bool:
    """``src[..., :-1]``: every key column but the last (the sink's)."""
    if not is_call(n, {aten.slice.Tensor}) or n.args[0] is not src:
        return False
    nd, width = len(val(src).shape), val(src).shape[-1]
    dim, start, end, step = (tuple(n.args[1:]) + (0, None, None, 1)[len(n.args) - 1:])[:4]
    return dim % nd == nd - 1 and start in (0, None) and end in (-1, width - 1) and step == 1


def _max_of(m: Node, x: Node) -> bool:
    """``x.max(dim=-1, keepdim=True).values`` (amax, or max.dim's item 0) of ``x``."""
    if is_call(m, {operator.getitem}) and m.args[1] == 0:
        m = m.args[0]
        return is_call(m, {aten.max.dim}) and m.args[0] is x
    return is_call(m, {aten.amax.default}) and m.args[0] is x


def sink_scores(sm: Node, x: Node) -> tuple[Node, Node]:
    """``cat([scores, sinks.reshape(1, H, 1, 1).expand(B, H, S, 1)], -1)`` (minus its row
    max) -> (scores, the [H] sinks). Anything else before a softmax whose last column is
    dropped is refused: that column is a sink only in this form."""
    if is_call(x, {aten.sub.Tensor}) and isinstance(x.args[1], Node) \
            and _max_of(x.args[1], x.args[0]):
        x = skip_casts(x.args[0])      # the row max: softmax-invariant
    if not (is_call(x, {aten.cat.default}) and len(x.args[0]) == 2
            and (x.args[1] if len(x.args) > 1 else 0) % len(val(x).shape)
            == len(val(x).shape) - 1):
        fail(sm, f"softmax whose last column is dropped, over {x.target} (not "
             f"cat([scores, sinks], -1))", "Attention sinks are recognised as gpt-oss writes "
             "them: cat the per-head sink column to the scores, softmax, drop the column")
    scores, column = x.args[0]
    b, h, s, _ = val(scores).shape
    sink = skip_casts(column)
    if is_call(sink, {aten.expand.default}):
        sink = skip_casts(sink.args[0])
    if is_call(sink, RESHAPES):
        sink = skip_casts(sink.args[0])
    if tuple(val(column).shape) != (b, h, s, 1) or tuple(val(sink).shape) != (h,):
        fail(sm, f"attention sink column of shape {tuple(val(column).shape)} from a tensor "
             f"of shape {tuple(val(sink).shape)}", f"Sinks must be one logit per q head: a "
             f"[{h}] tensor reshaped to (1, {h}, 1, 1) and expanded over batch and queries")
    return scores, sink


def _feeds_matmul(sm: Node) -> bool:
    n = sm
    while len(n.users) == 1:
        prev, (n,) = n, n.users
        if is_call(n, MATMUL):
            return True
        if not (is_call(n, CASTS) or is_call(n, {aten.dropout.default})
                or _drops_last_column(n, prev)):
            return False
    return any(is_call(u, MATMUL) for u in n.users)


def reaches_matmul(n: Node) -> bool:
    """``n`` is ``q @ k^T`` under casts, constant scales and a soft-cap: the scores."""
    while True:
        n = skip_casts(n)
        if is_call(n, MATMUL):
            return True
        if is_call(n, MULS | DIVS | {aten.tanh.default}):
            n = n.args[0] if isinstance(n.args[0], Node) else n.args[1]
            continue
        if is_call(n, {aten.add.Tensor}):     # scores + a bias (ALiBi), then the mask
            return any(isinstance(a, Node) and reaches_matmul(a) for a in n.args[:2])
        if is_call(n, {aten.sub.Tensor}) and isinstance(n.args[0], Node):   # scores - bias
            n = n.args[0]
            continue
        return False


# Recognisers as data: (the ops a form is found at, node -> its Site, or None when the node
# turns out not to be attention, e.g. a softmax that does not feed ``@ v``).
RECOGNISERS = ((KERNEL_OF, sdpa_site), (SOFTMAX, eager_site))


def find_sites(gm: GraphModule) -> list[Site]:
    """Every attention of the graph, in graph order."""
    sites = []
    for n in gm.graph.nodes:
        for targets, recognise in RECOGNISERS:
            if is_call(n, targets):
                site = recognise(n)
                if site is not None:
                    sites.append(site)
                break
    return sites


def site_form(s: Site) -> str:
    """How a site was written, for the pass history (e.g. "sdpa (is_causal, window)")."""
    kind = "sdpa" if s.node.target in KERNEL_OF else "eager"
    mask = "is_causal" if s.causal else (f"{s.mask_kind} mask" if s.mask is not None
                                        else "one token")
    extra = "".join(f", {k}" for k, x in (("window", s.window), ("softcap", s.softcap),
                                         ("sinks", s.sinks is not None),
                                         ("alibi", s.alibi is not None)) if x)
    return f"{kind} ({mask}{extra})"
