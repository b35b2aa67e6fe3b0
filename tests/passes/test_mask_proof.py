"""Masks proven, not sampled (passes/mask_predicate.py, passes/prove/masks.py).

An ordinary model's attention mask is read from the graph as a predicate K(i, j) of the
query position i and the key position j, and proven, for every i, j >= 0, to be exactly
causal or exactly causal within a window W. The captured chunk length no longer matters: a
window longer than the chunk is seen in the mask's formula, not in its sampled values.

Environment: ``DCP_MASK_FULL=1`` runs every (tp, dcp) x mode of the end-to-end matches and
both backstop mutations (the default is a representative slice, to keep the suite fast).
"""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dcp_compile
from dcp_compile import check as checking
from dcp_compile.models.demo import DemoConfig
from dcp_compile.models.plain import plain_llama
from dcp_compile.frontends.ordinary import FullForwardReference
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.errors import DCPCheckError, DCPTransformError
from dcp_compile.runtime.program.facts import ModelFacts
from full_runs import full  # noqa: E402

VOCAB, BLOCK = 256, 4
CFG = DemoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_q_heads=8,
                 num_kv_heads=2, head_dim=8, intermediate_size=96)
CONTEXT = 12
WINDOW = 14                    # longer than the captured chunk: the mask shows no cut there
# Capacity 8 blocks: 32 tokens at dcp=1, so sequences run well past the window.
SHAPES = StepShapes(batch=4, context_len=CONTEXT, max_blocks=8, num_blocks=40)
FULL = full("DCP_MASK_FULL")
CONFIGS = [(2, 1, "decode"), (4, 2, "prefill")] + (
    [(4, 2, "decode"), (8, 2, "decode"), (2, 1, "prefill"), (8, 2, "prefill")] if FULL else [])


def _steps(mode: str, gen: torch.Generator) -> list[checking.CheckStep]:
    """Rows crossing the window (14), the interleave period (8 at dcp=2) and vblocks."""
    def ids(n):
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    if mode == "decode":   # prompts 12, 11, 9, 7 then 4 decode steps: up to 16 tokens
        steps = [checking.CheckStep("context", [ids(n) for n in (12, 11, 9, 7)])]
        steps += [checking.CheckStep(f"decode {t}", [ids(1) for _ in range(4)], decode=True)
                  for t in range(4)]
        return steps
    chunks = ((12, 7, 1, 12), (12, 9, 12, 3), (5, 8, 3, 1))   # up to 29 tokens a row
    return [checking.CheckStep(f"chunk {c}", [ids(n) for n in lens])
            for c, lens in enumerate(chunks)]


def assert_matches_own_forward(model, program, mode):
    steps = _steps(mode, torch.Generator().manual_seed(1))
    ref = checking.run_model(FullForwardReference(model), program, steps)
    runs = checking.run_program(program, steps)
    errors, tol, first = checking.compare(ref, runs, steps, torch.float32)
    assert first is None, f"program differs from the model's own forward: {first}, " \
                          f"errors per step {errors}, tolerance {tol:.3g}"


@pytest.mark.parametrize("tp,dcp,mode", CONFIGS, ids=[f"tp{t}-dcp{d}-{m}" for t, d, m in CONFIGS])
def test_window_longer_than_the_chunk_matches(tp, dcp, mode):
    model = plain_llama(CFG, attention="eager", window=WINDOW)
    program = dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, block_size=BLOCK,
                                    shapes=SHAPES, check=False)
    assert checking.program_windows(program) == [WINDOW] * CFG.num_layers
    assert_matches_own_forward(model, program, mode)


def test_the_mask_theorem_of_each_layer_is_in_the_certificate():
    model = plain_llama(CFG, attention="eager", window=WINDOW)
    program = dcp_compile.transform(model, tp=2, dcp=1, mode="prefill", block_size=BLOCK,
                                    shapes=SHAPES, check=False)
    cert = program.certificate
    assert cert.ok
    for layer in range(CFG.num_layers):
        theorem = cert[f"mask_layer_{layer}"]
        assert theorem.proven and f"i - j < {WINDOW}, for all positions" in theorem.statement
    assert cert.to_json()["theorems"][-1]["name"] == "mask_layer_1"


# ---------------------------------------------------------------------------------------
# Mutations: a wrong window, a non-causal mask, a mask on the wrong position are caught.
# ---------------------------------------------------------------------------------------


