"""One torchrun/gloo world for five launches' worth of claims (tests/e2e/test_torchrun_world.py):
the pages' torchrun blocks, run first and as written (each initialises the world with
``init_distributed_from_env`` and destroys it), then, in one world initialised again, the
collectives self-test (tests/support/selftest_worker.py), the prefill worker, the decode worker
(dcp_compile/workers/prefill.py, decode.py) and the torch.compile backend
(tests/support/backend_worker.py), one after the other, so that every rank starts (torch, gloo)
once instead of five times.

    run_torchrun(4, "tests.support.world_worker", ["--readme", README_BLOCK_PATHS_JSON,
                                           "--selftest", SELFTEST_ARGV_JSON,
                                           "--prefill", PREFILL_ARGV_JSON,
                                           "--decode", DECODE_ARGV_JSON,
                                           "--backend", BACKEND_ARGV_JSON])

Each ``--<part>`` is the JSON list of that worker's own command-line arguments; ``--readme``
the JSON list of the page blocks' script files.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import runpy
import sys
import time
from datetime import timedelta

PARTS = ("selftest", "prefill", "decode", "backend")
TIMEOUT = 120.0     # seconds: every collective of the parts' world (init_distributed_from_env's)


def run_readme_blocks(paths: list[str]) -> None:
    """Run each page block as a script, as written: it initialises the world from
    torchrun's environment and destroys it at its end."""
    import torch
    import torch.distributed as dist

    for path in paths:
        runpy.run_path(path, run_name="__main__")
        if dist.is_initialized():
            raise RuntimeError(f"page block {path} left its process group initialised: it "
                               f"must end with torch.distributed.destroy_process_group().")
        torch._dynamo.reset()   # the parts compile other models: no cache entry carries over
        print(f"readme block {os.path.basename(path)} ok rank={os.environ['RANK']} "
              f"cpu={time.process_time():.1f}s", flush=True)


def init_world_again() -> tuple[int, int]:
    """The default group again, on keys of its own in torchrun's store: a second env://
    init would read the first group's gloo addresses, still in the store."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timedelta(seconds=TIMEOUT))
    dist.init_process_group("gloo", store=dist.PrefixStore("world_worker/", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT))
    return rank, world


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", required=True, help="JSON: the page blocks' script files")
    for part in PARTS:
        ap.add_argument(f"--{part}", required=True, help="JSON: that worker's argv")
    args = ap.parse_args(argv)
    # The collector's young generation less often (launch.GC_THRESHOLDS, not imported: the
    # blocks start in a process where nothing of ours is): a compile allocates ~10^5
    # short-lived objects. It changes when garbage is collected, not what the blocks run.
    gc.set_threshold(10_000, 50, 100)
    run_readme_blocks(json.loads(args.readme))    # first: nothing of ours imported before

    import torch.distributed as dist

    from dcp_compile.runtime.distributed.launch import freeze_gc
    from dcp_compile.workers import decode, prefill
    from tests.support import backend_worker, selftest_worker

    freeze_gc()
    workers = {"selftest": selftest_worker, "prefill": prefill, "decode": decode,
               "backend": backend_worker}
    rank, world = init_world_again()
    try:
        for part in PARTS:
            worker = workers[part]
            worker.run(worker.parse(json.loads(getattr(args, part))), rank, world)
            print(f"world part {part} done rank={rank} cpu={time.process_time():.1f}s",
                  flush=True)   # this rank's CPU so far: where a launch's time goes
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
