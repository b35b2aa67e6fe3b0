"""The third-party corpus (tests/support/third_party.py): every decoder architecture of
torchtune, litgpt, torchtitan and x-transformers, and the nanoGPT / gpt-fast classics, tiny,
in decode and prefill.

A cell passes when the program matches the model's own forward (fp32, 1e-4, greedy tokens
equal; tests/support/hf_corpus.run_model) or is refused by a DCPError whose reason is a real DCP
limit (T.REAL_LIMITS). Anything else (a silent mismatch, a non-project exception, a refusal of
an ordinary form) is a bug: the ones known today are xfail(strict=True) with their issue
#35 reason, so a fix flips them loudly and the entry must go.

By default a slice runs (a cell per library and behaviour); ``DCP_THIRD_PARTY=1`` runs
every cell. The libraries come from requirements/corpus.txt (scripts/setup.sh installs
them); without them these tests skip, naming the missing one.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

import pytest
import torch

import hf_corpus
import third_party as T
from full_runs import full

FULL = full("DCP_THIRD_PARTY")
ROOT = Path(__file__).resolve().parents[2]

# The slice: a cell per library and per behaviour (matches, a real limit, a known bug).
SLICE = [("litgpt/Llama-3.1-8B", "decode"), ("torchtitan/qwen3-separate-qkv", "prefill"),
         ("nanoGPT/sdpa", "prefill"), ("x-transformers/alibi", "decode"),
         ("litgpt/Gemma-7b", "decode"), ("torchtune/llama3", "decode"),
         ("gpt-fast/llama", "decode")]

CELLS = [(name, mode) for name in T.ARCHS for mode in T.MODES] if FULL else SLICE


def _needs(library: T.Library) -> None:
    dist = T.DISTRIBUTIONS[library]
    if dist is not None and importlib.util.find_spec(dist.replace("-", "_")) is None:
        pytest.skip(f"{dist} is not installed: run scripts/setup.sh (requirements/corpus.txt)")


def _param(name: str, mode: str):
    # raises=AssertionError: only the cell's verdict is the expected failure; a model that
    # no longer builds (or a broken harness) fails the test.
    marks = ([pytest.mark.xfail(strict=True, raises=AssertionError, reason=T.KNOWN[(name, mode)])]
             if (name, mode) in T.KNOWN else [])
    return pytest.param(name, mode, marks=marks, id=f"{name}-{mode}")


@pytest.mark.parametrize("name,mode", [_param(n, m) for n, m in CELLS])
def test_cell_matches_or_is_refused_for_a_real_dcp_limit(name, mode):
    _needs(T.ARCHS[name].library)
    out = T.run_case(name, mode)
    assert out.kind != "mismatch", f"SILENTLY WRONG: {out.reason} ({out.message[:300]})"
    assert out.kind != "crash", f"a non-project exception: {out.message[:600]}"
    if out.kind == "refused":
        assert out.reason in T.REAL_LIMITS, (
            f"refused for {out.reason!r}, not a real DCP limit: {out.message[:600]}")
        if out.reason == "MHA: decode DCP needs tp > kv heads":
            kv = T.ARCHS[name].kv_heads
            assert kv is not None and kv >= hf_corpus.TP and f"num_kv_heads={kv}." in \
                out.message, f"refused as MHA, but the model has {kv} KV heads: {out.message}"


def test_known_cells_are_corpus_cells_with_issue_reasons():
    for (name, mode), why in T.KNOWN.items():
        assert name in T.ARCHS and mode in T.MODES, (name, mode)
        assert why.startswith("issue #35: "), why
    assert set(SLICE) <= {(n, m) for n in T.ARCHS for m in T.MODES}


@pytest.mark.parametrize("name", list(T.ARCHS) if FULL else
                         sorted({n for n, _ in SLICE}))
def test_arch_builds_tiny_and_returns_every_tokens_logits(name):
    arch = T.ARCHS[name]
    _needs(arch.library)
    model = T.build(name)
    assert sum(p.numel() for p in model.parameters()) < 12_000_000
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        logits = T.logits_of(model, torch.tensor([[3, 1, 4, 1, 5]]))
    positions = 1 if name.endswith("last-logits") else 5
    assert logits.shape[:2] == (1, positions) and logits.shape[-1] >= T.VOCAB


def test_every_library_has_architectures_in_the_corpus():
    libraries = {arch.library for arch in T.ARCHS.values()}
    assert libraries == set(T.Library)
    assert len(T.ARCHS) >= 50


def test_installed_versions_are_the_pinned_ones():
    pins = [line.split("#")[0].strip()
            for line in (ROOT / "requirements" / "corpus.txt").read_text().splitlines()]
    pins = dict(pin.split("==") for pin in pins if pin)
    for library, dist in T.DISTRIBUTIONS.items():
        if dist is None:
            continue
        assert dist in pins, f"{dist} is not pinned in requirements/corpus.txt"
        try:
            installed = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        assert installed == pins[dist], (
            f"{dist} {installed} is installed, requirements/corpus.txt pins {pins[dist]}: "
            f"run scripts/setup.sh")
    assert "triton" not in pins, "triton (about 1 GB) is stubbed, not installed"


def test_torchtitan_triton_stub_names_itself_when_called():
    _needs(T.Library.TORCHTITAN)
    if importlib.util.find_spec("triton") is not None:
        pytest.skip("triton is installed: the stub is not used")
    T._stub_torchtitan_triton_kernels()
    from torchtitan.distributed.minimal_async_ep import kernels
    with pytest.raises(RuntimeError, match="is a stub .triton is not installed"):
        kernels.fill_dispatch_metadata_kernel()