class MaskLM(nn.Module):
    """One attention layer whose mask is ``mask(i, j)`` over query / key positions i, j
    (built from torch.arange or from position_ids)."""

    def __init__(self, mask, *, from_positions=False):
        super().__init__()
        self.mask, self.from_positions = mask, from_positions
        self.embed = nn.Embedding(VOCAB, 32)
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32, bias=False) for _ in range(4))
        self.head = nn.Linear(32, VOCAB, bias=False)

    def forward(self, input_ids, position_ids=None):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        heads = lambda t: t.view(b, s, 4, 8).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        if self.from_positions:
            pos = position_ids if position_ids is not None else torch.arange(s)[None]
            keep = self.mask(pos[:, None, :, None], pos[:, None, None, :])
        else:
            i = torch.arange(s)
            keep = self.mask(i[:, None], i[None, :])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.head(x + self.o(out.transpose(1, 2).reshape(b, s, -1)))


def _plan(model, tokens=CONTEXT, windows=None, facts=None):
    """insert_paged_cache's analysis of the captured graph (no rewrite); ``facts``: what an
    earlier step found."""
    from dcp_compile.frontends.ordinary import OrdinaryStep, capture_ordinary
    from dcp_compile.passes.infra import TransformContext
    from dcp_compile.passes.insert_paged_cache import InsertPagedCache
    from dcp_compile.runtime.config import DCPConfig
    step = OrdinaryStep(model.eval())
    captured = capture_ordinary(step, 2, tokens, device="cpu")
    ctx = TransformContext(config=DCPConfig(tp=2, dcp=1, block_size=BLOCK), step="context",
                           facts=facts or ModelFacts())
    inputs = captured.user_inputs
    cache = InsertPagedCache(ctx, token_input=inputs[0],
                             position_input=inputs[1] if len(inputs) > 1 else None,
                             num_blocks=SHAPES.num_blocks, max_blocks=SHAPES.max_blocks,
                             windows=windows)
    for n in list(captured.gm.graph.nodes):
        if n.target == torch.ops.aten._assert_tensor_metadata.default:
            captured.gm.graph.erase_node(n)
    return cache.plan(captured.gm)


PROVEN = {   # id -> (mask(i, j), built from position_ids, window)
    "causal-arange": (lambda i, j: j <= i, False, 0),
    "causal-position_ids": (lambda i, j: j <= i, True, 0),
    "window-20-longer-than-the-chunk": (lambda i, j: (j <= i) & (i - j < 20), False, 20),
    "window-5-position_ids": (lambda i, j: (j <= i) & (j > i - 5), True, 5),
    "window-1-diagonal": (lambda i, j: i == j, False, 1),
    # aten.to.device: a cast (op_classes.CASTS); the mask reader's own copy once lacked it.
    "causal-moved-to-a-device": (lambda i, j: (j <= i).to(i.device, torch.bool), False, 0),
}


@pytest.mark.parametrize("case", list(PROVEN))
def test_masks_are_proven_with_their_window(case):
    mask, from_positions, window = PROVEN[case]
    plan = _plan(MaskLM(mask, from_positions=from_positions))
    assert [s.window for s in plan.sites] == [window]
    assert plan.mask_theorems[0].proven


