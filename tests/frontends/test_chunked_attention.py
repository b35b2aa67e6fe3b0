"""Chunked attention (Llama 4's ``attention_chunk_size``) under DCP (issue #38).

A query attends to the earlier keys of its own chunk of C positions: ``same_chunk``, a
predicate of the two global positions, so each rank masks the keys it holds and the LSE
combine is unchanged, whatever C is against the vblock (block_size x dcp). hf.prepare tells
the paged op each layer's chunk from the config (the model applies it only through the mask
it builds, which the paged attention function does not get); before, prepare attended across
chunk boundaries and matched only below one chunk.

The tiny Llama 4 has four layers: three chunked RoPE layers and one full-attention NoPE layer
(attention-temperature tuning on, floor_scale=64), and Llama 4's MoE (shared expert + top-1
routed expert, sigmoid router) in every layer. Compared with the model's own forward: fp32,
1e-4, greedy tokens. The NoPE temperature reads arange(S) and the cache's length, not
position_ids: prepare refuses it unless max_model_len < floor_scale (where it is 1).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_corpus as C  # noqa: E402
from full_runs import full  # noqa: E402
from helpers import assert_close_report, assert_live_kernel_matches_reference  # noqa: E402

LENGTHS = (1, 7, 9, 16, 21)    # past 2 chunks for every C below; around the vblock (8, 16)
FLOOR = 64                     # Llama 4's floor_scale: max_model_len 63 keeps its scale exact


def prepare(model):
    from dcp_compile import hf
    return hf.prepare(model, max_model_len=FLOOR - 1)


def llama4(chunk: int, attention: str | None = None, floor: int = FLOOR):
    return C.build("llama4_text", attention, attention_chunk_size=chunk, floor_scale=floor,
                   num_hidden_layers=4, num_experts_per_tok=1, max_position_embeddings=64)


def test_the_tiny_llama4_has_chunked_nope_and_moe_layers():
    cfg = llama4(3).config
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert cfg.no_rope_layers == [1, 1, 1, 0]            # layer 3: NoPE
    assert cfg.num_experts_per_tok == 1 and cfg.moe_layers == [0, 1, 2, 3]


# C below, at and above the vblock of 8 (dcp=2) / 16 (dcp=4), and not dividing it.
CASES = [(3, 4, 2, "decode"), (8, 4, 2, "prefill"), (12, 8, 4, "decode"),
         (5, 8, 4, "prefill")]
if full("DCP_CHUNKED_FULL"):   # every chunk length x tp/dcp x mode
    CASES = [(c, t, d, m) for c in (3, 5, 8, 12, 16) for t, d in ((4, 2), (8, 4))
             for m in ("decode", "prefill")]
else:                          # the slice: C below the vblock (decode), C at it (prefill)
    CASES = CASES[:2]


@pytest.mark.parametrize("chunk,tp,dcp,mode", CASES,
                         ids=[f"C={c}-tp{t}-dcp{d}-{m}" for c, t, d, m in CASES])
def test_llama4_chunked_attention_matches_past_two_chunks(chunk, tp, dcp, mode, monkeypatch):
    monkeypatch.setattr(C, "LENGTHS", LENGTHS)
    out = C.run_model(llama4(chunk), mode, prepare=prepare, tp=tp, dcp=dcp)
    assert out.kind == "matches", f"{out.cell()}: {out.message[:500]}"


# The ordinary path (the model's own sdpa / eager attention, no hf.prepare): the chunked
# mask the model builds (create_chunked_causal_mask) is read from the graph and proven
# ``j <= i and i // C == j // C`` for every position (passes/prove/masks.py), then computed
# by the paged op's attention_chunk. The NoPE layer's temperature is a function of each
# token's own position there (lift_positions): floor_scale=16 makes it change inside the
# prompts, which the prepare path refuses.
DIRECT = [("sdpa", 3, 4, 2, "decode"), ("eager", 5, 8, 4, "prefill")]
if full("DCP_CHUNKED_FULL"):
    DIRECT = [(a, c, t, d, m) for a in ("sdpa", "eager") for c in (3, 8, 12)
              for t, d in ((4, 2), (8, 4)) for m in ("decode", "prefill")]


@pytest.mark.parametrize("attention,chunk,tp,dcp,mode", DIRECT,
                         ids=[f"{a}-C={c}-tp{t}-dcp{d}-{m}" for a, c, t, d, m in DIRECT])
def test_llama4_own_attention_chunked_matches_past_two_chunks(attention, chunk, tp, dcp, mode,
                                                              monkeypatch):
    monkeypatch.setattr(C, "LENGTHS", LENGTHS)
    out = C.run_model(llama4(chunk, attention, floor=16), mode, tp=tp, dcp=dcp)
    assert out.kind == "matches", f"{out.cell()}: {out.message[:500]}"


def test_own_attention_chunk_is_proven_from_the_mask():
    """The chunk comes from the graph's mask (proven), not the config: each chunked layer's
    mask theorem states it, the NoPE layer's is causal, and the op carries C."""
    import dcp_compile
    from dcp_compile.runtime.serving.engine import StepShapes
    shapes = StepShapes(batch=2, context_len=8, max_blocks=4, num_blocks=10)
    program = dcp_compile.transform(llama4(3, "sdpa"), tp=4, dcp=2, mode="prefill",
                                    block_size=4, shapes=shapes, check=False)
    statements = [t.statement for t in program.facts.mask_theorems]
    assert [("i // 3 == j // 3" in s) for s in statements] == [True, True, True, False]
    assert all(t.proven for t in program.facts.mask_theorems)
    assert program.facts.chunks == (3, 3, 3, 0)


