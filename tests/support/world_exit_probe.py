"""Create and tear down threaded worlds, with failures and hangs, then exit at once.

Run by tests/e2e/test_faults.py in a subprocess: ``python3 tests/support/world_exit_probe.py REPEAT LAST``
runs every scenario REPEAT times, then scenario LAST, prints the rank threads still alive
right after it, and exits at once. A rank thread left in a C++ wait (torch's store barrier
retries every 10 s) that wakes while the interpreter shuts down is killed inside C++ and
aborts the process ("terminate called without an active exception", exit 134): so no rank
thread may be alive once a world has returned, except one stuck in Python (reported).
"""

from __future__ import annotations

import sys
import threading

import torch

from dcp_compile.runtime.errors import DCPWorldError
from dcp_compile.runtime.topology import topology
from dcp_compile.runtime.distributed.world import bind_roles, leaked_ranks, run_threaded

F = torch.ops._c10d_functional
TOPO = topology(4, 2, "prefill")
_release = threading.Event()


def _all_reduce(rank):
    return F.wait_tensor(F.all_reduce(torch.ones(1), "sum", "0")).item()


def _fail_before_bind(rank):
    if rank == 1:
        raise ValueError("failed before binding")
    bind_roles(TOPO, rank)  # the others wait in new_group's store barrier


def _raise_in_collective(rank):
    if rank == 2:
        raise ValueError("boom")
    return _all_reduce(rank)


def _mismatched(rank):
    if rank != 0:
        _all_reduce(rank)  # rank 0 never joins


def _hang_outside_collectives(rank):
    if rank == 1:
        _release.wait(1.0)  # stuck in Python past the timeout and the stop grace
        return None
    return _all_reduce(rank)


# name -> (function, timeout)
SCENARIOS = {
    "ok": (lambda rank: [bind_roles(TOPO, rank), _all_reduce(rank)][1], 60.0),
    "fail-before-bind": (_fail_before_bind, 0.5),
    "raise-in-collective": (_raise_in_collective, 60.0),
    "mismatched-collectives": (_mismatched, 0.3),
    "hang-outside-collectives": (_hang_outside_collectives, 0.2),
}


def run(name: str) -> None:
    fn, timeout = SCENARIOS[name]
    try:
        run_threaded(4, fn, timeout=timeout)
    except DCPWorldError:
        if name == "ok":
            raise


def main(argv: list[str]) -> int:
    repeat, last = int(argv[0]), argv[1]
    for _ in range(repeat):
        for name in SCENARIOS:
            run(name)
    run(last)
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("dcp-rank-"))
    leaked = sorted(f"dcp-rank-{r}" for _, r in leaked_ranks())
    print(f"probe done: {repeat} x {len(SCENARIOS)} worlds, then {last}", flush=True)
    print(f"rank threads alive: {alive}; reported as leaked: {leaked}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
