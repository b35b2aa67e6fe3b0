"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the indexer keeps the top-k prior tokens
per query. transform rewrites transformers' indexers (captured as one dcp.index_topk node,
tests/frontends/test_dsa_capture.py) into the exact DCP selection
(tests/frontends/test_dsa_transform.py); what is not that form stays a named refusal, never a
silent mismatch: any other attention mask computed from a topk (transform), and hf.prepare,
whose paged op caches no MLA latent (docs/moe-mla.md: DeepSeek Sparse Attention)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_corpus as C  # noqa: E402

import dcp_compile  # noqa: E402
from dcp_compile import DCPSparseAttentionError  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402

TOPK = 4                      # cuts at every prompt longer than 4 tokens
PROMPT = 17                   # past two vblocks of 8


def _set_topk(model, k: int) -> None:
    for m in model.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = k


def _transform(model, mode: str):
    shapes = StepShapes(batch=len(C.LENGTHS), context_len=max(C.LENGTHS), max_blocks=4,
                        num_blocks=4 * len(C.LENGTHS) + 2)
    return dcp_compile.transform(model, tp=C.TP, dcp=C.DCP, mode=mode, block_size=C.BLOCK,
                                 shapes=shapes)


@pytest.fixture(scope="module")
def v32():
    return C.build("deepseek_v32", index_topk=TOPK)


def test_the_indexer_cuts_at_these_prompts(v32):
    """The refusal guards a real difference: with index_topk=4 the model's own forward on a
    17-token prompt differs from the same weights reading every prior token."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, C.TINY["vocab_size"], (1, PROMPT), generator=gen)
    with torch.no_grad():
        cut = v32(ids, use_cache=False).logits
        _set_topk(v32, 10**6)
        try:
            dense = v32(ids, use_cache=False).logits
        finally:
            _set_topk(v32, TOPK)
    assert torch.equal(cut[0, :TOPK], dense[0, :TOPK])     # no cut yet: the same
    assert (cut[0, TOPK:] - dense[0, TOPK:]).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_prepare_names_sparse_attention(model_type):
    """hf.prepare names DSA too (not only MLA, which would send the user to transform)."""
    from dcp_compile import hf
    with pytest.raises(DCPSparseAttentionError, match="index_topk=4"):
        hf.prepare(C.build(model_type, index_topk=TOPK))


def test_a_top_k_mask_of_any_model_is_refused():
    """Not a model-type check: any attention mask computed from a topk is refused by the
    mask reader (a plain module whose keys are picked by their score against the query)."""
    class TopKAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(256, 32)
            self.q = torch.nn.Linear(32, 32)
            self.k = torch.nn.Linear(32, 16)
            self.v = torch.nn.Linear(32, 16)
            self.idx = torch.nn.Linear(32, 4)
            self.o = torch.nn.Linear(32, 32)
            self.head = torch.nn.Linear(32, 256)

        def forward(self, input_ids):
            x = self.embed(input_ids)
            b, s, _ = x.shape
            q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
            k = self.k(x).view(b, s, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
            v = self.v(x).view(b, s, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            w = self.idx(x)
            score = (w @ w.transpose(1, 2)).masked_fill(~causal, float("-inf"))
            top = score.topk(min(TOPK, s), dim=-1).indices
            keep = torch.zeros(b, s, s, dtype=torch.bool).scatter(-1, top, True) & causal
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=keep[:, None])
            return self.head(x + self.o(out.transpose(1, 2).reshape(b, s, 32)))

    with pytest.raises(DCPSparseAttentionError, match="DeepSeek Sparse Attention"):
        _transform(TopKAttention().eval(), "decode")
