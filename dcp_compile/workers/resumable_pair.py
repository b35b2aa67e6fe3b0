"""One rank of a supervised disaggregated pair: a prefill world and a decode world, KV over NIXL.

Started by dcp_compile.workers.supervise_pair, never by hand:

    python -m dcp_compile.workers.resumable_pair prefill|decode --state STATE.json
        --program FILE --dir WORLD_DIR --port PORT --other-tp T --other-dcp D
        [--fault RANK:STEP:kill|stop]

Both worlds read ``STATE.json`` (the supervisor's requests: ``id``, ``prompt``, the tokens
already ``generated``; ``steps``) and share the attempt's directory ``WORLD_DIR``.

Prefill rank. Computes every unfinished request's KV from its prompt plus its generated
tokens (prefill steps in chunks after a prior: ``resumable.RESUMES``), holds each request's
blocks for the decode ranks the transfer plan names (``PrefillKVConnector.hold``, side
channel at ``PORT + rank`` on 127.0.0.1), and after a barrier rank 0 writes ``handoff.pt``
(per request its block table, length and lease epoch, and the last-token logits). It then
serves until every reader notified, or until ``WORLD_DIR/abort`` exists (the supervisor
writes it when the decode world is lost): then it releases every lease still held. Either
way it writes ``leases/rank<r>.json`` last: the outcome of each lease, the leases still held
and the blocks whose epoch still marks them held (both empty: no lease leaked).

Decode rank. Waits for the handoff, handshakes with the prefill ranks of its plan, reads
each request's KV and greedy-decodes the remaining steps from the handoff's logits; rank 0
appends each step's tokens to ``WORLD_DIR/progress.jsonl`` (``resumable.greedy_steps``). A
prefill rank lost before the reads complete fails the read (or the handshake) within
``--transfer-timeout`` with a ``DCPTransferError`` naming that prefill rank.

``--fault RANK:STEP:KIND`` (the tests' fault injection, ``resumable.Fault``): STEP -1 is
"during the transfer" -- a prefill rank right after the handoff is written, while it
serves; a decode rank after its handshake, before its reads -- and a decode STEP >= 0 is
before the decode step after global step STEP. The time goes to ``WORLD_DIR/<role>.fault``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from dcp_compile.runtime.names import Mode
from dcp_compile.workers import program_for
from dcp_compile.workers.resumable import (RESUMES, Fault, greedy_steps, inject,
                                           resume_capacity, resume_contexts)

HOST = "127.0.0.1"
ENGINES = {Mode.PREFILL: "prefill", Mode.DECODE: "decode"}   # NIXL engine ids
# Seconds between a serving prefill rank's polls (as dcp_compile.workers.disagg).
SERVE_POLL = 0.002
# The STEP of a fault that fires during the transfer (see the module docstring).
DURING_TRANSFER = -1


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=sorted(ENGINES.values()))
    ap.add_argument("--state", required=True)
    ap.add_argument("--program", required=True)
    ap.add_argument("--dir", required=True, help="the attempt's directory (handoff, abort, "
                    "progress, lease reports)")
    ap.add_argument("--port", type=int, required=True, help="the prefill side channels' "
                    "base port")
    ap.add_argument("--other-tp", type=int, required=True, help="the other world's tp")
    ap.add_argument("--other-dcp", type=int, required=True, help="the other world's dcp")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds to wait for the other world (lease and handoff)")
    ap.add_argument("--transfer-timeout", type=float, default=20.0)
    ap.add_argument("--collective-timeout", type=float, default=120.0)
    ap.add_argument("--fault", default=None, type=Fault.parse)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from dcp_compile.runtime.distributed.launch import run_in_world
    torch.set_num_threads(1)
    role = run_prefill if args.role == "prefill" else run_decode
    run_in_world(lambda rank, world: role(args, rank), timeout=args.collective_timeout)
    return 0


def _state(args, program, mode):
    """The state file's unfinished requests. The prefill world computes their KV again
    (``resume_capacity``); the decode world only receives it: its caches bound them."""
    with open(args.state) as f:
        state = json.load(f)
    capacity = (resume_capacity(program) if mode == Mode.PREFILL
                else program.shapes.max_blocks * program.config.vblock)
    return state, *resume_contexts(state, capacity, mode=mode)


def _my_fault(args, rank: int) -> Fault | None:
    return args.fault if args.fault is not None and args.fault.rank == rank else None


def lease_report(conn) -> dict:
    """What a prefill rank's connector still holds: every lease's outcome, the leases not
    ended and the blocks whose epoch marks them held (a leak: either list non-empty)."""
    return {"rank": conn.rank,
            "outcomes": {rid: lease.outcome for rid, lease in sorted(conn.released.items())},
            "held": sorted(conn.leases),
            "held_blocks": torch.nonzero(conn.block_epochs > 0).flatten().tolist()}


def run_prefill(args, rank: int) -> None:
    import torch.distributed as dist

    from dcp_compile.runtime.errors import DCPTransferError
    from dcp_compile.runtime.serving.rank_engine import rank_engine
    from dcp_compile.runtime.transfer.nixl.connector import PrefillKVConnector
    from dcp_compile.runtime.transfer.plan import plan_transfer
    from dcp_compile.workers.disagg import _pairs, _save, engine_config

    work = Path(args.dir)
    program = program_for(args.program, None, mode=Mode.PREFILL)
    cfg = program.config
    state, todo, contexts, left = _state(args, program, Mode.PREFILL)
    plan = plan_transfer(cfg, engine_config(cfg, tp=args.other_tp, dcp=args.other_dcp,
                                            mode=Mode.DECODE))
    engine = rank_engine(program, rank, fill=float("nan"))
    with torch.no_grad():
        first_logits = RESUMES[Mode.PREFILL].context(engine, contexts,
                                                     program.shapes.context_len)
    n = len(todo)
    table = engine.allocator.table(list(range(n)), program.shapes.max_blocks)
    caches = [c.contiguous() for c in engine.executor.caches]
    conn = PrefillKVConnector(cfg, rank, _pairs(caches), engine_id=ENGINES[Mode.PREFILL],
                              host=HOST, side_channel_port=args.port)
    try:
        readers = [(ENGINES[Mode.DECODE], d) for d in plan.readers_of(rank)]
        blocks = [table[b, :-(-engine.lengths[b] // cfg.vblock)].tolist() for b in range(n)]
        epochs = [conn.hold(r["id"], blocks[b], readers, timeout=args.timeout, epoch=b + 1)
                  for b, r in enumerate(todo)]
        dist.barrier()               # every side channel is up before the decode side reads
        if rank == 0:
            _save({"first": state["steps"] - left, "first_logits": first_logits,
                   "requests": [{"id": r["id"], "seq_len": engine.lengths[b],
                                 "prefill_block_table": blocks[b], "epoch": epochs[b]}
                                for b, r in enumerate(todo)]}, str(work / "handoff.pt"))
        fault = _my_fault(args, rank)
        if fault is not None:
            inject(fault, str(work / "prefill"))
        deadline = time.monotonic() + args.timeout
        while conn.leases:
            conn.poll()
            if (work / "abort").exists():        # the decode world was lost
                for rid in sorted(conn.leases):
                    conn.release(rid)
                break
            if time.monotonic() > deadline:
                raise DCPTransferError(
                    f"prefill rank {rank}: leases {sorted(conn.leases)} not read within "
                    f"{args.timeout:.0f} s and no abort. Is the decode world running?")
            time.sleep(SERVE_POLL)
        report = lease_report(conn)
    finally:
        conn.close()
    (work / "leases").mkdir(exist_ok=True)
    (work / "leases" / f"rank{rank}.json").write_text(json.dumps(report))
    print(f"resumable_pair prefill rank={rank} leases "
          f"{json.dumps(report['outcomes'], sort_keys=True)}", flush=True)


def _wait_for_handoff(args, rank: int) -> dict:
    from dcp_compile.runtime.errors import DCPTransferError
    path = Path(args.dir) / "handoff.pt"
    deadline = time.monotonic() + args.timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise DCPTransferError(f"decode rank {rank}: no handoff at {path} within "
                                   f"{args.timeout:.0f} s. Is the prefill world running?")
        time.sleep(0.05)
    return torch.load(path)


def run_decode(args, rank: int) -> None:
    from dcp_compile.runtime.serving.rank_engine import rank_engine
    from dcp_compile.runtime.transfer.nixl.connector import (DecodeKVConnector,
                                                             TransferRequest, wait_all)
    from dcp_compile.workers.disagg import _pairs, engine_config

    work = Path(args.dir)
    program = program_for(args.program, None, mode=Mode.DECODE)
    cfg = program.config
    state, todo, _, _ = _state(args, program, Mode.DECODE)
    prefill_cfg = engine_config(cfg, tp=args.other_tp, dcp=args.other_dcp, mode=Mode.PREFILL)
    engine = rank_engine(program, rank, fill=float("nan"))
    conn = DecodeKVConnector(prefill_cfg, cfg, rank, _pairs(engine.executor.caches),
                             engine_id=ENGINES[Mode.DECODE], host=HOST,
                             side_channel_port=args.port,
                             handshake_timeout=args.transfer_timeout,
                             transfer_timeout=args.transfer_timeout)
    fault = _my_fault(args, rank)
    try:
        handoff = _wait_for_handoff(args, rank)
        requests = handoff["requests"]
        if [r["id"] for r in requests] != [r["id"] for r in todo]:
            raise ValueError(f"decode rank {rank}: the handoff holds requests "
                             f"{[r['id'] for r in requests]}, the state "
                             f"{[r['id'] for r in todo]}: they come from other attempts.")
        lengths = [r["seq_len"] for r in requests]
        for b, length in enumerate(lengths):
            engine.allocator.ensure(b, length, groups=conn.plan.decode_block_groups)
        table = engine.allocator.table(list(range(len(requests))), program.shapes.max_blocks)
        # The handoff is written after every prefill side channel came up (the prefill
        # world's barrier): a refused connection now is a dead prefill rank, named at once.
        conn.handshake(listening=True)
        if fault is not None and fault.step == DURING_TRANSFER:
            inject(fault, str(work / "decode"))
        for b, r in enumerate(requests):
            conn.start_read(TransferRequest(r["id"], r["seq_len"], r["prefill_block_table"],
                                            table[b, :-(-r["seq_len"] // cfg.vblock)].tolist(),
                                            r["epoch"]))
        for r in requests:
            wait_all([conn], r["id"])
        engine.lengths = list(lengths)
        with torch.no_grad():
            greedy_steps(engine.decode, handoff["first_logits"], todo,
                         first=handoff["first"], steps=state["steps"],
                         progress=str(work / "progress.jsonl") if rank == 0 else None,
                         fault=fault if fault is not None and fault.step >= 0 else None,
                         fault_file=str(work / "decode"))
    finally:
        conn.close()
    print(f"resumable_pair decode rank={rank} ok", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
