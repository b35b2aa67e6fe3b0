"""Sliding windows the model libraries write in place, read as a formula of positions
(dcp_compile/frontends/module_windows.py): litgpt writes its window row by row in a Python
loop over the length, which torch.export keeps at the captured length only.

Shown here: (1) the formula is the mask litgpt's loop writes, at every length tried, and the
swapped attention computes the model's own forward (eager; a window one longer would not:
the test can fail); (2) the transformed program matches the model's own full forward
(fp32, 1e-4, greedy tokens; tests/support/hf_corpus.run_model), with the window proven per
layer (Gemma-2 alternates sliding and global layers); (3) code other than the pinned code is
refused, naming the function. The other litgpt sliding-window models (Gemma-3, Phi-3/4-mini,
Mistral, both modes) are cells of the third-party corpus (tests/corpora).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import hf_corpus
from dcp_compile.frontends import module_windows as mw
from dcp_compile.runtime.errors import DCPTransformError

import third_party as T  # noqa: E402

if importlib.util.find_spec("litgpt") is None:
    pytest.skip("litgpt is not installed: run scripts/setup.sh (requirements/corpus.txt)",
                allow_module_level=True)

# litgpt models that write a sliding window: Gemma-2 (soft-capping: scores + mask, every other
# layer global), Mistral (F.scaled_dot_product_attention with the mask), Phi-3 (MHA).
MODELS = ["litgpt/Gemma-2-2b", "litgpt/Mistral-7B-v0.1", "litgpt/Phi-3-mini-4k-instruct"]


def _loop_mask(tokens: int, window: int) -> torch.Tensor:
    """litgpt 0.5.13's loop (CausalSelfAttention.forward, input_pos None), verbatim."""
    sliding_window_mask = torch.full((tokens, tokens), float("-inf"))
    for i in range(tokens):
        window_start = max(0, i - window + 1)
        sliding_window_mask[i, window_start: i + 1] = 0.0
    return sliding_window_mask.view(1, 1, tokens, tokens)


@pytest.mark.parametrize("window", [1, 4, 9])
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 16])
def test_the_formula_is_the_mask_litgpts_loop_writes(tokens, window):
    got = mw.window_mask(tokens, window, dtype=torch.float32, device="cpu")
    assert torch.equal(got, _loop_mask(tokens, window))


def _logits(model, ids, sites=()):
    with torch.no_grad(), mw.module_windows_enabled(list(sites)) as swapped:
        return T.logits_of(model, ids), swapped


@pytest.mark.parametrize("name", MODELS)
def test_swapped_attention_computes_the_models_own_forward(name):
    model = T.build(name)
    sites = mw.window_sites(model)
    assert sites and all(w == T.WINDOW for *_, w in sites)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    want, _ = _logits(model, ids)
    got, swapped = _logits(model, ids, sites)
    again, _ = _logits(model, ids)
    assert swapped == len(sites)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(again, want, rtol=0, atol=0)     # the swap is undone
    # The comparison can fail: a window one longer is another model.
    longer = [(n, m, r, w + 1) for n, m, r, w in sites]
    wrong, _ = _logits(model, ids, longer)
    assert (wrong - want).abs().max() > 1e-3


def test_gemma2_windows_only_its_sliding_layers():
    model = T.build("litgpt/Gemma-2-2b")
    names = [n for n, *_ in mw.window_sites(model)]
    assert names == ["transformer.h.0.attn"]          # layer 1 is global (litgpt's indices)


@pytest.mark.parametrize("name,mode", [("litgpt/Gemma-2-2b", "prefill"),
                                       ("litgpt/Mistral-7B-v0.1", "decode")])
def test_program_matches_the_models_own_forward(name, mode, monkeypatch):
    """The cache insertion proves each layer's mask (a window of 4, or causal) for every
    position; the program matches, prompts of 1..16 tokens leaving the window."""
    import dcp_compile
    windows = []
    real = dcp_compile.transform

    def transform(*a, **kw):
        program = real(*a, **kw)
        windows.append(program.facts.windows)
        return program
    monkeypatch.setattr(dcp_compile, "transform", transform)
    out = hf_corpus.run_model(T.build(name), mode, logits_of=T.logits_of, check=False)
    assert out.kind == "matches", (out.cell(), out.message[:800])
    want = (T.WINDOW, 0) if "Gemma" in name else (T.WINDOW, T.WINDOW)
    assert windows == [want]


def test_other_code_than_the_pinned_code_is_refused_naming_it():
    from litgpt.model import CausalSelfAttention
    model = T.build("litgpt/Mistral-7B-v0.1")

    class Tweaked(CausalSelfAttention):
        def scaled_dot_product_attention(self, q, k, v, mask=None):
            return super().scaled_dot_product_attention(q, k, v, mask) * 2

    model.transformer.h[1].attn.__class__ = Tweaked
    with pytest.raises(DCPTransformError, match=r"transformer\.h\.1\.attn \(.*Tweaked\) is "
                                                r"litgpt 0\.5\.13's attention with a sliding "
                                                r"window of 4.*code differs.*"
                                                r"scaled_dot_product_attention"):
        mw.window_sites(model)


def test_a_model_called_with_a_kv_cache_is_refused():
    """The rewrite reads the no-cache forward only; litgpt's own KV cache path is refused."""
    model = T.build("litgpt/Mistral-7B-v0.1")
    sites = mw.window_sites(model)
    model.set_kv_cache(batch_size=1, max_seq_length=8)
    with pytest.raises(DCPTransformError, match=r"KV cache or a mask"), torch.no_grad(), \
            mw.module_windows_enabled(sites):
        model(torch.zeros(1, 2, dtype=torch.long), input_pos=torch.arange(2))

