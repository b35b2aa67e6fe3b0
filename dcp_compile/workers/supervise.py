"""A supervised world: a rank lost mid-generation costs a relaunch, not the requests.

    python -m dcp_compile.workers.supervise --nproc 4 --dcp 2 --steps 16 --out out.json \\
        [--mode decode|prefill] [--pids pids.json] [--program FILE] [--checkpoint DIR]

``--mode decode`` (the default) runs a decode-mode program (a context step, then decode
steps); ``--mode prefill`` a prefill-mode one (sequence-parallel prefill steps: the prompt,
then one step of one token per sequence per generated token).

The supervisor launches the world itself, one process per rank with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on loopback; each rank runs
dcp_compile.workers.resumable), so it sees every rank's exit. Rank 0 streams each step's
tokens to a progress file as the step finishes; the supervisor reads it as it grows and keeps,
per request, its id, prompt and the tokens generated so far. The world is lost when

* a rank exits without finishing (killed, or raised because a peer vanished under its
  collective), or
* no step finishes within ``--step-timeout`` seconds once the world is stepping (a hang:
  a stopped or deadlocked rank), or ``--startup-timeout`` before its first step.

Then every rank still running is killed (SIGKILL: bounded, a stopped rank included), each
unfinished request records why it stopped and what it held, and a new world on a new port
resumes every unfinished request from its prompt plus its generated tokens in one context
step, or chunks after a prior in prefill mode (dcp_compile.workers.resumable): greedy decoding
gives the uninterrupted run's tokens.

OUT.json: ``tokens`` (per prompt, in order), ``restarts``, ``mode``, ``requests`` (per request: id,
prompt length, tokens, each stop's reason and tokens held), ``faults`` (per lost world:
reason, step reached, ``detect_s`` from the fault to its detection, ``resume_s`` from the
detection to the relaunched world's first step, ``recomputed`` generated tokens whose KV was
computed again) and ``elapsed_s``. ``--pids`` holds ``{rank: pid}`` of the current world,
rewritten at every launch.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dcp_compile.runtime.errors import DCPWorldError
from dcp_compile.workers import CHECKPOINT_HELP, PROGRAM_HELP
from dcp_compile.runtime.names import Mode
from dcp_compile.workers.resumable import RESUMES, Fault

# How often the supervisor looks at the ranks and the progress file (seconds).
POLL_S = 0.05
# Lines of a rank's output quoted when the supervisor gives up.
TAIL_LINES = 40


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--dcp", type=int, required=True)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--mode", choices=sorted(RESUMES), default=Mode.DECODE.value,
                    help="the program's mode: decode (context step, then decode steps) or "
                    "prefill (sequence-parallel prefill steps throughout)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pids", default=None, help="a JSON file holding {rank: pid} of the "
                    "current world, rewritten at every launch")
    ap.add_argument("--program", default=None, help=PROGRAM_HELP + " (its context_len must "
                    "hold the longest prompt + steps, to resume in one context step)")
    ap.add_argument("--checkpoint", default=None, help=CHECKPOINT_HELP)
    ap.add_argument("--lengths", default="1,31,33,32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interleave-size", type=int, default=None)
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("--step-timeout", type=float, default=30.0,
                    help="seconds without a finished step before the world counts as hung")
    ap.add_argument("--startup-timeout", type=float, default=600.0,
                    help="seconds a world may take to its first step")
    ap.add_argument("--collective-timeout", type=float, default=120.0)
    ap.add_argument("--work-dir", default=None, help="where the program, states, progress "
                    "and rank logs go (default: a temporary directory)")
    ap.add_argument("--fault", action="append", default=[], type=Fault.parse_or_none,
                    help="RANK:STEP:kill|stop injected into the n-th world (repeat: one per "
                    "world, in order; 'none': no fault in that world); for tests")
    return ap.parse_args(argv)


@dataclass
class Request:
    id: str
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    stops: list[dict] = field(default_factory=list)


@dataclass
class World:
    """One launch: its rank processes, progress file and what it has read of it."""

    procs: dict[int, subprocess.Popen]
    progress: Path
    started: float
    offset: int = 0
    last_step_at: float | None = None
    first_step_at: float | None = None


def main(argv=None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="dcp-supervise-") as tmp:
        out = supervise(args, Path(args.work_dir or tmp))
    Path(args.out).write_text(json.dumps(out))
    print(f"supervise: {len(out['tokens'])} requests finished, {out['restarts']} restarts",
          flush=True)
    return 0


def program_file(args, work: Path) -> str:
    """The program every world loads: ``--program``, else the demo model's program of
    ``--mode``: a decode program with a context step long enough to resume any request
    (longest prompt + steps), or a prefill program with prompt chunks of the longest prompt
    and caches for the longest prompt + steps (a resume runs in chunks)."""
    if args.program:
        return args.program
    import dcp_compile
    from dcp_compile.models.demo import demo_model
    from dcp_compile.runtime.serving.engine import StepShapes
    from dcp_compile.workers.decode import lengths_of
    lengths = lengths_of(args)
    longest = max(lengths) + args.steps
    context_len = longest if args.mode == Mode.DECODE else max(lengths)
    shapes = StepShapes.fitting(len(lengths), context_len, longest, block_size=16,
                                dcp=args.dcp)
    program = dcp_compile.transform(demo_model(), tp=args.nproc, dcp=args.dcp,
                                    mode=args.mode, interleave_size=args.interleave_size,
                                    check=False, shapes=shapes)
    path = work / "program.dcp"
    program.save(path, weights=args.checkpoint is None)
    return str(path)


def supervise(args, work: Path) -> dict:
    from dcp_compile.workers import program_for
    from dcp_compile.workers.decode import lengths_of, prompt_tokens
    from dcp_compile.workers.resumable import resume_capacity
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    program = program_file(args, work)
    # Refused here, before any rank starts: a program of another layout or mode.
    capacity = resume_capacity(program_for(program, None, tp=args.nproc, dcp=args.dcp,
                                           mode=args.mode,
                                           interleave_size=args.interleave_size))
    requests = [Request(str(i), p) for i, p in
                enumerate(prompt_tokens(lengths_of(args), args.seed))]
    faults: list[dict] = []
    attempt = 0
    while True:
        world = launch(args, work, attempt, program, requests, capacity)
        try:
            lost = watch(args, world, requests, faults)
        except BaseException:
            kill(world)      # the supervisor gives up (or is interrupted): no rank outlives it
            raise
        if lost is None:
            break
        faults.append(lost)
        if all(len(r.generated) >= args.steps for r in requests):
            break            # lost after its last step: nothing to resume
        if attempt >= args.max_restarts:
            raise DCPWorldError(
                f"the supervised world was lost {len(faults)} times (--max-restarts "
                f"{args.max_restarts}): last {lost['reason']}. The ranks' output is in "
                f"err.failures (--work-dir keeps every world's logs); raise --max-restarts "
                f"or fix the cause.",
                failures=lost.pop("logs"))
        attempt += 1
    return supervision_result(requests, faults, attempt, t0, mode=str(args.mode))


def supervision_result(requests, faults: list[dict], restarts: int, t0: float,
                       **extra) -> dict:
    """OUT.json of a supervised run (a world or the disaggregated pair): every request's
    tokens and stops, each loss without its logs, the restarts and the elapsed time."""
    for f in faults:
        f.pop("logs", None)
        f.pop("detected_at", None)
        f.setdefault("resume_s", None)
    return {"tokens": [r.generated for r in requests], "restarts": restarts, **extra,
            "requests": [{"id": r.id, "prompt_len": len(r.prompt), "tokens": r.generated,
                          "stops": r.stops} for r in requests],
            "faults": faults, "elapsed_s": time.monotonic() - t0}


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's environment for one local rank of ``world`` on loopback (over the
    launcher's defaults: ``launch.rank_process_env``)."""
    from dcp_compile.runtime.distributed.launch import LOOPBACK, rank_process_env
    return rank_process_env(dict(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port)))


