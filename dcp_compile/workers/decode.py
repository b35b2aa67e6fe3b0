"""One rank of a real multi-process DCP decode world (torchrun + gloo).

    torchrun --nproc-per-node 4 -m dcp_compile.workers.decode --dcp 2 --steps 16 --out tokens.json

Every process transforms the demo model itself (deterministic: the same SPMD program on every
rank), or loads the program file ``--program PATH`` written once for the launch
(:func:`build_program` then ``program.save(PATH)``, weightless with ``weights=False``), binds
its process groups, loads its weight shard (with ``--checkpoint DIR``: reads only its own
slices of the checkpoint) and runs the greedy engine — the program's own context step, then decode.
Rank 0 writes the generated tokens and logits.
"""

from __future__ import annotations

import argparse
import json

import torch

from dcp_compile.runtime.names import Mode
from dcp_compile.workers import CHECKPOINT_HELP, PROGRAM_HELP, program_for, rank_check


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dcp", type=int, required=True)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--lengths", default="1,31,33,32")
    ap.add_argument("--interleave-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--program", default=None, help=PROGRAM_HELP)
    ap.add_argument("--checkpoint", default=None, help=CHECKPOINT_HELP)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)

    from dcp_compile.runtime.distributed.launch import run_in_world

    run_in_world(lambda rank, world: run(args, rank, world))
    return 0


def run(args, rank: int, world: int) -> None:
    """This rank's decode in the initialised world of ``world`` ranks (``main``, or a caller
    that runs more in the same world)."""
    from dcp_compile.runtime.serving.rank_engine import rank_engine

    program = program_for(args.program,
                          lambda: build_program(args, tp=world, check=rank_check(rank)),
                          dcp=args.dcp, mode=Mode.DECODE, interleave_size=args.interleave_size)
    engine = rank_engine(program, rank, checkpoint=args.checkpoint)
    with torch.no_grad():
        result = engine.generate(prompt_tokens(lengths_of(args), args.seed), args.steps)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"tokens": result.tokens,
                       "logits": [step.tolist() for step in result.logits]}, f)
    print(f"decode_worker rank={rank} ok", flush=True)


def lengths_of(args) -> list[int]:
    return [int(x) for x in args.lengths.split(",")]


def build_program(args, *, tp: int, check: bool | None = None):
    """The program of the launch ``args`` on ``tp`` ranks (each rank's own transform, or the
    program file one process writes for the launch)."""
    import dcp_compile
    from dcp_compile.models.demo import demo_model
    lengths = lengths_of(args)
    return dcp_compile.transform(demo_model(), tp=tp, dcp=args.dcp, mode=Mode.DECODE,
                                 interleave_size=args.interleave_size, check=check,
                                 shapes=shapes_for(lengths, args.steps, args.dcp))


def prompt_tokens(lengths, seed) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def shapes_for(lengths, steps, dcp):
    from dcp_compile.runtime.serving.engine import StepShapes
    return StepShapes.fitting(len(lengths), max(lengths), max(lengths) + steps,
                              block_size=16, dcp=dcp)


if __name__ == "__main__":
    raise SystemExit(main())
