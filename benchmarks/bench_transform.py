"""Compile-time cost for a Llama-3-8B-shaped model on the meta device (no weights allocated).

Hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256; tp=16, dcp=2, decode mode (two
step graphs: context and decode). For each layer count, one run prints, in seconds and as a
ratio to plain ``torch.export`` of the same model with the same step inputs:

  export    torch.export.export(model, step inputs, strict=False) for both steps, alone
  capture   our capture (torch.export + signature checks) inside transform()
  passes    our pass pipeline (incremental shape propagation; includes validate_and_prove)
  transform capture + passes, end to end
  lower     dcp_compile.lower(program) to StableHLO: each distinct op call decomposed once
            and copied for the others, repeated calls merged, then torch-mlir
  prove     a cold layout proof (no certificate cache) for the same dcp/block/interleave

A 1-layer transform and lowering run first, untimed, so one-time costs (imports, op
registration, torch-mlir's tables) are not charged to the first row. ``--full-propagation``
also times the passes with a full shape re-propagation after every pass (the pass manager's
old behaviour), for comparison; ``--full-placement-sweeps`` the passes with the placement
analysis's old full sweeps (env DCP_COMPILE_FULL_PLACEMENT_SWEEPS=1); ``--stack-traces``
the transform with every node recording its source line (what a dump gets; the default
records none: dcp_compile.capture.stack_traces).

    python3 -m benchmarks.bench_transform [--layers 8,32,80] [--repeat N] [--no-lower]

The machine's load is printed with the table: on a shared machine compare the ratios of
one run, not seconds across runs.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

import dcp_compile
from dcp_compile.capture import example_step_inputs
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.passes.pipeline import STEPS_BY_MODE
from dcp_compile.runtime.serving.engine import StepShapes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)

BLOCK = 16


def llama3_8b(layers: int) -> DemoConfig:
    return DemoConfig(vocab_size=128256, hidden_size=4096, num_layers=layers, num_q_heads=32,
                      num_kv_heads=8, head_dim=128, intermediate_size=14336,
                      rope_theta=500000.0)


def time_export(model, shapes: StepShapes, mode: str) -> float:
    """Plain torch.export of every step graph transform() captures, with the same inputs."""
    cache_shape = model.kv_cache_shape(shapes.num_blocks, BLOCK)
    dtype = next(model.parameters()).dtype
    total = 0.0
    for step in STEPS_BY_MODE[mode]:
        tokens = 1 if step == "decode" else shapes.context_len
        example = example_step_inputs(shapes.batch, tokens, shapes.max_blocks, cache_shape,
                                      model.num_layers, device="meta", dtype=dtype)
        t0 = time.perf_counter()
        torch.export.export(model, example, strict=False)
        total += time.perf_counter() - t0
    return total


def time_transform(model, args, shapes):
    t0 = time.perf_counter()
    prog = dcp_compile.transform(model, tp=args.tp, dcp=args.dcp, mode="decode",
                                 block_size=BLOCK, shapes=shapes)
    total = time.perf_counter() - t0
    capture = sum(r.matched.get("capture_seconds", 0.0) for r in prog.history)
    passes = sum(r.seconds for r in prog.history)
    return prog, capture, passes, total


def time_transform_with_stack_traces(model, args, shapes) -> float:
    """The transform again, every node recording its source line (CompileOptions)."""
    from dcp_compile.driver import CompileOptions, compile_program
    from dcp_compile.frontends import frontend_for
    from dcp_compile.runtime.config import DCPConfig
    config = DCPConfig(tp=args.tp, dcp=args.dcp, mode="decode", block_size=BLOCK)
    t0 = time.perf_counter()
    compile_program(frontend_for(model, shapes), config, CompileOptions(stack_traces=True))
    return time.perf_counter() - t0


def time_passes_full_propagation(model, args, shapes) -> float:
    """The passes again, re-propagating the whole graph after each (the old manager)."""
    from dcp_compile.passes import propagation

    def full(gm, changed, before=None):
        propagation.repropagate(gm)
        return len(gm.graph.nodes)

    real = propagation.propagate_changed
    propagation.propagate_changed = full
    try:
        return time_transform(model, args, shapes)[2]
    finally:
        propagation.propagate_changed = real


def time_passes_full_placement_sweeps(model, args, shapes) -> float:
    """The passes again, the placement analysis sweeping every node on every sweep (its old
    algorithm, quadratic in the layers) instead of only the nodes whose inputs changed."""
    import os
    from dcp_compile.passes.placement.analysis import FULL_SWEEPS_ENV
    os.environ[FULL_SWEEPS_ENV] = "1"
    try:
        return time_transform(model, args, shapes)[2]
    finally:
        del os.environ[FULL_SWEEPS_ENV]


def time_lower(prog) -> tuple[float | str, dict]:
    """Lowering seconds (or why it failed) and its phases summed over the step graphs."""
    t0 = time.perf_counter()
    try:
        result = dcp_compile.lower(prog)
    except Exception as e:  # noqa: BLE001 - a benchmark row, not a crash
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}", {}
    phases: dict[str, float] = {}
    for module in result.modules.values():
        for phase, sec in module.seconds.items():
            phases[phase] = phases.get(phase, 0.0) + sec
    return time.perf_counter() - t0, phases


def time_prove(dcp: int) -> float:
    from dcp_compile.passes.prove import theorems as proofs
    from dcp_compile.runtime import layout
    t0 = time.perf_counter()
    proofs._prove(dcp, BLOCK, BLOCK, layout)  # uncached: the cold proof
    return time.perf_counter() - t0


def _load() -> str:
    import os
    return "load average %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count() or 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="8,32,80")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run export and transform this many times each, alternately, and "
                         "report each one's fastest (for a loaded machine)")
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--no-lower", action="store_true", help="skip the lowering column")
    ap.add_argument("--full-propagation", action="store_true",
                    help="also time the passes with a full re-propagation after each")
    ap.add_argument("--stack-traces", action="store_true",
                    help="also time the transform with every node's source line recorded")
    ap.add_argument("--full-placement-sweeps", action="store_true",
                    help="also time the passes with the placement analysis's old full sweeps")
    docs_section.add_argument(ap)
    args = ap.parse_args()
    with docs_section.recorded("bench_transform", args.write_docs):
        print("load:", _load())
        shapes = StepShapes(batch=8, context_len=1024, max_blocks=256, num_blocks=2049)
        warm = dcp_compile.transform(demo_model(llama3_8b(1), device="meta"), tp=args.tp,
                                     dcp=args.dcp, mode="decode", block_size=BLOCK, shapes=shapes)
        if not args.no_lower:
            dcp_compile.lower(warm)     # one-time costs: torch-mlir's tables, MLIR contexts

        cols = ["export", "capture", "passes", "transform", "lower", "prove"]
        print(f"seconds (x torch.export), tp={args.tp} dcp={args.dcp} block={BLOCK}, decode "
              f"mode = context + decode graphs")
        print(f"{'layers':>6} " + " ".join(f"{c:>16}" for c in cols) + f" {'maxrss MB':>10}")
        rows = {}
        for layers in [int(x) for x in args.layers.split(",")]:
            model = demo_model(llama3_8b(layers), device="meta")
            # Alternate export and transform, keep each one's fastest run: on a loaded machine
            # the minimum is the run least disturbed by other processes.
            export, capture, passes, total = (float("inf"),) * 4
            for _ in range(args.repeat):
                export = min(export, time_export(model, shapes, "decode"))
                prog, c, p, t = time_transform(model, args, shapes)
                capture, passes, total = min(capture, c), min(passes, p), min(total, t)
            lower, phases = ("skipped", {}) if args.no_lower else time_lower(prog)
            prove = time_prove(args.dcp)
            row = dict(export=export, capture=capture, passes=passes, transform=total,
                       lower=lower, prove=prove)
            rows[layers] = row
            cells = []
            for c in cols:
                v = row[c]
                cells.append(f"{v:>7.2f} ({v / export:>5.2f}x)" if isinstance(v, float)
                             else f"{v[:16]:>16}")
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(f"{layers:>6} " + " ".join(cells) + f" {rss:>10.0f}", flush=True)
            if args.full_propagation:
                full = time_passes_full_propagation(model, args, shapes)
                print(f"{'':>6} passes with full re-propagation after each pass: {full:.2f} s "
                      f"(incremental: {passes:.2f} s)", flush=True)
            if args.stack_traces:
                traced = min(time_transform_with_stack_traces(model, args, shapes)
                             for _ in range(args.repeat))
                print(f"{'':>6} transform with stack traces: {traced:.2f} s (without: "
                      f"{total:.2f} s, {traced / total:.2f}x)", flush=True)
            if args.full_placement_sweeps:
                full = time_passes_full_placement_sweeps(model, args, shapes)
                print(f"{'':>6} passes with full placement sweeps: {full:.2f} s "
                      f"(worklist: {passes:.2f} s)", flush=True)
            if isinstance(lower, str) and lower.startswith("failed"):
                print(f"{'':>6} lower {lower}")
            if phases:
                print(f"{'':>6} lower phases: " + ", ".join(f"{k} {v:.2f} s"
                                                            for k, v in phases.items()))
        print("load:", _load())
        if len(rows) > 1:
            first, last = min(rows), max(rows)
            scale = rows[last]["transform"] / rows[first]["transform"]
            print(f"transform {last} layers / {first} layers: {scale:.2f}x "
                  f"(layers ratio {last / first:.2f}x)")


if __name__ == "__main__":
    main()
