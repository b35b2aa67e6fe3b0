"""Width-K decode steps and greedy speculative decoding against the model's own forward.

Every case: the program (tp, dcp, interleave, K) decodes greedily with drafts verified in
width-K steps on the threaded world (garbage block NaN-poisoned); its tokens must equal,
token for token, the single-device model's plain greedy tokens and every verified position's
logits must be within 1e-4 of the model's (fp32). The n-gram drafter on repetitive prompts
and a draft model with other weights give rows with different accepted counts in one batch;
prompts of period +- 1 tokens and K up to 8 put drafts across interleave runs and vblocks.

Default: a small slice. ``DCP_SPEC_FULL=1`` runs the full matrix (demo, ordinary, HF Llama,
Qwen2, Gemma2 window, DeepSeek-V3 MLA x dcp 1/2/4/8 x interleave 1 and = block x K 2..8).
"""

from __future__ import annotations

import os

import pytest
import torch

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.frontends.ordinary import FullForwardReference
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.serving.kv_cache import KVCacheSpec
from dcp_compile.runtime.serving.speculative import ModelDrafter, NgramDrafter, accept_greedy
from dcp_compile.runtime.serving.step_contract import StepContract
from dcp_compile.verify import draft_program_drafter, verify_speculative
from full_runs import full  # noqa: E402

FULL = full("DCP_SPEC_FULL")
ATOL = 1e-4
BLOCK = 4
STEPS = 10