def test_own_attention_chunk_contradicting_the_config_refused(monkeypatch):
    """The config's attention_chunk_size is checked against the proven mask."""
    import dcp_compile
    import dcp_compile.frontends.ordinary as O
    from dcp_compile.runtime.errors import DCPTransformError
    from dcp_compile.runtime.serving.engine import StepShapes
    monkeypatch.setattr(O, "attention_chunks", lambda model: [4, 4, 4, 0])
    shapes = StepShapes(batch=2, context_len=8, max_blocks=4, num_blocks=10)
    with pytest.raises(DCPTransformError, match="attention_chunk_size=4"):
        dcp_compile.transform(llama4(3, "sdpa"), tp=4, dcp=2, mode="prefill", block_size=4,
                              shapes=shapes, check=False)


def test_prepare_without_the_chunks_would_differ(monkeypatch):
    """The test above can fail: attending across chunk boundaries (the old prepare) is
    caught by the same comparison."""
    import dcp_compile.frontends.huggingface as H
    monkeypatch.setattr(C, "LENGTHS", LENGTHS)
    monkeypatch.setattr(H, "declared_chunks", lambda model: None)
    out = C.run_model(llama4(3), "prefill", prepare=prepare)
    assert out.kind == "mismatch", out.cell()


def test_nope_temperature_past_floor_scale_refused_by_name():
    """A NoPE layer's temperature numbers a paged step's tokens from 0: refused unless
    max_model_len keeps every position below floor_scale - 1."""
    from dcp_compile import hf
    from dcp_compile.runtime.errors import DCPTransformError
    import dcp_compile
    from dcp_compile.runtime.serving.engine import StepShapes
    shapes = StepShapes(batch=2, context_len=8, max_blocks=4, num_blocks=10)
    with pytest.raises(DCPTransformError, match="attn_temperature_tuning"):
        dcp_compile.transform(hf.prepare(llama4(3), max_model_len=FLOOR), tp=4, dcp=2,
                              mode="decode", block_size=4, shapes=shapes, check=False)


def test_chunk_of_the_op_matches_dense_attention():
    """dcp.paged_attention(attention_chunk) equals dense attention with the chunked mask."""
    from dcp_compile.runtime.kernels.ops import _paged_attention_impl
    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d, chunk = 2, 11, 4, 2, 8, 4
    q, k, v = (torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv))
    positions = torch.arange(s).expand(b, s).clone()
    table = torch.arange(2 * 3).view(b, 3)
    caches = [torch.zeros(7, 4, hkv, d) for _ in range(2)]
    out, _, _ = _paged_attention_impl(q, k, v, *caches, positions, table, 0.3,
                                      attention_chunk=chunk)
    i = torch.arange(s)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] // chunk == i[:, None] // chunk)
    kr, vr = (t.repeat_interleave(hq // hkv, dim=2).transpose(1, 2) for t in (k, v))
    scores = (q.transpose(1, 2) @ kr.transpose(-2, -1) * 0.3).masked_fill(~keep, float("-inf"))
    ref = (torch.softmax(scores, dim=-1) @ vr).transpose(1, 2)
    assert_close_report(out, ref, atol=1e-5, what="paged attention with a chunk")


def test_live_kernel_applies_the_same_chunk():
    assert_live_kernel_matches_reference(attention_chunk=5)
