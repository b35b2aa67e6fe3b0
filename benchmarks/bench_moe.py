"""Mixture of experts under DCP: tensor-parallel experts vs expert parallel, side by side.

A Mixtral-shaped transformers model (random weights from a small config: hidden 256, expert
intermediate 512, 2 layers) with 8 or 64 experts and top-2 or top-8 routing, transformed at
tp=8 (dcp=4) with tensor-parallel experts (each expert's intermediate dim cut over tp) and
with ``expert_parallel=True`` (each rank holds E/tp whole experts). For each it prints the
expert-weight bytes one rank holds (from the program's weight shards) and the decode step
time: one decode step of ``--batch`` sequences with ``--context`` tokens in the cache, on a
threaded world (every rank a thread), wall seconds on rank 0, median of ``--steps``. Ratios
are EP / TP of the same model, measured in the same run. Printed, never asserted; the ranks
share the machine's cores, so a time is the sum of all ranks' work, not one device's.

    python3 benchmarks/bench_moe.py [--tp 8] [--dcp 4] [--context 256] [--batch 4]
                                    [--steps 5] [--experts 8,64] [--top-k 2,8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dcp_compile
from dcp_compile import hf
from dcp_compile.runtime.engine import StepShapes
from dcp_compile.runtime.world import bind_roles, run_threaded

BLOCK = 16


def mixtral(experts: int, top_k: int, layers: int = 2):
    import transformers
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=4096, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    model = transformers.MixtralForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model


def expert_bytes_per_rank(program, model) -> int:
    """Bytes of the stacked expert weights rank 0 holds (its shards, or the whole)."""
    total = 0
    for name, p in model.named_parameters():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        spec = next((s for k, s in program.shards.items()
                     if k.endswith(name.replace(".", "_"))), None)
        shape = spec.shape(p.shape) if spec is not None else p.shape
        total += torch.Size(shape).numel() * p.element_size()
    return total


def decode_step_seconds(program, batch: int, context: int, steps: int) -> float:
    shapes = program.shapes

    def rank_main(rank):
        loaded = program.load(rank, bind_roles(program.topology, rank))
        g = torch.Generator().manual_seed(rank)
        caches = [torch.randn(c.shape, generator=g, dtype=c.dtype)
                  for c in program.cache_spec().allocate()]
        ids = torch.randint(0, 256, (batch, 1), generator=g)
        positions = torch.full((batch, 1), context, dtype=torch.long)
        table = torch.arange(batch * shapes.max_blocks).view(batch, shapes.max_blocks)
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
    ap.add_argument("--dcp", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--experts", default="8,64")
    ap.add_argument("--top-k", default="2,8")
    args = ap.parse_args()
    print(f"Mixtral-shaped MoE, hidden 256, expert intermediate 512, 2 layers, tp={args.tp} "
          f"dcp={args.dcp}, batch {args.batch} x context {args.context}, fp32, "
          f"{torch.get_num_threads()} intra-op threads")
    print(f"{'experts':>7} {'top-k':>5} {'TP MB/rank':>11} {'EP MB/rank':>11} "
          f"{'TP step s':>10} {'EP step s':>10} {'EP/TP time':>10}")
    max_blocks = -(-(args.context + 1) // (BLOCK * args.dcp))
    shapes = StepShapes(batch=args.batch, context_len=16, max_blocks=max_blocks,
                        num_blocks=args.batch * max_blocks + 1)
    for experts in map(int, args.experts.split(",")):
        for top_k in map(int, args.top_k.split(",")):
            if top_k > experts:
                continue
            model = mixtral(experts, top_k)
            wrapper = hf.prepare(model)
            row = {}
            for ep in (False, True):
                program = dcp_compile.transform(wrapper, tp=args.tp, dcp=args.dcp,
                                                mode="decode", block_size=BLOCK,
                                                shapes=shapes, check=False,
                                                expert_parallel=ep)
                row[ep] = (expert_bytes_per_rank(program, model),
                           decode_step_seconds(program, args.batch, args.context,
                                               args.steps))
            (tb, ts), (eb, es) = row[False], row[True]
            print(f"{experts:>7} {top_k:>5} {tb / 2**20:>11.2f} {eb / 2**20:>11.2f} "
                  f"{ts:>10.4f} {es:>10.4f} {es / ts:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
