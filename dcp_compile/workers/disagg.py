"""Disaggregated prefill -> decode with real processes: two torchrun/gloo worlds, KV over NIXL.

One rank of either world (``python -m dcp_compile.workers.disagg prefill|decode ...``, launched by
torchrun; both worlds run at the same time, each with its own master port). Both worlds need
the side channel's key in their environment (``DCP_KV_KEY`` or ``DCP_KV_KEY_FILE``, the same
value; docs/transfer.md: The side channel's key), or a connector refuses to start::

    export DCP_KV_KEY=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
    # prefill world: TP=4/DCP=2 prefill program, chunked prompts, then serves its KV
    torchrun --nproc-per-node 4 -m dcp_compile.workers.disagg prefill --dcp 2 --block-size 8 \\
        --plan '[[20,11,5],[17,9,0]]' --port 31000 \\
        --decoders '[{"engine_id": "d-tp2", "tp": 2, "dcp": 1}]' \\
        --handoff OUT/handoff.pt --out-dir OUT
    # decode world: standard TP=2 decode, pulls the KV by the plan, then greedy-decodes
    torchrun --nproc-per-node 2 -m dcp_compile.workers.disagg decode --dcp 1 --block-size 8 \\
        --engine-id d-tp2 --prefill-tp 4 --prefill-dcp 2 --prefill-port 31000 \\
        --batch 3 --max-context 48 --steps 8 --handoff OUT/handoff.pt --out-dir OUT

Prefill rank. Transforms the model (``mode="prefill"``; every rank builds the same SPMD
program: :func:`build_program`), or loads the world's program file (``--program``), runs
the prompt chunks of ``--plan`` (chunk -> tokens per sequence, tokens from
:func:`dcp_compile.workers.prefill.plan_tokens`) through the engine, registers its final caches
with a :class:`~dcp_compile.runtime.transfer.nixl.connector.PrefillKVConnector` (side channel at ``--port +
rank``), and after a gloo barrier (every side channel is up) rank 0 writes the *handoff*
(what a router passes to the decode engine: per sequence the request id, prompt length, the
prefill block table and the epoch of its lease, plus each sequence's last-token logits).
Each rank holds every request's blocks (:meth:`PrefillKVConnector.hold`) for the decode
ranks the plans name before the barrier. Then every rank polls its
agent (without NIXL's progress thread a READ advances only while the prefill side polls)
until every decode rank that :meth:`TransferPlan.readers_of` names, of every engine in
``--decoders``, has notified every request, and exits. With ``--out-dir`` each rank also
saves its caches, block table and lengths (``prefill_rank<r>.pt``) for the test.

Decode rank. Transforms the model (``mode="decode"``; ``--dcp 1`` is the standard TP
decode), or loads the world's program file (``--program``), allocates its caches poisoned
with NaN, waits for the handoff, takes block tables from its own allocator
(``--reserve-blocks`` first holds some blocks for a dummy sequence, so local and remote block
numbers differ), creates a :class:`~dcp_compile.runtime.transfer.nixl.connector.DecodeKVConnector`,
handshakes with the prefill ranks of its plan, reads every request and waits for all of
them. Sequence lengths are the prompt lengths; decoding starts from the first token chosen
(argmax) from the prefill's last-token logits and runs ``--steps`` greedy steps. Each rank
saves its caches *right after the transfer* (``decode_rank<r>.pt``, with its block table and
transfer stats); rank 0 writes the tokens and logits (``decode.json``).

Failures stop both worlds in bounded time: a rank that fails appends its error to
``--abort-file``; a prefill rank waiting for readers and a decode rank waiting for the handoff
give up as soon as that file exists (the launching test also writes it when a world fails).
Everything listens on 127.0.0.1 only; UCX runs over tcp on loopback
(:func:`dcp_compile.runtime.transfer.nixl.connector.configure_ucx_env`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from dataclasses import asdict

import torch

from dcp_compile.runtime.names import Mode
from dcp_compile.workers import PROGRAM_HELP, program_for

HOST = "127.0.0.1"
# Seconds between a waiting prefill rank's polls: often enough that a READ (which needs the
# prefill side's progress) is not slowed, rarely enough that 4 idle ranks leave the cores to
# the decode world while it builds its program.
SERVE_POLL = 0.002


# ---------------------------------------------------------------------------------------
# Shared by the workers and the test
# ---------------------------------------------------------------------------------------


def prefill_chunks(engine, chunk_plan) -> torch.Tensor:
    """Run ``chunk_plan`` (chunk -> token list per sequence) on ``engine``; return each
    sequence's logits of its last prompt token (from the last chunk it took part in)."""
    n = len(chunk_plan[0])
    last = [None] * n
    with torch.no_grad():
        for chunk in chunk_plan:
            logits = engine.prefill(chunk)
            for b, tokens in enumerate(chunk):
                if tokens:
                    last[b] = logits[b].clone()
    missing = [b for b, x in enumerate(last) if x is None]
    if missing:
        raise ValueError(f"sequences {missing} have no prompt tokens in the chunk plan. Give "
                         f"every sequence at least one token.")
    return torch.stack(last)


