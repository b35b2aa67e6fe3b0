"""A supervised disaggregated pair: a prefill world and a decode world, KV over NIXL on loopback.

    python -m dcp_compile.workers.supervise_pair --prefill-nproc 2 --prefill-dcp 2 \\
        --decode-nproc 2 --decode-dcp 1 --steps 8 --out out.json [--fault ROLE:RANK:STEP:KIND]

Each attempt launches both worlds (``dcp_compile.workers.resumable_pair``, one process per
rank with torchrun's environment, each world on its own master port; the side channels on
127.0.0.1 only). The prefill world computes every unfinished request's KV from its prompt plus
the tokens it already generated and serves it; the decode world reads it and decodes, its
rank 0 streaming each step's tokens (``--mode decode`` of dcp_compile.workers.supervise does the
same for one world). An attempt is lost when

* a decode rank dies: the supervisor writes the attempt's abort file, kills the decode
  world, and waits (``--release-timeout``) for the prefill world to release every lease it
  still holds and report it (``leases/rank<r>.json``): the fault records each prefill rank's
  lease outcomes and ``leaked`` (leases or blocks still held; empty: none);
* a prefill rank dies: the supervisor waits (``--transfer-timeout`` plus a margin) for the
  decode side to fail by itself, and records ``decode_error`` (its DCPTransferError, which
  names the prefill rank) and ``decode_failed_s`` (from the fault to that rank's exit);
* a prefill rank hangs (stopped: process state T): the decode side's handshake or READ
  on it times out (``--transfer-timeout``) and fails naming it; recorded as above;
* no decode step within ``--step-timeout`` (``--startup-timeout`` before the first): a
  decode rank that hangs; the reason names the ranks found stopped.

Then what is left of both worlds is killed and a new pair on new ports resumes every
unfinished request: greedy decoding gives the uninterrupted run's tokens. OUT.json:
``tokens``, ``restarts``, ``requests``, ``faults`` (per lost attempt: ``side``, reason,
step reached, ``detect_s``, ``resume_s``, ``recomputed`` and the side's records above) and
``elapsed_s``. ``--fault ROLE:RANK:STEP:KIND`` (repeat: one per attempt, ``none`` skips one):
the fault of ``resumable_pair`` (STEP -1: during the transfer) in world ROLE. Both worlds
need the side channel's key in the environment (``DCP_KV_KEY`` or ``DCP_KV_KEY_FILE``,
docs/transfer.md); without one the supervisor refuses to start.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dcp_compile.runtime.errors import DCPInputError, DCPWorldError
from dcp_compile.runtime.names import Mode
from dcp_compile.workers.resumable import Fault
from dcp_compile.workers.resumable_pair import DURING_TRANSFER
from dcp_compile.workers.supervise import (POLL_S, Request, World, kill, proc_state,
                                           read_progress, refuse_own_errors,
                                           supervision_result, tail)

BLOCK = 8   # block size = interleave size of both programs (the transfer plan needs it)
# Seconds past --transfer-timeout the supervisor gives the decode side to fail by itself.
FAIL_MARGIN_S = 60.0


@dataclass(frozen=True)
class PairFault:
    role: str
    fault: Fault

    @classmethod
    def parse_or_none(cls, text: str) -> "PairFault | None":
        if text == "none":
            return None
        role, _, rest = text.partition(":")
        if role not in (Mode.PREFILL, Mode.DECODE):
            raise DCPInputError(f"--fault must read ROLE:RANK:STEP:KIND with ROLE prefill or "
                                f"decode: --fault {text!r}. E.g. --fault decode:1:-1:kill.")
        fault = Fault.parse(rest)
        if role == Mode.PREFILL and fault.step != DURING_TRANSFER:
            raise DCPInputError(f"a prefill fault fires while the prefill world serves its KV "
                                f"(STEP {DURING_TRANSFER}), the only time it runs: --fault "
                                f"{text!r}. Use --fault prefill:{fault.rank}:"
                                f"{DURING_TRANSFER}:{fault.kind}.")
        return cls(role, fault)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill-nproc", type=int, default=2)
    ap.add_argument("--prefill-dcp", type=int, default=2)
    ap.add_argument("--decode-nproc", type=int, default=2)
    ap.add_argument("--decode-dcp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="1,31,33,32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("--step-timeout", type=float, default=30.0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--transfer-timeout", type=float, default=20.0,
                    help="the decode side's handshake and transfer bound (seconds)")
    ap.add_argument("--release-timeout", type=float, default=60.0,
                    help="seconds the prefill world may take to release its leases after "
                    "the decode world is lost")
    ap.add_argument("--collective-timeout", type=float, default=120.0)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--fault", action="append", default=[], type=PairFault.parse_or_none,
                    help="ROLE:RANK:STEP:KIND injected into the n-th attempt; for tests")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="dcp-supervise-pair-") as tmp:
        out = supervise_pair(args, Path(args.work_dir or tmp))
    Path(args.out).write_text(json.dumps(out))
    print(f"supervise_pair: {len(out['tokens'])} requests finished, {out['restarts']} "
          f"restarts", flush=True)
    return 0


def programs(args, work: Path) -> dict[str, str]:
    """The demo model's prefill program (prompt chunks of the longest prompt, caches for
    the longest prompt + steps) and decode program (caches as long), as files."""
    import dcp_compile
    from dcp_compile.models.demo import demo_model
    from dcp_compile.runtime.serving.engine import StepShapes
    from dcp_compile.workers.decode import lengths_of
    from dcp_compile.workers.disagg import decode_shapes
    lengths = lengths_of(args)
    longest = max(lengths) + args.steps
    shapes = {Mode.PREFILL: StepShapes.fitting(len(lengths), max(lengths), longest,
                                               block_size=BLOCK, dcp=args.prefill_dcp),
              Mode.DECODE: decode_shapes(len(lengths), longest, args.decode_dcp, BLOCK)}
    layout = {Mode.PREFILL: (args.prefill_nproc, args.prefill_dcp),
              Mode.DECODE: (args.decode_nproc, args.decode_dcp)}
    files = {}
    for mode, (tp, dcp) in layout.items():
        program = dcp_compile.transform(demo_model(), tp=tp, dcp=dcp, mode=mode,
                                        block_size=BLOCK, shapes=shapes[mode], check=False)
        files[mode] = str(work / f"{mode}.dcp")
        program.save(files[mode])
    return files


def supervise_pair(args, work: Path) -> dict:
    from dcp_compile.workers.decode import lengths_of, prompt_tokens
    from dcp_compile.runtime.transfer.nixl.auth import load_key
    # Refused before anything is built or launched: both worlds need the side channel's key
    # (docs/transfer.md: The side channel's key), which their ranks inherit from here.
    load_key(who="the supervised pair")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    files = programs(args, work)
    requests = [Request(str(i), p) for i, p in
                enumerate(prompt_tokens(lengths_of(args), args.seed))]
    faults: list[dict] = []
    attempt = 0
    while True:
        pair = launch_pair(args, work, attempt, files, requests)
        try:
            lost = watch_pair(args, pair, requests, faults)
        except BaseException:
            for w in pair.values():
                kill(w)
            raise
        if lost is None:
            break
        faults.append(lost)
        if all(len(r.generated) >= args.steps for r in requests):
            break
        if attempt >= args.max_restarts:
            raise DCPWorldError(
                f"the supervised pair was lost {len(faults)} times (--max-restarts "
                f"{args.max_restarts}): last {lost['reason']}. --work-dir keeps every "
                f"attempt's logs; raise --max-restarts or fix the cause.",
                failures=lost.pop("logs"))
        attempt += 1
    return supervision_result(requests, faults, attempt, t0)


def launch_pair(args, work: Path, attempt: int, files: dict[str, str],
                requests: list[Request]) -> dict[str, World]:
    """Write the attempt's state and start both worlds (prefill first: it serves)."""
    from dcp_compile.runtime.distributed.launch import free_port, free_port_base, loopback_env
    from dcp_compile.workers.supervise import rank_env
    here = work / f"pair{attempt}"
    here.mkdir()
    state = here / "state.json"
    state.write_text(json.dumps({"steps": args.steps, "requests": [
        {"id": r.id, "prompt": r.prompt, "generated": r.generated} for r in requests]}))
    progress = here / "progress.jsonl"
    progress.touch()
    side_port = free_port_base(args.prefill_nproc)
    layout = {Mode.PREFILL: (args.prefill_nproc, (args.decode_nproc, args.decode_dcp)),
              Mode.DECODE: (args.decode_nproc, (args.prefill_nproc, args.prefill_dcp))}
    fault = args.fault[attempt] if attempt < len(args.fault) else None
    pair = {}
    for role, (nproc, (other_tp, other_dcp)) in layout.items():
        cmd = [sys.executable, "-m", "dcp_compile.workers.resumable_pair", str(role),
               "--state", str(state), "--program", files[role], "--dir", str(here),
               "--port", str(side_port), "--other-tp", str(other_tp),
               "--other-dcp", str(other_dcp), "--transfer-timeout", str(args.transfer_timeout),
               "--collective-timeout", str(args.collective_timeout)]
        if fault is not None and fault.role == role:
            cmd += ["--fault", str(fault.fault)]
        port = free_port()
        procs = {}
        for rank in range(nproc):
            log = open(here / f"{role}{rank}.log", "w")  # noqa: SIM115 - the child holds it
            procs[rank] = subprocess.Popen(
                cmd, env=loopback_env(rank_env(rank, nproc, port)), stdout=log,
                stderr=subprocess.STDOUT)
            log.close()
        # a World's progress file names its logs' directory; only the decode world steps
        pair[role] = World(procs, progress, time.monotonic())
    return pair


