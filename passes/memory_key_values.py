"""Memory key/values (x-transformers' ``attn_num_mem_kv``) split off an attention site.

x-transformers joins learned keys and values before the sequence's (``cat([mem_k, k],
dim=-2)``, the same for v) and masks ``[queries, M + keys]``: every query attends the M
memory keys, at no position. The cache insertion (passes/insert_paged_cache.py) calls
:func:`split_memory` on each site: the site keeps the sequence's own K/V and the mask's
columns over them; the memory keys' columns are read (:func:`read_mask_keys`) and proven
kept for every query, with no bias; the memory goes to the paged op as ``mem_k`` / ``mem_v``
``[1, M, kv_heads, D]`` (:func:`memory_rows`), joined by cp rank 0 only
(runtime/kernels/live_attention.join_memory).
"""

from __future__ import annotations

import sympy
import torch
from torch.fx import Node

from .attention_patterns import Site, fail
from .infra import val
from .mask_predicate import I, J, _interpret, _keep
from .op_classes import CASTS, CONCATS, is_call
from .symbolic_tensors import axis, rename

aten = torch.ops.aten


def memory_join(t: Node, per_token: set) -> tuple[Node, Node] | None:
    """(learned part, the sequence's part) when ``t`` is ``cat([learned, per-token], dim=2)``
    of [B, H, S, D] tensors (casts around it skipped), else None."""
    x = t
    while is_call(x, CASTS):
        x = x.args[0]
    if not is_call(x, CONCATS):
        return None
    parts = list(x.args[0])
    dim = x.args[1] if len(x.args) > 1 else 0
    if dim % 4 != 2 or len(parts) != 2 or parts[0] in per_token or parts[1] not in per_token:
        return None
    # both [B, H, *, D]: torch.cat skips a 1-D empty tensor (XLM joins one where a cache
    # would be), which is no memory
    if any(val(p).dim() != 4 for p in parts) or val(parts[0]).shape[2] == 0:
        return None
    return parts[0], parts[1]


def memory_rows(g, t: Node) -> Node:
    """Memory keys or values [B, Hkv, M, D] (the same for every row: computed without the
    tokens) as the paged op's [1, M, Hkv, D]."""
    row = g.call_function(aten.slice.Tensor, (t, 0, 0, 1))
    return g.call_function(aten.transpose.int, (row, 1, 2))


def read_mask_keys(s: Site, root: Node, tokens: int, *, token_input: str,
                   position_input: Node | None, constants=lambda: {}) -> sympy.Basic:
    """K(i, j) of a piece of the site's mask (``root``, [..., queries, keys], read as the
    site's mask is, by its kind): the memory keys' columns of x-transformers' mask
    (:func:`split_memory` proves every query keeps them). Refused, as a mask
    is, if it differs across batch rows or heads."""
    m, _ = _interpret(root, s, tokens, token_input, position_input, constants)
    keep, bias = _keep(s, m)
    r = len(m.shape)
    if {axis(k) for k in range(r - 2)} & keep.free_symbols:
        fail(root, f"the attention mask of {s.node.name} differs across batch rows or heads",
             "Use one mask for every row and head")
    if sympy.simplify(bias) != 0:
        fail(root, f"the attention mask of {s.node.name} adds a score bias ({bias}) to these "
             f"keys", "Add no bias to memory keys")
    return rename(keep, {r - 2: I, r - 1: J})


def split_memory(s: Site, per_token: set, tokens: int, *, token_input: str,
                 position_input: Node | None, constants) -> None:
    """Memory key/values (x-transformers' ``attn_num_mem_kv``: ``cat([mem_k, k], dim=-2)``
    and the same for v): learned keys every query attends at no position. Split off the
    site (``s.mem``, the paged op's ``mem_k`` / ``mem_v``; cp rank 0 adds them to its
    partial attention and the LSE combine counts them once), the sequence's own keys
    left as the site's K/V, and its mask read over the sequence's keys, after proving
    that it keeps every memory key for every query."""
    joins = [memory_join(t, per_token) for t in (s.k, s.v)]
    if joins == [None, None]:
        return
    where = s.k if joins[0] is not None else s.v
    if None in joins or val(joins[0][0]).shape[2] != val(joins[1][0]).shape[2]:
        fail(s.node, f"memory key/values: attention {s.node.name} joins learned entries "
             f"before the sequence's own in its {'keys' if joins[0] else 'values'} only",
             "Join memory keys and values alike (cat([mem_k, k]), cat([mem_v, v]))")
    m = val(joins[0][0]).shape[2]
    if s.bias is None and s.mask is None and tokens == 1 and not s.causal:
        # one query, no mask: it sees the memory keys and its own key (all of them)
        s.k, s.v = joins[0][1], joins[1][1]
        s.mem = (joins[0][0], joins[1][0])
        return
    if s.bias is not None or s.mask is None:
        what = "adds a score bias" if s.bias is not None else "has no mask"
        fail(where, f"memory key/values: attention {s.node.name} joins {m} learned keys "
             f"before the sequence's and {what}; the paged op reads memory keys with a mask "
             f"over the sequence's keys only",
             "Build the model without memory key/values, or without the score bias")
    g = s.node.graph
    mask = s.mask
    last = val(mask).dim() - 1
    if val(mask).shape[-1] != m + tokens:
        fail(mask, f"memory key/values: the mask of attention {s.node.name} has "
             f"{val(mask).shape[-1]} keys, not the {m} memory keys and the {tokens} "
             f"tokens'", "Mask the memory keys and the sequence's keys together")
    with g.inserting_after(mask):
        seq = g.call_function(aten.slice.Tensor, (mask, last, m, m + tokens))
        mem = g.call_function(aten.slice.Tensor, (mask, last, 0, m))
    seq.meta["val"], mem.meta["val"] = val(mask)[..., m:], val(mask)[..., :m]
    for n in (seq, mem):
        for key in ("stack_trace", "nn_module_stack"):
            if key in mask.meta:
                n.meta[key] = mask.meta[key]
    keep = read_mask_keys(s, mem, tokens, token_input=token_input,
                          position_input=position_input, constants=constants)
    hidden = [(i, j) for i in range(tokens) for j in range(m)
              if sympy.simplify(keep.subs({I: i, J: j})) is not sympy.true]
    for j in range(m):   # for every query position, not only the captured ones
        if sympy.simplify(keep.subs(J, j)) is not sympy.true and not hidden:
            hidden.append(("every i >= 0", j))
    if hidden:
        fail(mask, f"memory key/values: the mask of attention {s.node.name} hides a "
             f"memory key from a query (query i, memory key j: {hidden[:3]}); memory keys "
             f"are seen by every query, at no position", "Keep every memory key "
             "visible to every query")
    s.mask = seq
    s.k, s.v = joins[0][1], joins[1][1]
    s.mem = (joins[0][0], joins[1][0])