def prefill_shapes(chunk_plan_lengths: list[list[int]], dcp: int, block_size: int):
    """Static shapes of the prefill program for a plan of chunk lengths."""
    from dcp_compile.workers.prefill import shapes_for
    context_len = max(n for chunk in chunk_plan_lengths for n in chunk)
    return shapes_for(chunk_plan_lengths, context_len, dcp, block_size)


def decode_shapes(batch: int, max_context: int, dcp: int, block_size: int,
                  reserve_blocks: int = 0):
    """Static shapes of the decode program: ``max_context`` tokens (prompt + generated) per
    sequence. ``context_len`` (the program's own prompt step, not run here) is one block."""
    from dcp_compile.runtime.serving.engine import StepShapes
    return StepShapes.fitting(batch, block_size, max_context, block_size=block_size, dcp=dcp,
                              spare_blocks=reserve_blocks)


def demo_config(layers: int):
    from dcp_compile.models.demo import DemoConfig
    return DemoConfig(num_layers=layers)


def _demo(layers: int):
    from dcp_compile.models.demo import demo_model
    return demo_model(demo_config(layers))


def _deepseek_v3(layers: int):
    from dcp_compile.models.mla import hf_deepseek
    return hf_deepseek("V3", num_hidden_layers=layers, first_k_dense_replace=layers)


# --model -> (builder over the layer count, vocabulary of the prompt tokens). The demo model is
# the Llama-style paged-attention model; deepseek-v3 is Hugging Face's DeepseekV3ForCausalLM
# from a tiny config (MLA: the cache is one latent head, passes/absorb_latent_attention.py).
MODELS = {"demo": (_demo, 256), "deepseek-v3": (_deepseek_v3, 128)}


def build_model(name: str, layers: int):
    """The model both worlds (and the test's single-device reference) build, same weights."""
    return MODELS[name][0](layers)


def build_program(args, *, tp: int):
    """The program of one world of the launch ``args`` (its role: prefill or decode) on
    ``tp`` ranks: each rank's own transform, or the program file one process writes for the
    world (``--program``)."""
    import dcp_compile
    if args.role == "prefill":
        mode, shapes = Mode.PREFILL, prefill_shapes(json.loads(args.plan), args.dcp,
                                                    args.block_size)
    else:
        mode, shapes = Mode.DECODE, decode_shapes(args.batch, args.max_context, args.dcp,
                                                  args.block_size, args.reserve_blocks)
    return dcp_compile.transform(build_model(args.model, args.layers), tp=tp, dcp=args.dcp,
                                 mode=mode, block_size=args.block_size, shapes=shapes,
                                 check=False)


def engine_config(program_config, *, tp: int, dcp: int, mode: str):
    """The other engine's DCPConfig: same model (heads, head_dim, MLA) and block size."""
    from dcp_compile.runtime.config import DCPConfig
    c = program_config
    return DCPConfig(tp=tp, dcp=dcp, mode=mode, block_size=c.block_size,
                     num_q_heads=c.num_q_heads, num_kv_heads=c.num_kv_heads,
                     head_dim=c.head_dim, mla=c.mla)


def _pairs(flat: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(flat[0::2], flat[1::2]))


