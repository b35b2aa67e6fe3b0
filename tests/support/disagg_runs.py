"""Launch the disaggregated worlds of dcp_compile/workers/disagg.py (tests/transfer/test_disagg_e2e.py's
launcher): for every scenario, one prefill world and decode worlds, each a torchrun/gloo
launch of its own size, NIXL over UCX/tcp on 127.0.0.1, all at the same time.

A torchrun world costs its processes' start-up (~3 CPU-s each: Python, torch, gloo) more
than its work, so the scenarios share worlds: one launch of ``tests.support.disagg_parts_worker``
runs, one after the other on the same ranks, a part of each scenario that has a world of
that size (:func:`pack`). A world runs its parts in scenario order, so the first scenario's
parts never wait for a later one's, and each later one starts once its worlds are done with
the earlier ones: no world waits for another in a circle.

The launcher transforms each part's program once (``disagg.build_program``, what a rank
would build) and every rank of the world loads that program file (``--program``)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from dcp_compile.runtime.errors import DCPWorldError
from dcp_compile.runtime.distributed.launch import run_torchrun
from dcp_compile.runtime.distributed.launch import free_port_base
from dcp_compile.workers.disagg import build_program, parse

LAUNCH_TIMEOUT = 900.0      # seconds per torchrun launch (a loaded two-core machine)
WAIT_TIMEOUT = 600.0        # seconds a world waits for the other one


def _loopback_env() -> dict:
    return {"UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"), "UCX_NET_DEVICES": "lo",
            "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"), "OMP_NUM_THREADS": "1"}


def scenario_parts(tmp: Path, *, port: int, abort: Path, model: str, block: int, plan,
                   prefill: tuple[int, int], prefill_id: str, decoders: dict,
                   max_context: int, steps: int, reserve_blocks: int) -> dict:
    """One scenario's parts, ``{"prefill" or decode engine id: (nproc, disagg argv)}``: the
    prefill world ``prefill`` = (tp, dcp) serving on ports ``port``.. and every decode world
    of ``decoders`` (engine id -> (tp, dcp)); outputs in ``tmp/prefill``, ``tmp/<engine>``."""
    handoff = tmp / "handoff.pt"
    batch = len(plan[0])
    common = ["--model", model, "--block-size", block, "--layers", 2, "--handoff", handoff,
              "--abort-file", abort, "--timeout", WAIT_TIMEOUT]
    parts = {"prefill": (prefill[0], [
        "prefill", "--dcp", prefill[1], *common, "--out-dir", tmp / "prefill",
        "--engine-id", prefill_id, "--plan", json.dumps(plan), "--port", port,
        "--decoders", json.dumps([{"engine_id": e, "tp": tp, "dcp": dcp}
                                  for e, (tp, dcp) in decoders.items()])])}
    for e, (tp, dcp) in decoders.items():
        parts[e] = (tp, [
            "decode", "--dcp", dcp, *common, "--out-dir", tmp / e, "--engine-id", e,
            "--prefill-tp", prefill[0], "--prefill-dcp", prefill[1], "--prefill-port", port,
            "--batch", batch, "--max-context", max_context, "--steps", steps,
            "--reserve-blocks", reserve_blocks])
    return {name: (nproc, [str(a) for a in argv]) for name, (nproc, argv) in parts.items()}


def pack(scenarios: dict[str, dict]) -> list[tuple[int, list[tuple[str, str]]]]:
    """Worlds ``(nproc, [(scenario, part), ...])``: each part joins the first world of its
    size that has no part of its scenario yet (parts of one scenario run at the same time),
    else starts a world; a world's parts are in scenario order."""
    worlds: list[tuple[int, list[tuple[str, str]]]] = []
    for name, parts in scenarios.items():
        for part, (nproc, _) in parts.items():
            world = next((w for w in worlds if w[0] == nproc
                          and all(s != name for s, _ in w[1])), None)
            if world is None:
                worlds.append(world := (nproc, []))
            world[1].append((name, part))
    return worlds


def launch_worlds(tmp: Path, scenarios: dict[str, dict]) -> dict:
    """Run every scenario (name -> :func:`scenario_parts`' keywords but ``port`` and
    ``abort``) in shared worlds; scenario ``name``'s outputs land in ``tmp/name``. A failing
    world makes the others give up (the abort file) and fails the test with every failing
    world's output; a NIXL wheel that does not import skips it."""
    try:
        from dcp_compile.runtime.transfer.nixl.build import nixl_api
        nixl_api()
    except Exception as e:  # the wheel raises ImportError, or RuntimeError without a backend
        pytest.skip(f"import nixl failed: {type(e).__name__}: {e}")
    abort = tmp / "abort.txt"
    port = free_port_base(sum(s["prefill"][0] for s in scenarios.values()))
    parts = {}
    for name, kwargs in scenarios.items():
        parts[name] = scenario_parts(tmp / name, port=port, abort=abort, **kwargs)
        port += kwargs["prefill"][0]
        for part, (nproc, argv) in parts[name].items():
            program = tmp / name / f"{part}.dcp"
            program.parent.mkdir(parents=True, exist_ok=True)
            argv += ["--program", str(program)]
            build_program(parse(argv), tp=nproc).save(program)
    errors: dict[str, DCPWorldError] = {}
    outputs: dict[str, str] = {}

    def launch(label, nproc, part_argvs):
        try:
            outputs[label] = run_torchrun(nproc, "tests.support.disagg_parts_worker",
                                          [json.dumps(part_argvs)], timeout=LAUNCH_TIMEOUT,
                                          env=_loopback_env()).stdout
        except DCPWorldError as e:
            errors[label] = e
            with open(abort, "a") as f:  # the other worlds stop waiting for this one
                f.write(f"{label} world failed: {str(e)[:2000]}\n")

    threads = []
    for nproc, members in pack(parts):
        label = " + ".join(f"{s}/{p}" for s, p in members)
        threads.append(threading.Thread(
            target=launch, args=(label, nproc, [parts[s][p][1] for s, p in members]),
            daemon=True))
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
