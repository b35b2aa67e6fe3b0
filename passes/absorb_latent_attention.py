"""absorb_latent_attention: Multi-head Latent Attention (DeepSeek MLA) -> attention in latent
space, one shared head.

An ordinary MLA model attends with expanded K/V (dcp_compile/models/mla.py, Hugging Face
``DeepseekV3Attention``)::

    kv      = linear(c, W)          c = RMSNorm(latent) [B, S, L], W = kv_b_proj [H*(dn+dv), L]
    k_nope, v = per-head split of kv into [dn | dv]        [B, H, S, dn], [B, H, S, dv]
    k       = cat(k_nope, k_pe.expand(heads))             k_pe [B, 1, S, dr] (RoPE'd, shared)
    out     = SDPA(q, k, v)                                q [B, H, S, dn + dr]

Since k_nope_h = W_UK_h c and v_h = W_UV_h c per head h (W viewed [H, dn+dv, L]), the same
attention is, exactly (the absorbed form)::

    q_abs   = cat(q_nope_h @ W_UK_h, q_pe)                 [B, H, S, L + dr]
    kv      = cat(c, k_pe)                                 [B, 1, S, L + dr]  one KV head
    o       = SDPA(q_abs, kv, kv, enable_gqa, same scale)  [B, H, S, L + dr]
    out     = o[..., :L] @ W_UV_h^T                        [B, H, S, dv]

This pass rewrites the graph into that form before the cache is inserted: the attention is
then MQA with K = V = [c ; k_pe] (insert_paged_cache stores a tensor that is both K and V
once), q heads and W's head rows are sharded by TP as usual (W_UK/W_UV are per-head views of
W), and DCP decode gathers q_abs, attends over each rank's latents and combines the partial
[L + dr] outputs by LSE before W_UV. Why absorbed (not expanded): docs/moe-mla.md, "Multi-head
Latent Attention".

Recognised: ``aten.scaled_dot_product_attention`` or eager ``q @ k^T -> softmax -> @ v``
whose key is ``cat(k_nope, expand(k_pe))`` (or Hugging Face's new_empty + copy_ of the two)
on the last dim, k_nope and v per-head column blocks [h*(dn+dv), +dn) and [h*(dn+dv)+dn, +dv)
of one bias-free linear (checked by evaluating the view/split chain on column indices).
A key with that shared-head signature in any other form is refused (DCPTransformError), never
cached expanded.
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.fx.operator_schemas import normalize_function

from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.program.facts import LatentAttention, ModelFacts

from .infra import DCPPass, Found, Property, source_of, val
from .op_classes import CASTS, COLUMN_LAYOUT_OPS, MATMUL, SOFTMAX
from .op_classes import is_call as _call
from .op_classes import skip_casts as _skip_casts

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def _fail(node: Node, why: str, fix: str):
    raise DCPTransformError(f"{why} at node {node.name} ({source_of(node)}). {fix}.")


def shared_key_parts(k: Node):
    """``cat([k_nope, x.expand(...)], -1)`` with x one head -> (cat, k_nope, x); else None.
    The signature of MLA's decoupled RoPE key (one head shared by all query heads)."""
    k = _skip_casts(k)
    if not _call(k, {aten.cat.default}) or len(val(k).shape) != 4:
        return None
    dim = k.args[1] if len(k.args) > 1 else k.kwargs.get("dim", 0)
    parts = [_skip_casts(p) for p in k.args[0]]
    shared = [p for p in parts if _call(p, {aten.expand.default})
              and val(p.args[0]).shape[1] == 1 and val(p).shape[1] > 1]
    if not shared:
        return None
    if dim % 4 != 3 or len(parts) != 2 or parts[1] is not shared[0]:
        _fail(k, f"an attention key with a head-shared part ({shared[0].name}) built as "
              f"cat over dim {dim} of {len(parts)} parts", "MLA keys must be "
              "cat([k_nope, k_pe.expand(heads)], dim=-1) (DeepSeek's layout)")
    return k, parts[0], parts[1].args[0]


def weight_name(lin: Node) -> str:
    return lin.args[1].name if isinstance(lin.args[1], Node) else lin.name


