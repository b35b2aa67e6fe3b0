"""One rank of a real multi-process world running a model compiled with backend "dcp".

    torchrun --nproc-per-node 4 -m dcp_compile.workers.backend --dcp 2 --steps 8 --out result.json

Every process compiles the single-device demo model with
``torch.compile(model, backend="dcp", options={"tp": WORLD, "dcp": DCP}, fullgraph=True)``
(the backend found by name through its entry point), allocates this rank's KV caches and
runs the greedy engine: Dynamo compiles the "context" graph on the prompt step and the
"decode" graph on the first one-token step. Then each rank compiles a model with a graph
break (a print inside forward) with ``fullgraph=False`` and records the error it must raise.
Rank 0 writes tokens, logits and the ranks' errors to ``--out``.
"""

from __future__ import annotations

import argparse
import json

import torch


class PrintingDemo(torch.nn.Module):
    """The demo model with a print between embedding and layers: a Dynamo graph break."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, block_table, kv_caches):
        m = self.model
        x = m.embed_tokens(input_ids)
        print("graph break here")
        from dcp_compile.models import rope_cos_sin
        cos, sin = rope_cos_sin(positions, m.inv_freq, x.dtype)
        new = []
        for i, layer in enumerate(m.layers):
            x, kc, vc = layer(x, cos, sin, positions, block_table, kv_caches[2 * i],
                              kv_caches[2 * i + 1])
            new += [kc, vc]
        return m.lm_head(m.norm(x)), new


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dcp", type=int, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lengths", default="1,31,33,32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from dcp_compile.backend import kv_cache_spec
    from dcp_compile.models import demo_model
    from dcp_compile.workers.decode import prompt_tokens, shapes_for
    from runtime.engine import Engine, LocalExecutor
    from runtime.launch import init_distributed_from_env

    rank, world = init_distributed_from_env()
    try:
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

        # A graph break must fail the compile, never run the model eagerly unsharded.
        torch._dynamo.reset()
        broken = torch.compile(PrintingDemo(model), backend="dcp", options=options,
                               fullgraph=False, dynamic=False)
        error = None
        try:
            with torch.no_grad():
                broken(*_step_inputs(shapes, caches))
        except Exception as e:  # noqa: BLE001 - reported to the test
            inner = getattr(e, "inner_exception", e)
            error = {"type": type(e).__name__, "inner": type(inner).__name__,
                     "message": str(inner).splitlines()[0]}
        errors = [None] * world
        dist.all_gather_object(errors, error)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump({"tokens": result.tokens,
                           "logits": [step.tolist() for step in result.logits],
                           "graph_break_errors": errors}, f)
        print(f"backend_worker rank={rank} ok", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def _step_inputs(shapes, caches):
    ids = torch.zeros(shapes.batch, shapes.context_len, dtype=torch.int64)
    positions = torch.arange(shapes.context_len).expand(shapes.batch, -1).contiguous()
    table = torch.zeros(shapes.batch, shapes.max_blocks, dtype=torch.int64)
    return ids, positions, table, caches


if __name__ == "__main__":
    raise SystemExit(main())
