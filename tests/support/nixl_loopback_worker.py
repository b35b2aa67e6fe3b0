"""One engine process of tests/support/nixl_runs.py running several loopback scenarios one after the
other (``tests.support.nixl_loopback``'s ``main`` per scenario), so that the process
starts (Python, torch, NIXL) once for all of them:

    python3 -m tests.support.nixl_loopback_worker ROLE SPEC_1 RESULT_1 [SPEC_2 RESULT_2 ...]

Every engine process runs the scenarios in the same order, and a scenario's prefill side
serves until its decode side has written its result (the spec's ``stop_file``), so a
scenario never waits for a later one.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from dcp_compile.runtime.distributed.launch import freeze_gc
    from tests.support import nixl_loopback as loopback

    role, *paths = argv or sys.argv[1:]
    freeze_gc()
    for spec, result in zip(paths[0::2], paths[1::2], strict=True):
        loopback.main([role, spec, result])
    return 0


if __name__ == "__main__":
    sys.exit(main())
