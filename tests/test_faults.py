"""Fault injection: hung ranks (threads and torchrun processes), exit-time aborts, unbounded
configuration sizes, dumps into folders they do not own (issue 12: Faults, CI)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from dcp_compile.errors import DCPWorldError
from runtime.world import leaked_ranks, run_threaded

ROOT = Path(__file__).resolve().parent.parent
F = torch.ops._c10d_functional

# --- threaded worlds ----------------------------------------------------------------------

# Cycles of every scenario of tests/world_exit_probe.py (5 worlds each) in the CI guard.
EXIT_PROBE_REPEAT = 6


def test_threaded_worlds_never_abort_the_interpreter_at_exit():
    """CI guard for `terminate called without an active exception` (exit 134): worlds that
    fail, time out and hang are created and torn down repeatedly in a fresh interpreter that
    then exits at once. No rank thread may outlive its world unless it is reported leaked."""
    proc = subprocess.run([sys.executable, "tests/world_exit_probe.py",
                           str(EXIT_PROBE_REPEAT), "fail-before-bind"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "terminate called" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    alive, _, leaked = proc.stdout.split("rank threads alive: ")[1].partition("; reported as leaked: ")
    assert alive.strip() == leaked.strip(), proc.stdout


def test_hung_thread_rank_is_named_and_not_leaked_silently():
    """Rank 1 hangs outside any collective; ranks 0 and 2 wait for it in an all_reduce. The
    error names rank 1 as the one that stopped answering and 0, 2 as stopped because of it;
    rank 1's thread is listed by leaked_ranks() until it ends."""
    release = threading.Event()

    def fn(rank):
        if rank == 1:
            release.wait()
            return None
        return F.wait_tensor(F.all_reduce(torch.ones(1), "sum", "0")).item()

    try:
        with pytest.raises(DCPWorldError, match="did not finish in 5.0 s") as info:
            run_threaded(3, fn, timeout=5.0)
        err = info.value
        assert err.leaked == [1] and err.timed_out == [0, 1, 2]
        assert "Rank [1] stopped answering" in str(err)
        assert "Ranks [0, 2] were stopped in a collective because of it" in str(err)
        assert "release.wait()" in err.failures[1]
        assert [r for _, r in leaked_ranks()] == [1]
    finally:
        release.set()
    for t in threading.enumerate():
        if t.name == "dcp-rank-1":
            t.join(30)
    assert leaked_ranks() == []
    assert run_threaded(2, lambda r: r) == [0, 1]  # later worlds are unaffected
