"""Context buckets (runtime/program/buckets.py): one graph per (step kind, bucket) over one set of
weights; the Engine runs each step in the smallest bucket holding its batch, every executor
(threads, XLA, the Neuron modules) runs that bucket's graph, and the logits equal the model's
own forward whichever buckets a run crosses.

By default the threaded tp=4/dcp=2 decode case runs (the suite's time budget: an XLA case
lowers and compiles six modules, ~80 s); ``DCP_BUCKET_CASES=1`` runs decode and prefill at
tp=8/dcp=4 and tp=4/dcp=2 on threads and on XLA.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":        # child process of _on_xla: this worktree first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
    from tests.support.suite_path import install   # the suite's import path, as conftest sets it
    install()

import dcp_compile  # noqa: E402
from dcp_compile.models.demo import DemoConfig, demo_model  # noqa: E402
from dcp_compile.runtime.program.buckets import check_buckets, smallest_bucket  # noqa: E402
from dcp_compile.runtime.serving.engine import Engine, StepShapes  # noqa: E402
from dcp_compile.runtime.errors import DCPConfigError, DCPInputError  # noqa: E402
from full_runs import full  # noqa: E402
from suite_path import ROOT  # noqa: E402

BLOCK = 4
ATOL = 1e-4
ALL = full("DCP_BUCKET_CASES")
# (tp, dcp) -> buckets (tokens), the shapes' capacity in vblocks, prompt lengths, decode
# steps: prompts start in the smallest bucket (length 1: empty shards) and decode crosses
# every bucket up to the full capacity.
LAYOUTS = {(4, 2): ([8, 16], 4, (1, 7), 14),
           (8, 4): ([16, 32], 3, (1, 13), 22)}
EVERY_CASE = [pytest.param(4, 2, "decode", id="tp4-dcp2-decode"),
              pytest.param(4, 2, "prefill", id="tp4-dcp2-prefill"),
              pytest.param(8, 4, "decode", id="tp8-dcp4-decode"),
              pytest.param(8, 4, "prefill", id="tp8-dcp4-prefill")]
CASES = EVERY_CASE if ALL else EVERY_CASE[:1]
XLA_CASES = EVERY_CASE if ALL else []
CHUNKS = 5


@functools.lru_cache(maxsize=None)
def _program(tp, dcp, mode):
    buckets, max_blocks, _, _ = LAYOUTS[tp, dcp]
    model = demo_model(DemoConfig(num_layers=1))
    shapes = StepShapes(batch=2, context_len=16, max_blocks=max_blocks,
                        num_blocks=2 * max_blocks + 1)
    return model, dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, block_size=BLOCK,
                                        shapes=shapes, buckets=buckets, check=False)


def _prompts(tp, dcp, mode):
    _, _, lengths, _ = LAYOUTS[tp, dcp]
    if mode == "prefill":      # chunks of up to context_len tokens up to the capacity
        lengths = (lengths[0] + 4, BLOCK * dcp * (LAYOUTS[tp, dcp][1] - 1) + 3)
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _widths_seen():
    """Wrap an executor's step to record (kind, block-table width) of every step."""
    seen = []

    def wrap(step):
        def recorded(self, kind, input_ids, positions, block_table, *rest):
            seen.append((str(getattr(kind, "value", kind)), int(block_table.shape[-1])))
            return step(self, kind, input_ids, positions, block_table, *rest)
        return recorded
    return seen, wrap


def _run_case(tp, dcp, mode, backend) -> dict:
    """Verify the bucketed program on ``backend``; returns the report and the widths run."""
    model, program = _program(tp, dcp, mode)
    prompts = _prompts(tp, dcp, mode)
    _, _, _, steps = LAYOUTS[tp, dcp]
    if backend == "xla":
        from dcp_compile import xla as V
        cls = V.XLAExecutor
        seen, wrap = _widths_seen()
        cls.step = wrap(cls.step)
    else:
        from dcp_compile import verify as V
        from dcp_compile.runtime.serving.rank_program import RankProgram
        seen, wrap = _widths_seen()
        original = RankProgram.run
        RankProgram.run = wrap(original)
    try:
        if mode == "decode":
            report = V.verify(model, program, prompts, steps, atol=ATOL)
        else:
            report = V.verify_prefill(model, program, prompts, CHUNKS, atol=ATOL)
    finally:
        if backend != "xla":
            RankProgram.run = original
    return {"report": report.to_json(), "widths": sorted(set(seen)),
            "buckets": list(program.buckets)}


