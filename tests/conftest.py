"""Suite-wide settings: one intra-op thread per process, and the long tests first.

The README's test command runs the suite on pytest-xdist workers (``-n auto --dist
worksteal``: one worker per core). Two choices keep the cores busy with real work:

* one torch intra-op thread per process (and ``OMP_NUM_THREADS=1`` for the processes the
  tests launch): every tensor here is tiny, so a second intra-op thread only spins (the fuzz
  measured half the CPU per model with one thread), stealing the core of the other worker;
* the long tests (real multi-process launches, the fuzz shards) at the front of the
  collection: worksteal hands each worker a contiguous half and idle workers steal from the
  back of a queue, so a long test never starts last and leaves the other core idle.

Neither changes what a test checks; without ``-n`` (or with ``-n 0``) everything runs in
one process, in this order.
"""

from __future__ import annotations

import os

import pytest
import torch

LONG_FIRST_MODULES = ("test_fuzz_sharding.py",)


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def _long(item) -> bool:
    return item.get_closest_marker("multiprocess") is not None or \
        item.path.name in LONG_FIRST_MODULES


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not _long(item))       # stable: the rest keep their order
