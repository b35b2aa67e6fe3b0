"""One rank of a supervised world: resumes a state file's requests, streams each step.

Started by dcp_compile.workers.supervise, never by hand:

    python -m dcp_compile.workers.resumable --state STATE.json --program FILE
        --progress PROGRESS.jsonl [--mode decode|prefill] [--checkpoint DIR]
        [--fault RANK:STEP:kill|stop]

``STATE.json`` (written by the supervisor) holds ``steps`` and the requests: ``id``,
``prompt`` and the tokens already ``generated``. Every unfinished request's KV is computed
again from its prompt plus its generated tokens, then greedy decoding runs to ``steps``
tokens. How depends on the program's mode (``RESUMES``, one row per mode):

* decode: one context step over prompt + generated (the decode program's prompt step, with
  no prior), then one decode step per token;
* prefill: prompt + generated in chunks of ``context_len`` (the sequence-parallel prefill
  step, each chunk after the prior ones), then one prefill step of one token per sequence
  per generated token.

Greedy decoding is a function of the token sequence, so the tokens equal an uninterrupted
run's. Rank 0 appends one line per step to ``PROGRESS.jsonl`` (``{"step": g, "tokens":
{id: token}}``) as soon as the step's tokens are known: a rank lost at any step loses at most
the step in flight.

``--fault RANK:STEP:KIND`` (the tests' fault injection): rank RANK sends itself SIGKILL
(``kill``) or SIGSTOP (``stop``, a hang) just before the step that follows global step STEP
(or the first later step of a resumed world), after writing the time to
``<progress>.fault``: the supervisor measures detection from it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import dataclass

from typing import Callable

import torch

from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.names import Mode
from dcp_compile.workers import CHECKPOINT_HELP, program_for

# --fault KIND -> the signal the rank sends itself.
FAULT_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str

    @classmethod
    def parse(cls, text: str) -> "Fault":
        try:
            rank, step, kind = text.split(":")
            fault = cls(int(rank), int(step), kind)
        except ValueError:
            raise DCPInputError(f"--fault must read RANK:STEP:KIND: --fault {text!r}. "
                                f"E.g. --fault 1:3:kill.") from None
        if kind not in FAULT_SIGNALS:
            raise DCPInputError(f"--fault kind must be one of {sorted(FAULT_SIGNALS)}: "
                                f"--fault {text!r}. Use kill (SIGKILL) or stop (SIGSTOP).")
        return fault

    @classmethod
    def parse_or_none(cls, text: str) -> "Fault | None":
        """``parse``, or None for ``none`` (a world of a --fault list left alone)."""
        return None if text == "none" else cls.parse(text)

    def __str__(self) -> str:
        return f"{self.rank}:{self.step}:{self.kind}"


def _one_context_step(engine, contexts: list[list[int]], chunk: int) -> torch.Tensor:
    return engine.prefill(contexts)


def _chunks_after_a_prior(engine, contexts: list[list[int]], chunk: int) -> torch.Tensor:
    """Each context in chunks of ``chunk`` tokens (a sequence with fewer sits the later
    chunks out); the logits of each sequence's last token."""
    last: list[torch.Tensor | None] = [None] * len(contexts)
    for start in range(0, max(map(len, contexts)), chunk):
        rows = [c[start:start + chunk] for c in contexts]
        logits = engine.prefill(rows)
        for b, row in enumerate(rows):
            if row:
                last[b] = logits[b]
    return torch.stack(last)


def _decode_step(engine, tokens: list[int]) -> torch.Tensor:
    return engine.decode(tokens)


def _prefill_step(engine, tokens: list[int]) -> torch.Tensor:
    return engine.prefill([[t] for t in tokens])


@dataclass(frozen=True)
class Resume:
    """How a world of one program mode computes a resumed request's KV again and steps."""

    limit: str                                   # what bounds prompt + generated, for errors
    capacity: Callable                           # (shapes, vblock) -> tokens a resume holds
    context: Callable                            # (engine, contexts, context_len) -> logits
    step: Callable                               # (engine, tokens) -> next logits


# program mode -> how it resumes (the module docstring says why each)
RESUMES = {
    Mode.DECODE: Resume("context_len", lambda shapes, vblock: shapes.context_len,
                        _one_context_step, _decode_step),
    Mode.PREFILL: Resume("capacity (max_blocks x block_size x dcp)",
                         lambda shapes, vblock: shapes.max_blocks * vblock,
                         _chunks_after_a_prior, _prefill_step),
}