def _linear_behind(n: Node) -> tuple[Node, list[Node]]:
    """The linear a tensor's columns come from, through layout-only ops (and the path)."""
    path = []
    while _call(n, COLUMN_LAYOUT_OPS):
        path.append(n)
        n = n.args[0]
    return n, path


def _column_map(lin: Node, out: Node) -> torch.Tensor:
    """Evaluate the layout ops from ``lin`` to ``out`` on the column index of lin's output."""
    shape = tuple(val(lin).shape)
    env = {lin: torch.arange(shape[-1]).expand(shape).clone()}
    order = {n: i for i, n in enumerate(lin.graph.nodes)}
    need, stack = set(), [out]
    while stack:
        n = stack.pop()
        if n in need or n is lin:
            continue
        need.add(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(need, key=order.get):
        if not _call(n, COLUMN_LAYOUT_OPS):
            _fail(n, f"the kv_b projection's output reaches {out.name} through {n.target}",
                  "Only views, transposes and splits may sit between kv_b_proj and k_nope / v")
        if _call(n, CASTS):
            env[n] = env[n.args[0]]
            continue
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
        env[n] = n.target(*args, **kwargs)
    return env[out]


def _new(g, mode, target, args, kwargs=None, like: Node | None = None) -> Node:
    n = g.call_function(target, args, kwargs or {})
    fargs, fkwargs = torch.fx.node.map_arg((args, kwargs or {}), lambda a: a.meta["val"])
    with mode:
        n.meta["val"] = target(*fargs, **fkwargs)
    for key in ("stack_trace", "nn_module_stack"):
        if like is not None and key in like.meta:
            n.meta[key] = like.meta[key]
    return n


class AbsorbLatentAttention(DCPPass):
    """An ordinary model's graph (the ordinary frontend builds this pass): every MLA
    attention in its absorbed form (module doc); the latent widths go to the facts
    (``ModelFacts.mla``). A model without MLA passes through unchanged."""

    name = "absorb_latent_attention"
    required = frozenset({Property.CANONICAL_OPS})      # the kv_b_proj is a linear
    ensured = frozenset({Property.LATENT_ABSORBED})

    def call(self, gm):
        latent = absorb_latent_attention(gm)
        self.record(mla_layers=len(latent))
        return Found(gm, True, facts=ModelFacts(
            mla=LatentAttention(**latent[0]) if latent else None))


def absorb_latent_attention(gm: GraphModule) -> list[dict]:
    """Rewrite every MLA attention of ``gm`` into the absorbed form (module doc); returns one
    record per rewritten layer (its latent and rope widths)."""
    g = gm.graph
    mode = detect_fake_mode([n.meta["val"] for n in g.nodes if n.op == "placeholder"])
    realify_complex_rope(g, mode)
    heads_first_keys(g, mode)
    records, rewritten = [], set()
    for n in list(g.nodes):
        if not _call(n, {SDPA}):
            continue
        _key_from_copies(g, n, n.args[1] if len(n.args) > 1 else n.kwargs.get("key"), mode)
        kw = normalize_function(n.target, n.args, n.kwargs,
                                normalize_to_only_use_kwargs=True).kwargs
        parts = shared_key_parts(kw["key"])
        if parts is None:
            continue
        records.append(_rewrite(g, mode, n, kw, *parts))
        rewritten.add(parts[0])
    for n in list(g.nodes):   # eager attention: `q @ k.transpose(-2, -1)` with an MLA key
        if _call(n, {aten.matmul.default}) and _call(n.args[1], {aten.transpose.int}):
            _key_from_copies(g, n.args[1], _skip_casts(n.args[1].args[0]), mode)
            parts = shared_key_parts(n.args[1].args[0])
            if parts is not None:
                records.append(_rewrite_eager(g, mode, n, *parts))
                rewritten.add(parts[0])
    for n in g.nodes:   # the MLA key signature anywhere else: never cache it expanded
        if _call(n, {aten.cat.default}) and n not in rewritten and n.users \
                and shared_key_parts(n) is not None and _feeds_attention(n):
            _fail(n, f"MLA-style key {n.name} (a head-shared RoPE part concatenated to "
                  f"per-head keys) reaches an attention that is not "
                  f"aten.scaled_dot_product_attention", "Build the model with SDPA attention "
                  "(attn_implementation='sdpa'): only that form is rewritten to the latent "
                  "cache")
    g.eliminate_dead_code()
    if records:
        _views_as_unsqueeze(g, mode)
    gm.recompile()
    return records


def _views_as_unsqueeze(g, mode) -> None:
    """A view that only inserts a size-1 dim (HF's ``k_pe.view(B, 1, S, dr)``) is an
    ``unsqueeze``: said so, the token dim's move is plain to the prefill token-dim trace."""
    for n in list(g.nodes):
        if not _call(n, {aten.view.default, aten.reshape.default}):
            continue
        src, out = tuple(val(n.args[0]).shape), tuple(val(n).shape)
        if len(out) != len(src) + 1:
            continue
        for d in range(len(out)):
            if out[d] == 1 and out[:d] + out[d + 1:] == src:
                with g.inserting_before(n):
                    u = _new(g, mode, aten.unsqueeze.default, (n.args[0], d), like=n)
                n.replace_all_uses_with(u)
                g.erase_node(n)
                break


def realify_complex_rope(g, mode) -> int:
    """``view_as_real(view_as_complex(x) * f)`` (complex RoPE, DeepSeek-V2 / Meta Llama) ->
    the same rotation in real arithmetic on x's (re, im) pairs, with cos/sin read from
    ``view_as_real(f)``; a ``flatten`` of the result becomes a reshape. Every op is then a
    last-dim slice / pointwise / cat / view (per-token and placement rules exist for them;
    none do for complex views). Returns how many rotations were rewritten."""
    count = 0
    for n in list(g.nodes):
        if not _call(n, {aten.view_as_real.default}) or not _call(n.args[0], {aten.mul.Tensor}):
            continue
        mul = n.args[0]
        xs = [a for a in mul.args if _call(a, {aten.view_as_complex.default})]
        if len(xs) != 1:
            continue
        x = xs[0].args[0]
        f = mul.args[1] if mul.args[0] is xs[0] else mul.args[0]
        if not isinstance(f, Node) or not val(f).is_complex():
            continue
        nd = len(val(x).shape)

        def new(target, *args):
            return _new(g, mode, target, args, like=n)

        with g.inserting_before(n):
            fr = new(aten.view_as_real.default, f)
            cos, sin = (new(aten.slice.Tensor, fr, len(val(fr).shape) - 1, i, i + 1)
                        for i in (0, 1))
            a, b = (new(aten.slice.Tensor, x, nd - 1, i, i + 1) for i in (0, 1))
            re = new(aten.sub.Tensor, new(aten.mul.Tensor, a, cos), new(aten.mul.Tensor, b, sin))
            im = new(aten.add.Tensor, new(aten.mul.Tensor, a, sin), new(aten.mul.Tensor, b, cos))
            out = new(aten.cat.default, [re, im], nd - 1)
        if tuple(val(out).shape) != tuple(val(n).shape):
            _fail(n, f"complex RoPE of shape {tuple(val(n).shape)} broadcasts to "
                  f"{tuple(val(out).shape)} in real form", "Report this model")
        n.replace_all_uses_with(out)
        for u in list(out.users):
            if _call(u, {aten.flatten.using_ints}):
                with g.inserting_before(u):
                    r = _new(g, mode, aten.reshape.default, (out, list(val(u).shape)), like=u)
                u.replace_all_uses_with(r)
        count += 1
    return count


def _key_from_copies(g, reader: Node, key: Node, mode) -> None:
    """Hugging Face builds the MLA key in place: ``k = new_empty(...)``, then
    ``k[..., :dn].copy_(k_nope)`` and ``k[..., dn:].copy_(k_pe.expand(...))``. That key becomes
    ``cat([k_nope, k_pe.expand(...)], -1)`` (the same values, a functional graph);
    ``reader`` reads the key (the attention, or eager attention's transpose)."""
    if not _call(key, {aten.new_empty.default}):
        return
    width, pieces, dead = val(key).shape[-1], [], []
    for u in key.users:
        if u is reader:
            continue
        copies = list(u.users)
        if not (_call(u, {aten.slice.Tensor}) and u.args[1] % 4 == 3
                and (len(u.args) < 5 or u.args[4] == 1) and len(copies) == 1
                and _call(copies[0], {aten.copy_.default}) and copies[0].args[0] is u
                and tuple(val(copies[0].args[1]).shape) == tuple(val(u).shape)):
            _fail(u, f"the attention key {key.name} (new_empty) is written by {u.target}",
                  "Write the key as slices of the last dim filled by copy_, or build it "
                  "with torch.cat")
        start = u.args[2] if len(u.args) > 2 else 0
        pieces.append((start, copies[0].args[1]))
        dead += [copies[0], u]
    pieces.sort(key=lambda p: p[0])
    ends = [p[0] + val(p[1]).shape[-1] for p in pieces]
    if [p[0] for p in pieces] != [0] + ends[:-1] or (ends and ends[-1] != width):
        _fail(key, f"the slices copied into attention key {key.name} do not tile its last "
              f"dim of {width}", "Fill every column of the key exactly once")
    with g.inserting_before(reader):
        cat = _new(g, mode, aten.cat.default, ([p[1] for p in pieces], -1), like=key)
    reader.replace_input_with(key, cat)
    for n in dead:
        g.erase_node(n)
    g.erase_node(key)


def _swaps_dims_1_2(n: Node) -> bool:
    return _call(n, {aten.transpose.int}) and len(val(n).shape) == 4 and \
        sorted(d % 4 for d in n.args[1:3]) == [1, 2]


def heads_first_keys(g, mode) -> int:
    """torchtitan builds MLA's key tokens-first, ``cat([k_nope, k_pe.expand(B, S, H, dr)],
    -1)`` ``[B, S, H, D]``, and its inner attention transposes it to ``[B, H, S, D]``: the
    transpose is moved in front of the cat and the expand (it swaps neither the cat dim nor
    the expanded one's size-1 dim away), so the key reads ``cat([k_nope^T, k_pe^T.expand])``
    as in DeepSeek's own layout. Only a transpose of exactly that key is moved."""
    count = 0
    for n in list(g.nodes):
        if not _swaps_dims_1_2(n) or not _call(n.args[0], {aten.cat.default}):
            continue
        cat = n.args[0]
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        parts = list(cat.args[0])
        if dim % 4 != 3 or len(parts) != 2 or not _call(parts[1], {aten.expand.default}):
            continue
        k_nope, (k_pe, _size) = parts[0], parts[1].args[:2]
        if val(k_pe).shape[2] != 1 or val(parts[1]).shape[2] == 1:
            continue

        def new(target, *args):
            return _new(g, mode, target, args, like=n)

        with g.inserting_before(n):
            shared = new(aten.transpose.int, k_pe, 1, 2)
            key = new(aten.cat.default, [new(aten.transpose.int, k_nope, 1, 2),
                                         new(aten.expand.default, shared,
                                             list(val(n).shape[:3]) + [-1])], -1)
        n.replace_all_uses_with(key)
        g.erase_node(n)
        count += 1
    return count


def _feeds_attention(n: Node) -> bool:
    stack, seen = [n], set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if _call(x, SOFTMAX | MATMUL) or (
                x.op == "call_function" and "attention" in str(x.target)):
            return True
        stack.extend(x.users)
    return False


def _parts(anchor: Node, q: Node, v: Node, k_nope: Node, k_pe: Node) -> dict:
    """Check one MLA attention's pieces (module doc) and return its sizes and nodes."""
    lin, _ = _linear_behind(k_nope)
    lin_v, _ = _linear_behind(v)
    if not _call(lin, {aten.linear.default}) or lin_v is not lin:
        _fail(anchor, f"MLA attention whose k_nope ({k_nope.name}) and value ({v.name}) do "
              f"not both come from one linear (found {lin.name} and {lin_v.name})",
              "k_nope and v must be the per-head split of one kv_b_proj output")
    latent, weight = lin.args[0], lin.args[1]
    if len(lin.args) > 2 and lin.args[2] is not None:
        _fail(anchor, f"MLA attention whose kv_b_proj ({weight_name(lin)}) has a bias: the "
              f"absorbed form folds only its weight", "Use a bias-free kv_b_proj (DeepSeek's)")
    b, heads, s, dn = val(k_nope).shape
    dv, dr = val(v).shape[-1], val(k_pe).shape[-1]
    lat = val(latent).shape[-1]
    if tuple(val(latent).shape) not in ((b, s, lat), (b, 1, s, lat)) or \
            tuple(val(weight).shape) != (heads * (dn + dv), lat) or \
            tuple(val(k_pe).shape) != (b, 1, s, dr) or \
            tuple(val(q).shape) != (b, heads, s, dn + dr) or val(v).shape[1] != heads:
        _fail(anchor, f"MLA shapes do not fit: latent {tuple(val(latent).shape)}, kv_b weight "
              f"{tuple(val(weight).shape)}, k_nope {tuple(val(k_nope).shape)}, v "
              f"{tuple(val(v).shape)}, k_pe {tuple(val(k_pe).shape)}, q "
              f"{tuple(val(q).shape)}", "Use DeepSeek's MLA layout")
    col = torch.arange(heads)[:, None] * (dn + dv)
    for what, node, off, width in (("k_nope", k_nope, 0, dn), ("v", v, dn, dv)):
        want = (col + off + torch.arange(width)[None]).view(1, heads, 1, width)
        got = _column_map(lin, node)
        if tuple(got.shape) != (b, heads, s, width) or not bool((got == want).all()):
            _fail(node, f"{what} of MLA attention {anchor.name} is not the per-head block "
                  f"[h*(dn+dv) + {off}, +{width}) of kv_b_proj's output", "Split kv_b_proj "
                  "per head as [k_nope (qk_nope_head_dim) | v (v_head_dim)]")
    return dict(latent=latent, weight=weight, k_pe=k_pe, q=q, b=b, heads=heads, s=s, dn=dn,
                dv=dv, dr=dr, lat=lat, dtype=val(k_nope).dtype)


def _absorbed_inputs(new, p: dict) -> tuple[Node, Node]:
    """(q_abs [B,H,S,L+dr], kv [B,1,S,L+dr]) at the current insertion point."""
    b, s, dn, dr, lat = (p[k] for k in ("b", "s", "dn", "dr", "lat"))
    q, latent = p["q"], p["latent"]
    c = latent
    if len(val(latent).shape) == 4:       # HF views the normed latent [B,S,L] as [B,1,S,L]
        src = _skip_casts(latent.args[0]) if _call(latent, {aten.view.default,
                                                          aten.reshape.default}) else None
        c = src if src is not None and tuple(val(src).shape) == (b, s, lat) else \
            new(aten.view.default, latent, [b, s, lat])
    c = c if val(c).dtype == p["dtype"] else new(aten.to.dtype, c, p["dtype"])
    kv = new(aten.cat.default, [new(aten.unsqueeze.default, c, 2),
                                new(aten.transpose.int, p["k_pe"], 1, 2)], -1)  # [B,S,1,L+dr]
    kv = new(aten.transpose.int, kv, 1, 2)                                      # [B,1,S,L+dr]
    q_nope = new(aten.slice.Tensor, q, 3, 0, dn)
    q_pe = new(aten.slice.Tensor, q, 3, dn, dn + dr)
    q_lat = new(aten.matmul.default, q_nope, _w_heads(new, p, 0, dn, q_nope))  # [B,H,S,L]
    return new(aten.cat.default, [q_lat, q_pe], -1), kv


def _w_heads(new, p: dict, start: int, end: int, like: Node, transpose: bool = False) -> Node:
    """Rows [start, end) of every head of W = kv_b_proj.weight, as a batch over heads
    ``[1, H, end - start, L]`` (``[1, H, L, end - start]`` transposed) in ``like``'s dtype:
    W_UK is rows [0, dn), W_UV rows [dn, dn + dv). A view of W itself, so the placement
    analysis cuts W by heads where a head-sharded operand meets it in the matmul; the batched
    product never materialises [B, S, H*(dn+dv), L]."""
    w = new(aten.view.default, p["weight"], [p["heads"], p["dn"] + p["dv"], p["lat"]])
    w = new(aten.slice.Tensor, w, 1, start, end)
    if transpose:
        w = new(aten.transpose.int, w, 1, 2)
    w = new(aten.unsqueeze.default, w, 0)
    return w if val(w).dtype == val(like).dtype else new(aten.to.dtype, w, val(like).dtype)


def _apply_w_uv(new, p: dict, o: Node) -> Node:
    """o [B,H,S,L+dr] (attention in latent space) -> o[..., :L] @ W_UV_h^T [B,H,S,dv]."""
    o_lat = new(aten.slice.Tensor, o, 3, 0, p["lat"])                          # [B,H,S,L]
    return new(aten.matmul.default, o_lat,
               _w_heads(new, p, p["dn"], p["dn"] + p["dv"], o_lat, transpose=True))


def _record(p: dict, scale) -> dict:
    return dict(kv_lora_rank=p["lat"], qk_rope_head_dim=p["dr"], qk_nope_head_dim=p["dn"],
                v_head_dim=p["dv"], heads=p["heads"], scale=scale)


def _rewrite(g, mode, sdpa: Node, kw: dict, key: Node, k_nope: Node, k_pe: Node) -> dict:
    q, v = kw["query"], _skip_casts(kw["value"])
    if kw.get("dropout_p", 0.0):
        _fail(sdpa, f"MLA attention with dropout_p={kw['dropout_p']}", "Call model.eval()")
    p = _parts(sdpa, q, v, k_nope, k_pe)
    scale = kw.get("scale")
    scale = float(scale) if scale is not None else (p["dn"] + p["dr"]) ** -0.5

    def new(target, *args, **kwargs):
        return _new(g, mode, target, args, kwargs, like=sdpa)

    with g.inserting_before(sdpa):
        q_abs, kv = _absorbed_inputs(new, p)
        o = new(SDPA, q_abs, kv, kv, attn_mask=kw.get("attn_mask"),
                is_causal=bool(kw.get("is_causal", False)), scale=scale, enable_gqa=True)
        out = _apply_w_uv(new, p, o)
    sdpa.replace_all_uses_with(out)
    g.erase_node(sdpa)
    return _record(p, scale)


def _rewrite_eager(g, mode, qk: Node, key: Node, k_nope: Node, k_pe: Node) -> dict:
    """Eager ``q @ k^T ... softmax ... @ v``: q -> q_abs, k and v -> the one latent head
    repeated over the query heads (repeat_kv's expand + reshape, which the cache insertion
    strips), and W_UV after ``@ v``; the scale, mask and casts in between are kept."""
    pv = _pv_matmul(qk)
    if pv is None:
        _fail(qk, f"MLA scores {qk.name} do not reach `softmax(...) @ v`",
              "Write eager attention as softmax(q @ k^T * scale + mask) @ v")
    p = _parts(qk, qk.args[0], _skip_casts(pv.args[1]), k_nope, k_pe)

    def new(target, *args, **kwargs):
        return _new(g, mode, target, args, kwargs, like=qk)

    with g.inserting_before(qk):
        q_abs, kv = _absorbed_inputs(new, p)
        b, heads, s, width = p["b"], p["heads"], p["s"], p["lat"] + p["dr"]
        rep = new(aten.reshape.default,
                  new(aten.expand.default, new(aten.unsqueeze.default, kv, 2),
                      [b, 1, heads, s, width]), [b, heads, s, width])
        kt = new(aten.transpose.int, rep, -2, -1)
    qk.args = (q_abs, kt)
    pv.args = (pv.args[0], rep)
    for n in (qk, pv):   # same shapes in between; the two matmuls change theirs
        fargs = torch.fx.node.map_arg(n.args, lambda a: a.meta["val"])
        with mode:
            n.meta["val"] = n.target(*fargs)
    with g.inserting_before(pv.next):
        out = _apply_w_uv(new, p, pv)
    head = next(u for u in pv.users if u.op == "call_function" and u.target is aten.slice.Tensor
                and u.args[2:] == (0, p["lat"]))
    pv.replace_all_uses_with(out, delete_user_cb=lambda u: u is not head)
    return _record(p, None)


def _pv_matmul(qk: Node) -> Node | None:
    """Forward from ``q @ k^T`` through single-user elementwise ops to softmax, then casts,
    to ``probs @ v``."""
    n, seen_softmax = qk, False
    while len(n.users) == 1:
        (n,) = n.users
        if _call(n, SOFTMAX):
            seen_softmax = True
        elif _call(n, {aten.matmul.default}):
            return n if seen_softmax and n.args[0] is not qk else None
    return None
