"""Run batches of token prompts through ``vllm.LLM`` (greedy) and write what came out.

    python -m dcp_compile.vllm.offline SPEC.json OUT.json

SPEC: ``{"llm": {keyword arguments of vllm.LLM}, "batches": [{"name": ..., "prompts":
[[token ids], ...], "max_tokens": n, "sampling": {more SamplingParams: temperature, top_p,
seed, logprobs, ...}}, ...]}`` (greedy unless ``sampling`` says). The batches run one after
another in one engine (so a later batch can hit the prefix cache an earlier one filled).
OUT: per batch the generated token ids, the log-probability vLLM gave each (with
``logprobs``), vLLM's prefix-cache hits (``num_cached_tokens``) and seconds; and, when the
plugin serves the model, each rank's program record (``program_record``).

SPEC ``{"config_only": [{keyword arguments}, ...]}`` runs only vLLM's config checks
(``EngineArgs.create_engine_config``: no workers); OUT ``{"config_errors": [message or
null, ...]}``.

The tests, docs/vllm.md and benchmarks/bench_vllm.py run it in the vLLM environment
(``.venv-vllm``): vLLM pins another transformers than the rest of the suite.
"""

from __future__ import annotations

import json
import os
import sys
import time


def program_record(model) -> dict:
    """What the plugin did on one rank: program calls by step kind (in all, and the most in
    one vLLM step), its shapes and cache blocks, whether its KV caches are vLLM's own
    tensors (the same memory, not a copy), and whether the weights it kept of vLLM's weight
    stream are bit-equal to what the project's checkpoint reader reads for the rank."""
    import torch

    from dcp_compile.runtime.program.checkpoint import Checkpoint
    caches = model._caches()
    rank = model.loaded.rank
    streamed = model.program.read_checkpoint(rank, model.weights)[0]
    directory = model.program.read_checkpoint(rank, model.vllm_config.model_config.model)[0]
    with Checkpoint(model.vllm_config.model_config.model) as ckpt:
        checkpoint_bytes = sum(ckpt._entry(k).nbytes for k in ckpt.files)
    vllm_kv = [layer.kv_cache for layer in model.attn]
    same = all(c.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
               for kv, pair in zip(vllm_kv, zip(caches[::2], caches[1::2])) for c in pair)
    return {"calls": {str(k): n for k, n in model.calls.items()},
            "most_calls_per_step": {str(k): n for k, n in model.most_calls.items()},
            "options": model.options,
            "num_blocks": int(caches[0].shape[0]),
            "garbage_block": model.program.config.garbage_block,
            "caches_are_vllms": same, "build_seconds": round(model.build_seconds, 2),
            "load_seconds": round(model.load_seconds, 2),
            "weights_equal_checkpoint_reader": list(streamed) == list(directory) and all(
                torch.equal(streamed[n], directory[n]) for n in directory),
            "weight_bytes_kept": model.weights.stats.bytes_read,
            "checkpoint_bytes": checkpoint_bytes}


def config_error(llm_kwargs: dict) -> str | None:
    """vLLM's refusal of this configuration (its config checks: no model, no workers), or
    None when it accepts it."""
    from vllm.engine.arg_utils import EngineArgs
    try:
        EngineArgs(**llm_kwargs).create_engine_config()
    except Exception as e:     # pydantic wraps vLLM's ValueError: the message is the fact
        return str(e)
    return None


def run(spec: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")   # two ranks on two cores
    if "config_only" in spec:
        return {"config_errors": [config_error(kw) for kw in spec["config_only"]]}
    # program_record reaches the workers through LLM.apply_model, which vLLM sends pickled
    # only when allowed: a local tool on loopback, never a server setting.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(**spec["llm"])
    out = {"start_seconds": round(time.perf_counter() - start, 2), "batches": []}
    for batch in spec["batches"]:
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": batch["max_tokens"],
                                   "ignore_eos": True, **batch.get("sampling", {})})
        t = time.perf_counter()
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]],
                               params, use_tqdm=False)
        out["batches"].append({
            "name": batch["name"], "seconds": round(time.perf_counter() - t, 3),
            "tokens": [list(r.outputs[0].token_ids) for r in results],
            "logprobs": [[step[tok].logprob for tok, step in
                          zip(r.outputs[0].token_ids, r.outputs[0].logprobs)]
                         if r.outputs[0].logprobs else None for r in results],
            "cached": [r.num_cached_tokens or 0 for r in results]})
    archs = (spec["llm"].get("hf_overrides") or {}).get("architectures", [])
    if "DcpCompiledForCausalLM" in archs:
        # By its module's name: under ``python -m`` this module is __main__, which the
        # workers cannot import.
        from dcp_compile.vllm.offline import program_record as record
        out["ranks"] = llm.apply_model(record)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m dcp_compile.vllm.offline SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
