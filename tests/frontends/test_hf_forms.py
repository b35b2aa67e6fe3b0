"""Hugging Face forms of sharding, end to end: each model, built tiny with seeded weights,
is transformed, run on the threaded world (the garbage block poisoned) and compared with
its own forward at every step (fp32 logits within 1e-4, the same greedy tokens; prompts of
1, 7, 9 and 16 tokens around a vblock of 8) by the corpus' own cell
(tests/support/hf_corpus.run_model), or refused naming the real limit.

* transformers' ``Conv1D`` (GPT-2, GPT-SW3): a linear whose weight is stored ``[in, out]``,
  sharded column/row like any linear; GPT-2's fused ``c_attn`` split into q, k, v. Decode
  DCP of these multi-head models is refused (as many KV heads as query heads: no tp
  replicates KV); decode runs at dcp=1 and prefill DCP at tp=4, dcp=2.
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