def prompts_for(period: int) -> list[list[int]]:
    """Repetitive rows (n-gram hits), period +- 1 tokens (drafts cross rank runs), a
    one-token row."""
    loop = [3, 1, 4, 1, 5, 9, 2, 6]
    return [(loop * 4)[:period + 1], [7, 8] * ((period + 2) // 2), [11]][:3]


def shapes_for(prompts, K, dcp) -> StepShapes:
    longest = max(len(p) for p in prompts) + STEPS
    return StepShapes.fitting(len(prompts), max(len(p) for p in prompts), longest,
                              block_size=BLOCK, dcp=dcp, decode_len=K)


def small_demo(seed=0, kv=2):
    return demo_model(DemoConfig(vocab_size=64, hidden_size=64, num_layers=2, num_q_heads=8,
                                 num_kv_heads=kv, head_dim=8, intermediate_size=96,
                                 seed=seed))


def perturbed_demo(scale=0.1):
    """The demo model with noise on its matrices: a draft that agrees only sometimes."""
    model = small_demo()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return model


def ordinary_plain(kv=2):
    from dcp_compile.models.plain import plain_llama
    return plain_llama(DemoConfig(vocab_size=64, hidden_size=64, num_layers=2, num_q_heads=8,
                                  num_kv_heads=kv, head_dim=8, intermediate_size=96),
                       attention="sdpa")


def hf(config_name, model_name, kv=2, **over):
    pytest.importorskip("transformers")
    from test_hf import build
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=kv, bos_token_id=None,
                eos_token_id=None, pad_token_id=None, max_position_embeddings=128)
    return build(config_name, model_name, {**base, **over})


def deepseek_v3(kv=1):
    from test_mla import hf_deepseek
    return hf_deepseek("V3", vocab_size=64, max_position_embeddings=128)


# id -> (factory, paged: the model has the engine's step signature itself)
MODELS = {
    "demo": (lambda kv: small_demo(kv=kv), True),
    "ordinary": (ordinary_plain, False),
    "hf-llama": (lambda kv: hf("LlamaConfig", "LlamaForCausalLM", kv), False),
    "hf-qwen2": (lambda kv: hf("Qwen2Config", "Qwen2ForCausalLM", kv), False),
    "hf-gemma2-window": (lambda kv: hf("Gemma2Config", "Gemma2ForCausalLM", kv,
                                       attn_implementation="eager", head_dim=8,
                                    sliding_window=4, attn_logit_softcapping=3.0,
                                    query_pre_attn_scalar=16), False),
    "hf-deepseek-v3-mla": (deepseek_v3, False),
}
# (model, dcp, interleave, K)
SLICE = [("demo", 2, 1, 4)]
LAYOUTS = [(1, 1), (2, 1), (2, BLOCK), (4, 1), (4, BLOCK), (8, 1), (8, BLOCK)]
# Every layout with two widths, K = 2..8 each taken: 14 cases per model.
MATRIX = [(m, dcp, i, 2 + (2 * j + w) % 7) for m in MODELS
          for j, (dcp, i) in enumerate(LAYOUTS) for w in (0, 5)]


def kv_heads_for(model_id, dcp):
    """GQA 8:2, or 8:1 at dcp 8 (decode DCP replicates a KV head over tp / kv_heads = dcp
    ranks, and 8 query heads go round 8 ranks at most); MLA has one latent head."""
    return 1 if model_id == "hf-deepseek-v3-mla" or dcp == 8 else 2


def tp_for(model_id, dcp):
    return dcp * kv_heads_for(model_id, dcp) if dcp > 1 else 2


def transform(model, dcp, interleave, shapes, tp):
    return dcp_compile.transform(model, tp=tp, dcp=dcp, block_size=BLOCK,
                                 interleave_size=interleave, shapes=shapes, check=False)


@pytest.mark.parametrize("model_id,dcp,interleave,K", MATRIX if FULL else SLICE)
def test_speculative_greedy_equals_plain_greedy(model_id, dcp, interleave, K):
    factory, paged = MODELS[model_id]
    model = factory(kv_heads_for(model_id, dcp))
    prompts = prompts_for(interleave * dcp)
    shapes = shapes_for(prompts, K, dcp)
    tp = tp_for(model_id, dcp)
    program = transform(model, dcp, interleave, shapes, tp)
    assert program.certificate["query_local_bound_is_causal"].proven
    reference = model if paged else FullForwardReference(model)
    report = verify_speculative(reference, program, prompts, STEPS,
                                lambda rank: NgramDrafter())
    assert report.ok, report.to_json()
    assert report.max_abs_error <= ATOL
    # Rows with different accepted counts in one batch (one verification step).
    mixed = [step for step in report.spec["accepted_per_step"]
             if len({c for c in step if c >= 0}) > 1]
    assert mixed, f"every step accepted the same count in every row: {report.spec}"


@pytest.fixture(scope="module")
def demo_dcp2():
    """(model, prompts, program): the demo model at tp=4, dcp=2, interleave 1, K=4."""
    model, prompts = small_demo(), prompts_for(2)
    return model, prompts, transform(model, 2, 1, shapes_for(prompts, 4, 2), 4)


@pytest.mark.parametrize("draft_dcp", [1, 2] if FULL else [1])
def test_draft_model_program_with_other_weights(draft_dcp, demo_dcp2):
    """A draft model (perturbed weights) as another program on the same world: dcp 1 or
    the target's; its drafts are partly accepted, the output stays the target's greedy."""
    target, prompts, program = demo_dcp2
    draft = transform(perturbed_demo(), draft_dcp, 1, shapes_for(prompts, 2, draft_dcp), 4)
    report = verify_speculative(target, program, prompts, STEPS,
                                draft_program_drafter(draft, program))
    assert report.ok, report.to_json()
    assert 0 < report.spec["accepted"] < report.spec["drafted"], report.spec


def _engine(model, K, prompts):
    shapes = shapes_for(prompts, K, 1)
    c = model.config
    spec = KVCacheSpec(c.num_layers, shapes.num_blocks, BLOCK, c.num_kv_heads, c.head_dim)
    return Engine(LocalExecutor(model, spec.allocate()), shapes, block_size=BLOCK)


def test_wrong_query_bound_is_caught_numerically(monkeypatch, demo_dcp2):
    """The per-query bound is load-bearing: counting from the row's end (local(G) - k)
    breaks the logits of a width-K step under DCP."""
    from dcp_compile.runtime import layout
    model, prompts, program = demo_dcp2
    good = layout.query_local_bound

    def from_row_end(n, offset, rank, *, dcp, interleave, block):
        return good(n, 3, rank, dcp=dcp, interleave=interleave, block=block) - (3 - offset)
    monkeypatch.setattr(layout, "query_local_bound", from_row_end)
    report = verify_speculative(model, program, prompts, STEPS, lambda rank: NgramDrafter())
    assert not report.ok and report.max_abs_error > ATOL


def test_accept_greedy_and_ngram_lookup():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accept_greedy([5], [4, 5]) == 0
    assert accept_greedy([], [4]) == 0
    d = NgramDrafter(max_n=2)
    assert d.propose([[1, 2, 3, 1, 2]], [3]) == [[3, 1, 2]]
    assert d.propose([[1, 2, 3]], [2]) == [[]]
    assert d.propose([[1, 2, 1, 2]], [0]) == [[]]


def test_single_device_speculation_with_a_draft_model_engine():
    model = small_demo()
    prompts = prompts_for(4)
    plain = _engine(model, 1, prompts).generate(prompts, STEPS)
    with torch.no_grad():
        spec = _engine(model, 5, prompts).generate(
            prompts, STEPS, drafter=ModelDrafter(_engine(perturbed_demo(), 3, prompts)))
    assert spec.tokens == plain.tokens
    for b in range(len(prompts)):
        for t in range(STEPS):
            assert float((spec.logits[b][t] - plain.logits[t][b]).abs().max()) <= ATOL


def test_speculation_needs_a_width_k_program():
    model = small_demo()
    prompts = prompts_for(2)
    with pytest.raises(DCPInputError, match="width K >= 2"):
        _engine(model, 1, prompts).generate(prompts, 3, drafter=NgramDrafter())


def test_decode_rows_refuses_a_row_wider_than_the_step():
    model = small_demo()
    prompts = prompts_for(2)
    engine = _engine(model, 2, prompts)
    engine.prefill(prompts)
    with pytest.raises(DCPInputError, match="0..decode_len=2"):
        engine.decode_rows([[1, 2, 3], [1], [1]])


@pytest.mark.skipif(not FULL, reason="XLA compiles take a minute: DCP_SPEC_FULL=1")
@pytest.mark.parametrize("spec", ["ngram:3", "draft:dcp_compile.models.demo:demo_model:4"])
def test_cli_width_k_decode_lowers_and_runs_on_xla(spec):
    """`verify --backend xla --speculative ...`: the width-K decode step (and a draft
    program) lowered to StableHLO, run by XLA:CPU (fresh process: it sets the devices)."""
    pytest.importorskip("jax")
    pytest.importorskip("torch_mlir")
    import json
    import subprocess
    import sys
    from suite_path import ROOT
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "dcp_compile.cli", "verify", "--tp", "4",
                           "--dcp", "2", "--block-size", "4", "--steps", "5",
                           "--speculative", spec, "--shared-prefix", "9", "--backend", "xla",
                           "--json"], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["tokens_agree"] and report["max_abs_error"] <= ATOL
    assert report["reused_tokens"] == 3 * 8 and report["mean_accepted"] >= 1.0, report