REFUSED = {  # id -> (mask(i, j), built from position_ids, what the refusal names)
    "attends-the-next-token": (lambda i, j: j <= i + 1, False, "not causal"),
    "wrong-position-query-for-key": (lambda i, j: i <= i + 0 * j, True, "bidirectional"),
    "key-shifted-by-one": (lambda i, j: j <= i - 1, False, "hides a query's own position"),
    "window-with-a-hole": (lambda i, j: (j <= i) & (i - j != 3), False,
                           "not as a sliding window"),
    "window-only-up-to-position-30": (lambda i, j: (j <= i) & ((i - j < 4) | (i < 30)), False,
                                      "not as a sliding window"),
    "chunk-shifted-by-one": (lambda i, j: (j <= i) & (i // 4 == (j + 1) // 4), False,
                             "not made of differences of positions or of their chunks"),
    "two-chunk-lengths": (lambda i, j: (j <= i) & (i // 4 == j // 6), False,
                          "not made of differences of positions or of their chunks"),
    "chunk-with-a-hole": (lambda i, j: (j <= i) & (i // 4 == j // 4) & (i - j != 2), False,
                          "not as a sliding window"),
    "two-chunks-back": (lambda i, j: (j <= i) & (i // 4 - j // 4 <= 1), False,
                        "not as a sliding window"),
}

CHUNKED = {  # id -> (mask(i, j), built from position_ids, window, chunk)
    "chunk-4-arange": (lambda i, j: (j <= i) & (i // 4 == j // 4), False, 0, 4),
    "chunk-3-position_ids": (lambda i, j: (j <= i) & (i // 3 == j // 3), True, 0, 3),
    "chunk-5-window-2": (lambda i, j: (j <= i) & (i - j < 2) & (i // 5 == j // 5), True, 2, 5),
    # Llama 4 at C = 8192 (its checkpoints' value): far past the captured length.
    "chunk-8192": (lambda i, j: (j <= i) & (i // 8192 == j // 8192), False, 0, 8192),
}


@pytest.mark.parametrize("case", list(CHUNKED))
def test_chunked_masks_are_proven_with_their_chunk(case):
    """Chunked attention (``i // C == j // C``): proven for every position, C read from the
    mask's own atoms (any C against the captured length and the vblock)."""
    mask, from_positions, window, chunk = CHUNKED[case]
    plan = _plan(MaskLM(mask, from_positions=from_positions))
    assert [(s.window, s.chunk) for s in plan.sites] == [(window, chunk)]
    assert plan.mask_theorems[0].proven
    assert f"i // {chunk} == j // {chunk}" in plan.mask_theorems[0].statement


def _masks(chunk: int):
    """Masks over i, j, i // C, j // C (sympy): the chunked targets and mutations of them."""
    import sympy
    from dcp_compile.passes.mask_predicate import I, J
    a, b = sympy.floor(I / chunk), sympy.floor(J / chunk)
    causal, same = J <= I, sympy.Eq(a, b)
    yield sympy.And(causal, same)
    for w in (1, 2, chunk - 1, chunk, chunk + 3):
        yield sympy.And(causal, same, I - J < w)
    yield sympy.And(causal, a <= b)                       # the same chunk, said another way
    yield sympy.And(causal, I < chunk * b + chunk)        # ... and another
    yield sympy.And(causal, a - b <= 1)                   # this chunk and the one before
    yield sympy.And(causal, same, sympy.Ne(I, 2 * chunk + 1))
    yield sympy.And(causal, same, I <= 5 * chunk)
    yield sympy.And(J <= I + 1, same)
    yield sympy.And(causal, same, I - chunk * a < chunk - 1)   # the chunk's last row hidden
    yield sympy.And(causal, sympy.Or(same, I - J < 2))    # a window across the boundary


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_the_chunk_decision_agrees_with_brute_force(chunk):
    """The decision over (i // C, j // C, i mod C, j mod C) is exact: a proven mask equals
    its target at every (i, j) of a grid of 8 chunks, and a failed one's counterexample is a
    real difference (so a proof cannot be a bug's artefact, nor a refusal a false alarm)."""
    import sympy
    from dcp_compile.passes.mask_predicate import I, J
    from dcp_compile.passes.prove.masks import prove_mask, target
    proven = 0
    for keep in _masks(chunk):
        v = prove_mask(keep, name="t", where="t")
        at, want = (sympy.lambdify((I, J), f, "math")
                    for f in (keep, target(v.window, v.chunk)))
        grid = [(i, j) for i in range(8 * chunk + 3) for j in range(8 * chunk + 3)]
        differ = [(i, j) for i, j in grid if bool(at(i, j)) != bool(want(i, j))]
        if v.proven:
            proven += 1
            assert not differ, (keep, v.window, v.chunk, differ[:3])
        else:
            e = v.theorem.counterexample
            assert e is not None and e["mask"] != e["target"], (keep, v.why)
            assert bool(keep.subs({I: e["i"], J: e["j"]})) == e["mask"]
    assert proven >= 7          # the targets, the two rewritings, the windows


@pytest.mark.parametrize("case", list(REFUSED))
def test_wrong_masks_are_refused_naming_the_node(case):
    mask, from_positions, why = REFUSED[case]
    with pytest.raises(DCPTransformError, match=why) as e:
        _plan(MaskLM(mask, from_positions=from_positions))
    assert "at node " in str(e.value) and "test_mask_proof.py" in str(e.value)


@pytest.mark.parametrize("declared", [WINDOW - 1, WINDOW + 1, 0], ids=["W-1", "W+1", "none"])
def test_a_config_window_that_disagrees_with_the_proven_mask_is_refused(declared):
    model = MaskLM(lambda i, j: (j <= i) & (i - j < WINDOW))
    if not declared:       # the config says "no window": the proven mask still has one
        assert [s.window for s in _plan(model, windows=[0]).sites] == [WINDOW]
        return
    with pytest.raises(DCPTransformError, match=f"config declares sliding_window={declared}"
                                                f".*at query position"):
        _plan(model, windows=[declared])


def test_a_config_window_on_a_proven_causal_mask_is_refused():
    with pytest.raises(DCPTransformError, match=r"iff j <= i, but the config declares "
                                                r"sliding_window=20"):
        _plan(MaskLM(lambda i, j: j <= i), windows=[20])


def test_a_one_token_step_takes_the_prompt_steps_proven_windows():
    """The decode step's 1x1 mask shows no window: the prompt step's proven one is used,
    not a config that (wrongly) declares none."""
    model = MaskLM(lambda i, j: (j <= i) & (i - j < WINDOW))
    plan = _plan(model, tokens=1, windows=[0], facts=ModelFacts(windows=(WINDOW,)))
    assert [s.window for s in plan.sites] == [WINDOW] and plan.mask_theorems == ()


@pytest.mark.parametrize("wrong", [WINDOW + 1] + ([WINDOW - 1] if FULL else []),
                         ids=["W+1", "W-1"][:1 + FULL])
def test_check_crosses_the_window_and_catches_a_wrong_one(monkeypatch, wrong):
    """The backstop: if the proof were wrong (patched here to claim W +- 1), check= in decode
    mode runs past the window and refuses the program."""
    from dcp_compile.passes import insert_paged_cache
    from dcp_compile.passes.prove import masks
    real = masks.prove_mask

    def lying(keep, **kw):
        v = real(keep, **kw)
        return masks.MaskVerdict(wrong, v.theorem, v.why, v.keep) if v.proven else v

    monkeypatch.setattr(insert_paged_cache, "prove_mask", lying)
    model = plain_llama(CFG, attention="eager", window=WINDOW)
    with pytest.raises(DCPCheckError, match="'decode [0-9]+' step") as e:
        dcp_compile.transform(model, tp=2, dcp=1, mode="decode", block_size=BLOCK,
                              shapes=SHAPES, check=True)
    assert e.value.report.first_mismatch["position"] == min(WINDOW, wrong) > CONTEXT


# ---------------------------------------------------------------------------------------
# Hugging Face models that apply their window only through the mask.
# ---------------------------------------------------------------------------------------

HF_WINDOW = dict(num_attention_heads=8, num_key_value_heads=2, num_local_experts=2,
                 num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32, sliding_window=32,
                 experts_implementation="batched_mm")   # static shapes on fake tensors
HF_MASK_WINDOWS = {   # id -> (config, model, extra overrides); neither passes sliding_window=
    "phimoe-config-only": ("PhimoeConfig", "PhimoeForCausalLM", {}),
    "qwen2_moe-module-attribute": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                                   dict(use_sliding_window=True, max_window_layers=2)),
}


def _hf(case, **overrides):
    pytest.importorskip("transformers")
    from test_hf import build
    config, model, extra = HF_MASK_WINDOWS[case]
    return build(config, model, {**HF_WINDOW, **extra, **overrides})


@pytest.mark.parametrize("case", list(HF_MASK_WINDOWS))
def test_prepare_reads_windows_the_attention_function_is_not_told(case):
    from dcp_compile import hf
    model = _hf(case)
    with pytest.raises(DCPTransformError, match=r"uses sliding-window attention \(from "
                                                r".*sliding_window=32"):
        hf.prepare(model)
    assert hf.prepare(model, max_model_len=32).max_model_len == 32


@pytest.mark.parametrize("attn", ["eager", "sdpa"][:1 + FULL])
@pytest.mark.parametrize("case", list(HF_MASK_WINDOWS)[:1 + FULL])
def test_hf_windows_longer_than_the_chunk_are_read_from_the_mask(case, attn):
    """The mask shows the 14-token window (longer than the 12-token chunk): the proof finds
    it, and it agrees with the config's windows (0 on Qwen2-MoE's full layer)."""
    from dcp_compile.frontends.huggingface import declared_windows
    model = _hf(case, sliding_window=WINDOW, attn_implementation=attn)
    declared = declared_windows(model)
    assert WINDOW in declared
    plan = _plan(model, windows=declared)
    assert [s.window for s in plan.sites] == declared
    assert all(s.mask is not None for s in plan.sites)
    assert all(t.proven and t.name == f"mask_layer_{k}" for k, t in
               enumerate(plan.mask_theorems))
