"""One torchrun world running several disaggregated parts one after the other (the launch of
tests/support/disagg_runs.py): each part is one world's role of dcp_compile/workers/disagg.py (its own
command line), run on the same ranks, in the same gloo world, so that the ranks start
(Python, torch, gloo) once for every part.

    run_torchrun(4, "tests.support.disagg_parts_worker", [json.dumps([PREFILL_ARGV, DECODE_ARGV])])

A part that fails appends its error to its ``--abort-file`` (``disagg.run_role``), so the
other worlds stop waiting for it.
"""

from __future__ import annotations

import json
import sys


def main(argv=None) -> int:
    import torch

    from dcp_compile.runtime.distributed.launch import run_in_world
    from dcp_compile.workers import disagg

    parts = [disagg.parse(a) for a in json.loads((argv or sys.argv[1:])[0])]
    torch.set_num_threads(1)

    def run_parts(rank: int, world: int) -> None:
        for args in parts:
            disagg.run_role(args, rank, world)

    run_in_world(run_parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
