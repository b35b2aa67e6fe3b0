"""Mixture of experts under DCP: tensor-parallel experts vs expert parallel, side by side.

A Mixtral-shaped transformers model (random weights from a config: hidden ``--hidden``,
expert intermediate ``--intermediate``, ``--layers`` layers, 16 q / 2 KV heads) with 8 or 64
experts and top-2 or top-8 routing, transformed at tp=8 (dcp=4) with tensor-parallel experts
(each expert's intermediate dim cut over tp) and with ``expert_parallel=True`` (each rank
holds E/tp whole experts). For each it prints the expert-weight bytes one rank holds (from
the program's weight shards) and the decode step time: one decode step of ``--batch``
sequences with ``--context`` tokens in the cache, on a threaded world (every rank a thread).

Both programs are loaded in the same world and their steps alternate (TP, EP, TP, EP, ...),
each after a barrier, so that load changes on the machine hit both alike; a time is rank 0's
wall seconds from the barrier to the step's end, ``--reps`` of each after ``--warmup``.
Printed: the median and the interquartile range of each, and the median of the paired
EP/TP ratios (each EP step over the TP step just before it). Never asserted. The ranks share
the machine's cores, so a time is the sum of all ranks' work, not one device's.

    python3 benchmarks/bench_moe.py [--tp 8] [--dcp 4] [--hidden 1024] [--intermediate 512]
                                    [--layers 3] [--context 256] [--batch 16] [--reps 60]
                                    [--experts 8,64] [--top-k 2,8]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist

import dcp_compile
from dcp_compile import hf
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.serving.rank_engine import load_rank
from dcp_compile.runtime.distributed.world import bind_roles, run_threaded
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)

BLOCK, VOCAB = 16, 256
MODES = {"TP": False, "EP": True}        # label -> expert_parallel


def mixtral(experts: int, top_k: int, args):
    import transformers
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=2,
        num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
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


def interleaved_step_seconds(programs: dict, args) -> dict[str, list[float]]:
    """Rank 0's decode step seconds of each program, their steps alternating."""
    first = next(iter(programs.values()))
    shapes = first.shapes

    def rank_main(rank):
        names = bind_roles(first.topology, rank)     # one topology: both programs bind it
        g = torch.Generator().manual_seed(rank)
        steps = {}
        for label, program in programs.items():
            caches = [torch.randn(c.shape, generator=g, dtype=c.dtype)
                      for c in program.cache_spec().allocate()]
            steps[label] = (load_rank(program, rank, names).step_fn("decode"), caches)
        ids = torch.randint(0, VOCAB, (args.batch, 1), generator=g)
        positions = torch.full((args.batch, 1), args.context, dtype=torch.long)
        table = torch.arange(args.batch * shapes.max_blocks).view(args.batch, -1)
        seconds = {label: [] for label in programs}
        with torch.no_grad():
            for rep in range(args.warmup + args.reps):
                for label, (step, caches) in steps.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    step(ids, positions, table, caches)
                    if rep >= args.warmup:
                        seconds[label].append(time.perf_counter() - t0)
        return seconds
    return run_threaded(first.config.tp, rank_main, timeout=3600)[0]


def spread(xs: list[float]) -> str:
    q1, q2, q3 = statistics.quantiles(xs, n=4)
    return f"{1e3 * q2:8.1f} [{1e3 * q1:6.1f}-{1e3 * q3:6.1f}]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--dcp", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--experts", default="8,64")
    ap.add_argument("--top-k", default="2,8")
    docs_section.add_argument(ap)
    args = ap.parse_args()
    with docs_section.recorded("bench_moe", args.write_docs):
        print(f"Mixtral-shaped MoE, hidden {args.hidden}, expert intermediate {args.intermediate}, "
              f"{args.layers} layers, tp={args.tp} dcp={args.dcp}, decode batch {args.batch} x "
              f"context {args.context}, fp32, {torch.get_num_threads()} intra-op threads; "
              f"TP/EP steps alternating, {args.reps} each; ms: median [q1-q3]")
        print(f"| experts | top-k | TP MB/rank | EP MB/rank | TP step ms | EP step ms | "
              f"EP/TP (paired median) |")
        print("|---|---|---|---|---|---|---|")
        max_blocks = -(-(args.context + 1) // (BLOCK * args.dcp))
        shapes = StepShapes(batch=args.batch, context_len=16, max_blocks=max_blocks,
                            num_blocks=args.batch * max_blocks + 1)
        for experts in map(int, args.experts.split(",")):
            for top_k in map(int, args.top_k.split(",")):
                if top_k > experts:
                    continue
                model = mixtral(experts, top_k, args)
                wrapper = hf.prepare(model)
                programs = {label: dcp_compile.transform(
                    wrapper, tp=args.tp, dcp=args.dcp, mode="decode", block_size=BLOCK,
                    shapes=shapes, check=False, expert_parallel=ep) for label, ep in MODES.items()}
                mb = {label: expert_bytes_per_rank(p, model) / 2**20
                      for label, p in programs.items()}
                seconds = interleaved_step_seconds(programs, args)
                ratio = statistics.median(e / t for t, e in zip(seconds["TP"], seconds["EP"]))
                print(f"| {experts} | {top_k} | {mb['TP']:.1f} | {mb['EP']:.1f} | "
                      f"{spread(seconds['TP'])} | {spread(seconds['EP'])} | {ratio:.2f} |",
                      flush=True)
                del programs, wrapper, model
                gc.collect()


if __name__ == "__main__":
    main()
