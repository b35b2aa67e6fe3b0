"""DeepSeek Sparse Attention lowered to StableHLO and run on XLA:CPU replicas (docs/lowering.md,
"DeepSeek Sparse Attention on XLA"; docs/moe-mla.md).

The selection orders keys by DSA_ORDER (score descending, then position ascending) through
one distinct int64 per key (``sparse_attention.dsa_key``) and ``torch.topk``, which lowers to
``stablehlo.sort``; the two stable sorts it replaces (``aten.sort.stable``) did not lower.
Tested: the key's order is the stable sorts' permutation exactly, on ties of every kind
(equal scores, -0.0 and 0.0, +-inf, non-selectable keys, positions out of order); the
selection ops lowered alone equal the eager ops on XLA:CPU, ties included; the DSA programs
of tiny DeepSeek-V3.2 and GLM-5 (``index_topk=4``: the indexer cuts, and the cut is shown to
change the model's logits) lowered and run on tp host devices give the model's own greedy
tokens and logits within 1e-4 (fp32), decode and prefill in two chunks.

The slice (default run): the order and the ops alone. ``DCP_HYBRID_XLA_FULL=1``:
DeepSeek-V3.2 decode and prefill at tp=4/dcp=2 and tp=8/dcp=4, GLM-5 with a shared indexer
layer at tp=4/dcp=2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":        # child process of _in_xla_process: this worktree first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
    from tests.support.suite_path import install   # the suite's import path, as conftest sets it
    install()

pytest.importorskip("jax", reason="XLA tests need jax/jaxlib (pip install -e '.[xla]')")
pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir (the stablehlo extra)")
pytest.importorskip("transformers")

from dcp_compile import xla as X  # noqa: E402
from dcp_compile.runtime.kernels.sparse_attention import (  # noqa: E402
    NEG_INF, _index_candidates_impl, _index_threshold_impl, dsa_first)

from full_runs import full  # noqa: E402
from xla_process import child_main, in_xla_process, run_lowered_alone  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))

MAX_TP = 8
X.request_host_devices(MAX_TP)

TOL = 1e-4
FULL = full("DCP_HYBRID_XLA_FULL")


def stable_sorts_order(scores, positions):
    """DSA_ORDER as two stable sorts (by position, then by score descending): the order the
    selection used before, which torch-mlir does not lower (aten.sort.stable)."""
    last = torch.iinfo(torch.int64).max
    by_pos = torch.argsort(torch.where(positions >= 0, positions, last), dim=-1, stable=True)
    s = torch.where(positions >= 0, scores, NEG_INF).gather(-1, by_pos)
    by_score = torch.argsort(s, dim=-1, descending=True, stable=True)
    return by_pos.gather(-1, by_score)


# Scores drawn from few values (ties everywhere): both zeros, both infinities, tiny normals.
# Not denormals: XLA:CPU flushes them to zero in every float op (its comparisons included),
# so there a denormal score ties with 0 and the order differs from eager torch's.
TIED = torch.tensor([NEG_INF, -0.0, 0.0, 0.5, -1.5, 2.0, float("inf"), 1e-30, -1e-30])


def tied_keys(g, shape, unselectable: float = 0.3):
    """(scores, positions) of ``shape``: scores from TIED, distinct positions in no order
    along the last axis, about ``unselectable`` of them -1."""
    *lead, t = shape
    scores = TIED[torch.randint(0, len(TIED), shape, generator=g)]
    rows = torch.stack([torch.randperm(t, generator=g) * 3 + 1
                        for _ in range(int(torch.tensor(lead).prod()))]).view(shape)
    positions = torch.where(torch.rand(shape, generator=g) < unselectable, -1, rows)
    return scores, positions


@pytest.mark.parametrize("keys", [1, 7, 33])
def test_the_dsa_key_orders_keys_as_the_stable_sorts_do(keys):
    g = torch.Generator().manual_seed(keys)
    for _ in range(50):
        scores, positions = tied_keys(g, (2, 3, keys))
        assert torch.equal(dsa_first(scores, positions, keys),
                           stable_sorts_order(scores, positions))


def _op_cases():
    """The selection's two ops on tied keys: a rank's candidates (5 of 12 keys) and the
    threshold over two ranks' gathered candidates (the 4th of 10)."""
    g = torch.Generator().manual_seed(0)
    scores, positions = tied_keys(g, (2, 3, 12))
    cand_s, cand_p = tied_keys(g, (2, 2, 3, 5), unselectable=0.2)
    return {"index_candidates": (lambda s, p: _index_candidates_impl(s, p, 5),
                                 [scores, positions]),
            "index_threshold": (lambda s, p: _index_threshold_impl(s, p, 4), [cand_s, cand_p])}


