"""One torchrun/gloo world for four launches' worth of claims (tests/test_torchrun_world.py):
the collectives self-test (tests/selftest_worker.py), the prefill worker, the decode worker
(dcp_compile/workers/prefill.py, decode.py) and the torch.compile backend
(tests/backend_worker.py), one after the other in the same initialised world, so that
every rank starts (torch, gloo) once instead of four times.

    run_torchrun(4, "tests.world_worker", ["--selftest", SELFTEST_ARGV_JSON,
                                           "--prefill", PREFILL_ARGV_JSON,
                                           "--decode", DECODE_ARGV_JSON,
                                           "--backend", BACKEND_ARGV_JSON])

Each ``--<part>`` is the JSON list of that worker's own command-line arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

PARTS = ("selftest", "prefill", "decode", "backend")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for part in PARTS:
        ap.add_argument(f"--{part}", required=True, help="JSON: that worker's argv")
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from dcp_compile.runtime.launch import init_distributed_from_env
    from dcp_compile.workers import decode, prefill
    from tests import backend_worker, selftest_worker

    workers = {"selftest": selftest_worker, "prefill": prefill, "decode": decode,
               "backend": backend_worker}
    rank, world = init_distributed_from_env()
    try:
        for part in PARTS:
            worker = workers[part]
            worker.run(worker.parse(json.loads(getattr(args, part))), rank, world)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
