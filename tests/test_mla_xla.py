"""The MLA decode program (tp=8/dcp=8), lowered to StableHLO, on XLA:CPU replicas equals the
model's own forward (tests/mla_xla_worker.py runs it in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="XLA tests need jax/jaxlib (pip install -e '.[xla]')")
pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir (the stablehlo extra)")


def test_mla_tp8_dcp8_decode_lowered_on_xla_matches_model():
    worker = Path(__file__).with_name("mla_xla_worker.py")
    proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True,
                          cwd=worker.parent.parent, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["tokens_agree"], report
    assert report["max_abs_error"] < 1e-4 and len(report["step_errors"]) == 4