def case_ops() -> dict:
    """Each op lowered alone and run on one XLA:CPU device: op -> whether its outputs equal
    the eager op's exactly, and how many stablehlo.sort ops it lowered to."""
    out = {}
    for name, (fn, inputs) in _op_cases().items():
        want = fn(*inputs)
        lowered, got = run_lowered_alone(fn, inputs, name)
        out[name] = {"equal": all(torch.equal(a, b) for a, b in zip(got, want)),
                     "sorts": lowered.text.count("stablehlo.sort")}
    return out


def test_the_selection_ops_lowered_equal_the_eager_ops_on_ties(tmp_path):
    s, p = _op_cases()["index_candidates"][1]
    first = stable_sorts_order(s, p)[..., :5]     # the eager op is the stable sorts' order
    assert torch.equal(_index_candidates_impl(s, p, 5)[1], p.gather(-1, first))
    got = _in_xla_process("case_ops", tmp_path=tmp_path)
    assert got == {name: {"equal": True, "sorts": 1} for name in _op_cases()}, got


# -- whole DSA programs on XLA:CPU ---------------------------------------------------------

LAYOUTS = ((4, 2), (8, 4))
CELLS = [("deepseek_v32", mode, tp, dcp) for mode in ("decode", "prefill")
         for tp, dcp in LAYOUTS] + [("glm5-full-shared", mode, 4, 2)
                                    for mode in ("decode", "prefill")]


def case_program(name, mode, tp, dcp) -> dict:
    """Lower the DSA program (tests/frontends/test_dsa_transform.py's tiny model and
    shapes), run it on XLA, compare with the model's own forward: the report, and the
    lowered modules' sort counts."""
    import hf_corpus as C
    import test_dsa_transform as T
    from dcp_compile.frontends.ordinary import FullForwardReference
    model = T._model(name)
    T._assert_the_cut_matters(model, C.STEPS[mode])
    program = T._transform(model, mode, tp, dcp)
    lowered = X.lower_for_xla(program)
    reference = FullForwardReference(model)
    if mode == "decode":
        report = X.verify(reference, program, C.prompts(), C.STEPS[mode], atol=TOL,
                          lowered=lowered)
    else:       # two chunks: the second selects over the first's cached keys
        report = X.verify_prefill(reference, program, C.prompts(), chunks=2, atol=TOL,
                                  lowered=lowered, check_cache=False)
    return {"report": report.to_json(), "indexers": sum(T._own_indexer(model)),
            "sorts": {step: m.text.count("stablehlo.sort")
                      for step, m in lowered.modules.items()}}


@pytest.mark.skipif(not FULL, reason="DCP_HYBRID_XLA_FULL=1 runs it")
@pytest.mark.parametrize("name,mode,tp,dcp", CELLS,
                         ids=[f"{a}-{b}-tp{c}-dcp{d}" for a, b, c, d in CELLS])
def test_dsa_program_on_xla_is_the_models_forward(name, mode, tp, dcp, tmp_path):
    got = _in_xla_process("case_program", name, mode, tp, dcp, tmp_path=tmp_path)
    report = got["report"]
    assert report["ok"] and report["tokens_agree"], report
    assert report["max_abs_error"] <= TOL, report
    # every step's module: two sorts per layer with its own indexer (the rank's candidates,
    # the threshold), none for a layer reusing another's selection
    assert got["sorts"] and set(got["sorts"].values()) == {2 * got["indexers"]}, got
    print(f"DSA {name} {mode} tp={tp} dcp={dcp} on XLA: max |logit error| "
          f"{report['max_abs_error']:.1e}, sorts per module {got['sorts']}")


def _in_xla_process(case: str, *args, tmp_path):
    return in_xla_process(globals(), case, *args, tmp_path=tmp_path, max_tp=MAX_TP)


if __name__ == "__main__":        # child process of _in_xla_process
    child_main(globals())
