"""Transform cost for a Llama-3-8B-shaped model on the meta device (no weights allocated).

Hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256; tp=16, dcp=2. Prints, per layer
count, capture time vs passes time side by side and the peak resident memory growth, so the
scaling from 8 to 32 to 80 layers is visible in one run.

    python3 benchmarks/bench_transform.py [--layers 8,32,80]
"""

from __future__ import annotations

import argparse
import resource
import time
import tracemalloc

import dcp_compile
from dcp_compile.models import DemoConfig, demo_model
from runtime.engine import StepShapes


def llama3_8b(layers: int) -> DemoConfig:
    return DemoConfig(vocab_size=128256, hidden_size=4096, num_layers=layers, num_q_heads=32,
                      num_kv_heads=8, head_dim=128, intermediate_size=14336,
                      rope_theta=500000.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="8,32,80")
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--dcp", type=int, default=2)
    args = ap.parse_args()
    shapes = StepShapes(batch=8, context_len=1024, max_blocks=256, num_blocks=2049)
    print(f"{'layers':>6} {'capture s':>10} {'passes s':>9} {'passes/capture':>15} "
          f"{'total s':>8} {'py peak MB':>11} {'maxrss MB':>10}")
    for layers in [int(x) for x in args.layers.split(",")]:
        model = demo_model(llama3_8b(layers), device="meta")
        tracemalloc.start()
        t0 = time.perf_counter()
        prog = dcp_compile.transform(model, tp=args.tp, dcp=args.dcp, mode="decode",
                                     shapes=shapes)
        total = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        capture = sum(r.matched.get("capture_seconds", 0.0) for r in prog.history)
        passes = sum(r.seconds for r in prog.history)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{layers:>6} {capture:>10.2f} {passes:>9.2f} {passes / capture:>15.2f} "
              f"{total:>8.2f} {peak / 2**20:>11.1f} {rss:>10.0f}")


if __name__ == "__main__":
    main()