def _codes(world: World) -> dict[int, int | None]:
    return {r: p.poll() for r, p in world.procs.items()}


def _dead(codes: dict) -> dict[int, int]:
    return {r: c for r, c in codes.items() if c is not None and c < 0}


def watch_pair(args, pair: dict[str, World], requests: list[Request],
               faults: list[dict]) -> dict | None:
    """Follow the pair until it finishes (None) or is lost (what was lost, and why)."""
    pre, dec = pair[Mode.PREFILL], pair[Mode.DECODE]
    while True:
        if read_progress(dec, requests) and faults and "resume_s" not in faults[-1]:
            faults[-1]["resume_s"] = dec.first_step_at - faults[-1].pop("detected_at")
        codes = {role: _codes(w) for role, w in pair.items()}
        now = time.monotonic()
        if all(c == 0 for cs in codes.values() for c in cs.values()):
            read_progress(dec, requests)
            short = [r.id for r in requests if len(r.generated) < args.steps]
            if short:
                raise DCPWorldError(f"the pair finished but requests {short} hold fewer than "
                                    f"{args.steps} tokens ({dec.progress}).")
            return None
        for role in (Mode.DECODE, Mode.PREFILL):
            dead = _dead(codes[role])
            if dead:
                reason = "; ".join(f"{role} rank {r} was killed by "
                                   f"{signal.Signals(-c).name}" for r, c in dead.items())
                return (lose_decode if role == Mode.DECODE else lose_prefill)(
                    args, pair, requests, reason, now)
        hung = _stopped(pre)
        if hung and any(c not in (None, 0) for c in codes[Mode.DECODE].values()):
            # A stopped prefill rank: the decode side's handshake/READ timed out on it and
            # failed by itself (its error names the rank); not an error of its own.
            return lose_prefill(args, pair, requests, "; ".join(
                f"{Mode.PREFILL} rank {r} stopped (process state T)" for r in hung), now)
        for role, w in pair.items():
            failed = {r: c for r, c in codes[role].items() if c not in (None, 0)}
            if failed:
                for other in pair.values():
                    if other is not w:
                        kill(other)
                refuse_own_errors(w, failed, str(role))    # raises: no rank was lost
                return finish_loss(pair, requests, f"{role} ranks {sorted(failed)} exited "
                                   f"with codes {failed}", now, args.steps, role)
        last = dec.last_step_at
        if last is None and now - pre.started > args.startup_timeout:
            side, which = _hung_side(pair)
            return finish_loss(pair, requests, f"no decode step within --startup-timeout "
                               f"{args.startup_timeout} s of the launch{which}", now,
                               args.steps, side)
        if last is not None and now - last > args.step_timeout:
            side, which = _hung_side(pair)
            return finish_loss(pair, requests, f"no decode step finished for --step-timeout "
                               f"{args.step_timeout} s{which}", now, args.steps, side)
        time.sleep(POLL_S)


