"""Speculative decoding and prefix caching, side by side in one run (machine shared: read
ratios within one table, with the load average printed next to it).

  1. width-K decode step cost and tokens/s vs K (1, 2, 4, 8) at 4k and 16k context for
     dcp 1, 2, 4 (tp = 2 * dcp, the demo model's 2 KV heads): step time is the median CPU
     time of rank 0's step on the threaded world (waiting for other ranks left out); tokens/s if every draft is accepted (K per step)
     and at the n-gram acceptance measured in table 2 on the repetitive prompt;
  2. n-gram acceptance (tokens per verification step) on a repetitive and a random prompt;
  3. prompt tokens computed for 4 prompts sharing a 1k-token prefix, with and without the
     prefix cache (and the prompt phase's wall time).

Caches are filled with random KV (no 16k prompt step): a step costs what its context costs.

    python3 benchmarks/bench_spec.py [--contexts 4096 16384 --widths 1 2 4 8 --dcps 1 2 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes
from dcp_compile.runtime.serving.kv_cache import KVCacheSpec
from dcp_compile.runtime.serving.speculative import NgramDrafter
from dcp_compile.runtime.distributed.world import run_threaded
from dcp_compile.runtime.serving.rank_engine import rank_engine
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)

BLOCK = 16


def load() -> str:
    return "load %.1f %.1f %.1f" % os.getloadavg()


def step_cost(model, context: int, dcp: int, K: int, steps: int) -> float:
    """Median CPU seconds of rank 0's width-K decode step at ``context`` prior tokens."""
    shapes = StepShapes.fitting(1, BLOCK, context + K, block_size=BLOCK, dcp=dcp,
                                decode_len=K)
    program = dcp_compile.transform(model, tp=2 * dcp, dcp=dcp, block_size=BLOCK,
                                    shapes=shapes, check=False)

    def rank_main(rank):
        engine = rank_engine(program, rank)
        for c in engine.executor.caches:
            c.normal_(generator=torch.Generator().manual_seed(rank))
        engine.lengths = [context]
        times = []
        with torch.no_grad():
            for _ in range(steps + 1):
                t0 = time.thread_time()      # this rank's CPU: steadier on a shared machine
                engine.decode_rows([list(range(1, K + 1))])
                times.append(time.thread_time() - t0)
                engine.rewind(0, context)            # every step at the same position
        return statistics.median(times[1:])
    return run_threaded(program.config.tp, rank_main)[0]


def single_engine(model, batch, context_len, max_tokens, K=1, prefix_caching=False):
    shapes = StepShapes.fitting(batch, context_len, max_tokens, block_size=BLOCK, dcp=1,
                                decode_len=K)
    c = model.config
    spec = KVCacheSpec(c.num_layers, shapes.num_blocks, BLOCK, c.num_kv_heads, c.head_dim)
    return Engine(LocalExecutor(model, spec.allocate()), shapes, block_size=BLOCK,
                  prefix_caching=prefix_caching)


def acceptance(model, K: int, steps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts = {"repetitive": ([5, 17, 3, 9, 42, 7, 11, 2] * 8),
               "random": torch.randint(0, model.config.vocab_size, (64,), generator=g).tolist()}
    out = {}
    for name, p in prompts.items():
        engine = single_engine(model, 1, len(p), len(p) + steps + K, K=K)
        with torch.no_grad():
            out[name] = engine.generate([p], steps, drafter=NgramDrafter()).stats
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--dcps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=1024)
    docs_section.add_argument(ap)
    args = ap.parse_args()
    with docs_section.recorded("bench_spec", args.write_docs):
        torch.set_num_threads(1)
        model = demo_model(DemoConfig())

        print(f"## 2. n-gram acceptance, K=4, 48 tokens ({load()})")
        acc = acceptance(model, 4, 48)
        for name, st in acc.items():
            print(f"{name:>10}: {st.mean_accepted:.2f} tokens/step "
                  f"({st.accepted}/{st.drafted} drafts accepted, {st.steps} steps)")
        rep = acc["repetitive"].mean_accepted

        print(f"\n## 1. width-K decode step, batch 1 ({load()})")
        print(f"{'context':>8} {'dcp':>4} {'K':>3} {'cpu ms':>8} {'vs K=1':>7} "
              f"{'tok/s all-acc':>13} {'tok/s rep':>10}")
        for context in args.contexts:
            for dcp in args.dcps:
                base = None
                for K in args.widths:
                    t = step_cost(model, context, dcp, K, args.steps)
                    base = base or t
                    print(f"{context:>8} {dcp:>4} {K:>3} {t * 1e3:>8.2f} {t / base:>6.2f}x "
                          f"{K / t:>13.1f} {min(rep, K) / t:>10.1f}", flush=True)

        print(f"\n## 3. prompt tokens computed, 4 prompts = {args.prefix}-token shared prefix "
              f"+ 32 own ({load()})")
        g = torch.Generator().manual_seed(1)
        shared = torch.randint(0, model.config.vocab_size, (args.prefix,), generator=g).tolist()
        prompts = [shared + torch.randint(0, model.config.vocab_size, (32,),
                                          generator=g).tolist() for _ in range(4)]
        total = sum(len(p) for p in prompts)
        for caching in (False, True):
            engine = single_engine(model, 4, args.prefix + 32, args.prefix + 40,
                                   prefix_caching=caching)
            t0 = time.perf_counter()
            with torch.no_grad():
                engine.prefill(prompts)
            wall = time.perf_counter() - t0
            computed = total - engine.allocator.reused_tokens
            print(f"prefix cache {'on ' if caching else 'off'}: {computed:>5} of {total} tokens "
                  f"computed, prompt phase {wall:.2f} s")


if __name__ == "__main__":
    main()
