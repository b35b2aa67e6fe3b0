"""The corpus (tests/support/hf_corpus.py): every causal decoder type of transformers 5.x that builds
from a tiny config, through hf.prepare and directly (sdpa, eager), in decode and prefill.

Each cell either matches the model's own forward (fp32, 1e-4, 8 greedy steps, prompts inside,
at and past a vblock's edge, the garbage block NaN-poisoned) or is refused by a DCPError that
names the real reason. Zero silent mismatches, zero non-project exceptions, and the table of
docs/models.md is what the compiler does today: each cell run here must read as it says.

By default a representative slice runs (one cell per behaviour class); ``DCP_CORPUS=1``
runs every cell against the page (about 700 cells; spread over xdist's workers).
``python tests/support/hf_corpus.py --write-docs`` runs every cell and rewrites the page's table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import hf_corpus as C  # noqa: E402
from full_runs import full  # noqa: E402

from suite_path import ROOT  # noqa: E402  (the repository root)

PAGE = ROOT / "docs" / "models.md"
START, END = "<!-- corpus-table:start -->", "<!-- corpus-table:end -->"
FULL = full("DCP_CORPUS")

# The default slice: one cell per behaviour (dense GQA matches, window, MoE, MLA, ALiBi
# (Bloom's, read from baddbmm on heads merged into the batch), sinks, SSM, encoder, learned
# positions), decode and prefill between them.
SLICE = [("llama", "sdpa", "decode"), ("qwen2", "prepare", "prefill"),
         ("gemma2", "eager", "decode"), ("mixtral", "prepare", "decode"),
         ("deepseek_v3", "eager", "prefill"), ("bloom", "eager", "prefill"),
         ("gpt_oss", "prepare", "decode"), ("mamba", "eager", "decode"),
         ("bert", "sdpa", "decode"), ("opt", "sdpa", "prefill")]
CELLS = [(t, p, m) for t in C.CORPUS for p in C.PATHS for m in C.MODES] if FULL else SLICE


def docs_table() -> dict[tuple[str, str, str], str]:
    text = PAGE.read_text()
    if START not in text:
        return {}
    rows = text.split(START)[1].split(END)[0].strip().splitlines()[2:]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        t = cells[0].strip("`")
        for (path, mode), cell in zip([(p, m) for p in C.PATHS for m in C.MODES], cells[1:]):
            table[(t, path, mode)] = cell
    return table



@pytest.mark.parametrize("model_type,path,mode", CELLS, ids=["-".join(c) for c in CELLS])
def test_corpus_cell_matches_or_names_its_refusal(model_type, path, mode):
    out = C.run_case(model_type, path, mode)
    assert out.kind != "mismatch", f"SILENTLY WRONG: {out.reason} {out.message}"
    assert out.kind != "crash", f"a non-project exception: {out.message}"
    if out.kind == "refused":
        assert out.reason != "other", f"a refusal that names no reason: {out.message}"
    expected = docs_table().get((model_type, path, mode))
    assert out.cell() == expected, (
        f"docs/models.md's corpus table says {expected!r}, the compiler now gives {out.cell()!r} "
        f"({out.message[:300]}). If the change is intended, refresh the table: "
        f"python tests/support/hf_corpus.py --write-docs")


def test_every_causal_lm_type_is_in_the_corpus_or_excluded_with_a_reason():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    types = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert not set(C.CORPUS) & set(C.EXCLUDED)
    missing = types - set(C.CORPUS) - set(C.EXCLUDED)
    assert not missing, f"causal LM types neither in the corpus nor excluded: {sorted(missing)}"
    assert len(C.CORPUS) >= 60


def test_only_composites_and_encoder_decoders_are_excluded():
    """A type that does not build tiny is a harness limit, not a reason: write its config."""
    others = {t: why for t, why in C.EXCLUDED.items()
              if not any(kind in why for kind in ("composite", "encoder-decoder"))}
    assert not others, f"excluded for a reason that is not composite / encoder-decoder: {others}"


def test_refusal_reasons_are_classified_by_the_feature_named():
    assert C.reason_of("… The model uses ALiBi (model.transformer, …)") == "ALiBi"
    assert C.reason_of("passes s_aux=tensor(8,) to its attention function") == \
        "attention sinks"
    assert C.reason_of("The model uses SSM / linear-attention layers (…)") == \
        "SSM / linear-attention layers"
    assert C.reason_of("something vague happened") == "other"


def test_docs_table_has_every_corpus_cell():
    table = docs_table()
    missing = [c for c in ((t, p, m) for t in C.CORPUS for p in C.PATHS for m in C.MODES)
               if c not in table]
    assert not missing, (f"docs/models.md's corpus table lacks {len(missing)} cells (first "
                         f"{missing[:3]}): run `python tests/support/hf_corpus.py --write-docs`")
