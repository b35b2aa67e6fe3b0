"""The lowered program on XLA:CPU vs the eager threaded program, same model, shapes and
prompts, one run (``--interpreter``: also vs the StableHLO reference interpreter, at tp=2).

Prints: transform and lowering time, XLA compile time per module, and the mean time of each
step kind (prompt step, decode step) on each executor, with the XLA / eager ratio. The
machine is shared: read the numbers next to the printed load average.

``--buckets`` (context lengths in tokens) builds the program with context buckets and prints
the memory-floor table: per (bucket, step kind) the bytes XLA's cost analysis counts for the
compiled module per rank next to the ideal (weights + the bucket's KV + activations,
dcp_compile.memory_floor), and the decode step's time with every sequence at the bucket's
full context.

    python3 benchmarks/bench_xla.py [--tp 4 --dcp 2 --steps 16 --layers 2] [--interpreter]
    python3 benchmarks/bench_xla.py --buckets 64,128,256,512 [--batch 4] [--ops 12]

``--ops N`` also prints, per bucket, the N HLO instructions XLA counts the most bytes for
(memory_floor.bytes_by_op: XLA's cost analysis of each top-level instruction).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dcp_compile import xla as X  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)


class Timed:
    """Executor wrapper recording each step's wall time by kind."""

    def __init__(self, inner):
        self.inner, self.times = inner, {}

    @property
    def caches(self):
        return self.inner.caches

    def step(self, kind, input_ids, positions, block_table):
        t = time.perf_counter()
        out = self.inner.step(kind, input_ids, positions, block_table)
        self.times.setdefault(kind, []).append(time.perf_counter() - t)
        return out


def eager_threaded(program, prompts, steps) -> dict:
    """Rank 0's step times on the threaded world (every rank runs; collectives sync them)."""
    import torch

    from dcp_compile.runtime.serving.rank_engine import rank_engine
    from dcp_compile.runtime.distributed.world import run_threaded

    def rank_main(rank):
        engine = rank_engine(program, rank, wrap=Timed)
        with torch.no_grad():
            result = engine.generate(prompts, steps)
        return engine.executor.times, result.tokens

    return run_threaded(program.config.tp, rank_main, timeout=600)[0]


def on_executor(executor, program, prompts, steps):
    import torch

    from dcp_compile.runtime.serving.rank_engine import prompt_kind
    from dcp_compile.runtime.serving.engine import Engine
    timed = Timed(executor)
    engine = Engine(timed, program.shapes, block_size=program.config.block_size,
                    dcp=program.config.dcp, prompt_kind=prompt_kind(program))
    with torch.no_grad():
        result = engine.generate(prompts, steps)
    return timed.times, result.tokens