def _stopped(world: World) -> list[int]:
    """Ranks of ``world`` in process state T (stopped: a hang)."""
    return [r for r, p in world.procs.items() if p.poll() is None and proc_state(p.pid) == "T"]


def _hung_side(pair: dict[str, World]) -> tuple[str | None, str]:
    """The world whose ranks are stopped, and their names for a timeout's reason."""
    for role in (Mode.DECODE, Mode.PREFILL):
        ranks = _stopped(pair[role])
        if ranks:
            return role, ": " + "; ".join(f"{role} rank {r} stopped (process state T)"
                                          for r in ranks)
    return None, ""


def _wait_exit(world: World, seconds: float) -> dict[int, int | None]:
    """Codes of ``world``'s ranks once all exited, or after ``seconds`` (None: running)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in world.procs.values()):
        time.sleep(POLL_S)
    return _codes(world)


def lose_decode(args, pair, requests, reason, detected) -> dict:
    """A decode rank died: abort, then the prefill world must release every lease it holds
    (each rank reports it) within --release-timeout."""
    pre, dec = pair[Mode.PREFILL], pair[Mode.DECODE]
    here = dec.progress.parent
    (here / "abort").write_text(reason)
    kill(dec)
    t = time.monotonic()
    codes = _wait_exit(pre, args.release_timeout)
    release_s = time.monotonic() - t
    reports = {}
    for r in pre.procs:
        path = here / "leases" / f"rank{r}.json"
        reports[r] = json.loads(path.read_text()) if path.exists() else None
    leaked = {r: "no lease report (did not release within --release-timeout or failed: "
                 f"exit {codes[r]})" if rep is None else
                 {"held": rep["held"], "held_blocks": rep["held_blocks"]}
              for r, rep in reports.items()
              if rep is None or rep["held"] or rep["held_blocks"]}
    fault = finish_loss(pair, requests, reason, detected, args.steps, Mode.DECODE)
    fault.update({"leases": {str(r): rep and rep["outcomes"] for r, rep in reports.items()},
                  "leaked": {str(r): v for r, v in leaked.items()},
                  "release_s": release_s})
    return fault


TRANSFER_ERROR = re.compile(r"DCPTransferError: (.*)")


def lose_prefill(args, pair, requests, reason, detected) -> dict:
    """A prefill rank died: the decode side must fail by itself, naming it, within its
    transfer timeout (plus FAIL_MARGIN_S); then abort (the prefill survivors release)."""
    pre, dec = pair[Mode.PREFILL], pair[Mode.DECODE]
    here = dec.progress.parent
    deadline = time.monotonic() + args.transfer_timeout + FAIL_MARGIN_S
    failed_at, failed = None, {}
    while time.monotonic() < deadline:
        codes = _codes(dec)
        failed = {r: c for r, c in codes.items() if c not in (None, 0)}
        if failed or all(c == 0 for c in codes.values()):
            failed_at = time.time()
            break
        time.sleep(POLL_S)
    errors = {}
    for r in failed:
        found = TRANSFER_ERROR.findall((here / f"{Mode.DECODE}{r}.log").read_text(
            errors="replace"))
        errors[str(r)] = found[-1] if found else None
    (here / "abort").write_text(reason)
    fault_at = _fault_time(here, Mode.PREFILL)
    fault = finish_loss(pair, requests, reason, detected, args.steps, Mode.PREFILL)
    fault.update({"decode_error": errors,
                  "decode_failed_s": None if failed_at is None or fault_at is None
                  else failed_at - fault_at})
    return fault


def _fault_time(here: Path, role) -> float | None:
    path = here / f"{role}.fault"
    return json.loads(path.read_text())["time"] if path.exists() else None


def finish_loss(pair, requests, reason, detected, steps, side) -> dict:
    """Kill what is left of the pair and record the loss (as supervise.lose)."""
    dec = pair[Mode.DECODE]
    here = dec.progress.parent
    for w in pair.values():
        kill(w)
    read_progress(dec, requests)
    for r in requests:
        r.stops.append({"reason": reason, "generated": len(r.generated)})
    fault_at = _fault_time(here, side) if side else None
    logs = {f"{role} {r}": tail((here / f"{role}{r}.log").read_text(errors="replace"))
            for role, w in pair.items() for r in w.procs}
    return {"side": None if side is None else str(side), "reason": reason,
            "step": max(len(r.generated) for r in requests),
            "detect_s": None if fault_at is None
            else time.time() - fault_at - (time.monotonic() - detected),
            "detected_at": detected,
            "recomputed": sum(len(r.generated) for r in requests if len(r.generated) < steps),
            "logs": logs}


if __name__ == "__main__":
    raise SystemExit(main())
