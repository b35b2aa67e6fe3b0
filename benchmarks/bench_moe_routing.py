"""bf16 routing: how many of a MoE program's expert choices differ from the single-device
model's, and how close to a tie they were.

Each model (tests/frontends/test_moe.py's tiny configs and seeded weights, cast to bf16) is transformed
at tp=4/dcp=2 (decode mode: a context step, then decode steps) with tensor-parallel experts
and with ``expert_parallel=True``, and decodes ``--steps`` greedy tokens for ``--batch``
random prompts of 1..``--max-prompt`` tokens on a threaded world, its routing traced
(dcp_compile.routing.trace_routing). The single-device bf16 model then runs its own full
forward (no cache) over each sequence the program saw (prompt + generated tokens, teacher
forced), its routing recorded (model_routing). For every (MoE layer, token) decision:

* a *flip* is an expert set that differs between the program (rank 0; every rank's is
  checked identical) and the model; a *cascade* is a flip downstream of a flip in an
  earlier MoE layer, at this token or an earlier one of its sequence (attended to): its
  input differs by a whole expert's output, not by rounding;
* a first flip's *gap* is how far apart the swapped experts' scores are in the model's own selection
  scores (fp32, from its bf16 hidden state: router logits, or sigmoid + score-correction
  bias for DeepSeek-V3/GLM4-MoE); a *near tie* is a gap below a threshold (printed for
  several). ``margin<t`` counts the decisions whose k-th and (k+1)-th scores are within t
  (how many near ties there were to flip).

    python3 benchmarks/bench_moe_routing.py [--models mixtral,qwen3_moe,...] [--steps 24]
                                            [--batch 8] [--max-prompt 40]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))     # the repository root
from tests.support.suite_path import install  # noqa: E402

install()           # the tests' modules by plain name, as tests/conftest.py sets them

import dcp_compile  # noqa: E402
from dcp_compile import hf  # noqa: E402
from dcp_compile.routing import (ModelRouting, RoutingComparison, compare_routing,  # noqa: E402
                                 model_routing, trace_routing)
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402
from dcp_compile.verify import run_threaded_program  # noqa: E402

from test_moe import MODELS, build  # noqa: E402  (the tests' configs)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)

TP, DCP, BLOCK, INTERLEAVE = 4, 2, 4, 2
THRESHOLDS = (1e-3, 1e-2, 3e-2, 1e-1)


def prompts_for(batch: int, max_prompt: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
            for _ in range(batch)]


def measure(model_id: str, ep: bool, args) -> RoutingComparison:
    model = build(model_id, seed=args.seed).to(torch.bfloat16)
    mla = hasattr(model.config, "kv_lora_rank")
    # MLA: the ordinary frontend; max_model_len: gpt-oss's window covers every position
    subject = model if mla else hf.prepare(
        model, max_model_len=model.config.max_position_embeddings)
    tokens = args.max_prompt + args.steps
    max_blocks = -(-tokens // (BLOCK * DCP))
    shapes = StepShapes(batch=args.batch, context_len=args.max_prompt, max_blocks=max_blocks,
                        num_blocks=args.batch * max_blocks + 1)
    program = dcp_compile.transform(subject, tp=TP, dcp=DCP, mode="decode", block_size=BLOCK,
                                    interleave_size=INTERLEAVE, shapes=shapes, check=False,
                                    expert_parallel=ep)
    traced, trace = trace_routing(program)
    prompts = prompts_for(args.batch, args.max_prompt, model.config.vocab_size, args.seed)
    runs = run_threaded_program(traced, prompts, args.steps, timeout=1800)
    got = trace.choices(0)
    for rank in range(1, TP):
        if trace.choices(rank) != got:
            raise AssertionError(f"{model_id}: rank {rank} routed differently from rank 0")
    reference = {}
    with model_routing(model) as routing, torch.no_grad():
        for b, (p, out) in enumerate(zip(prompts, runs[0].result.tokens)):
            model(torch.tensor([p + out[:-1]]))
            reference[b] = ModelRouting(list(routing.ids), list(routing.scores),
                                         list(routing.groups))
    return compare_routing(got, reference)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(m for m in MODELS))
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    docs_section.add_argument(ap)
    args = ap.parse_args()
    with docs_section.recorded("bench_moe_routing", args.write_docs):
        print(f"bf16, tp={TP} dcp={DCP}, batch {args.batch}, prompts 1..{args.max_prompt} tokens, "
              f"{args.steps} greedy steps; flips vs the single-device bf16 model's own forward")
        gaps = "".join(f" {'gap<' + format(t, 'g'):>9}" for t in THRESHOLDS)
        margins = "".join(f" {'margin<' + format(t, 'g'):>11}" for t in THRESHOLDS)
        print(f"{'model':<12} {'experts':<8} {'decisions':>9} {'choices':>8} {'flips':>6} {'cascade':>7}"
              f"{gaps}{margins} {'s':>5}")
        total = RoutingComparison()
        for model_id in args.models.split(","):
            for ep in (False, True):
                start = time.perf_counter()
                r = measure(model_id, ep, args)
                total = total.merged(r)
                print(f"{model_id:<12} {'EP' if ep else 'TP':<8} {r.decisions:>9} {r.choices:>8} "
                      f"{r.flips:>6} {r.cascades:>7}"
                      + "".join(f" {r.flips_below(t):>9}" for t in THRESHOLDS)
                      + "".join(f" {r.near_ties(t):>11}" for t in THRESHOLDS)
                      + f" {time.perf_counter() - start:>5.0f}", flush=True)
        r = total
        print(f"{'total':<12} {'':<8} {r.decisions:>9} {r.choices:>8} {r.flips:>6} {r.cascades:>7}"
              + "".join(f" {r.flips_below(t):>9}" for t in THRESHOLDS)
              + "".join(f" {r.near_ties(t):>11}" for t in THRESHOLDS))
        if r.flip_gaps:
            print(f"first flips' gaps (largest {max(r.flip_gaps):.4g}): "
                  f"{sorted(round(g, 4) for g in r.flip_gaps)}")


if __name__ == "__main__":
    main()
