"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) in a captured graph: still a named refusal.

The lightning indexer scores every prior token per query and the attention keeps only the
``index_topk`` best (``torch.topk``, scattered into the mask). A DCP rank holds only its
shard of the keys and of the indexer's K, so a per-rank top-k selects a different set than
one device. The exact decode selection exists as runtime ops
(runtime/kernels/sparse_attention.py: index_scores over the local shard, local candidates,
a gathered threshold in DSA_ORDER, ``partial_attention(keep=)``), checked against the models'
own forward (tests/frontends/test_dsa_exact.py). transformers' indexers are captured as one
``dcp.index_topk`` node (dcp_compile/frontends/module_sparse_attention.py), its inputs the
indexer's roped q, head weights and K; what is missing is the rewrite of that node: caching
its K beside the latent and emitting the DCP selection (decode and prefill).
insert_paged_cache calls this before the mask reader (passes/mask_predicate.py), so the
refusal names the feature, not "not a formula" (docs/moe-mla.md: DeepSeek Sparse Attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.fx import Node

from dcp_compile.runtime.errors import DCPSparseAttentionError

from .infra import source_of
from .op_classes import TOP_K

if TYPE_CHECKING:
    from .attention_patterns import Site


def refuse_top_k_selection(s: Site) -> None:
    """A mask that keeps the keys a ``topk`` picks (DeepSeek Sparse Attention's indexer,
    DeepSeek-V3.2 / GLM-5) is a data-dependent selection over ALL prior tokens: under DCP a
    rank holds only its shard of the keys, so no per-rank formula of positions reproduces it.
    Refused by name before the generic "not a formula of positions" reading would be."""
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
            f"per-rank top-k selects a different set. The runtime has the exact decode "
            f"selection (runtime/kernels/sparse_attention.py: local candidates, an all-gather "
            f"of their scores and positions, a global threshold, ties by position), but the "
            f"rewrite that replaces this selection in a captured graph (the indexer's K "
            f"cached beside the latent, the selection emitted, decode or prefill) is not "
            f"built yet. Serve "
            f"this model without DCP, or with the indexer removed (dense latent attention "
            f"over every prior token); docs/moe-mla.md: DeepSeek Sparse Attention")
