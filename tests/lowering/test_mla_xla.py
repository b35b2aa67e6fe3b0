"""The MLA decode program (tp=8/dcp=8), lowered to StableHLO, on XLA:CPU replicas equals the
model's own forward (tests/support/mla_xla_worker.py: here when jax has 8 host devices, as in the
suite, whose test modules ask for them at import; in a fresh process otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="XLA tests need jax/jaxlib (pip install -e '.[xla]')")
pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir (the stablehlo extra)")

import mla_xla_worker  # noqa: E402  (asks XLA:CPU for 8 host devices)
from suite_path import ROOT  # noqa: E402


def _report() -> dict:
    import jax
    if len(jax.devices("cpu")) >= 8:
        return mla_xla_worker.report()
    worker = Path(mla_xla_worker.__file__)
    proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True,
                          cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_mla_tp8_dcp8_decode_lowered_on_xla_matches_model():
    report = _report()
    assert report["ok"] and report["tokens_agree"], report
    assert report["max_abs_error"] < 1e-4 and len(report["step_errors"]) == 4
