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

from dcp_compile.runtime.errors import DCPWorldError
from dcp_compile.runtime.distributed.world import leaked_ranks, run_threaded

from suite_path import ROOT  # noqa: E402  (the repository root)
F = torch.ops._c10d_functional

# --- threaded worlds ----------------------------------------------------------------------

# Cycles of every scenario of tests/support/world_exit_probe.py (5 worlds each) in the CI guard.
EXIT_PROBE_REPEAT = 6


def test_threaded_worlds_never_abort_the_interpreter_at_exit():
    """CI guard for `terminate called without an active exception` (exit 134): worlds that
    fail, time out and hang are created and torn down repeatedly in a fresh interpreter that
    then exits at once. No rank thread may outlive its world unless it is reported leaked."""
    proc = subprocess.run([sys.executable, "tests/support/world_exit_probe.py",
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


# --- configuration sizes --------------------------------------------------------------------

def _bounded(fn, *args, seconds=60.0):
    """fn(*args) on a daemon thread; its outcome, or a failure if it has not returned within
    ``seconds`` (a bound on a hang, not a timing measurement)."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn.__name__}{args} still running after {seconds} s"
    return out


@pytest.mark.parametrize("kwargs,field", [
    (dict(tp=2**40, dcp=1), "tp"),
    (dict(tp=2**40, dcp=3), "tp"),          # used to list the divisors of 2**40
    (dict(tp=8, dcp=2**40), "dcp"),
    (dict(tp=4, dcp=2, block_size=2**62, interleave_size=3), "block_size"),
    (dict(tp=8, dcp=2, num_q_heads=2**40, num_kv_heads=8), "num_q_heads"),
])
def test_huge_sizes_are_refused_at_once(kwargs, field):
    from dcp_compile.runtime.config import SIZE_LIMITS, DCPConfig
    from dcp_compile.runtime.errors import DCPConfigError
    err = _bounded(lambda: DCPConfig(**kwargs)).get("error")
    assert isinstance(err, DCPConfigError)
    assert f"{field} is too large: {field}={kwargs[field]}. Use {field} <= " \
           f"{SIZE_LIMITS[field]}." in str(err)


def test_largest_sizes_validate_with_suggested_fixes():
    """At the limits the rules (divisor lists, the suggested dcp) still run in O(sqrt)."""
    from dcp_compile.runtime.config import DCPConfig
    from dcp_compile.runtime.errors import DCPConfigError
    err = _bounded(lambda: DCPConfig(tp=2**16, dcp=2**15, num_q_heads=2**16,
                                     num_kv_heads=4)).get("error")
    assert isinstance(err, DCPConfigError) and "Use dcp=16384." in str(err)
    err = _bounded(lambda: DCPConfig(tp=2**16 - 1, dcp=2)).get("error")
    assert "Use dcp in [1, 3, 5, 15, 17, 51, 85, 255, 257, 771, 1285, 3855, 4369, 13107, " \
           "21845, 65535]." in str(err)


@pytest.mark.parametrize("field", ["tp", "dcp", "block_size", "num_q_heads", "num_kv_heads",
                                   "head_dim"])
@pytest.mark.parametrize("value", [True, 2.0, "4", -1, 0, None])
def test_config_sizes_are_typed(field, value):
    from dcp_compile.runtime.config import DCPConfig
    from dcp_compile.runtime.errors import DCPConfigError
    kwargs = dict(tp=4, dcp=2, num_q_heads=8, num_kv_heads=2, head_dim=16)
    kwargs[field] = value
    if value is None and field not in ("tp", "dcp", "block_size"):
        DCPConfig(**kwargs)  # head counts may be left out
        return
    with pytest.raises(DCPConfigError, match=f"{field} must be a positive integer: "
                                             f"{field}={value!r}"):
        DCPConfig(**kwargs)


def test_attention_dp_and_mode_are_typed():
    from dcp_compile.runtime.config import DCPConfig
    from dcp_compile.runtime.errors import DCPConfigError
    with pytest.raises(DCPConfigError, match="attention_dp must be a bool: attention_dp=1"):
        DCPConfig(tp=4, dcp=1, attention_dp=1)
    with pytest.raises(DCPConfigError, match=r"mode must be one of .*: mode=\['decode'\]"):
        DCPConfig(tp=4, dcp=1, mode=["decode"])


# --- dumps only touch files they wrote ------------------------------------------------------

def _dump_steps(root, passes):
    """Dump a tiny graph through ``passes`` (names) into ``root``/decode, like a transform."""
    from torch.fx import Graph, GraphModule

    from dcp_compile.passes import dump as D
    from dcp_compile.passes.manager import PassRecord
    g = Graph()
    g.output(g.call_function(torch.ops.aten.relu.default, (g.placeholder("x"),)))
    gm = GraphModule(torch.nn.Module(), g)
    dump = D.PassDump(root, "decode", source="unit")
    for name in passes:
        dump(PassRecord(name, "decode", False, {}, {}, 0.0), gm)
    return dump.close()


def test_dump_into_a_users_folder_keeps_the_users_files(tmp_path):
    """The old dump deleted every `NN_*` file and manifest.json of the step folder."""
    mine = {tmp_path / "notes.txt": "user notes", tmp_path / "decode" / "00_plan.txt": "plan",
            tmp_path / "decode" / "99_results.csv": "a,b", tmp_path / "other" / "x.py": "1"}
    for path, text in mine.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    _dump_steps(tmp_path, ["capture", "pass_a", "pass_b"])
    assert (tmp_path / "decode" / "02_pass_b.py").exists()
    _dump_steps(tmp_path, ["capture"])  # a re-dump replaces what the dump wrote, only
    for path, text in mine.items():
        assert path.read_text() == text
    assert (tmp_path / "decode" / "00_capture.py").exists()
    assert not (tmp_path / "decode" / "02_pass_b.py").exists()  # its own stale entry is gone
    assert (tmp_path / "index.html").exists()


@pytest.mark.parametrize("name", ["index.html", "decode/manifest.json", "decode/00_capture.py",
                                  "certificate.json"])
def test_dump_refuses_to_overwrite_a_file_it_did_not_write(tmp_path, name):
    from dcp_compile.runtime.errors import DCPConfigError
    from dcp_compile.passes.dump import PassDump
    theirs = tmp_path / name
    theirs.parent.mkdir(parents=True, exist_ok=True)
    theirs.write_text("not the dump's")
    if name == "certificate.json":  # written at close() only, when a certificate is known
        dump = PassDump(tmp_path, "decode", source="unit")
        with pytest.raises(DCPConfigError, match="holds a file the dump did not write"):
            dump.close(certificate=_certificate())
    else:
        with pytest.raises(DCPConfigError, match=f"holds a file the dump did not write: "
                                                 f"{theirs}"):
            _dump_steps(tmp_path, ["capture"])
    assert theirs.read_text() == "not the dump's"


def _certificate():
    from dcp_compile import prove
    return prove(2, 16, 16)


def test_a_foreign_ledger_is_refused(tmp_path):
    from dcp_compile.runtime.errors import DCPConfigError
    from dcp_compile.passes.dump import LEDGER
    (tmp_path / "decode").mkdir()
    (tmp_path / "decode" / LEDGER).write_text("{\"not\": \"a list\"}")
    with pytest.raises(DCPConfigError, match="ledger is not one the dump wrote"):
        _dump_steps(tmp_path, ["capture"])


# --- torchrun: the rank that stopped answering is named, not its victims --------------------

@pytest.mark.multiprocess
def test_hung_torchrun_rank_is_named_not_its_victim():
    """Rank 1 sleeps outside any collective; rank 0's all_reduce times out (5 s) and torchrun
    reports rank 0 as the root cause. The launcher must name rank 1 (from the stacks each
    rank dumps when terminated) and call rank 0 its victim."""
    from dcp_compile.runtime.distributed import launch
    with pytest.raises(DCPWorldError) as info:
        launch.run_torchrun(2, "tests.support.fault_worker",
                            ["--hang-rank", "1", "--collective-timeout", "5"],
                            timeout=600, cwd=ROOT)
    err = info.value
    head = str(err).splitlines()[0]
    assert "rank 1 stopped answering (rank 1 at fault_worker.py" in head, head
    assert "in stop_answering, outside any collective" in head, head
    assert "ranks [0] stopped after it (rank 0 timed out in all_reduce)" in head, head
    assert "rank 0 failed" not in head
    assert list(err.failures) == [1, 0]
    assert "[stacks when terminated]" in err.failures[1]


def _dump(*frames):
    """A faulthandler dump of one thread, ``frames`` innermost first as (path, line, func)."""
    body = "".join(f'  File "{p}", line {n} in {f}\n' for p, n, f in frames)
    return "Current thread 0x00007f00 (most recent call first):\n" + body


_RUNPY = [("<frozen runpy>", 88, "_run_code"), ("<frozen runpy>", 198, "_run_module_as_main")]
_TD = "/site-packages/torch/distributed/"
_IN_ALL_REDUCE = _dump((_TD + "distributed_c10d.py", 3252, "all_reduce"),
                       (_TD + "c10d_logger.py", 83, "wrapper"),
                       ("/w/worker.py", 39, "main"), *_RUNPY)
_IN_BARRIER = _dump((_TD + "distributed_c10d.py", 4000, "barrier"),
                    (_TD + "c10d_logger.py", 83, "wrapper"), ("/w/worker.py", 41, "main"), *_RUNPY)
_SLEEPING = ("Thread 0x00007f01 (most recent call first):\n"
             '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
             '  File "/usr/lib/python3.11/threading.py", line 1000 in _bootstrap\n\n'
             + _dump(("/w/worker.py", 24, "stop_answering"), ("/w/worker.py", 38, "main"),
                     *_RUNPY))


def _launch_timeout_error(stacks):
    from dcp_compile.runtime.distributed import launch
    proc = subprocess.CompletedProcess(["python", "-m", "w"], -15, "", "")
    return launch._launch_error(len(stacks), "w", proc, {r: "" for r in stacks}, True, 30.0,
                                stacks)


def test_launch_timeout_names_the_rank_outside_collectives():
    """The launcher's own timeout killed every rank: ranks 0 and 2 in collectives, rank 1 in
    the worker's code (with a helper thread of its own)."""
    err = _launch_timeout_error({0: _IN_ALL_REDUCE, 1: _SLEEPING, 2: _IN_BARRIER})
    head = str(err).splitlines()[0]
    assert ("did not finish in 30.0 s and was killed: rank 1 stopped answering (rank 1 at "
            "worker.py:24 in stop_answering, outside any collective); ranks [0, 2] stopped "
            "after it (rank 0 killed in all_reduce; rank 2 killed in barrier)") in head, head
    assert list(err.failures) == [1, 0, 2] and err.timed_out == [0, 1, 2]


def test_launch_timeout_with_every_rank_in_a_collective_says_so():
    err = _launch_timeout_error({0: _IN_ALL_REDUCE, 1: _IN_BARRIER})
    head = str(err).splitlines()[0]
    assert ("every failing rank was waiting in a collective (rank 0 killed in all_reduce; "
            "rank 1 killed in barrier): the ranks issued different collectives") in head, head
