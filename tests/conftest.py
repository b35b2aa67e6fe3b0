"""Suite-wide settings: the import path, one intra-op thread per process, and the long tests first.

The tests live in rooms by job (passes/, runtime/, frontends/, lowering/, transfer/, e2e/,
corpora/, repository/) and the modules they share in support/. Test modules and helpers
import each other by plain module name (``from helpers import ...``, ``from test_moe import
MATRIX``), so this conftest puts tests/support and every room on sys.path
(support/suite_path.py, the one definition; the child scripts some tests start call it too).
Plain names rather than packages with ``__init__.py``: several tests re-run their own file as
a child script (``python tests/runtime/test_buckets.py ...``) and the workers run by path or
with ``-m tests.support.X``; a module that imports by plain name runs the same way in each.
The price is that two modules of tests/ must never share a basename (pytest would import the
second under the first's name, or stop with "import file mismatch"), so collection refuses
a duplicate, naming both paths.

The README's test command runs the suite on pytest-xdist workers (``-n auto --dist
worksteal``: one worker per core). Two choices keep the cores busy with real work:

* one torch intra-op thread per process (and ``OMP_NUM_THREADS=1`` for the processes the
  tests launch): every tensor here is tiny, so a second intra-op thread only spins (the fuzz
  measured half the CPU per model with one thread), stealing the core of the other worker;
* the cyclic garbage collector skips what the collection built: every worker freezes the
  objects alive once its tests are collected (torch, transformers, sympy... never rescanned)
  and collects the young generation less often. A test allocates ~10^5 short-lived objects
  (export's fake tensors, nodes, stack summaries) and each full collection rescanned every
  import: ~8% of the fuzz's CPU, ~10% of test_mla's and test_ordinary_models'. Garbage is
  still collected;
* the long tests (real multi-process launches, the fuzz shards) at the front of each
  worker's first queue: worksteal hands each worker a contiguous share of the collection
  and idle workers steal from the back of a queue, so a long test never starts last while
  the other core idles.

Neither changes what a test checks; without ``-n`` (or with ``-n 0``) everything runs in
one process, in this order.

``DCP_TEST_CPU=path`` writes each test's CPU seconds (its process plus the children it waited
for: torchrun launches) as tab-separated lines, one file per xdist worker (``path.gw0``...):
on a shared machine wall-clock durations measure the load, CPU seconds measure the test.
"""

from __future__ import annotations

import gc
import os
import resource
import secrets
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
import suite_path  # noqa: E402

suite_path.install()

LONG_MODULES = ("test_fuzz_sharding.py",)     # besides every test marked multiprocess
LONG_TESTS = ("test_lowering_interpreter.py::test_lowered_programs_on_interpreter_replicas_"
              "match_the_single_device_model",)   # five interpreter worlds, one child


def pytest_configure(config):
    try:
        suite_path.refuse_duplicate_basenames()
    except suite_path.DuplicateTestModule as e:
        raise pytest.UsageError(str(e)) from e     # before collection, no traceback
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The KV side channel's key (runtime/transfer/nixl/auth.py): one per session, shared by
    # every engine the tests start, in this process and the worlds it launches; the tests of
    # a missing key unset it.
    os.environ.setdefault("DCP_KV_KEY", secrets.token_hex(32))
    torch.set_num_threads(1)


def pytest_collection_finish(session):
    from dcp_compile.runtime.distributed.launch import GC_THRESHOLDS   # the workers' thresholds too
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _long(item) -> bool:
    return (item.path.name in LONG_MODULES or item.nodeid.split("/")[-1] in LONG_TESTS
            or item.get_closest_marker("multiprocess") is not None)


def _launch(item) -> str:
    """The long tests that one launch serves: a multiprocess module's tests share its worlds
    (a module-scoped fixture: the disaggregated worlds, the NIXL engines), so they stay on
    one worker, which launches them once; each fuzz shard is a launch of its own. The vLLM
    modules are one launch: two vLLM engines at once (each binding its workers to cores 0
    and 1, each picking free ports) never run side by side, one after the other instead."""
    if item.path.name.startswith("test_vllm_"):
        return "vllm"
    return item.nodeid if item.path.name in LONG_MODULES else item.path.name


@pytest.hookimpl(trylast=True)   # after -m/-k deselection: order the items that run
def pytest_collection_modifyitems(config, items):
    """Order the items as n queues laid end to end, n = the number of xdist workers, each
    the size of worksteal's first split (contiguous, len // workers left each): queue i
    starts with every n-th launch's long tests (the fuzz first; a launch that does not fit,
    placed largest first, goes to the queue with the most room), then its share of the
    rest. So every worker starts with long tests, and no launch's tests are split between
    two workers (each would launch the worlds). Every worker computes the same order from
    the same collection."""
    n = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    long = sorted((i for i in items if _long(i)), key=lambda i: i.path.name not in LONG_MODULES)
    launches: dict[str, list] = {}
    for item in long:
        launches.setdefault(_launch(item), []).append(item)
    room, left = [], len(items)
    for q in range(n):
        room.append(left // (n - q))
        left -= room[-1]
    order = list(launches.values())
    queue_of = {}
    for k in sorted(range(len(order)), key=lambda k: -len(order[k])):   # largest first
        q = k % n                       # every n-th launch; elsewhere if it does not fit
        if room[q] < len(order[k]):
            q = max(range(n), key=lambda q: room[q])
        queue_of[k] = q
        room[q] -= len(order[k])
    rest = [i for i in items if not _long(i)]
    queues = []
    for q in range(n):
        take = max(room[q], 0)
        queues.append([i for k in range(len(order)) if queue_of[k] == q for i in order[k]]
                      + rest[:take])
        rest = rest[take:]
    queues[-1] += rest
    items[:] = [item for queue in queues for item in queue]


def _cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("DCP_TEST_CPU")
    if not path:
        yield
        return
    start = _cpu_seconds()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    with open(f"{path}.{worker}" if worker else path, "a") as f:
        f.write(f"{_cpu_seconds() - start:.2f}\t{item.nodeid}\n")
