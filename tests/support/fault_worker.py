"""A torchrun worker on which one rank stops answering (run by tests/e2e/test_faults.py).

Every rank starts, meets the others in a barrier (so what follows is not start-up time) and
creates a group whose collectives time out after ``--collective-timeout`` seconds. Then rank
``--hang-rank`` sleeps forever outside any collective, and the others all_reduce on the group:
they time out (or the launcher's own timeout kills them all). The launcher must name the
sleeping rank, not the ranks that gave up waiting for it.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dcp_compile.runtime.distributed.launch import freeze_gc, init_distributed_from_env


def stop_answering() -> None:
    while True:
        time.sleep(1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hang-rank", type=int, required=True)
    ap.add_argument("--collective-timeout", type=float, required=True)
    args = ap.parse_args()
    rank, world_size = init_distributed_from_env(timeout=600)
    freeze_gc()
    dist.barrier()
    group = dist.new_group(list(range(world_size)),
                           timeout=timedelta(seconds=args.collective_timeout))
    print(f"rank {rank} ready", flush=True)
    if rank == args.hang_rank:
        stop_answering()
    dist.all_reduce(torch.ones(1), group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