def _on_xla(tp, dcp, mode, tmp_path) -> dict:
    """The XLA case in a fresh process (XLA:CPU's device count is fixed at jax's start)."""
    out = tmp_path / "case.pt"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, __file__, repr((tp, dcp, mode)), str(out)],
                          env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def _assert_matches_and_crosses_buckets(got, tp, dcp, mode):
    report = got["report"]
    assert report["ok"] and report["tokens_agree"], report
    assert report["max_abs_error"] <= ATOL, report
    kind = "decode" if mode == "decode" else "prefill"
    widths = {w for k, w in got["widths"] if k == kind}
    # The run crossed every bucket of its step kind (so each bucket's graph ran and matched).
    expected = {b // (BLOCK * dcp) for b in got["buckets"]}
    assert widths == expected, (got["widths"], got["buckets"])


# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp,dcp,mode", CASES)
def test_buckets_on_threads_match_the_single_device_model(tp, dcp, mode):
    _assert_matches_and_crosses_buckets(_run_case(tp, dcp, mode, "threads"), tp, dcp, mode)


@pytest.mark.parametrize("tp,dcp,mode", XLA_CASES)
def test_buckets_on_xla_match_the_single_device_model(tp, dcp, mode, tmp_path):
    pytest.importorskip("jax", reason="XLA needs jax/jaxlib (pip install -e '.[xla]')")
    pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir")
    _assert_matches_and_crosses_buckets(_on_xla(tp, dcp, mode, tmp_path), tp, dcp, mode)


def test_one_graph_per_step_and_bucket_over_one_set_of_weights():
    _, program = _program(4, 2, "decode")
    assert program.buckets == (8, 16, 32)
    for bucket in program.buckets:
        view = program.for_bucket(bucket)
        assert set(view.graphs) == {"context", "decode"}
        table = [n for n in view.graphs["decode"].graph.nodes if n.op == "placeholder"][
            len(program.weight_inputs) + 3]
        assert tuple(table.meta["val"].shape) == (2, bucket // (BLOCK * 2)), bucket
        assert view.weight_inputs is program.weight_inputs
        assert view.constants is program.constants


def test_buckets_reuse_the_frontend_and_build_one_program(monkeypatch):
    """The bucket loop captures each bucket through the program's own frontend (at a
    narrower block table): the model is inspected and wrapped once, one program is built
    and one check runs, whatever the number of buckets."""
    from dcp_compile import driver
    from dcp_compile.runtime.program import dcp_program
    made, programs = [], []
    frontend_for, program_init = driver.frontend_for, dcp_program.DCPProgram.__init__
    monkeypatch.setattr(driver, "frontend_for", lambda *a, **k: made.append(a) or
                        frontend_for(*a, **k))
    monkeypatch.setattr(dcp_program.DCPProgram, "__init__", lambda self, *a, **k:
                        programs.append(self) or program_init(self, *a, **k))
    model = demo_model(DemoConfig(num_layers=1))
    program = dcp_compile.transform(model, tp=4, dcp=2, block_size=BLOCK, buckets=[8, 16],
                                    shapes=StepShapes(batch=2, context_len=16, max_blocks=4,
                                                      num_blocks=9), check=False)
    assert program.buckets == (8, 16, 32)
    assert len(made) == 1 and programs == [program]


def test_lower_emits_one_module_per_step_and_bucket():
    pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir")
    from dcp_compile.lowering import lower
    _, program = _program(4, 2, "decode")
    lowered = lower(program, steps=["decode"])
    assert {(m.kind, m.bucket) for m in lowered.modules.values()} == {
        ("decode", b) for b in (8, 16, 32)}
    assert set(lowered.modules) == {"decode_8", "decode_16", "decode"}
    # A bucket's module reads its own block-table width: [2, bucket / vblock].
    for name, m in lowered.modules.items():
        assert f"tensor<2x{m.bucket // 8}xi64>" in m.text, name


@pytest.mark.parametrize("buckets,match", [
    ([12], "positive multiples of the vblock"),
    ([0], "positive multiples of the vblock"),
    ([40], "exceed the program's capacity"),
])
def test_bad_buckets_are_refused(buckets, match):
    with pytest.raises(DCPConfigError, match=match):
        check_buckets(buckets, block_size=BLOCK, dcp=2, max_blocks=4)


def test_the_engine_picks_the_smallest_bucket_holding_the_batch():
    class Recorder:
        widths = []

        def step(self, kind, input_ids, positions, block_table):
            self.widths.append(block_table.shape[1])
            return torch.zeros(input_ids.shape + (4,))

    rec = Recorder()
    engine = Engine(rec, StepShapes(batch=2, context_len=8, max_blocks=4, num_blocks=9),
                    block_size=BLOCK, dcp=2, buckets=[8, 16])
    engine.prefill([[1] * 8, [1] * 3])          # 8 tokens: bucket 8 (1 entry)
    engine.decode([1, 1])                       # 9 tokens: bucket 16
    engine.lengths = [16, 3]
    engine.decode([1, 1])                       # 17 tokens: the full capacity, 32
    assert rec.widths == [1, 2, 4]
    assert smallest_bucket((8, 16, 32), 16) == 16
    with pytest.raises(DCPInputError, match="more than the largest context bucket"):
        smallest_bucket((8, 16, 32), 33)


def test_cli_refuses_a_bucket_off_the_vblock(capsys):
    from dcp_compile import cli
    try:
        code = cli.main(["verify", "--tp", "4", "--dcp", "2", "--block-size", "4",
                         "--buckets", "8,12"])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert "multiples of the vblock" in capsys.readouterr().err


if __name__ == "__main__":        # child process of _on_xla
    import ast
    args, out = ast.literal_eval(sys.argv[1]), sys.argv[2]
    torch.save(_run_case(*args, "xla"), out)
