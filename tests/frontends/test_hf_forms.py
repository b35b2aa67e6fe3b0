"""Hugging Face forms of sharding, end to end: each model, built tiny with seeded weights,
is transformed, run on the threaded world (the garbage block poisoned) and compared with
its own forward at every step (fp32 logits within 1e-4, the same greedy tokens; prompts of
1, 7, 9 and 16 tokens around a vblock of 8) by the corpus' own cell
(tests/support/hf_corpus.run_model), or refused naming the real limit.

* transformers' ``Conv1D`` (GPT-2, GPT-SW3): a linear whose weight is stored ``[in, out]``,
  sharded column/row like any linear; GPT-2's fused ``c_attn`` split into q, k, v. Decode
  DCP of these multi-head models is refused (as many KV heads as query heads: no tp
  replicates KV); decode runs at dcp=1 and prefill DCP at tp=4, dcp=2.
* OPT: its MLP over ``x.reshape(-1, H)`` keeps the token dim (prefill's sequence
  parallelism reduce-scatters along it); ``project_in`` / ``project_out``
  (``word_embed_proj_dim`` < ``hidden_size``) run whole on every rank, like vLLM's
  ReplicatedLinear, with a tied or an untied LM head.
* GPT-BigCode's multi-query attention in prefill (``unsqueeze(1)`` + ``view(B, S, H, D)``
  around the token dim); its decode (one KV head: tp > kv heads).
* CodeGen's qkv fused per mp_num=4 group: prefill at tp=8, dcp=2 (an attention shard of 4)
  matches; an attention shard of 8 would cut a group, and is refused naming that.
* StableLM's ``qk_layernorm`` (one LayerNorm module per head over ``split`` + ``cat``):
  refused naming it (which heads a rank normalises would pick other parameters per rank).
* Gemma 3n's AltUp: its in-place ``corrected[1:] += x`` a value (decode matches); its prefill
  refused naming the stacked residual streams sequence parallelism does not cut.
"""

from __future__ import annotations

import pytest

import hf_corpus as C
from dcp_compile import hf

pytestmark = pytest.mark.filterwarnings("ignore")


def _cell(model_type, path, mode, *, tp=C.TP, dcp=C.DCP, **overrides):
    model = C.build(model_type, None if path == "prepare" else path, **overrides)
    return C.run_model(model, mode, prepare=hf.prepare if path == "prepare" else None,
                       tp=tp, dcp=dcp)


@pytest.mark.parametrize("model_type,path,mode,tp,dcp", [
    ("gpt2", "sdpa", "prefill", 4, 2),
    ("gpt2", "prepare", "prefill", 4, 2),
    ("gpt2", "eager", "decode", 4, 1),
    ("gpt-sw3", "sdpa", "prefill", 4, 2),
], ids=["gpt2-sdpa-prefill-tp4-dcp2", "gpt2-prepare-prefill-tp4-dcp2",
        "gpt2-eager-decode-tp4-dcp1", "gpt-sw3-sdpa-prefill-tp4-dcp2"])
def test_conv1d_models_match(model_type, path, mode, tp, dcp):
    out = _cell(model_type, path, mode, tp=tp, dcp=dcp)
    assert out.kind == "matches", out


def test_conv1d_mha_decode_dcp_is_refused_naming_the_limit():
    out = _cell("gpt2", "sdpa", "decode", tp=4, dcp=2)
    assert out.kind == "refused" and "multi-head attention" in out.message, out
    assert "Use dcp=1" in out.message


@pytest.mark.parametrize("model_type,path,mode,tp,dcp,overrides", [
    ("opt", "sdpa", "prefill", 4, 2, {}),
    ("opt", "sdpa", "prefill", 4, 2, {"word_embed_proj_dim": 32}),
    ("opt", "prepare", "prefill", 4, 2, {"word_embed_proj_dim": 32}),
    ("opt", "eager", "decode", 4, 1, {"word_embed_proj_dim": 32}),
    ("opt", "eager", "decode", 4, 1, {"word_embed_proj_dim": 32, "tie_word_embeddings": False}),
    ("gpt_bigcode", "sdpa", "prefill", 4, 2, {}),
    ("gpt_bigcode", "prepare", "decode", 4, 2, {}),
    ("codegen", "sdpa", "prefill", 8, 2, {}),
], ids=["opt-prefill", "opt-project-in-out-prefill", "opt-project-in-out-prepare-prefill",
        "opt-project-in-out-decode-dcp1", "opt-project-in-out-untied-decode-dcp1",
        "gpt-bigcode-mqa-prefill", "gpt-bigcode-mqa-decode", "codegen-tp8-prefill"])
def test_hf_sharding_forms_match(model_type, path, mode, tp, dcp, overrides):
    out = _cell(model_type, path, mode, tp=tp, dcp=dcp, **overrides)
    assert out.kind == "matches", out


@pytest.mark.parametrize("model_type,mode,tp,dcp,overrides,names", [
    ("codegen", "decode", 8, 1, {}, r"the cut \[64/8\] is finer than the 4 groups of 16"),
    ("stablelm", "decode", 4, 2, {"qk_layernorm": True},
     r"per-head modules with their own parameters"),
    ("stablelm", "prefill", 4, 2, {"qk_layernorm": True},
     r"per-head modules with their own parameters"),
], ids=["codegen-attention-shard-8-over-mp-num-4", "stablelm-qk-layernorm-decode",
        "stablelm-qk-layernorm-prefill"])
def test_hf_sharding_forms_refused_by_name(model_type, mode, tp, dcp, overrides, names):
    import re
    out = _cell(model_type, "sdpa", mode, tp=tp, dcp=dcp, **overrides)
    assert out.kind == "refused" and re.search(names, out.message), out
    assert out.reason != "other", out


def test_gemma3n_altup_decode_matches_and_its_prefill_names_the_stacked_streams():
    """Gemma 3n's AltUp writes ``corrected[1:] += x`` in place (``add_`` into a slice, then
    ``copy_`` back): made a value (``slice_scatter``), placed off the sharded dim; its
    coefficient linears (2 streams) run replicated. Its prefill stops at sequence
    parallelism: the residual stream between layers is the stack [streams, B, S, H]."""
    out = _cell("gemma3n_text", "eager", "decode")
    assert out.kind == "matches", out
    out = _cell("gemma3n_text", "sdpa", "prefill")
    assert out.kind == "refused", out
    assert "sequence parallelism needs [B, S=16, ...]" in out.message
    assert "Gemma 3n's AltUp" in out.message and "Use a decode-mode program" in out.message