def launch(args, work: Path, attempt: int, program: str, requests: list[Request],
           capacity: int) -> World:
    """Write the resume state of ``requests`` and start one process per rank; a state the
    program cannot resume (longer than its ``capacity``: ``resumable.resume_capacity``) is
    refused here, before any rank starts."""
    from dcp_compile.runtime.distributed.launch import free_port
    from dcp_compile.workers.resumable import resume_contexts
    resume = {"steps": args.steps, "requests": [
        {"id": r.id, "prompt": r.prompt, "generated": r.generated} for r in requests]}
    resume_contexts(resume, capacity, mode=args.mode)
    here = work / f"world{attempt}"
    here.mkdir()
    state = here / "state.json"
    state.write_text(json.dumps(resume))
    progress = here / "progress.jsonl"
    progress.touch()
    cmd = [sys.executable, "-m", "dcp_compile.workers.resumable", "--state", str(state),
           "--program", program, "--progress", str(progress), "--mode", str(args.mode),
           "--collective-timeout", str(args.collective_timeout)]
    if args.checkpoint:
        cmd += ["--checkpoint", args.checkpoint]
    if attempt < len(args.fault) and args.fault[attempt] is not None:
        cmd += ["--fault", str(args.fault[attempt])]
    port = free_port()
    procs = {}
    for rank in range(args.nproc):
        log = open(here / f"rank{rank}.log", "w")  # noqa: SIM115 - the child holds it
        procs[rank] = subprocess.Popen(cmd, env=rank_env(rank, args.nproc, port),
                                       stdout=log, stderr=subprocess.STDOUT)
        log.close()
    if args.pids:
        tmp = Path(args.pids + ".tmp")
        tmp.write_text(json.dumps({str(r): p.pid for r, p in procs.items()}))
        tmp.replace(args.pids)   # a reader sees the old world's or the new one's, whole
    return World(procs, progress, time.monotonic())


