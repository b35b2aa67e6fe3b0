"""The vLLM environment the plugin's tests run in, the tiny checkpoint and the reference.

vLLM's CPU build pins transformers < 5.20 and the suite runs a newer one, so
``scripts/setup.sh`` creates ``.venv-vllm/`` beside the repository (DCP_SETUP_VLLM=1, the
default); the tests run vLLM there as a subprocess and compare its greedy tokens with
transformers' ``generate`` here. Without that environment the tests fail, naming the setup
step, unless DCP_SETUP_VLLM=0 says it was left out on purpose (then they skip).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from suite_path import ROOT

# scripts/setup.sh's place for it (DCP_VLLM_VENV moves it, for both).
VENV_PYTHON = Path(os.environ.get("DCP_VLLM_VENV") or ROOT / ".venv-vllm") / "bin" / "python"
LLM_ARGS = dict(tensor_parallel_size=2, decode_context_parallel_size=2,
                hf_overrides={"architectures": ["DcpCompiledForCausalLM"]}, dtype="float32",
                block_size=16, max_model_len=256, max_num_seqs=4,
                distributed_executor_backend="mp")


def vllm_python() -> Path:
    """The vLLM environment's interpreter; skip (DCP_SETUP_VLLM=0) or fail without it."""
    if VENV_PYTHON.exists():
        return VENV_PYTHON
    if os.environ.get("DCP_SETUP_VLLM") == "0":
        pytest.skip("no vLLM environment (.venv-vllm): DCP_SETUP_VLLM=0 left it out")
    pytest.fail(f"no vLLM environment at {VENV_PYTHON.parent.parent}: run scripts/setup.sh "
                f"(it creates it), or set DCP_SETUP_VLLM=0 to skip the vLLM tests.")


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_HOST_IP="127.0.0.1",
               VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    return env


def write_checkpoint(path: Path) -> Path:
    """The tiny Llama checkpoint and tokenizer (dcp_compile.models.tiny_llama), offline."""
    from dcp_compile.models.tiny_llama import write_tiny_llama
    return write_tiny_llama(path)


def prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(n)] for n in lengths]


def reference_tokens(checkpoint: Path, prompt_ids: list[list[int]], max_tokens: int):
    """transformers' greedy ``generate`` on each prompt (no EOS stop: vLLM runs with
    ignore_eos), the new tokens only."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint,
                                                              dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None     # the checkpoint's EOS would stop it
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            got = model.generate(torch.tensor([ids]), do_sample=False,
                                 max_new_tokens=max_tokens, pad_token_id=0)
            out.append(got[0, len(ids):].tolist())
    return out


def run_offline(spec: dict, workdir: Path, timeout: float = 900) -> dict:
    """``python -m dcp_compile.vllm.offline`` in the vLLM environment; its JSON result."""
    spec_path, out_path = workdir / "spec.json", workdir / "out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([str(vllm_python()), "-m", "dcp_compile.vllm.offline",
                           str(spec_path), str(out_path)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)   # no signal to the suite's group reaches it
    if proc.returncode != 0:
        (workdir / "stderr.txt").write_text(proc.stderr)
        (workdir / "stdout.txt").write_text(proc.stdout)
        # vLLM's logger writes to stdout: the engine core's and workers' errors are there.
        raise AssertionError(f"vLLM run failed (exit {proc.returncode}); its output in "
                             f"{workdir / 'stdout.txt'} and {workdir / 'stderr.txt'}\n"
                             f"stdout:\n{root_cause(proc.stdout)}\nstderr:\n"
                             f"{root_cause(proc.stderr)}")
    return json.loads(out_path.read_text())


def root_cause(stderr: str, context: int = 4000) -> str:
    """The part of a failed vLLM run's stderr that says why: vLLM's engine process logs its
    own traceback ("EngineCore failed" / "Traceback") well before the client's
    ``EngineDeadError``, so the tail alone hides it. The first traceback and the tail."""
    first = stderr.find("Traceback (most recent call last)")
    head = stderr[first:first + context] if first >= 0 else ""
    return f"{head}\n[...]\n{stderr[-context:]}" if head else stderr[-2 * context:]
