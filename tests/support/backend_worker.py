"""A torchrun worker for the backend part of tests/e2e/test_torchrun_world.py:
dcp_compile.workers.compiled's compiled decode, then, in the same world, a model with a graph
break compiled with ``fullgraph=False``, whose error every rank records. Rank 0 writes
tokens, logits and the ranks' errors to ``--out``; ``--dump DIR`` compiles with
``DCP_COMPILE_DUMP=DIR``.

    run_torchrun(4, "tests.support.backend_worker", ["--dcp", "2", "--out", "result.json"])

Also home of ``PrintingDemo``, the graph-break fixture test_backend.py compiles in-process.
"""

from __future__ import annotations

import json
import os

import torch

DUMP_ENV = "DCP_COMPILE_DUMP"


class PrintingDemo(torch.nn.Module):
    """The demo model with a print between embedding and layers: a Dynamo graph break."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, block_table, kv_caches):
        m = self.model
        x = m.embed_tokens(input_ids)
        print("graph break here")
        from dcp_compile.models.demo import rope_cos_sin
        cos, sin = rope_cos_sin(positions, m.inv_freq, x.dtype)
        new = []
        for i, layer in enumerate(m.layers):
            x, kc, vc = layer(x, cos, sin, positions, block_table, kv_caches[2 * i],
                              kv_caches[2 * i + 1])
            new += [kc, vc]
        return m.lm_head(m.norm(x)), new


def graph_break_error(run) -> dict | None:
    """Compile PrintingDemo around ``run.model`` and call it: the error it raised."""
    torch._dynamo.reset()
    broken = torch.compile(PrintingDemo(run.model), backend="dcp", options=run.options,
                           fullgraph=False, dynamic=False)
    try:
        with torch.no_grad():
            broken(*_step_inputs(run.shapes, run.caches))
    except Exception as e:  # noqa: BLE001 - reported to the test
        inner = getattr(e, "inner_exception", e)
        return {"type": type(e).__name__, "inner": type(inner).__name__,
                "message": str(inner).splitlines()[0]}
    return None


def _step_inputs(shapes, caches):
    ids = torch.zeros(shapes.batch, shapes.context_len, dtype=torch.int64)
    positions = torch.arange(shapes.context_len).expand(shapes.batch, -1).contiguous()
    table = torch.zeros(shapes.batch, shapes.max_blocks, dtype=torch.int64)
    return ids, positions, table, caches


def parse(argv=None):
    from dcp_compile.workers.compiled import parser
    ap = parser()
    ap.add_argument("--dump", default=None, help="DCP_COMPILE_DUMP while this part compiles")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from dcp_compile.runtime.distributed.launch import run_in_world

    args = parse(argv)
    run_in_world(lambda rank, world: run(args, rank, world))
    return 0


def run(args, rank: int, world: int) -> None:
    """This rank's part in the initialised world (``main``, or tests/support/world_worker.py)."""
    import torch.distributed as dist

    from dcp_compile.workers.compiled import compile_and_decode, result_json

    before = os.environ.get(DUMP_ENV)
    if args.dump:
        os.environ[DUMP_ENV] = args.dump
    try:
        run_ = compile_and_decode(args, world)
        # A graph break must fail the compile, never run the model eagerly unsharded.
        errors = [None] * world
        dist.all_gather_object(errors, graph_break_error(run_))
    finally:
        if before is None:
            os.environ.pop(DUMP_ENV, None)
        else:
            os.environ[DUMP_ENV] = before
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({**result_json(run_), "graph_break_errors": errors}, f)
    print(f"backend_worker rank={rank} ok", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