def resume_capacity(program) -> int:
    """Tokens (prompt + generated) a request of ``program``'s world can be resumed with."""
    return RESUMES[program.config.mode].capacity(program.shapes, program.config.vblock)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--state", required=True)
    ap.add_argument("--program", required=True)
    ap.add_argument("--progress", required=True)
    ap.add_argument("--mode", choices=sorted(RESUMES), default=Mode.DECODE.value)
    ap.add_argument("--checkpoint", default=None, help=CHECKPOINT_HELP)
    ap.add_argument("--fault", default=None, type=Fault.parse)
    ap.add_argument("--collective-timeout", type=float, default=120.0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from dcp_compile.runtime.distributed.launch import run_in_world
    run_in_world(lambda rank, world: run(args, rank), timeout=args.collective_timeout)
    return 0


def resume_contexts(state: dict, capacity: int, *, mode: str = Mode.DECODE
                    ) -> tuple[list[dict], list[list[int]], int]:
    """The unfinished requests of ``state``, each one's context (prompt + generated) and
    the steps left. Every unfinished request holds the same number of generated tokens (the
    engine steps them together); a context longer than ``capacity`` (``resume_capacity``:
    a decode program's context step, a prefill program's caches) is refused: the world of
    ``mode`` cannot resume it."""
    todo = [r for r in state["requests"] if len(r["generated"]) < state["steps"]]
    done = {len(r["generated"]) for r in todo}
    if len(done) > 1:
        raise DCPInputError(
            f"resume state holds unfinished requests at different steps: "
            f"{ {r['id']: len(r['generated']) for r in todo} }. The supervisor records whole "
            f"steps; resume from a state it wrote.")
    contexts = [r["prompt"] + r["generated"] for r in todo]
    too_long = {r["id"]: len(c) for r, c in zip(todo, contexts) if len(c) > capacity}
    if too_long:
        how = RESUMES[mode]
        raise DCPInputError(
            f"cannot resume in a {mode} world: prompt + generated tokens {too_long} exceed "
            f"the program's {how.limit}={capacity}. Build the program with a {how.limit} "
            f">= longest prompt + steps (dcp_compile.workers.supervise does).")
    return todo, contexts, state["steps"] - done.pop() if todo else 0


def run(args, rank: int) -> None:
    from dcp_compile.runtime.serving.rank_engine import rank_engine

    with open(args.state) as f:
        state = json.load(f)
    program = program_for(args.program, None, mode=args.mode)
    how = RESUMES[program.config.mode]
    todo, contexts, left = resume_contexts(state, resume_capacity(program), mode=args.mode)
    if not todo:
        return
    engine = rank_engine(program, rank, checkpoint=args.checkpoint)
    fault = args.fault if args.fault is not None and args.fault.rank == rank else None
    with torch.no_grad():
        logits = how.context(engine, contexts, program.shapes.context_len)
        greedy_steps(lambda nxt: how.step(engine, nxt), logits, todo,
                     first=state["steps"] - left, steps=state["steps"],
                     progress=args.progress if rank == 0 else None, fault=fault,
                     fault_file=args.progress)
    print(f"resumable {args.mode} rank={rank} ok", flush=True)


def greedy_steps(step, logits: torch.Tensor, todo: list[dict], *, first: int, steps: int,
                 progress: str | None, fault: Fault | None, fault_file: str) -> None:
    """Greedy decoding from ``logits`` (each request's last token) for global steps
    ``first..steps-1``; ``step(tokens)`` runs one step and returns the next logits. With
    ``progress`` (rank 0), each step's tokens are appended as soon as they are known; a
    ``fault`` of this rank fires before the step after global step ``fault.step``."""
    out = open(progress, "a") if progress is not None else None  # noqa: SIM115
    try:
        for g in range(first, steps):
            nxt = logits.argmax(-1).tolist()
            if out is not None:
                out.write(json.dumps({"step": g, "tokens": {
                    r["id"]: t for r, t in zip(todo, nxt)}}) + "\n")
                out.flush()
            if g == steps - 1:
                break
            if fault is not None and g >= fault.step:
                inject(fault, fault_file)
            logits = step(nxt)
    finally:
        if out is not None:
            out.close()


def inject(fault: Fault, progress: str) -> None:
    """Record the fault's time, then stop this rank with its signal."""
    with open(progress + ".fault", "w") as f:
        json.dump({"rank": fault.rank, "step": fault.step, "kind": fault.kind,
                   "time": time.time()}, f)
    os.kill(os.getpid(), FAULT_SIGNALS[fault.kind])


if __name__ == "__main__":
    raise SystemExit(main())
