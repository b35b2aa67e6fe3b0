"""Run `dcp_compile.runtime.nixl.loopback` engines as real processes and collect their results (the NIXL
tests' one harness)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp_compile.runtime.nixl.loopback import loopback_env

ROOT = Path(__file__).resolve().parents[1]


def run_loopback(tmp: Path, spec: dict, roles: tuple[str, ...], *, timeout: float) -> dict:
    """Start one process per role on ``spec`` (written to ``tmp``), wait up to ``timeout`` s
    for all of them, and return ``{"spec": spec, "prefill": ..., "decode": ...}`` as they
    wrote it. A missing result or a crash fails the test, naming the process; a NIXL build
    that does not import skips it."""
    (tmp / "spec.json").write_text(json.dumps(spec))
    procs = {role: subprocess.Popen(
        [sys.executable, "-m", "dcp_compile.runtime.nixl.loopback", role, str(tmp / "spec.json"),
         str(tmp / f"{role}.json")], cwd=ROOT, env=loopback_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for role in roles}
    deadline = time.monotonic() + timeout
    errs = {}
    for role, p in procs.items():
        try:
            _, errs[role] = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            _, errs[role] = p.communicate()
    out = {"spec": spec}
    for role in ("prefill", "decode"):
        path = tmp / f"{role}.json"
        if not path.exists():
            pytest.fail(f"{role} process wrote no result; stderr:\n{errs[role].decode()[-3000:]}")
        out[role] = json.loads(path.read_text())
        if "nixl_import_error" in out[role]:
            pytest.skip(f"import nixl failed: {out[role]['nixl_import_error']}")
        if "crash" in out[role]:
            pytest.fail(f"{role} process crashed: {out[role]['traceback']}")
    return out