def read_progress(world: World, requests: list[Request]) -> bool:
    """Record the whole lines rank 0 appended since the last read; True if any."""
    with open(world.progress) as f:
        f.seek(world.offset)
        text = f.read()
    lines = text.split("\n")[:-1]          # a line without its newline is still in flight
    if not lines:
        return False
    world.offset += sum(len(line) + 1 for line in lines)
    by_id = {r.id: r for r in requests}
    for line in lines:
        entry = json.loads(line)
        for rid, token in entry["tokens"].items():
            req = by_id[rid]
            if len(req.generated) != entry["step"]:
                raise DCPWorldError(
                    f"rank 0 reported step {entry['step']} of request {rid}, which holds "
                    f"{len(req.generated)} tokens: the progress stream skipped or repeated a "
                    f"step ({world.progress}).")
            req.generated.append(token)
    now = time.monotonic()
    world.last_step_at = now
    if world.first_step_at is None:
        world.first_step_at = now
    return True


def proc_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (T: stopped), if it can be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def watch(args, world: World, requests: list[Request], faults: list[dict]) -> dict | None:
    """Follow ``world`` until it finishes (None) or is lost (what was lost, and why)."""
    while True:
        stepped = read_progress(world, requests)
        if stepped and faults and "resume_s" not in faults[-1]:
            faults[-1]["resume_s"] = world.first_step_at - faults[-1].pop("detected_at")
        codes = {r: p.poll() for r, p in world.procs.items()}
        now = time.monotonic()
        if all(c == 0 for c in codes.values()):
            read_progress(world, requests)
            unfinished = [r.id for r in requests if len(r.generated) < args.steps]
            if unfinished:
                raise DCPWorldError(f"the world finished but requests {unfinished} hold fewer "
                                    f"than {args.steps} tokens: rank 0's progress "
                                    f"({world.progress}) is incomplete.")
            return None
        failed = {r: c for r, c in codes.items() if c not in (None, 0)}
        if failed:
            dead = {r: c for r, c in failed.items() if c < 0}
            if not dead:
                refuse_own_errors(world, failed)
            culprits = dead or failed
            reason = "; ".join(
                f"rank {r} " + (f"was killed by {signal.Signals(-c).name}" if c < 0
                                else f"exited with code {c}") for r, c in culprits.items())
            return lose(world, requests, reason, now, args.steps)
        last = world.last_step_at
        if last is None and now - world.started > args.startup_timeout:
            return lose(world, requests, f"no step within --startup-timeout "
                        f"{args.startup_timeout} s of the launch" + stopped(world), now,
                        args.steps)
        if last is not None and now - last > args.step_timeout:
            return lose(world, requests, f"no step finished for --step-timeout "
                        f"{args.step_timeout} s (a rank stopped answering)" + stopped(world),
                        now, args.steps)
        time.sleep(POLL_S)


