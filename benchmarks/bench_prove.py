"""Cold proof time of the layout theorems over a grid of configurations.

Each configuration is proven in a fresh process state (no certificate cache): wall and CPU
seconds, and the number of pieces the symbolic proof split the domain into (independent of
block_size by construction; see passes/prove/engine.py).

    python3 benchmarks/bench_prove.py [--dcp 2,8,16] [--block 16,64,128,256,1024]
"""

from __future__ import annotations

import argparse
import time

import dcp_compile.runtime.layout  # noqa: F401  (import cost is not proof cost)
from dcp_compile.passes.prove.theorems import prove
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dcp", default="2,8,16")
    ap.add_argument("--block", default="16,64,128,256,1024")
    docs_section.add_argument(ap)
    args = ap.parse_args()
    with docs_section.recorded("bench_prove", args.write_docs):
        print(f"{'dcp':>4} {'block':>6} {'interleave':>10} {'ok':>3} {'wall s':>7} {'cpu s':>6} "
              f"{'pieces':>7}")
        worst = 0.0
        for dcp in map(int, args.dcp.split(",")):
            for block in map(int, args.block.split(",")):
                for interleave in sorted({1, 16 if block >= 16 else block, block}):
                    t0, c0 = time.perf_counter(), time.process_time()
                    cert = prove(dcp, interleave, block)
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    worst = max(worst, wall)
                    print(f"{dcp:>4} {block:>6} {interleave:>10} {'yes' if cert.ok else 'NO':>3} "
                          f"{wall:>7.3f} {cpu:>6.3f} {sum(t.cases for t in cert.theorems):>7}",
                          flush=True)
        print(f"slowest: {worst:.3f} s")


if __name__ == "__main__":
    main()
