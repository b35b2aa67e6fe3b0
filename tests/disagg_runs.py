"""Launch the disaggregated worlds of dcp_compile/workers/disagg.py at the same time (the two
disaggregated end-to-end tests' one launcher): one prefill world and decode worlds, each a
torchrun/gloo launch with its own master port, NIXL over UCX/tcp on 127.0.0.1. By default the
launcher transforms each world's program once (``disagg.build_program``, what a rank would
build) and every rank of the world loads that program file (``--program``)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from dcp_compile.runtime.errors import DCPWorldError
from dcp_compile.runtime.launch import run_torchrun
from dcp_compile.runtime.nixl.loopback import free_port_base
from dcp_compile.workers.disagg import build_program, parse

LAUNCH_TIMEOUT = 900.0      # seconds per torchrun launch (a loaded two-core machine)
WAIT_TIMEOUT = 600.0        # seconds a world waits for the other one


def _loopback_env() -> dict:
    return {"UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"), "UCX_NET_DEVICES": "lo",
            "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"), "OMP_NUM_THREADS": "1"}


def launch_worlds(tmp: Path, *, model: str, block: int, plan, prefill: tuple[int, int],
                  prefill_id: str, decoders: dict, max_context: int, steps: int,
                  reserve_blocks: int, program_files: bool = True) -> dict:
    """Run the prefill world ``prefill`` = (tp, dcp) and every decode world of ``decoders``
    (engine id -> (tp, dcp)) at once; outputs land in ``tmp/prefill`` and ``tmp/<engine>``.
    ``program_files``: each world loads the program the launcher wrote, else every rank
    transforms the model itself.
    A failing world makes the others give up (the abort file) and fails the test with
    every failing world's output; a NIXL wheel that does not import skips it."""
    try:
        from dcp_compile.runtime.nixl.build import nixl_api
        nixl_api()
    except Exception as e:  # the wheel raises ImportError, or RuntimeError without a backend
        pytest.skip(f"import nixl failed: {type(e).__name__}: {e}")
    port = free_port_base(prefill[0])
    handoff, abort = tmp / "handoff.pt", tmp / "abort.txt"
    batch = len(plan[0])
    common = ["--model", model, "--block-size", block, "--layers", 2, "--handoff", handoff,
              "--abort-file", abort, "--timeout", WAIT_TIMEOUT]
    launches = {"prefill": (prefill[0], [
        "prefill", "--dcp", prefill[1], *common, "--out-dir", tmp / "prefill",
        "--engine-id", prefill_id, "--plan", json.dumps(plan), "--port", port,
        "--decoders", json.dumps([{"engine_id": e, "tp": tp, "dcp": dcp}
                                  for e, (tp, dcp) in decoders.items()])])}
    for e, (tp, dcp) in decoders.items():
        launches[e] = (tp, [
            "decode", "--dcp", dcp, *common, "--out-dir", tmp / e, "--engine-id", e,
            "--prefill-tp", prefill[0], "--prefill-dcp", prefill[1], "--prefill-port", port,
            "--batch", batch, "--max-context", max_context, "--steps", steps,
            "--reserve-blocks", reserve_blocks])
    if program_files:
        for name, (nproc, args) in launches.items():
            program = tmp / f"{name}.dcp"
            args += ["--program", program]
            build_program(parse([str(a) for a in args]), tp=nproc).save(program)
    errors: dict[str, DCPWorldError] = {}
    outputs: dict[str, str] = {}

    def launch(name, nproc, args):
        try:
            outputs[name] = run_torchrun(nproc, "dcp_compile.workers.disagg",
                                         [str(a) for a in args], timeout=LAUNCH_TIMEOUT,
                                         env=_loopback_env()).stdout
        except DCPWorldError as e:
            errors[name] = e
            with open(abort, "a") as f:  # the other worlds stop waiting for this one
                f.write(f"{name} world failed: {str(e)[:2000]}\n")

    threads = [threading.Thread(target=launch, args=(name, *spec), daemon=True)
               for name, spec in launches.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LAUNCH_TIMEOUT + 60)
    if errors:
        # A world that failed first makes the others give up ("the other world failed"):
        # report every failing world, each with the output of its failing ranks.
        pytest.fail("\n\n".join(f"=== {name} world ===\n{err}" for name, err in errors.items()),
                    pytrace=False)
    return {"tmp": tmp, "outputs": outputs}
