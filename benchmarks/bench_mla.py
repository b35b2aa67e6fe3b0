"""MLA (DeepSeek latent attention) under DCP: KV bytes per rank and decode step time vs dcp.

The hand-written MLA model (dcp_compile/mla_models.py) at tp=8, dcp in {1, 2, 4, 8}: the
cache holds one latent head ([latent ; k_pe], kv_lora_rank + qk_rope_head_dim per token and
layer), so each rank's KV bytes fall as 1/dcp (plus the garbage block); an expanded-K/V
cache (what plain GQA caching of the expanded keys/values would hold) is printed for
comparison. Step time: threaded world (every rank a thread), wall seconds per decode step,
median over the decode steps on rank 0. Printed, never asserted.

    python3 benchmarks/bench_mla.py [--tp 8] [--dcps 1,2,4,8] [--context 64] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dcp_compile
from dcp_compile.mla_models import MLAConfig, plain_mla
from dcp_compile.verify import prompt_kind
from runtime.engine import Engine, LocalExecutor, StepShapes
from runtime.world import bind_roles, run_threaded


class TimedExecutor:
    """Pass-through executor recording the wall time of each decode step."""

    def __init__(self, inner):
        self.inner, self.decode_seconds = inner, []

    @property
    def caches(self):
        return self.inner.caches

    def step(self, kind, *args):
        t0 = time.perf_counter()
        out = self.inner.step(kind, *args)
        if kind == "decode":
            self.decode_seconds.append(time.perf_counter() - t0)
        return out


def decode_step_seconds(program, prompts, steps) -> float:
    """Median decode step wall time on rank 0 of a threaded world."""
    def rank_main(rank):
        loaded = program.load(rank, bind_roles(program.topology, rank))
        ex = TimedExecutor(LocalExecutor(loaded.step_fns(), program.cache_spec().allocate()))
        engine = Engine(ex, program.shapes, block_size=program.config.block_size,
                        dcp=program.config.dcp, prompt_kind=prompt_kind(program))
        with torch.no_grad():
            engine.generate(prompts, steps)
        return statistics.median(ex.decode_seconds)
    return run_threaded(program.config.tp, rank_main)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--dcps", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    cfg = MLAConfig(num_layers=2)
    model = plain_mla(cfg)
    block = 4
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    expanded = cfg.num_q_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    print(f"MLA: heads={cfg.num_q_heads} kv_lora_rank={cfg.kv_lora_rank} "
          f"rope={cfg.qk_rope_head_dim}: {latent} values/token/layer latent vs {expanded} "
          f"expanded K/V; tp={args.tp}, context {args.context}, fp32")
    print(f"{'dcp':>4} {'KV bytes/rank':>14} {'tp-only latent':>15} {'tp-only expanded':>17} "
          f"{'step s':>8}")
    g = torch.Generator().manual_seed(0)
    prompt = [torch.randint(0, cfg.vocab_size, (args.context,), generator=g).tolist()]
    for dcp in map(int, args.dcps.split(",")):
        tokens = args.context + args.steps + 1
        max_blocks = -(-tokens // (block * dcp))
        shapes = StepShapes(batch=1, context_len=args.context, max_blocks=max_blocks,
                            num_blocks=max_blocks + 1)
        program = dcp_compile.transform(model, tp=args.tp, dcp=dcp, mode="decode",
                                        block_size=block, shapes=shapes, check=False)
        spec = program.cache_spec()
        # The same token capacity without DCP (every rank all tokens): latent / expanded K/V.
        tokens_cap = (shapes.num_blocks - 1) * dcp * block + block
        tp_latent = cfg.num_layers * tokens_cap * latent * 4
        tp_expanded = cfg.num_layers * tokens_cap * (expanded // args.tp) * 4
        per_step = decode_step_seconds(program, prompt, args.steps)
        print(f"{dcp:>4} {spec.bytes_per_rank():>14} {tp_latent:>15} {tp_expanded:>17} "
              f"{per_step:>8.4f}")


if __name__ == "__main__":
    main()
