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

``--published`` sets published DCP figures (engines' PRs: model, hardware, layouts, context,
load -> TPOT or throughput ratio of DCP over no DCP, :data:`FIGURES`) next to the planner's
prediction of the same ratio, from meta-device compiles of the real models' configs, one per
(model, layout, batch), cached (:func:`cached_breakdowns`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
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


def context_buckets(contexts, dcp: int) -> list[int]:
    """A bucket per context (the program's capacity is the last): a static-shape step costs
    its whole cache operand on XLA:CPU (docs/lowering.md), so each context runs in the
    smallest bucket holding it (planner.bucket_for), as a served program would."""
    vblock = BLOCK * dcp
    return sorted({-(-(ctx + 1) // vblock) * vblock for ctx in contexts})[:-1]


def measure_xla(program, model, contexts, steps):
    """Median decode step seconds at each context of ``program`` lowered and run on XLA:CPU
    replicas, in the context's bucket (caches filled with a constant: the step's time does
    not depend on the values)."""
    from dcp_compile import xla as X
    executor = X.XLAExecutor(program, X.lower_for_xla(program), fill=0.5)
    b, vblock = program.shapes.batch, program.config.vblock
    ids = torch.randint(0, model.config.vocab_size, (b, 1),
                        generator=torch.Generator().manual_seed(0))
    out = {}
    for ctx in contexts:
        width = min(-(-(ctx + 1) // vblock), program.shapes.max_blocks)
        table = torch.arange(b * width).view(b, width)
        positions = torch.full((b, 1), ctx)
        executor.step("decode", ids, positions, table)           # warm-up
        key = ("decode", width)
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


# -- against published DCP numbers (issue #40 item 3, second bullet) -------------------------

# The real models' sizes as transformers configs (bf16: the meta model is not built in FP8),
# each with where its numbers were read.
KIMI_K2_CONFIG = ("https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json "
                  "(DeepseekV3ForCausalLM: 61 layers, 64 heads, 384 routed experts top-8, "
                  "1 dense layer, vocab 163840)")
V2_LITE_CONFIG = ("https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json "
                  "(27 layers, 16 heads, no q LoRA, 64 routed experts top-6, 2 shared)")


def published_config(name):
    import transformers
    if name == "deepseek-v3":          # DeepSeek-V3 / R1: transformers' defaults are its sizes
        return transformers.DeepseekV3Config(dtype="bfloat16")
    if name == "kimi-k2":
        return transformers.DeepseekV3Config(
            dtype="bfloat16", vocab_size=163840, num_attention_heads=64,
            num_key_value_heads=64, n_routed_experts=384, first_k_dense_replace=1,
            n_group=1, topk_group=1, routed_scaling_factor=2.827)
    if name == "deepseek-v2-lite":
        return transformers.DeepseekV2Config(
            dtype="bfloat16", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
            moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
            num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
            num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
            q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128)
    raise ValueError(f"unknown published model {name!r}")


# Contexts every compiled (model, layout, batch) is priced at (tokens a decode step reads).
PUBLISHED_CONTEXTS = (1536, 4608, 4750, 8704, 12288, 32768, 65536, 131072, 262144)
PUBLISHED_RANKS = {"deepseek-v3": 8, "kimi-k2": 8, "deepseek-v2-lite": 2}


def _breakdown_cache():
    return hardware.cache_path().parent / "published_breakdowns.json"


def cached_breakdowns(model, dcp, batch, contexts=PUBLISHED_CONTEXTS, compile_missing=True):
    """``{context: Breakdown}`` of ``model`` (a :func:`published_config` name) at tp =
    PUBLISHED_RANKS, ``dcp`` (all-gather combine, interleave = block), ``batch``: compiled
    once on the meta device (minutes for the 61-layer models) and cached by key in
    ``published_breakdowns.json`` next to the hardware cache, so every figure of the same
    (model, layout, batch) is priced from one compile."""
    import json
    from dataclasses import asdict

    from dcp_compile.meta_init import meta_model
    path = _breakdown_cache()
    key = f"{model}|tp{PUBLISHED_RANKS[model]}|dcp{dcp}|b{batch}"
    cache = json.loads(path.read_text()) if path.exists() else {}
    row = cache.get(key, {})
    if not all(str(c) in row for c in contexts):
        if not compile_missing:
            return None
        tp = PUBLISHED_RANKS[model]
        layout = planner.Layout(tp, dcp, False, "all_gather", BLOCK, BLOCK)
        sink = planner.Plan(model=model, ranks=tp, context_len=max(contexts), batch=batch,
                            hardware=hardware.PROFILES["h200"])
        t = time.perf_counter()
        program = planner._compile(meta_model(published_config(model)), layout,
                                   max(contexts), batch, sink)
        if program is None:
            raise dcp_compile.DCPError(f"{key}: refused: {sink.refused[0].rule}")
        row = {str(c): asdict(planner.breakdown(program, c)) for c in contexts}
        print(f"  compiled {key} in {time.perf_counter() - t:.0f} s", flush=True)
        cache = json.loads(path.read_text()) if path.exists() else {}  # another process's
        cache[key] = row
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, indent=0))
    return {int(c): planner.Breakdown(**b) for c, b in row.items()}


@dataclass(frozen=True)
class Figure:
    """One published DCP measurement: the ratio DCP / no DCP of ``metric`` (TPOT: time per
    output token, lower is better for DCP; throughput: output tokens/s, higher is better)."""
    source: str
    url: str
    model: str              # a published_config name (the architecture and sizes)
    setup: str              # as the source states it: model, hardware, engine, dtype, load
    hardware: str           # the profile the prediction is priced on
    layouts: str            # the two layouts compared
    context: int            # tokens a decode step reads: ISL + OSL / 2 for a serving run
    batches: tuple          # running sequences priced (compiled once each)
    metric: str             # "TPOT" or "throughput"
    published: float        # DCP / no DCP, from the source's own numbers
    fp8_weights: bool = True    # the served checkpoint's weights are 8-bit (see below)
    concurrency: int | None = None   # requests in flight, when the source gives it
    overrides: tuple = ()   # (field, value, source) of the profile the source's part differs in
    dcp: int = 8            # the DCP degree compared with dcp 1 (tp = PUBLISHED_RANKS)


_ATOM = "https://github.com/ROCm/ATOM/pull/847"
_ATOM_SETUP = ("DeepSeek-R1, 8x MI355X, ATOM, random ISL/OSL {io}, mean TPOT {tp} ms (TP8) vs "
               "{dcp} ms (TP8DCP8); bf16 KV (FP8 attention + DCP unsupported); the "
               "concurrency of this table is not in the text read")
_ANT = "https://github.com/antgroup/sglang/pull/19"
_S33926 = "https://github.com/sgl-project/sglang/pull/33926"
_S33926_SETUP = ("SGLang trtllm_mla DCP (sm100, DeepseekV3ForCausalLM; the GPU and checkpoint "
                 "are not named in the text read), output tok/s at concurrency 64: dcp8 {r} "
                 "over dcp1")
_S14194 = "https://github.com/sgl-project/sglang/pull/14194"
_V25049 = "https://github.com/vllm-project/vllm/pull/25049"

FIGURES = [
    *(Figure("ROCm/ATOM #847", _ATOM, "deepseek-v3",
             _ATOM_SETUP.format(io=io, tp=tp, dcp=dcp), "mi355x", "tp8 vs tp8 dcp8", ctx,
             (1, 64), "TPOT", round(dcp / tp, 3))
      for io, ctx, tp, dcp in (("1k/1k", 1536, 59.43, 76.48), ("8k/1k", 8704, 167.17, 141.54),
                               ("8k/8k", 12288, 139.45, 93.21))),
    Figure("antgroup/sglang #19", _ANT, "deepseek-v3",
           "DeepSeek-V3.1, SGLang, max_running_reqs 32, batch 24, ISL 4096 / OSL 1024, mean "
           "TPOT 44.04 ms (tp8) vs 33.69 ms (tp8+dcp8); the GPU is not named in the text "
           "read (priced on h20: the author's other DCP figures, sglang #14194, are on "
           "H20-3e)", "h20", "tp8 vs tp8 dcp8", 4608, (24,), "TPOT", round(33.69 / 44.04, 3),
           concurrency=24),
    *(Figure("sgl-project/sglang #33926", _S33926, "deepseek-v3",
             _S33926_SETUP.format(r=f"+{gain}%"), "b200", "tp8 vs tp8 dcp8", ctx, (64,),
             "throughput", round(1 + gain / 100, 2), concurrency=64)
      for ctx, gain in ((32768, 57), (65536, 57), (131072, 68), (262144, 52))),
    Figure("sgl-project/sglang #14194", _S14194, "kimi-k2",
           "Kimi-K2-Instruct-0905, 8x H20-3e, SGLang, max concurrency 48, 480 requests of "
           "ISL 4000 / OSL 1500, output tok/s 858.31 (dcp8+tp8) vs 382.54 (tp8); peak "
           "concurrent requests 96 vs 56, mean TTFT 7.7 s vs 150 s (tp8 queues: its KV is full)",
           "h20", "tp8 vs tp8 dcp8", 4750, (48,), "throughput", round(858.31 / 382.54, 2),
           concurrency=48,
           overrides=(("memory_bytes", 141 * hardware.GB,
                       "https://www.apetops-us.com/help/ai-293-h20-different-memory-versions-"
                       "a-deep-analysis-of-performance-differences-and-large-model-"
                       "adaptability (H20 in 96 GB and 141 GB versions; the 141 GB one's "
                       "bandwidth is not stated: the 96 GB one's 4.0 TB/s is used)"),)),
    Figure("vllm-project/vllm #25049", _V25049, "deepseek-v3",
           "DeepSeek-R1-0528, vLLM FLASH_ATTN_MLA (FA3: a Hopper GPU, not named), 4096 "
           "requests at max concurrency 4096, output tok/s 3502.24 (tp8+dcp8) vs 2332.43 "
           "(tp8); ISL/OSL not in the text read (priced at 4608)", "h200", "tp8 vs tp8 dcp8",
           4608, (64,), "throughput", round(3502.24 / 2332.43, 2), concurrency=4096),
]


# SGLang #33926's crossing: the concurrency below which dcp8 is slower than dcp1 (a step-time
# comparison at low concurrency, where neither arm is held by its KV capacity).
BREAK_EVEN = [(32768, "8-16"), (65536, "4-8"), (131072, "2-4"), (262144, "below 1")]


def _with_fp8_weights(b):
    """``b`` with its weights at one byte a parameter (an FP8 checkpoint) instead of the
    meta model's two: a what-if, since the meta model is built in bf16 (the KV stays bf16)."""
    from dataclasses import replace
    return replace(b, weight_bytes=b.weight_bytes // 2, expert_bytes=b.expert_bytes // 2,
                   weight_bytes_read=b.weight_bytes_read // 2)


def published_prediction(fig, batch, breakdowns):
    """(predicted DCP / no-DCP ratio of ``fig.metric`` at ``batch``, capacities (tp, dcp) in
    sequences of the figure's context, unpriced terms, step seconds (tp, dcp), "" or how the
    ratio is only a bound: a throughput arm the KV capacity holds below the priced batch),
    from the cached breakdowns
    ``{(dcp, batch): {context: Breakdown}}``."""
    ranks, dcps = PUBLISHED_RANKS[fig.model], (1, fig.dcp)
    hw = hardware.profile(fig.hardware)
    if fig.overrides:
        hw = hardware.with_overrides(hw, **{f: v for f, v, _ in fig.overrides})
    steps, caps, unpriced = {}, {}, set()
    for dcp in dcps:
        b = breakdowns[(dcp, batch)][fig.context]
        if fig.fp8_weights:
            b = _with_fp8_weights(b)
        p = planner.predict(b, hw, ranks)
        steps[dcp] = p.step_seconds
        caps[dcp] = planner.kv_capacity(b, hw, ranks, batch)
        unpriced.update(p.unpriced)
    ratio = steps[fig.dcp] / steps[1]
    bound = ""
    if fig.metric == "throughput":
        # tokens/s = running sequences / step; the running batch is capped by KV capacity.
        # An arm that runs fewer sequences than the priced batch is priced at the batch's
        # step (a longer one than its own): the ratio is then a bound (tp capped: an upper
        # one, dcp capped: a lower one, both: neither, "~").
        running = {d: min(fig.concurrency or batch, caps[d] or 0, batch) for d in caps}
        ratio = (running[fig.dcp] / steps[fig.dcp]) / (running[1] / steps[1]) \
            if running[1] else float("inf")
        bound = {(True, False): "<=", (False, True): ">=", (True, True): "~"}.get(
            (running[1] < batch, running[fig.dcp] < batch), "")
    return (ratio, (caps[1], caps[fig.dcp]), sorted(unpriced), (steps[1], steps[fig.dcp]),
            bound)


def published_table(figures=FIGURES, compile_missing=True):
    """Print every figure next to the planner's prediction of the same ratio."""
    needed = sorted({(f.model, d, b) for f in figures for b in f.batches
                     for d in (1, f.dcp)})
    breakdowns = {}
    for model, dcp, batch in needed:
        row = cached_breakdowns(model, dcp, batch, compile_missing=compile_missing)
        if row is not None:
            breakdowns.setdefault(model, {})[(dcp, batch)] = row
    print("Published DCP figures vs the planner (ratio = DCP / no DCP; TPOT: lower favours "
          "DCP, throughput: higher)")
    print(f"  {'source':<26} {'hw':<7} {'context':>7} {'metric':<10} {'published':>9}  "
          f"{'batch':>5} {'predicted':>9} {'pred/pub':>8}  {'tp ms':>7} {'dcp ms':>7}  "
          f"capacity tp/dcp (seqs)")
    for f in figures:
        for batch in f.batches:
            hw = f"{f.hardware}{'*' if f.overrides else ''}"
            have = breakdowns.get(f.model, {})
            if (1, batch) not in have or (f.dcp, batch) not in have:
                print(f"  {f.source:<26} {hw:<7} {f.context:7d} {f.metric:<10} "
                      f"{f.published:9.3f}  {batch:5d} not compiled: {f.model} tp"
                      f"{PUBLISHED_RANKS[f.model]} at batch {batch} (dcp 1 and {f.dcp})")
                continue
            ratio, caps, unpriced, steps, bound = published_prediction(f, batch, have)
            shown = f"{bound}{ratio:.3f}"
            print(f"  {f.source:<26} {hw:<7} {f.context:7d} {f.metric:<10} "
                  f"{f.published:9.3f}  {batch:5d} {shown:>9} {ratio / f.published:8.2f}  "
                  f"{steps[0] * 1e3:7.2f} {steps[1] * 1e3:7.2f}  {caps[0]}/{caps[1]}  "
                  f"(unpriced: {', '.join(unpriced) or '-'})",
                  flush=True)
    print(f"\n  {_S33926} break-even concurrency (measured) vs the planner's step ratio "
          f"dcp8 / dcp1 on b200 (below 1: dcp8 faster)")
    have = breakdowns.get("deepseek-v3", {})
    for ctx, measured in BREAK_EVEN:
        cells = []
        for batch in sorted({b for _, b in have}):
            if (1, batch) in have and (8, batch) in have:
                fig = Figure("", "", "deepseek-v3", "", "b200", "", ctx, (batch,), "TPOT", 1.0)
                cells.append(f"batch {batch}: {published_prediction(fig, batch, have)[0]:.3f}")
        print(f"  {ctx:7d}  measured crossing at concurrency {measured:<8} planner: "
              f"{', '.join(cells) or 'not compiled'}")
    for f in figures:
        for field_, value, source in f.overrides:
            print(f"  * {f.source}: {field_} = {value:.3g} ({source})")


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
    ap.add_argument("--published", action="store_true",
                    help="only the published DCP figures next to the planner's predictions "
                         "(docs/planner.md 'Against published DCP numbers'; compiles "
                         "DeepSeek-V3's 61 layers per (layout, batch) on the meta device once, "
                         "cached in published_breakdowns.json)")
    ap.add_argument("--cached-only", action="store_true",
                    help="with --published: price only what is cached, list the rest as not "
                         "compiled")
    docs_section.add_argument(ap)
    args = ap.parse_args()
    if args.deepseek_v3:
        deepseek_v3_table()
        return
    if args.published:
        published_table(compile_missing=not args.cached_only)
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
                    program = dcp_compile.transform(
                        model, tp=RANKS, block_size=BLOCK, shapes=shapes, check=False,
                        buckets=context_buckets(args.contexts, layout.dcp) or None, **c)
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
