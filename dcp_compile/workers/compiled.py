"""One rank of a real multi-process world running a model compiled with backend "dcp".

    torchrun --nproc-per-node 4 -m dcp_compile.workers.compiled --dcp 2 --steps 8 --out result.json

Every process compiles the single-device demo model with
``torch.compile(model, backend="dcp", options={"tp": WORLD, "dcp": DCP}, fullgraph=True)``
(the backend found by name through its entry point), allocates this rank's KV caches and
runs the greedy engine: Dynamo compiles the "context" graph on the prompt step and the
"decode" graph on the first one-token step. Rank 0 writes tokens and logits to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import torch


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dcp", type=int, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lengths", default="1,31,33,32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    return ap


@dataclass
class CompiledRun:
    """What one rank compiled and decoded (a caller may compile more in the same world)."""

    model: torch.nn.Module
    options: dict
    shapes: Any                 # dcp_compile.runtime.serving.engine.StepShapes
    caches: list
    result: Any                 # dcp_compile.runtime.serving.engine's generate() result: tokens, logits


def compile_and_decode(args, world: int) -> CompiledRun:
    """Compile the demo model with backend "dcp" for ``world`` ranks and decode greedily."""
    from dcp_compile.backend import kv_cache_spec
    from dcp_compile.models.demo import demo_model
    from dcp_compile.workers.decode import prompt_tokens, shapes_for
    from dcp_compile.runtime.serving.engine import Engine, LocalExecutor

    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = prompt_tokens(lengths, args.seed)
    shapes = shapes_for(lengths, args.steps, args.dcp)
    model = demo_model()
    options = {"tp": world, "dcp": args.dcp, "mode": "decode"}
    compiled = torch.compile(model, backend="dcp", options=options, fullgraph=True,
                             dynamic=False)
    caches = kv_cache_spec(model, tp=world, dcp=args.dcp,
                           num_blocks=shapes.num_blocks).allocate()
    engine = Engine(LocalExecutor(compiled, caches), shapes, block_size=16, dcp=args.dcp)
    with torch.no_grad():
        result = engine.generate(prompts, args.steps)
    return CompiledRun(model, options, shapes, caches, result)


def result_json(run: CompiledRun) -> dict:
    return {"tokens": run.result.tokens,
            "logits": [step.tolist() for step in run.result.logits]}


def main(argv=None) -> int:
    args = parser().parse_args(argv)

    import torch.distributed as dist

    from dcp_compile.runtime.distributed.launch import freeze_gc, init_distributed_from_env

    rank, world = init_distributed_from_env()

    freeze_gc()
    try:
        run = compile_and_decode(args, world)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(result_json(run), f)
        print(f"backend_worker rank={rank} ok", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