def _save(obj, path: str) -> None:
    """torch.save, atomically (a reader never sees half a file)."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def _check_abort(abort_file: str | None, what: str) -> None:
    from dcp_compile.runtime.errors import DCPTransferError
    if abort_file and os.path.exists(abort_file):
        with open(abort_file, errors="replace") as f:
            reason = f.read().strip() or "(no reason given)"
        raise DCPTransferError(f"{what}: the other world failed, giving up. Its error:\n"
                               f"{reason}")


def _report_failure(abort_file: str | None, who: str) -> None:
    if abort_file:
        with open(abort_file, "a") as f:
            f.write(f"{who}: {traceback.format_exc()}\n")


# ---------------------------------------------------------------------------------------
# Prefill world
# ---------------------------------------------------------------------------------------


def run_prefill_rank(args, rank: int, world: int) -> None:
    import torch.distributed as dist

    from dcp_compile.runtime.errors import DCPTransferError
    from dcp_compile.runtime.serving.rank_engine import rank_engine
    from dcp_compile.runtime.transfer.nixl.connector import PrefillKVConnector
    from dcp_compile.workers.prefill import plan_tokens
    from dcp_compile.runtime.transfer.plan import plan_transfer

    plan = json.loads(args.plan)
    decoders = json.loads(args.decoders)
    program = program_for(args.program, lambda: build_program(args, tp=world), dcp=args.dcp,
                          mode=Mode.PREFILL, block_size=args.block_size)
    cfg = program.config
    # Plan every decode engine before any work: an unservable pair fails here, not mid-read.
    plans = {d["engine_id"]: plan_transfer(cfg, engine_config(cfg, tp=d["tp"], dcp=d["dcp"],
                                                              mode=Mode.DECODE))
             for d in decoders}
    engine = rank_engine(program, rank, fill=float("nan"))
    executor = engine.executor
    first_logits = prefill_chunks(engine, plan_tokens(plan, args.seed,
                                                      vocab=MODELS[args.model][1]))
    n = len(plan[0])
    table = engine.allocator.table(list(range(n)), program.shapes.max_blocks)
    caches = [c.contiguous() for c in executor.caches]
    if args.out_dir:
        _save({"rank": rank, "caches": caches, "block_table": table,
               "lengths": list(engine.lengths)},
              os.path.join(args.out_dir, f"prefill_rank{rank}.pt"))

    conn = PrefillKVConnector(cfg, rank, _pairs(caches), engine_id=args.engine_id, host=HOST,
                              side_channel_port=args.port)
    try:
        request_ids = [f"{args.engine_id}-seq{b}" for b in range(n)]
        # Hold each request's blocks for the decode ranks the plans name (epoch b + 1 on every
        # rank: the handoff's epochs hold for all of them).
        epochs = []
        for b, rid in enumerate(request_ids):
            need = -(-engine.lengths[b] // cfg.vblock)
            readers = [(eng, d) for eng, p in plans.items() for d in p.readers_of(rank)]
            epochs.append(conn.hold(rid, table[b, :need].tolist(), readers,
                                    timeout=args.timeout, epoch=b + 1))
        dist.barrier()  # every rank's side channel is up before anyone is told to read
        if rank == 0:
            requests = []
            for b, rid in enumerate(request_ids):
                need = -(-engine.lengths[b] // cfg.vblock)
                requests.append({"request_id": rid, "seq_len": engine.lengths[b],
                                 "prefill_block_table": table[b, :need].tolist(),
                                 "epoch": epochs[b]})
            _save({"engine_id": args.engine_id, "host": HOST, "port": args.port,
                   "tp": cfg.tp, "dcp": cfg.dcp, "block_size": cfg.block_size,
                   "requests": requests, "first_logits": first_logits}, args.handoff)
        want = {(eng, d, rid) for eng, p in plans.items() for d in p.readers_of(rank)
                for rid in request_ids}
        t0 = time.monotonic()
        deadline = t0 + args.timeout
        while True:
            conn.poll()
            missing = {(eng, d, rid) for eng, d, rid in want
                       if (eng, d) not in conn.notifications.get(rid, {})}
            if not missing:
                break
            expired = [rid for rid in request_ids
                       if rid in conn.released and conn.released[rid].outcome != "read"]
            if expired:  # a lease ended before its readers notified: wait_for_readers says why
                conn.wait_for_readers(expired[0])
            _check_abort(args.abort_file, f"prefill rank {rank}")
            if time.monotonic() > deadline:
                raise DCPTransferError(
                    f"prefill rank {rank}: decode ranks did not read their KV within "
                    f"{args.timeout:.0f} s; missing (engine, decode rank, request): "
                    f"{sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}. Is the "
                    f"decode world running with --prefill-port {args.port}?")
            time.sleep(SERVE_POLL)
        statuses: dict[str, int] = {}  # "read" / "empty" (nothing to read) -> count
        for eng, d, rid in want:
            st = conn.notifications[rid][(eng, d)]
            statuses[st] = statuses.get(st, 0) + 1
        print(f"disagg prefill rank={rank} cp_rank={program.topology.cp_rank(rank)} "
              f"kv_heads={program.topology.kv_heads_of(rank)} lengths={engine.lengths} "
              f"served {len(want)} (decode rank, request) notifications in "
              f"{time.monotonic() - t0:.1f} s: {json.dumps(statuses, sort_keys=True)}",
              flush=True)
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------
# Decode world
# ---------------------------------------------------------------------------------------


def _wait_for_handoff(args, rank: int) -> dict:
    from dcp_compile.runtime.errors import DCPTransferError
    deadline = time.monotonic() + args.timeout
    while not os.path.exists(args.handoff):
        _check_abort(args.abort_file, f"decode rank {rank} ({args.engine_id})")
        if time.monotonic() > deadline:
            raise DCPTransferError(f"decode rank {rank} ({args.engine_id}): no handoff at "
                                   f"{args.handoff} within {args.timeout:.0f} s. Is the prefill "
                                   f"world running?")
        time.sleep(0.05)
    return torch.load(args.handoff)


def run_decode_rank(args, rank: int, world: int) -> None:
    from dcp_compile.runtime.errors import DCPTransferError
    from dcp_compile.runtime.serving.rank_engine import rank_engine
    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector, TransferRequest, wait_all

    shapes = decode_shapes(args.batch, args.max_context, args.dcp, args.block_size,
                           args.reserve_blocks)
    program = program_for(args.program, lambda: build_program(args, tp=world), dcp=args.dcp,
                          mode=Mode.DECODE, block_size=args.block_size)
    cfg = program.config
    prefill_cfg = engine_config(cfg, tp=args.prefill_tp, dcp=args.prefill_dcp, mode=Mode.PREFILL)
    engine = rank_engine(program, rank, fill=float("nan"), shapes=shapes)
    caches = engine.executor.caches
    if args.reserve_blocks:
        engine.allocator.ensure(-1, args.reserve_blocks * cfg.vblock)
    conn = DecodeKVConnector(prefill_cfg, cfg, rank, _pairs(caches), engine_id=args.engine_id,
                             host=HOST, side_channel_port=args.prefill_port,
                             handshake_timeout=args.transfer_timeout,
                             transfer_timeout=args.transfer_timeout)
    try:
        handoff = _wait_for_handoff(args, rank)
        requests = handoff["requests"]
        n = len(requests)
        if n > args.batch:
            raise DCPTransferError(f"decode rank {rank}: the handoff has {n} requests, the "
                                   f"decode program's batch is {args.batch}. Launch with "
                                   f"--batch >= {n}.")
        lengths = [r["seq_len"] for r in requests]
        if max(lengths) + args.steps > args.max_context:
            raise DCPTransferError(f"decode rank {rank}: prompts of {lengths} tokens + "
                                   f"{args.steps} steps exceed --max-context "
                                   f"{args.max_context}. Launch with a larger --max-context.")
        for b, length in enumerate(lengths):  # the rows one remote rank fills: one run
            engine.allocator.ensure(b, length, groups=conn.plan.decode_block_groups)
        table = engine.allocator.table(list(range(n)), shapes.max_blocks)
        t0 = time.monotonic()
        conn.handshake()
        t1 = time.monotonic()
        for b, r in enumerate(requests):
            need = -(-r["seq_len"] // cfg.vblock)
            conn.start_read(TransferRequest(r["request_id"], r["seq_len"],
                                            r["prefill_block_table"], table[b, :need].tolist(),
                                            r["epoch"]))
        stats = [wait_all([conn], r["request_id"])[0] for r in requests]
        t2 = time.monotonic()
        if args.out_dir:
            _save({"rank": rank, "caches": [c.clone() for c in caches], "block_table": table,
                   "lengths": lengths, "stats": [asdict(s) for s in stats],
                   "remote_ranks": conn.rank_plan.remote_ranks, "kind": conn.plan.kind},
                  os.path.join(args.out_dir, f"decode_rank{rank}.pt"))
        engine.lengths = list(lengths)
        with torch.no_grad():
            result = engine.continue_generate(handoff["first_logits"], args.steps)
        if rank == 0 and args.out_dir:
            with open(os.path.join(args.out_dir, "decode.json.tmp"), "w") as f:
                json.dump({"tokens": result.tokens,
                           "logits": [step.tolist() for step in result.logits],
                           "handshake_s": t1 - t0, "transfer_s": t2 - t1}, f)
            os.replace(os.path.join(args.out_dir, "decode.json.tmp"),
                       os.path.join(args.out_dir, "decode.json"))
        print(f"disagg decode {args.engine_id} rank={rank} cp_rank="
              f"{program.topology.cp_rank(rank)} <- prefill ranks "
              f"{conn.rank_plan.remote_ranks} ({conn.plan.kind}): "
              f"{sum(s.bytes for s in stats)} bytes, {sum(s.reads for s in stats)} reads, "
              f"{sum(s.notify_only for s in stats)} notify-only; handshake {t1 - t0:.2f} s, "
              f"transfer {t2 - t1:.3f} s; {args.steps} tokens decoded", flush=True)
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="role", required=True)
    for role in ("prefill", "decode"):
        p = sub.add_parser(role)
        p.add_argument("--dcp", type=int, required=True)
        p.add_argument("--block-size", type=int, default=8, help="= interleave size (DI)")
        p.add_argument("--layers", type=int, default=2)
        p.add_argument("--model", choices=sorted(MODELS), default="demo",
                       help="demo (Llama-style) or deepseek-v3 (HF, MLA, tiny config)")
        p.add_argument("--handoff", required=True, help="file the prefill world's rank 0 "
                       "writes (requests, block tables, last-token logits)")
        p.add_argument("--out-dir", default=None, help="per-rank caches and results")
        p.add_argument("--abort-file", default=None)
        p.add_argument("--timeout", type=float, default=300.0,
                       help="seconds to wait for the other world")
        p.add_argument("--program", default=None, help=PROGRAM_HELP)
    pre = sub.choices["prefill"]
    pre.add_argument("--engine-id", default="prefill")
    pre.add_argument("--plan", required=True, help="JSON: chunk -> tokens per sequence")
    pre.add_argument("--seed", type=int, default=0)
    pre.add_argument("--port", type=int, required=True, help="NIXL side channel base port")
    pre.add_argument("--decoders", required=True,
                     help='JSON: [{"engine_id": ..., "tp": ..., "dcp": ...}, ...] to serve')
    dec = sub.choices["decode"]
    dec.add_argument("--engine-id", default="decode")
    dec.add_argument("--prefill-tp", type=int, required=True)
    dec.add_argument("--prefill-dcp", type=int, required=True)
    dec.add_argument("--prefill-port", type=int, required=True)
    dec.add_argument("--batch", type=int, required=True)
    dec.add_argument("--max-context", type=int, required=True,
                     help="prompt + generated tokens per sequence the program holds")
    dec.add_argument("--steps", type=int, default=8)
    dec.add_argument("--reserve-blocks", type=int, default=0)
    dec.add_argument("--transfer-timeout", type=float, default=60.0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)

    from dcp_compile.runtime.distributed.launch import run_in_world

    torch.set_num_threads(1)
    run_in_world(lambda rank, world: run_role(args, rank, world))
    return 0


def run_role(args, rank: int, world: int) -> None:
    """This rank's part of the launch ``args`` (prefill or decode) in the initialised world
    (``main``, or a caller that runs more parts on the same ranks); a failure is appended
    to ``--abort-file`` first, so the other worlds stop waiting."""
    try:
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
        (run_prefill_rank if args.role == "prefill" else run_decode_rank)(args, rank, world)
    except BaseException:
        _report_failure(args.abort_file, f"{args.role} world ({args.engine_id}) rank {rank}")
        raise


if __name__ == "__main__":
    raise SystemExit(main())
