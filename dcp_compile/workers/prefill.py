"""One rank of a real multi-process prefill DCP world (torchrun + gloo).

    torchrun --nproc-per-node 4 -m dcp_compile.workers.prefill --dcp 2 --block-size 8 \
        --context-len 36 --plan '[[36,31,1],[33,7,0],[17,36,2]]' --out-dir OUT

Every process transforms the demo model itself (deterministic: the same SPMD program on every
rank), or loads the program file ``--program PATH`` written once for the launch
(:func:`build_program` then ``program.save(PATH)``), binds its process groups, loads its
weight shard, allocates its caches poisoned with NaN and runs the chunked prefill — a first
chunk, then chunks that attend to the prior cache. ``--plan`` gives each chunk's token count
per sequence (tokens are drawn by :func:`plan_tokens`). Each rank saves its full logits per
chunk, positions, final caches, block table and lengths to ``OUT/rank<r>.pt`` for the
launching test to compare with the single-device model.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from dcp_compile.runtime.names import Mode
from dcp_compile.workers import PROGRAM_HELP, program_for, rank_check


def plan_tokens(plan: list[list[int]], seed: int = 0, vocab: int = 256
                ) -> list[list[list[int]]]:
    """Seeded tokens for a plan of chunk lengths (chunk -> sequence -> count)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (n,), generator=g).tolist() for n in chunk]
            for chunk in plan]


def shapes_for(plan: list[list[int]], context_len: int, dcp: int, block: int):
    """Static shapes that hold the plan: batch = sequences, blocks for the longest total."""
    from dcp_compile.runtime.serving.engine import StepShapes
    totals = [sum(chunk[b] for chunk in plan) for b in range(len(plan[0]))]
    return StepShapes.fitting(len(totals), context_len, max(totals), block_size=block,
                              dcp=dcp)


def build_program(args, plan, *, check: bool | None = None):
    """The model and the program of the launch ``args`` (each rank's own transform, or the
    program file one process writes for the launch); ``check``: transform's."""
    import dcp_compile
    from dcp_compile.models.demo import DemoConfig, demo_model
    model = demo_model(DemoConfig(num_layers=args.layers))
    program = dcp_compile.transform(
        model, tp=args.tp, dcp=args.dcp, mode=Mode.PREFILL, block_size=args.block_size,
        shapes=shapes_for(plan, args.context_len, args.dcp, args.block_size), check=check)
    return model, program


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dcp", type=int, required=True)
    ap.add_argument("--tp", type=int, default=None, help="default: the world size")
    ap.add_argument("--block-size", type=int, default=8, help="= interleave size (DI)")
    ap.add_argument("--context-len", type=int, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--plan", required=True, help="JSON: chunk -> tokens per sequence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--program", default=None, help=PROGRAM_HELP)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)

    from dcp_compile.runtime.distributed.launch import run_in_world

    run_in_world(lambda rank, world: run(args, rank, world))
    return 0


def run(args, rank: int, world: int) -> None:
    """This rank's chunked prefill in the initialised world of ``world`` ranks (``main``, or
    a caller that runs more in the same world)."""
    from dcp_compile.runtime.serving.rank_engine import rank_engine
    from dcp_compile.verify import run_chunks

    args.tp = args.tp or world
    plan = json.loads(args.plan)
    program = program_for(args.program,
                          lambda: build_program(args, plan, check=rank_check(rank))[1],
                          dcp=args.dcp, tp=args.tp, mode=Mode.PREFILL,
                          block_size=args.block_size)
    engine = rank_engine(program, rank, fill=float("nan"), record=True)
    chunks = run_chunks(engine, engine.executor, plan_tokens(plan, args.seed), rank,
                        program.shapes.max_blocks)
    os.makedirs(args.out_dir, exist_ok=True)
    torch.save({"rank": rank, "logits": chunks.logits, "positions": chunks.positions,
                "caches": chunks.caches, "block_table": chunks.block_table,
                "lengths": chunks.lengths}, os.path.join(args.out_dir, f"rank{rank}.pt"))
    print(f"prefill_worker rank={rank} cp_rank={program.topology.cp_rank(rank)} "
          f"chunks={len(plan)} ok", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
