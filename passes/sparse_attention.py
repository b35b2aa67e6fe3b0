"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) in a captured graph: the indexer's
selection read off the attention mask (``read_index_selection``), or a named refusal.

The lightning indexer scores every prior token per query and the attention keeps only the
``index_topk`` best (``torch.topk``, scattered into the mask). A DCP rank holds only its
shard of the keys and of the indexer's K, so a per-rank top-k selects a different set than
one device. The exact decode selection exists as runtime ops
(runtime/kernels/sparse_attention.py: index_scores over the local shard, local candidates,
a gathered threshold in DSA_ORDER, ``partial_attention(keep=)``), checked against the models'
own forward (tests/frontends/test_dsa_exact.py). transformers' indexers are captured as one
``dcp.index_topk`` node (dcp_compile/frontends/module_sparse_attention.py), its inputs the
indexer's roped q, head weights and K.

The rewrite: ``read_index_selection`` recognises the model's mask ``causal & ~index_mask``
(bool) or ``causal.masked_fill(index_mask, min)`` (additive), ``index_mask`` being
``new_ones(..).scatter(-1, index_topk(...).long(), False).unsqueeze(1)``: the attention keeps
the causal keys the indexer selects. The mask reader then proves the causal side alone, and
insert_paged_cache stores the indexer's K beside the latent and hands the indexer's q and
head weights to ``dcp.paged_attention`` (``index_*`` keywords); dcp_decode / dcp_prefill emit
the exact DCP selection from them. Any other mask computed from a ``topk`` is refused by
``refuse_top_k_selection``, called before the mask reader (passes/mask_predicate.py), so the
refusal names the feature, not "not a formula" (docs/moe-mla.md: DeepSeek Sparse Attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.fx import Graph, Node

from dcp_compile.runtime.errors import DCPSparseAttentionError

from .infra import source_of, val
from .op_classes import ANDS, NOTS, TOP_K, is_call, skip_casts

if TYPE_CHECKING:
    from .attention_patterns import Site


aten = torch.ops.aten
INDEX_TOPK = torch.ops.dcp.index_topk.default


@dataclass(frozen=True)
class IndexSelection:
    """A lightning indexer's selection feeding an attention (``dcp.index_topk``'s inputs)."""

    node: Node            # the dcp.index_topk node
    q: Node               # [B, S, H, d] roped indexer queries
    weights: Node         # [B, S, H] head weights, scaled
    k: Node               # [B, S, d] the indexer's K of this step's tokens
    scale: float
    topk: int
    shared: bool = False  # an earlier layer's selection, reused (GLM-5 indexer_types "shared")

    @property
    def width(self) -> int:
        return val(self.k).shape[-1]


def _selected_mask(x: Node) -> Node | None:
    """``unsqueeze(new_ones(T).scatter(-1, T.long(), False), 1)`` -> T (dcp.index_topk): True
    at every key the indexer did NOT select; None for anything else."""
    if not (is_call(x, {aten.unsqueeze.default}) and x.args[1] == 1):
        return None
    sc = x.args[0]
    if not (is_call(sc, {aten.scatter.value}) and sc.args[1] in (-1, 2)
            and sc.args[3] is False):
        return None
    ones, idx = sc.args[0], skip_casts(sc.args[2])
    if not (is_call(idx, {INDEX_TOPK}) and is_call(ones, {aten.new_ones.default})
            and ones.kwargs.get("dtype") == torch.bool):
        return None
    return idx


def read_index_selection(s: Site) -> IndexSelection | None:
    """The indexer's selection of the site's mask, the mask replaced by its causal side:
    ``causal & ~selected_mask`` (bool) or ``causal.masked_fill(selected_mask, m)`` with m
    -inf or the dtype's minimum (additive: transformers' DeepseekV32Attention / GLM-5).
    None when the mask is not of this form (refuse_top_k_selection then names it)."""
    m = s.mask
    if not isinstance(m, Node):
        return None
    if is_call(m, ANDS):
        a, b = m.args[:2]
        if is_call(b, NOTS) and _selected_mask(b.args[0]) is not None:
            causal, top = a, _selected_mask(b.args[0])
        elif is_call(a, NOTS) and _selected_mask(a.args[0]) is not None:
            causal, top = b, _selected_mask(a.args[0])
        else:
            return None
    elif is_call(m, {aten.masked_fill.Scalar}) and _selected_mask(m.args[1]) is not None:
        fill = float(m.args[2])
        if not (fill == float("-inf") or fill == torch.finfo(val(m).dtype).min):
            return None
        causal, top = m.args[0], _selected_mask(m.args[1])
    else:
        return None
    if s.k is not s.v:
        raise DCPSparseAttentionError(
            f"DeepSeek Sparse Attention: attention {s.node.name} ({source_of(s.node)}) keeps "
            f"the keys chosen by {top.name} but is not latent attention absorbed into one "
            f"shared K = V head (passes/absorb_latent_attention.py): the indexer's K is "
            f"cached beside the MLA latent, so only MLA + DSA (DeepSeek-V3.2, GLM-5, HY-V4) is "
            f"built. docs/moe-mla.md: DeepSeek Sparse Attention")
    q, w, k, _bias, scale, topk = top.args
    s.mask = causal
    return IndexSelection(node=top, q=q, weights=w, k=k, scale=float(scale), topk=int(topk))


def refuse_top_k_selection(s: Site) -> None:
    """A mask that keeps the keys a ``topk`` picks, in a form ``read_index_selection`` does
    not take, is a data-dependent selection over ALL prior tokens: under DCP a rank holds
    only its shard of the keys, so no per-rank formula of positions reproduces it. Refused
    by name before the generic "not a formula of positions" reading would be."""
    seen, stack, picks = set(), [s.mask] if isinstance(s.mask, Node) else [], []
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
            if n.op == "call_function" and n.target in TOP_K:
                picks.append(n)
    if picks:
        n = min(picks, key=list(s.mask.graph.nodes).index)   # the first in the graph
        raise DCPSparseAttentionError(
            f"DeepSeek Sparse Attention: the indexer's top-k over a sharded context. The "
            f"attention mask of {s.node.name} ({source_of(s.node)}) keeps the keys chosen by "
            f"{n.target} at node {n.name} ({source_of(n)}): a data-dependent top-k over all "
            f"prior tokens. Under "
            f"DCP each rank holds only its shard of the keys and of the indexer's K, so a "
            f"per-rank top-k selects a different set. The exact DCP selection is emitted for "
            f"transformers' lightning indexers (DeepSeek-V3.2, GLM-5, HY-V4: dcp.index_topk over "
            f"absorbed latent attention, its indices scattered into the mask as "
            f"'causal & ~index_mask' or 'masked_fill(index_mask, min)'); this mask is not "
            f"that form. Serve "
            f"this model without DCP, or with the indexer removed (dense latent attention "
            f"over every prior token); docs/moe-mla.md: DeepSeek Sparse Attention")


# -- prefill: the indexer over the full chunk (dcp_prefill) ------------------------------


def index_k_linears(attn: Node) -> set[Node]:
    """The linears behind the indexer's K of a DSA attention (the second part of the
    ``cat([latent ; k_pe], index K)`` insert_paged_cache stores as K = V); none otherwise."""
    if not attn.kwargs.get("index_width"):   # no indexer, or a layer reusing another's
        return set()
    x = attn.args[1]
    while x.op == "call_function" and not is_call(x, {aten.cat.default}):
        x = x.args[0]
    found, stack, seen = set(), list(x.args[0][1:]), set()
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if is_call(n, {aten.linear.default}):
            found.add(n)
        else:
            stack.extend(n.all_input_nodes)
    return found


def full_chunk_indexer(g: Graph, plan) -> None:
    """DeepSeek Sparse Attention under prefill DCP: every query of the chunk selects over
    all prior tokens, so the indexer's q and head weights are needed for the whole chunk,
    in chunk order. The indexer reads the layer's hidden state (the full chunk, step 1)
    and, through MLA's low-rank q chain (q_a_proj -> RMSNorm), the q residual that step 3
    moves to the owned tokens: that shared chain is copied for the indexer, reading the
    full chunk (replicated, like the rest of the indexer). Its K is a token-indexed side
    input of the cached vector (gathered at the owned tokens with RoPE's cos/sin).
    ``plan``: dcp_prefill's LayerPlan of the layer."""
    moved = {*plan.projections, *plan.chained, *plan.qkv_path}
    index_inputs = [plan.attn.kwargs[k] for k in ("index_q", "index_weights")]
    behind, stack = set(), list(index_inputs)
    while stack:
        n = stack.pop()
        if n in behind or n.op != "call_function":
            continue
        behind.add(n)
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(g.nodes)}
    shared = sorted((n for n in behind if n in moved), key=order.__getitem__)
    copies: dict[Node, Node] = {}
    for n in shared:
        with g.inserting_after(n):
            c = g.node_copy(n, lambda a: copies.get(a, a))
        c.meta = dict(n.meta)
        copies[n] = c
    for n in behind - set(shared):
        for a in n.all_input_nodes:
            if a in copies:
                n.replace_input_with(a, copies[a])
