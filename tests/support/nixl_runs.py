"""Run `tests.support.nixl_loopback` engines as real processes and collect their results (the NIXL
tests' one harness). Several scenarios share the processes (tests/support/nixl_loopback_worker.py:
one process per role runs every scenario that has that role, in order): a process's start
(Python, torch, NIXL: ~3 CPU-s) costs more than a scenario's transfers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp_compile.runtime.distributed.launch import loopback_env

from suite_path import ROOT  # noqa: E402  (the repository root)


def run_loopback(tmp: Path, scenarios: dict[str, tuple[dict, tuple[str, ...]]], *,
                 timeout: float) -> dict:
    """Run every scenario (name -> (spec, its roles)), its spec written to ``tmp/name``,
    with one process per role; wait up to ``timeout`` s for all of them, and return
    ``{name: {"spec": spec, "prefill": ..., "decode": ...}}`` as they wrote it. A missing
    result or a crash fails the test, naming the scenario and process; a NIXL build that
    does not import skips it."""
    jobs: dict[str, list[str]] = {}          # role -> [spec, result, spec, result, ...]
    for name, (spec, roles) in scenarios.items():
        (tmp / name).mkdir(parents=True, exist_ok=True)
        (tmp / name / "spec.json").write_text(json.dumps(spec))
        for role in roles:
            jobs.setdefault(role, []).extend(
                [str(tmp / name / "spec.json"), str(tmp / name / f"{role}.json")])
    procs = {role: subprocess.Popen(
        [sys.executable, "-m", "tests.support.nixl_loopback_worker", role, *paths], cwd=ROOT,
        env=loopback_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for role, paths in jobs.items()}
    deadline = time.monotonic() + timeout
    errs = {}
    for role, p in procs.items():
        try:
            _, errs[role] = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            _, errs[role] = p.communicate()
    out = {}
    for name, (spec, _) in scenarios.items():
        out[name] = {"spec": spec}
        for role in ("prefill", "decode"):
            path = tmp / name / f"{role}.json"
            if not path.exists():
                pytest.fail(f"{name}: {role} process wrote no result; stderr:\n"
                            f"{errs[role].decode()[-3000:]}")
            out[name][role] = json.loads(path.read_text())
            if "nixl_import_error" in out[name][role]:
                pytest.skip(f"import nixl failed: {out[name][role]['nixl_import_error']}")
            if "crash" in out[name][role]:
                pytest.fail(f"{name}: {role} process crashed: {out[name][role]['traceback']}")
    return out
