"""DeepSeek Sparse Attention's indexer captured as one ``dcp.index_topk`` op
(dcp_compile/frontends/module_sparse_attention.py): the swapped model is the model's own
forward (fp32, 1e-4, greedy tokens) on prompts where index_topk cuts, the op's set is the
DSA_ORDER set (ties by position), the capture holds one op per indexer and no aten.topk, the
swap is undone, and an indexer whose code differs is refused by name. transform rewrites the
op into the DCP selection (tests/frontends/test_dsa_transform.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_corpus as C  # noqa: E402

from dcp_compile import DCPSparseAttentionError  # noqa: E402
from dcp_compile.frontends.module_sparse_attention import (  # noqa: E402
    indexer_sites, module_indexers_enabled)
from dcp_compile.runtime.kernels import sparse_attention as dsa  # noqa: E402

TOPK = 4
MODELS = {"deepseek_v32": ("deepseek_v32", {}, 2),
          "glm5-full-shared": ("glm_moe_dsa", {"indexer_types": ["full", "shared"]}, 1),
          "hy_v4": ("hy_v4", {}, 2)}


def _ids(batch: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, C.TINY["vocab_size"], (batch, n), generator=g)


def _set_topk(model, k: int) -> None:
    for m in model.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = k


@pytest.mark.parametrize("model_type,options,full_indexers", MODELS.values(), ids=MODELS)
def test_swapped_indexer_is_the_models_forward(model_type, options, full_indexers):
    model = C.build(model_type, index_topk=TOPK, **options)
    ids = _ids(2, 13)
    sites = indexer_sites(model)
    assert len(sites) == full_indexers            # GLM-5's shared layer has no indexer
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        with module_indexers_enabled(sites):
            got = model(ids, use_cache=False).logits
        assert all("forward" not in m.__dict__ for _, m, _ in sites)   # swap undone
        _set_topk(model, 10**6)
        dense = model(ids, use_cache=False).logits
    assert (ref - got).abs().max() <= 1e-4
    assert torch.equal(ref.argmax(-1), got.argmax(-1))
    assert (ref - dense).abs().max() > 1e-3       # the cut matters at these prompts


def test_index_topk_breaks_ties_by_position():
    """Zeros with every third score 1 (the docs' case): the op picks DSA_ORDER's set
    {0, 3, 6, 9}, torch.topk does not."""
    q = torch.ones(1, 1, 1, 1)
    k = torch.zeros(1, 17, 1)
    k[0, ::3] = 1
    idx = torch.ops.dcp.index_topk(q, torch.ones(1, 1, 1), k, torch.zeros(1, 1, 17), 1.0, 4)
    assert idx.dtype == torch.int32 and sorted(idx[0, 0].tolist()) == [0, 3, 6, 9]
    scores = k[0, :, 0]
    assert set(dsa.dsa_select(scores[None, None], torch.arange(17)[None, None], 4)[0, 0]
               .nonzero().flatten().tolist()) == {0, 3, 6, 9}


def test_capture_holds_one_index_topk_per_indexer():
    from dcp_compile.frontends.ordinary import OrdinaryStep
    model = C.build("deepseek_v32", index_topk=TOPK)
    ep = torch.export.export(OrdinaryStep(model), (_ids(1, 7),), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.dcp.index_topk.default) == 2
    assert torch.ops.aten.topk.default not in targets


def test_an_indexer_whose_code_differs_is_refused():
    model = C.build("deepseek_v32", index_topk=TOPK)
    idx = model.model.layers[0].self_attn.indexer
    cls = type(idx)
    idx.__class__ = type("PatchedIndexer", (cls,), {"forward": lambda self, *a, **k: None})
    with pytest.raises(DCPSparseAttentionError, match="DeepseekV32Indexer.forward"):
        indexer_sites(model)
