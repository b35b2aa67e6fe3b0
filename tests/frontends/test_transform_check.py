"""transform(check=...): a program that differs from the model is refused, naming the step,
the error and where; the check is on by default for small real models, off on meta, and
changes nothing."""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile import check as checking
from dcp_compile.runtime.errors import DCPCheckError, DCPTransformError
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.program.dcp_program import DCPProgram
from dcp_compile.runtime.serving.engine import StepShapes
import dcp_compile.runtime.kernels.ops

SHAPES = StepShapes(batch=3, context_len=20, max_blocks=2, num_blocks=7)
SMALL = DemoConfig(num_layers=1, vocab_size=64, hidden_size=64, num_q_heads=8,
                   num_kv_heads=2, intermediate_size=64)


def _model():
    return demo_model(SMALL)


def _perturb_rank_1(monkeypatch):
    """Rank 1 loads every weight shard off by 0.05: a deliberately wrong program."""
    real = DCPProgram.state_dict_for

    def wrong(self, rank):
        state = real(self, rank)
        if rank == 1:
            state = {n: t + 0.05 if t.is_floating_point() else t for n, t in state.items()}
        return state

    monkeypatch.setattr(DCPProgram, "state_dict_for", wrong)


@pytest.mark.parametrize("mode,step", [("decode", "context"), ("prefill", "prefill chunk 1")])
def test_wrong_program_is_refused_naming_step_error_and_position(monkeypatch, mode, step):
    _perturb_rank_1(monkeypatch)
    with pytest.raises(DCPCheckError) as info:
        dcp_compile.transform(_model(), tp=4, dcp=2, mode=mode, shapes=SHAPES, check=True)
    report = info.value.report
    assert not report.ok and report.first_mismatch["step"] == step
    first = report.first_mismatch
    assert first["error"] > report.tolerance and report.step_errors[0] > 1e-2
    msg = str(info.value)
    assert f"in the {step!r} step: max abs logit error {report.step_errors[0]:.3g} > " \
           f"tolerance {report.tolerance:.3g} (float32), first at row {first['row']}, " \
           f"position {first['position']}" in msg
    assert isinstance(info.value, DCPTransformError)        # a refusal like any other


def test_a_decode_step_only_error_is_named_as_the_decode_step(monkeypatch):
    """Counting the active token on every rank breaks DCP decode only: the context step
    passes and the refusal names the decode step."""
    real = dcp_compile.runtime.kernels.ops._active_mask_impl
    monkeypatch.setattr(dcp_compile.runtime.kernels.ops, "_active_mask_impl",
                        lambda n, rank, *a: torch.ones_like(real(n, rank, *a)))
    with pytest.raises(DCPCheckError, match="in the 'decode 1' step") as info:
        dcp_compile.transform(_model(), tp=4, dcp=2, shapes=SHAPES, check=True)
    report = info.value.report
    assert report.step_errors[0] <= report.tolerance < report.step_errors[1]


def test_a_program_that_does_not_run_is_refused(monkeypatch):
    from dcp_compile.runtime.serving.rank_program import RankProgram
    real = RankProgram.run

    def crash(self, kind, *args):
        if self.rank == 2 and kind == "decode":
            raise RuntimeError("shape mismatch in a rewritten view")
        return real(self, kind, *args)

    monkeypatch.setattr(RankProgram, "run", crash)
    with pytest.raises(DCPCheckError, match="failed to run on the threaded world"):
        dcp_compile.transform(_model(), tp=4, dcp=2, shapes=SHAPES, check=True)


@pytest.mark.parametrize("mode,steps,lengths", [
    # Two decode steps: the 7-token row writes position 8, the first of a new vblock.
    ("decode", ["context", "decode 1", "decode 2"], [[9, 7, 1], [1, 1, 1], [1, 1, 1]]),
    ("prefill", ["prefill chunk 1", "prefill chunk 2 (after chunk 1)"], [[9, 7, 1], [7, 1, 20]])])