@pytest.mark.parametrize("row,rule", [([5, 6, 7, 8], None), ([5, 6, -1, -1], None),
                                      ([5, 6, 8, -1], "contiguous"),
                                      ([6, 7, 8, 9], "allocated-entry"),
                                      ([5, -1, 6, -1], "padding-at-end"),
                                      ([4, 5, -1, -1], "continues-sequence")])
def test_step_contract_of_width_k_rows(row, rule):
    """A width-K decode row: up to K consecutive positions from the sequence's length, then
    padding."""
    c = StepContract(kind="decode", batch=1, tokens=4, max_blocks=3, num_blocks=8,
                     block_size=BLOCK, dcp=2)
    args = (torch.zeros(1, 4, dtype=torch.int64), torch.tensor([row]),
            torch.tensor([[0, 1, -1]]))        # the row crosses into vblock 1
    if rule == "allocated-entry":             # vblock 1 unallocated, seq_lens irrelevant
        args = (args[0], args[1], torch.tensor([[0, -1, -1]]))
    if rule is None:
        c.check(*args, seq_lens=torch.tensor([5]))
        return
    with pytest.raises(DCPInputError) as e:
        c.check(*args, seq_lens=torch.tensor([row[0] if rule == "allocated-entry" else 5]))
    assert e.value.rule == rule