def refuse_own_errors(world: World, failed: dict[int, int], name: str = "rank") -> None:
    """Raise if a rank that exited raised an error of its own (not a peer lost under its
    collective): a relaunch would raise it again, so it is no rank loss to resume. The
    ranks' logs are ``<name><rank>.log`` beside the progress file."""
    from dcp_compile.runtime.distributed.launch import rank_state
    logs = {r: (world.progress.parent / f"{name}{r}.log").read_text(errors="replace")
            for r in failed}
    own = [r for r, c in failed.items() if rank_state(c, logs[r], None)[0] == "error"]
    if not own:
        return
    kill(world)
    raise DCPWorldError(
        f"rank{'s' if len(own) > 1 else ''} {', '.join(map(str, own))} of the supervised "
        f"world raised an error of {'their' if len(own) > 1 else 'its'} own (exit code "
        f"{', '.join(str(failed[r]) for r in own)}), not a lost rank: a relaunch would raise "
        f"it again, so the supervisor stops. Fix the cause below.\n"
        + "\n".join(f"--- rank {r} ---\n{tail(logs[r])}" for r in own),
        failures={r: tail(logs[r]) for r in own})


def stopped(world: World) -> str:
    ranks = [r for r, p in world.procs.items() if proc_state(p.pid) == "T"]
    if not ranks:
        return ""
    return f": rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} stopped " \
           "(process state T)"


def lose(world: World, requests: list[Request], reason: str, detected: float,
         steps: int) -> dict:
    """Kill what is left of ``world``, record why each unfinished request stopped, and
    return the fault: reason, step reached, detection and the tokens to compute again."""
    kill(world)
    read_progress(world, requests)            # steps written before the kill still count
    reached = max(len(r.generated) for r in requests)
    for r in requests:
        r.stops.append({"reason": reason, "generated": len(r.generated)})
    fault_file = Path(str(world.progress) + ".fault")
    fault_at = None
    if fault_file.exists():  # an injected fault: wall time of the signal
        fault_at = json.loads(fault_file.read_text())["time"]
    logs = {r: tail((world.progress.parent / f"rank{r}.log").read_text(errors="replace"))
            for r in world.procs}
    return {"reason": reason, "step": reached,
            "detect_s": None if fault_at is None else time.time() - fault_at
            - (time.monotonic() - detected),
            "detected_at": detected,
            "recomputed": sum(len(r.generated) for r in requests
                              if len(r.generated) < steps), "logs": logs}


def kill(world: World) -> None:
    """SIGKILL every rank of ``world`` still running (a stopped one too) and reap them all."""
    for p in world.procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in world.procs.values():
        p.wait()


def tail(text: str) -> str:
    lines = text.splitlines()
    return "\n".join((["..."] if len(lines) > TAIL_LINES else []) + lines[-TAIL_LINES:])


if __name__ == "__main__":
    raise SystemExit(main())
