"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5, HY-V4), read at the module
level: for the capture, the indexer's forward becomes one ``dcp.index_topk`` op.

transformers' indexer (``DeepseekV32Indexer.forward``, ``GlmMoeDsaIndexer.forward``,
``HYV4Indexer.forward``: the same selection in another form, RULES' fields) scores
every prior token per query and returns ``torch.topk(...).indices``; in a captured graph that
is a matmul chain and an ``aten.topk`` whose inputs a graph rewrite would have to dig out
again. The swap runs the indexer's own projections, norm and RoPE verbatim and hands the
three tensors the DCP selection needs (its roped queries, its head weights, its K) to
``dcp.index_topk`` (runtime/kernels/sparse_attention.py), which scores as the model does and
returns the first ``index_topk`` keys in DSA_ORDER: the model's set wherever its cut has no
tie, and a rule of positions at a tie (docs/moe-mla.md, DeepSeek Sparse Attention). The
captured graph then holds the indexer as one node with its inputs named, which the DCP
rewrite replaces (passes/sparse_attention.py reads it off the mask; insert_paged_cache caches
its K beside the latent; dcp_decode / dcp_prefill emit index_scores, the candidates, one
all-gather, the threshold and partial_attention's keep).

No guessing: a rule (``RULES``, one row per indexer class) names the class, and the source of
the forward the swap re-states is pinned by its hash (transformers 5.25); an indexer of a
listed class whose code differs is refused naming the function. The class is untouched: the
swap is on the instance, undone after the capture.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dcp_compile.runtime.errors import DCPSparseAttentionError
from dcp_compile.runtime.kernels import sparse_attention  # noqa: F401  (registers the ops)

from .module_experts import changed_pins, rule_of_class, swap_sites


@dataclass(frozen=True)
class IndexerRule:
    """One library indexer class (``module:qualname``), the functions whose meaning the swap
    relies on (``module:qualname`` -> accepted source hashes), the RoPE function its
    forward applies (a name in the class's module) and where its forward differs from
    DeepSeek-V3.2's in form, not in the selection:

    ``rope_last``          RoPE on the last ``qk_rope_head_dim`` columns of q and K, the
                           unrotated ones first (HY-V4's "flipped" layout), not the first;
    ``scale_in_weights``   ``softmax_scale`` multiplied into the head weights, the per-head
                           products unscaled (``w * s * relu(q.k)``, not ``w * relu(s * q.k)``:
                           one selection, s > 0); the op then gets scale 1.0, so it runs the
                           model's own arithmetic;
    ``k_norm_own_dtype``   K's norm run in its weight's dtype (float32), cast back after.
    """

    indexer: str
    pinned: dict[str, set[str]]
    rope: str
    rope_last: bool = False
    scale_in_weights: bool = False
    k_norm_own_dtype: bool = False


_V32 = "transformers.models.deepseek_v32.modeling_deepseek_v32"
_GLM = "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa"
_HY4 = "transformers.models.hy_v4.modeling_hy_v4"
RULES = (
    IndexerRule(indexer=f"{_V32}:DeepseekV32Indexer",
                pinned={f"{_V32}:DeepseekV32Indexer.forward": {"d661c778bc18"}},
                rope="apply_rotary_pos_emb"),                  # half-split
    IndexerRule(indexer=f"{_GLM}:GlmMoeDsaIndexer",
                pinned={f"{_GLM}:GlmMoeDsaIndexer.forward": {"5b484bc355c7"}},
                rope="apply_rotary_pos_emb_interleave"),       # interleaved pairs
    IndexerRule(indexer=f"{_HY4}:HYV4Indexer",
                pinned={f"{_HY4}:HYV4Indexer.forward": {"36f7efb47d79"}},
                rope="apply_rotary_pos_emb_interleave", rope_last=True,
                scale_in_weights=True, k_norm_own_dtype=True),
)


def rule_for(module: nn.Module) -> IndexerRule | None:
    """The rule whose class ``module`` is (or derives from); None: not a listed indexer."""
    return rule_of_class(module, RULES, "indexer")


def check_pins(name: str, module: nn.Module, rule: IndexerRule) -> None:
    """Refuse an indexer whose code is not the code the swap was written from."""
    changed = changed_pins([module], rule.pinned)
    if changed:
        raise DCPSparseAttentionError(
            f"DeepSeek Sparse Attention: {name} ({type(module).__qualname__}) is a lightning "
            f"indexer whose code differs from the code dcp_compile reads it by: {changed} "
            f"(source hashes). dcp_compile re-states the indexer's forward to capture it as "
            f"dcp.index_topk; use transformers 5.25 (requirements/corpus.txt), or add the new "
            f"hash to dcp_compile/frontends/module_sparse_attention.py RULES after checking "
            f"the forward computes the same scores; docs/moe-mla.md: DeepSeek Sparse Attention")


def indexer_sites(model: nn.Module) -> list[tuple[str, nn.Module, IndexerRule]]:
    """Every indexer of a listed class in ``model``: (name, module, rule), code checked."""
    return swap_sites(model, rule_for, check_pins)


def _forward(idx: nn.Module, rule: IndexerRule):
    """The indexer's forward as its pinned source computes it, with the scoring and the
    top-k as ``dcp.index_topk``."""
    rope = getattr(importlib.import_module(rule.indexer.split(":")[0]), rule.rope)

    def forward(hidden_states: Tensor, q_resid: Tensor, position_embeddings,
                attention_mask: Tensor, position_ids=None, cache=None) -> Tensor:
        if cache is not None:
            raise DCPSparseAttentionError(
                "DeepSeek Sparse Attention: the indexer was called with a Cache during the "
                "capture; dcp_compile captures the model with use_cache=False")
        b, s, _ = hidden_states.shape
        cos, sin = position_embeddings
        dr = idx.qk_rope_head_dim
        # [rot ; pass] columns, or [pass ; rot] (rope_last): index r of the split is RoPE's
        r = int(rule.rope_last)
        split = [dr, idx.head_dim - dr][::1 - 2 * r]
        q = idx.wq_b(q_resid).view(b, s, idx.n_heads, idx.head_dim)
        qs = list(torch.split(q, split, dim=-1))
        k_in = idx.wk(hidden_states)
        if rule.k_norm_own_dtype:
            k = idx.k_norm(k_in.to(idx.k_norm.weight.dtype)).to(hidden_states.dtype)
        else:
            k = idx.k_norm(k_in)
        ks = list(torch.split(k.unsqueeze(2), split, dim=-1))
        qs[r], ks[r] = rope(qs[r], ks[r], cos, sin, unsqueeze_dim=2)
        q = torch.cat(qs, dim=-1)
        k = torch.cat(ks, dim=-1).squeeze(2)
        weights = idx.weights_proj(hidden_states.to(idx.weights_proj.weight.dtype)).float() \
            * (idx.n_heads ** -0.5)
        scale = float(idx.softmax_scale)
        if rule.scale_in_weights:
            weights, scale = weights * scale, 1.0
        if attention_mask.dtype == torch.bool:
            bias = torch.zeros(attention_mask.shape, dtype=torch.float32,
                               device=attention_mask.device).masked_fill(~attention_mask,
                                                                         float("-inf"))
        else:
            bias = attention_mask.float()
        bias = bias.expand(b, s, k.shape[1])
        return torch.ops.dcp.index_topk(q, weights, k, bias, scale, int(idx.index_topk))

    return forward


@contextlib.contextmanager
def module_indexers_enabled(sites: list):
    """Within: every site of :func:`indexer_sites` computes its selection as
    ``dcp.index_topk`` (swapped on the instance, the class untouched, undone on exit)."""
    try:
        for _, m, rule in sites:
            m.forward = _forward(m, rule)
        yield len(sites)
    finally:
        for _, m, _ in sites:
            m.__dict__.pop("forward", None)
