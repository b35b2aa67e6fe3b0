"""The planner checked: predicted vs measured decode step time on this machine, on the
threaded world (the eager program) and on XLA:CPU (the lowered program, ``--worlds``).

A sweep of models (dense: the demo model; MoE: a tiny Qwen3-MoE; MLA + MoE: a tiny
DeepSeek-V3) x layouts on 4 ranks x contexts. Each layout is transformed once (real weights,
capacity for the largest context) and its decode step timed at every context on the
threaded world (median of ``--steps`` steps, rank 0, caches of random KV as in
bench_decode); the planner prices the same program (dcp_compile.planner.breakdown) on the
``this-machine`` profile (dcp_compile.hardware, calibrated once and cached). Reports, per
model, the Spearman rank correlation of predicted vs measured step time over every
(layout, context) point and within each context, and the worst miss (predicted/measured).

On XLA:CPU each layout's program is lowered (dcp_compile.xla.lower_for_xla) and its decode
module run on ``RANKS`` host-device replicas (XLAExecutor; median of ``--steps`` steps after
a warm-up). It is priced on the same calibrated profile as a compiled graph: no eager
dispatch term (``op_overhead`` 0) and the KV read at the copy bandwidth (a compiled kernel
reads the KV once; the eager live-span kernel's measured bandwidth is not XLA's). A layout
XLA:CPU cannot run (a collective form it aborts on) is listed refused.

    python3 benchmarks/bench_plan.py [--contexts 512 4096 16384 --steps 5 --write-docs]
    python3 benchmarks/bench_plan.py --worlds xla        # XLA:CPU only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

import dcp_compile
from dcp_compile import hardware, planner
from dcp_compile.runtime.serving.engine import StepShapes

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402
from bench_decode import random_decode_inputs, timed  # noqa: E402

RANKS = 4
BLOCK = 16
LAYOUTS = [dict(dcp=1), dict(dcp=2), dict(dcp=4),
           dict(dcp=4, combine="all_to_all", interleave_size=1)]
MOE_LAYOUTS = LAYOUTS + [dict(dcp=2, expert_parallel=True)]


def models():
    import transformers

    from dcp_compile.models.demo import DemoConfig, demo_model
    from dcp_compile.models.mla import hf_deepseek
    dense = demo_model(DemoConfig(hidden_size=256, num_q_heads=8, num_kv_heads=1, head_dim=32,
                                  intermediate_size=512, num_layers=2, vocab_size=512))
    torch.manual_seed(0)
    moe = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1, head_dim=32,
        num_experts=8, num_experts_per_tok=2)).eval()
    mla = hf_deepseek("V3", first_k_dense_replace=1)
    return {"dense (demo)": (dense, LAYOUTS), "moe (qwen3-moe)": (moe, MOE_LAYOUTS),
            "mla+moe (deepseek-v3)": (mla, MOE_LAYOUTS)}


def measure(program, model, contexts, steps):
    from dcp_compile.runtime.distributed.world import bind_roles, run_threaded
    from dcp_compile.runtime.serving.rank_engine import load_rank

    def rank_main(rank):
        loaded = load_rank(program, rank, bind_roles(program.topology, rank))
        out = {}
        with torch.no_grad():
            for ctx in contexts:
                caches, table, ids, pos = random_decode_inputs(program, model, ctx, rank)
                out[ctx] = timed(lambda: loaded.run("decode", ids, pos, table, caches),
                                 steps)[0]
        return out

    return run_threaded(program.config.tp, rank_main, timeout=1800)[0]


def measure_xla(program, model, contexts, steps):
    """Median decode step seconds at each context of ``program`` lowered and run on XLA:CPU
    replicas (caches filled with a constant: the step's time does not depend on the values)."""
    from dcp_compile import xla as X
    executor = X.XLAExecutor(program, X.lower_for_xla(program), fill=0.5)
    b, max_blocks = program.shapes.batch, program.shapes.max_blocks
    table = torch.arange(b * max_blocks).view(b, max_blocks)
    ids = torch.randint(0, model.config.vocab_size, (b, 1),
                        generator=torch.Generator().manual_seed(0))
    out = {}
    for ctx in contexts:
        positions = torch.full((b, 1), ctx)
        executor.step("decode", ids, positions, table)           # warm-up
        key = ("decode", max_blocks)
        executor.step_seconds[key] = []
        for _ in range(steps):
            executor.step("decode", ids, positions, table)
        out[ctx] = statistics.median(executor.step_seconds[key])
    return out


def xla_profile(hw):
    """The calibrated profile as a compiled graph's: no per-op dispatch, KV at copy speed."""
    return hardware.with_overrides(hw, name=f"{hw.name} (xla)", op_overhead=0.0,
                                   kv_bandwidth=None)


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def deepseek_v3_table(contexts=(4096, 32768, 131072), batch=16, profile="h200"):
    """Predicted only (no hardware here): transformers' DeepseekV3Config defaults (the real
    model's sizes, bf16) on 8 ranks, tp8 vs tp8 + dcp8, compiled once each on the meta device
    (minutes: 61 layers of 256 experts) and priced at each context."""
    import transformers

    from dcp_compile.meta_init import meta_model
    model = meta_model(transformers.DeepseekV3Config(dtype="bfloat16"))
    hw = hardware.profile(profile)
    print(f"DeepSeek-V3 (bf16, meta) on 8 x {profile}, batch {batch}, predicted")
    print(f"  {'layout':<22} {'context':>7} {'step ms':>8} {'weights':>8} {'kv':>7} "
          f"{'flops':>7} {'coll':>7}  (ms; collective latency not priced)")
    for dcp in (1, 8):
        layout = planner.Layout(8, dcp, False, "all_gather", BLOCK, BLOCK)
        sink = planner.Plan(model="DeepSeek-V3", ranks=8, context_len=max(contexts),
                            batch=batch, hardware=hw)
        program = planner._compile(model, layout, max(contexts), batch, sink)
        if program is None:
            print(f"  {layout.label():<22} refused: {sink.refused[0].rule}")
            continue
        for ctx in contexts:
            p = planner.predict(planner.breakdown(program, ctx), hw, 8)
            t = {k: v * 1e3 for k, v in p.seconds.items()}
            print(f"  {layout.label():<22} {ctx:7d} {p.step_seconds * 1e3:8.2f} "
                  f"{t['weights']:8.2f} {t['kv']:7.2f} {t['flops']:7.2f} "
                  f"{t['collectives']:7.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--worlds", nargs="+", choices=("threaded", "xla"),
                    default=["threaded", "xla"],
                    help="where the steps are measured: the eager threaded world, XLA:CPU")
    ap.add_argument("--models", nargs="+", choices=("dense", "moe", "mla"),
                    default=["dense", "moe", "mla"], help="which of the sweep's models")
    ap.add_argument("--recalibrate", action="store_true",
                    help="measure this machine again instead of reading the cached profile")
    ap.add_argument("--deepseek-v3", action="store_true",
                    help="only the predicted DeepSeek-V3 tp8 vs tp8 + dcp8 table on h200 "
                         "(no measurement; compiles 61 layers on the meta device, minutes)")
    docs_section.add_argument(ap)
    args = ap.parse_args()
    if args.deepseek_v3:
        deepseek_v3_table()
        return
    if "xla" in args.worlds:
        from dcp_compile import xla as X
        X.request_host_devices(RANKS)           # before jax starts its CPU backend
    with docs_section.recorded("bench_plan", args.write_docs):
        torch.set_num_threads(1)
        hw = hardware.calibrate() if args.recalibrate else hardware.profile("this-machine")
        print(f"this-machine profile: memory {hw.memory_bandwidth / 1e9:.2f} GB/s, "
              f"peak {hw.peak_flops / 1e9:.1f} GFLOP/s, op {hw.op_overhead * 1e6:.1f} us, "
              f"collective {hw.link_latency * 1e6:.0f} us + {hw.link_bandwidth / 1e9:.2f} "
              f"GB/s; calibrated under {hw.sources.get('load_average', '?')}")
        print(f"{RANKS} ranks on threads of one {os.cpu_count()}-core host, batch "
              f"{args.batch}, fp32, median of {args.steps} steps (rank 0)\n")
        summary = []
        for name, (model, layouts) in models().items():
            if name.split()[0].split("+")[0] not in args.models:
                continue
            print(f"{name}")
            print(f"  {'layout':<26} {'world':<8} {'context':>7} {'measured ms':>12} "
                  f"{'predicted ms':>13} {'pred/meas':>9}  dominant")
            points = {w: [] for w in args.worlds}
            for kw in layouts:
                c = {"combine": "all_gather", "interleave_size": BLOCK,
                     "expert_parallel": False, **kw}
                layout = planner.Layout(RANKS, c["dcp"], c["expert_parallel"], c["combine"],
                                        c["interleave_size"], BLOCK)
                shapes = StepShapes.fitting(args.batch, BLOCK, max(args.contexts) + 1,
                                            block_size=BLOCK, dcp=layout.dcp)
                try:
                    program = dcp_compile.transform(model, tp=RANKS, block_size=BLOCK,
                                                    shapes=shapes, check=False, **c)
                except dcp_compile.DCPError as e:
                    print(f"  {layout.label():<26} refused: {str(e).splitlines()[0]}")
                    continue
                for world in args.worlds:
                    profile = hw if world == "threaded" else xla_profile(hw)
                    try:
                        measured = (measure if world == "threaded" else measure_xla)(
                            program, model, args.contexts, args.steps)
                    except dcp_compile.DCPError as e:
                        print(f"  {layout.label():<26} {world:<8} refused: "
                              f"{str(e).splitlines()[0]}")
                        continue
                    for ctx in args.contexts:
                        p = planner.predict(planner.breakdown(program, ctx), profile, RANKS)
                        points[world].append((layout.label(), ctx, measured[ctx],
                                              p.step_seconds))
                        print(f"  {layout.label():<26} {world:<8} {ctx:7d} "
                              f"{measured[ctx] * 1e3:12.2f} {p.step_seconds * 1e3:13.2f} "
                              f"{p.step_seconds / measured[ctx]:9.2f}  {p.dominant}",
                              flush=True)
            for world, pts in points.items():
                if not pts:
                    continue
                meas, pred = [p[2] for p in pts], [p[3] for p in pts]
                per_ctx = [spearman([p[3] for p in pts if p[1] == ctx],
                                    [p[2] for p in pts if p[1] == ctx])
                           for ctx in args.contexts]
                worst = max(pts, key=lambda p: max(p[3] / p[2], p[2] / p[3]))
                summary.append((name, world, spearman(pred, meas), per_ctx, worst))
            print()
        print("Spearman rank correlation, predicted vs measured step time")
        print(f"  {'model':<24} {'world':<8} {'all points':>10}  " +
              "  ".join(f"{'ctx ' + str(c):>9}" for c in args.contexts) + "  worst miss")
        for name, world, rho, per_ctx, w in summary:
            print(f"  {name:<24} {world:<8} {rho:10.2f}  " +
                  "  ".join(f"{r:9.2f}" for r in per_ctx) +
                  f"  {w[0]} ctx {w[1]}: predicted {w[3] * 1e3:.2f} ms, measured "
                  f"{w[2] * 1e3:.2f} ms ({w[3] / w[2]:.2f}x)")


if __name__ == "__main__":
    main()
