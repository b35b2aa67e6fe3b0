"""vllm.LLM with the dcp_compile plugin at dcp 1 and 2, next to stock vLLM CPU, at tp=2 (#37).

A tiny Llama (2 layers, hidden 128, 4 query heads of 32, 1 KV head, vocabulary 128: stock
vLLM's CPU attention needs head_dim >= 32 and a block size that is a multiple of 32) written
offline; a stream of 16 requests of mixed prompt lengths (8 to 120 tokens), 32 greedy tokens
each, handed to ``llm.generate`` at once (vLLM's continuous batching schedules them), after a
warm-up batch (the plugin transforms at its first step). Per configuration: requests per
second and generated tokens per second of the stream, and the engine's start-up seconds.

    python3 benchmarks/bench_vllm.py [--requests 16] [--max-tokens 32] [--write-docs]

Runs each engine in the vLLM environment (.venv-vllm, scripts/setup.sh) through
``python -m dcp_compile.vllm.offline``. Stock vLLM CPU has no dcp=2 (its CPU slot mapping
refuses context parallelism); the plugin supplies its own. Measured, never asserted (the
tests compare tokens: tests/e2e/test_vllm_offline.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = Path(os.environ.get("DCP_VLLM_VENV") or ROOT / ".venv-vllm") / "bin" / "python"
MODEL = dict(vocab_size=128, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=1)
CONFIGS = {   # name -> (decode_context_parallel_size, the plugin?)
    "plugin dcp=1": (1, True),
    "plugin dcp=2": (2, True),
    "stock vLLM CPU dcp=1": (1, False),
}


def llm_args(checkpoint: Path, dcp: int, plugin: bool) -> dict:
    args = dict(model=str(checkpoint), tensor_parallel_size=2, decode_context_parallel_size=dcp,
                dtype="float32", block_size=32, max_model_len=256, max_num_seqs=8,
                kv_cache_memory_bytes=16 << 20, enforce_eager=True,
                distributed_executor_backend="mp")
    if plugin:
        args["hf_overrides"] = {"architectures": ["DcpCompiledForCausalLM"],
                                "dcp_compile": {"batch": 8}}
    return args


def stream(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(rng.randrange(8, 121))] for _ in range(n)]


def run_config(checkpoint: Path, dcp: int, plugin: bool, prompts, max_tokens: int,
               work: Path) -> dict:
    spec = {"llm": llm_args(checkpoint, dcp, plugin),
            "batches": [{"name": "warm-up", "prompts": [[5, 6, 7], [8] * 40], "max_tokens": 4},
                        {"name": "stream", "prompts": prompts, "max_tokens": max_tokens}]}
    (work / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.run([str(VENV_PYTHON), "-m", "dcp_compile.vllm.offline",
                           str(work / "spec.json"), str(work / "out.json")], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_vllm: the engine failed:\n{proc.stderr[-4000:]}")
    return json.loads((work / "out.json").read_text())


def run(args) -> None:
    if not VENV_PYTHON.exists():
        raise SystemExit(f"bench_vllm: no vLLM environment at {VENV_PYTHON.parent.parent}: "
                         f"run scripts/setup.sh first.")
    from dcp_compile.models.tiny_llama import write_tiny_llama
    work = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    checkpoint = write_tiny_llama(work / "tiny-llama", **MODEL)
    prompts = stream(args.requests)
    generated = args.requests * args.max_tokens
    print(f"tp=2, {args.requests} requests, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens ({sum(map(len, prompts))} in all), "
          f"{args.max_tokens} greedy tokens each; load {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':<22} {'start s':>8} {'stream s':>9} {'req/s':>7} {'tok/s':>7}")
    tokens = {}
    for name, (dcp, plugin) in CONFIGS.items():
        out = run_config(checkpoint, dcp, plugin, prompts, args.max_tokens, work)
        batch = out["batches"][1]
        tokens[name] = batch["tokens"]
        print(f"{name:<22} {out['start_seconds']:>8.1f} {batch['seconds']:>9.2f} "
              f"{args.requests / batch['seconds']:>7.2f} {generated / batch['seconds']:>7.1f}")
    same = all(t == tokens["stock vLLM CPU dcp=1"] for t in tokens.values())
    print(f"greedy tokens of all three equal: {same}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    docs_section.add_argument(ap)
    args = ap.parse_args(argv)
    with docs_section.recorded("bench_vllm", args.write_docs):
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