def mean_ms(times, kind, skip_first=False) -> float:
    xs = times.get(kind, [])
    xs = xs[1:] if skip_first and len(xs) > 1 else xs
    return 1e3 * statistics.mean(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--buckets", type=lambda t: [int(x) for x in t.split(",")], default=None,
                    help="context buckets in tokens: print the memory-floor table")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (--buckets)")
    ap.add_argument("--reference-attention", action="store_true",
                    help="with --buckets: lower decode attention with the reference kernel "
                         "(runtime/kernels/ops.py) instead of lowering/paged_attention.py, to compare")
    ap.add_argument("--ops", type=int, default=0,
                    help="with --buckets: print the N costliest HLO instructions per bucket")
    ap.add_argument("--interpreter", action="store_true",
                    help="also time the StableHLO interpreter (at tp=2/dcp=2, small shapes)")
    docs_section.add_argument(ap)
    args = ap.parse_args()
    with docs_section.recorded("bench_xla buckets" if args.buckets else "bench_xla", args.write_docs):
        X.request_host_devices(args.tp)
        if args.buckets:
            return bucket_table_main(args)

        import torch

        import dcp_compile
        from dcp_compile.commands.verify import default_lengths
        from dcp_compile.models.demo import DemoConfig, demo_model
        from dcp_compile.runtime.serving.engine import StepShapes

        lengths = default_lengths(args.dcp, 16, 16)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
        shapes = StepShapes.fitting(len(prompts), max(lengths), max(lengths) + args.steps,
                                    block_size=16, dcp=args.dcp)
        model = demo_model(DemoConfig(num_layers=args.layers))
        print(f"demo model ({args.layers} layers), tp={args.tp} dcp={args.dcp}, prompts "
              f"{lengths}, {args.steps} decode steps, load average {os.getloadavg()[0]:.1f}, "
              f"{len(os.sched_getaffinity(0))} CPUs")
        t = time.perf_counter()
        program = dcp_compile.transform(model, tp=args.tp, dcp=args.dcp, shapes=shapes)
        print(f"transform: {time.perf_counter() - t:.2f} s")
        t = time.perf_counter()
        lowered = X.lower_for_xla(program)
        per_module = ", ".join(f"{s} {sum(m.seconds.values()):.2f} s"
                               for s, m in lowered.modules.items())
        print(f"lower to StableHLO: {time.perf_counter() - t:.2f} s ({per_module})")
        executor = X.XLAExecutor(program, lowered)
        for step, s in executor.compile_seconds.items():
            print(f"XLA compile {step}: {s:.2f} s "
                  f"({sum(lowered[step].op_counts().values())} StableHLO ops)")

        xla_times, xla_tokens = on_executor(executor, program, prompts, args.steps)
        eager_times, eager_tokens = eager_threaded(program, prompts, args.steps)
        prompt = "context" if "context" in program.graphs else "prefill"
        rows = [("prompt step (" + prompt + ")", prompt, False), ("decode step", "decode", True)]
        print(f"\n{'':<24}{'XLA:CPU':>12}{'eager threads':>15}{'XLA / eager':>13}")
        for label, kind, skip in rows:
            x, e = mean_ms(xla_times, kind, skip), mean_ms(eager_times, kind, skip)
            print(f"{label:<24}{x:>10.2f}ms{e:>13.2f}ms{x / e:>12.2f}x")
        print(f"(decode: mean of {len(xla_times.get('decode', [])) - 1} steps after the first; "
              f"greedy tokens agree: {xla_tokens == eager_tokens})")

        if args.interpreter:
            interpreter_row(args.layers)
        return 0


def full_context_step_seconds(executor, program, kind="decode", repeats=25) -> dict:
    """Median time of one ``kind`` step per bucket with every row at the bucket's full
    context (row b owns blocks b*width .. (b+1)*width-1). The buckets take turns, one step
    each per round, so a load spike on the shared machine hits every bucket alike."""
    import torch

    from dcp_compile.runtime.program.buckets import bucket_width
    c, batch = program.config, program.shapes.batch
    inputs = {}
    for bucket in program.buckets:
        width = bucket_width(bucket, block_size=c.block_size, dcp=c.dcp)
        inputs[bucket] = (torch.zeros((batch, 1), dtype=torch.int64),
                          torch.full((batch, 1), bucket - 1, dtype=torch.int64),
                          torch.arange(batch * width, dtype=torch.int64).reshape(batch, width))
    times = {bucket: [] for bucket in inputs}
    for round_ in range(repeats + 1):
        for bucket, (ids, positions, table) in inputs.items():
            t = time.perf_counter()
            executor.step(kind, ids, positions, table)
            if round_:                   # round 0 warms every module up
                times[bucket].append(time.perf_counter() - t)
    return {bucket: statistics.median(ts) for bucket, ts in times.items()}


