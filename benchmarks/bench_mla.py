"""MLA (DeepSeek latent attention) under DCP: KV bytes per rank and decode step time vs dcp.

A DeepSeek-shaped MLA model (dcp_compile/models/mla.py: kv_lora_rank L=512, rope dr=64,
16 heads, qk_nope = v = 128) at tp=8, dcp in {1, 2, 4, 8}, with a long context already in
the cache. The cache holds one latent head ([latent ; k_pe], L + dr values per token and
layer), so each rank's KV bytes fall as 1/dcp (plus the garbage block); the expanded K/V a
plain GQA cache of the same model would hold is printed for comparison.

Step time: the decode program on a threaded world (every rank a thread), one decode step of
``--batch`` sequences whose ``--context`` tokens are in the cache (random latents written
straight into each rank's blocks: the context step is not run, it would dominate the wall
time), wall seconds of the step on rank 0, median of ``--steps``. Ratios are against dcp=1.
Printed, never asserted; on a small machine the ranks share its cores, so the times are the
sum of all ranks' work, not one device's.

    python3 benchmarks/bench_mla.py [--tp 8] [--dcps 1,2,4,8] [--context 4096] [--batch 4]
                                    [--layers 3] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dcp_compile
from dcp_compile.models.mla import MLAConfig, plain_mla
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.serving.rank_engine import load_rank
from dcp_compile.runtime.distributed.world import run_threaded
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)

BLOCK = 16


def decode_step_seconds(program, batch: int, context: int, steps: int) -> float:
    """Median wall time of one decode step on rank 0 (every sequence ``context`` long)."""
    shapes = program.shapes

    def rank_main(rank):
        loaded = load_rank(program, rank)
        g = torch.Generator().manual_seed(rank)
        caches = [torch.randn(c.shape, generator=g, dtype=c.dtype)
                  for c in program.cache_spec().allocate()]
        ids = torch.zeros(batch, 1, dtype=torch.long)
        positions = torch.full((batch, 1), context, dtype=torch.long)
        per_row = shapes.max_blocks
        table = torch.arange(batch * per_row, dtype=torch.long).view(batch, per_row)
        step = loaded.step_fn("decode")
        seconds = []
        with torch.no_grad():
            for _ in range(steps + 1):           # the first step warms up
                t0 = time.perf_counter()
                step(ids, positions, table, caches)
                seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds[1:])
    return run_threaded(program.config.tp, rank_main)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--dcps", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    docs_section.add_argument(ap)
    args = ap.parse_args()
    with docs_section.recorded("bench_mla", args.write_docs):
        cfg = MLAConfig(num_layers=args.layers, hidden_size=512, num_q_heads=16, kv_lora_rank=512,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        intermediate_size=512, vocab_size=256)
        model = plain_mla(cfg)
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        expanded = cfg.num_q_heads * (cfg.qk_head_dim + cfg.v_head_dim)
        print(f"MLA: heads={cfg.num_q_heads} L={cfg.kv_lora_rank} dr={cfg.qk_rope_head_dim} "
              f"dn=dv={cfg.v_head_dim}, {cfg.num_layers} layers: {latent} values/token/layer "
              f"latent vs {expanded} expanded K/V; tp={args.tp}, batch {args.batch} x context "
              f"{args.context}, block {BLOCK}, fp32, {torch.get_num_threads()} intra-op threads")
        print(f"{'dcp':>4} {'KV MB/rank':>11} {'x dcp=1':>8} {'tp-only expanded MB/rank':>25} "
              f"{'decode step s':>14} {'x dcp=1':>8}")
        base = None
        for dcp in map(int, args.dcps.split(",")):
            max_blocks = -(-(args.context + 1) // (BLOCK * dcp))
            shapes = StepShapes(batch=args.batch, context_len=16, max_blocks=max_blocks,
                                num_blocks=args.batch * max_blocks + 1)
            program = dcp_compile.transform(model, tp=args.tp, dcp=dcp, mode="decode",
                                            block_size=BLOCK, shapes=shapes, check=False)
            kv = program.cache_spec().bytes_per_rank()
            # The same token capacity with an expanded K/V cache sharded by heads over tp only.
            tokens = (shapes.num_blocks - 1) * dcp * BLOCK + BLOCK
            tp_expanded = cfg.num_layers * tokens * (expanded // args.tp) * 4
            step = decode_step_seconds(program, args.batch, args.context, args.steps)
            base = base or (kv, step)
            print(f"{dcp:>4} {kv / 2**20:>11.2f} {kv / base[0]:>8.3f} {tp_expanded / 2**20:>25.2f} "
                  f"{step:>14.4f} {step / base[1]:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