def test_small_real_model_is_checked_by_default(mode, steps, lengths):
    shapes = StepShapes.fitting(3, 20, 40, block_size=4, dcp=2)
    prog = dcp_compile.transform(_model(), tp=4, dcp=2, mode=mode, block_size=4,
                                 shapes=shapes)
    report = prog.report.check
    assert report.ok and report.steps == steps
    assert max(report.step_errors) <= report.tolerance < 2e-4
    # Rows straddle the interleave period (4 * 2), plus one token; prefill's second chunk
    # continues every row, up to a full context_len.
    assert report.lengths == lengths


def test_meta_model_is_not_checked_by_default_and_check_true_is_an_error():
    model = demo_model(SMALL, device="meta")
    prog = dcp_compile.transform(model, tp=4, dcp=2, shapes=SHAPES)
    assert prog.report.check is None
    assert checking.skip_reasons(model, 4, SHAPES) == [
        "the model's weights are not real (meta device or fake tensors)"]
    with pytest.raises(DCPTransformError,
                       match=r"transform\(check=True\) cannot run the model: the model's "
                             r"weights are not real .*pass check=False"):
        dcp_compile.transform(model, tp=4, dcp=2, shapes=SHAPES, check=True)


def test_default_bound_turns_the_check_off_and_check_true_overrides_it(monkeypatch):
    model = _model()
    monkeypatch.setattr(checking, "MAX_PARAMETERS", 1000)
    reasons = checking.skip_reasons(model, 4, SHAPES)
    assert len(reasons) == 1 and "> MAX_PARAMETERS=1000" in reasons[0]
    assert dcp_compile.transform(model, tp=4, dcp=2, shapes=SHAPES).report.check is None
    assert dcp_compile.transform(model, tp=4, dcp=2, shapes=SHAPES,
                                 check=True).report.check.ok
    big = StepShapes(batch=64, context_len=128, max_blocks=2, num_blocks=7)
    assert any("MAX_STEP_TOKENS" in r for r in checking.skip_reasons(model, 16, big))
    assert any("MAX_TP" in r for r in checking.skip_reasons(model, 16, big))


def test_check_must_be_a_bool_or_none():
    with pytest.raises(DCPTransformError, match="check must be True, False or None"):
        dcp_compile.transform(_model(), tp=4, dcp=2, shapes=SHAPES, check="yes")


def test_the_check_changes_neither_model_nor_program_nor_the_global_rng():
    model = _model()
    prog = dcp_compile.transform(model, tp=4, dcp=2, shapes=SHAPES, check=False)
    weights = {n: t.clone() for n, t in model.state_dict().items()}
    constants = {n: t.clone() for n, t in prog.constants.items()}
    code = {k: gm.code for k, gm in prog.graphs.items()}
    rng = torch.get_rng_state()
    checking.check_program(model, prog)
    assert all(torch.equal(weights[n], t) for n, t in model.state_dict().items())
    assert all(torch.equal(constants[n], t) for n, t in prog.constants.items())
    assert {k: gm.code for k, gm in prog.graphs.items()} == code
    assert torch.equal(torch.get_rng_state(), rng)
    assert prog.report.check is None                # only transform() records it


@pytest.mark.parametrize("tp,dcp,mode", [(4, 2, "decode"), (8, 4, "decode"),
                                         (8, 4, "prefill"), (2, 1, "prefill")])
def test_check_rows_fit_the_shapes_and_straddle_the_interleave_period(tp, dcp, mode):
    shapes = StepShapes.fitting(4, 24, 40, block_size=4, dcp=dcp)
    prog = dcp_compile.transform(demo_model(DemoConfig(num_layers=1)), tp=tp, dcp=dcp,
                                 mode=mode, block_size=4, shapes=shapes, check=False)
    rows = checking.row_lengths(prog)
    period, vblock = 4 * dcp, 4 * dcp
    firsts = [a for a, _ in rows]
    assert {period - 1, period + 1, 1} <= set(firsts) and len(rows) <= shapes.batch
    assert all(a <= shapes.context_len and b <= shapes.context_len for a, b in rows)
    assert all(a + b <= shapes.max_blocks * vblock for a, b in rows)
    assert sum(-(-(a + b) // vblock) for a, b in rows) <= shapes.num_blocks - 1
    if mode == "prefill":
        assert all(b >= 1 for _, b in rows)                # a second chunk on every row