def bucket_table_main(args) -> int:
    import dcp_compile
    from dcp_compile.memory_floor import bucket_table, format_bucket_table
    from dcp_compile.models.demo import DemoConfig, demo_model
    from dcp_compile.runtime.program.buckets import bucket_width
    from dcp_compile.runtime.serving.engine import StepShapes
    capacity = max(args.buckets)
    width = bucket_width(capacity, block_size=16, dcp=args.dcp)
    shapes = StepShapes(batch=args.batch, context_len=16, max_blocks=width,
                        num_blocks=args.batch * width + 1)
    model = demo_model(DemoConfig(num_layers=args.layers))
    print(f"demo model ({args.layers} layers), tp={args.tp} dcp={args.dcp}, batch "
          f"{args.batch}, buckets {args.buckets}, load average {os.getloadavg()[0]:.1f}, "
          f"{len(os.sched_getaffinity(0))} CPUs")
    program = dcp_compile.transform(model, tp=args.tp, dcp=args.dcp, shapes=shapes,
                                    buckets=args.buckets[:-1], check=False)
    from dcp_compile.lowering import lower
    from dcp_compile.lowering.paged_attention import LOWERING_KERNELS
    if args.reference_attention:
        LOWERING_KERNELS.clear()
        print("decode attention: the reference kernel (runtime/kernels/ops.py), lowered as is")
    executor = X.XLAExecutor(program, lower(program, steps=["decode"]))
    seconds = full_context_step_seconds(executor, program)
    table = bucket_table(executor, program)
    for bucket, kinds in table.items():
        kinds["decode"]["seconds"] = seconds[bucket]
    print("per rank, per decode step (XLA's cost analysis of the compiled module; step "
          "time with every sequence at the bucket's full context):")
    print(format_bucket_table(table))
    if args.ops:
        ops_table(executor, program, args.ops)
    return 0


def ops_table(executor, program, n: int) -> None:
    """The n instructions of each compiled decode module XLA counts the most bytes for."""
    from dcp_compile.memory_floor import bytes_by_op
    from dcp_compile.runtime.program.buckets import bucket_of_width
    c = program.config
    for (kind, width), executable in sorted(executor.executables.items(),
                                            key=lambda kv: kv[0][1]):
        rows = bytes_by_op(executable)
        bucket = bucket_of_width(width, block_size=c.block_size, dcp=c.dcp)
        print(f"\nbucket {bucket}: {sum(r[0] for r in rows)} bytes over {len(rows)} "
              f"instructions; the {n} largest:")
        for nbytes, name, opcode in rows[:n]:
            print(f"  {nbytes:>9}  {name} ({opcode})")


def interpreter_row(layers: int) -> None:
    """XLA vs eager threads vs the StableHLO reference interpreter at tp=2/dcp=2 (the
    interpreter needs a CPU per rank) on small shapes: one prompt step, one decode step."""
    import torch

    import dcp_compile
    from dcp_compile.lowering import InterpreterExecutor
    from dcp_compile.models.demo import DemoConfig, demo_model
    from dcp_compile.runtime.serving.engine import StepShapes
    shapes = StepShapes(batch=2, context_len=8, max_blocks=1, num_blocks=3)
    model = demo_model(DemoConfig(num_layers=layers, num_kv_heads=1))
    program = dcp_compile.transform(model, tp=2, dcp=2, shapes=shapes)
    lowered = X.lower_for_xla(program)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 7)]
    times = {"XLA:CPU": on_executor(X.XLAExecutor(program, lowered), program, prompts, 5)[0],
             "eager threads": eager_threaded(program, prompts, 5)[0],
             "interpreter": on_executor(InterpreterExecutor(program, lowered, isolate=True),
                                        program, prompts, 2)[0]}
    print("\ntp=2 dcp=2, batch 2, context 8 (one prompt step; decode: mean after the first, "
          "the interpreter's one step):")
    print(f"{'':<16}" + "".join(f"{k:>16}" for k in times))
    for kind in ("context", "decode"):
        print(f"{kind + ' step':<16}" + "".join(f"{mean_ms(t, kind, kind == 'decode'):>14.1f}ms"
                                               for t in times.values()))


if __name__ == "__main__":
    sys.exit(main())
