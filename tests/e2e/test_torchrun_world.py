"""Real processes: one torchrun/gloo world of 4 ranks (tp=4, dcp=2) serves five claims.

The world (tests/support/world_worker.py) runs the pages' torchrun blocks, then four workers one
after the other, so every rank starts (torch, gloo) once instead of five times; each test
reads its part's output:

0. The torch.compile block of docs/runtime.md (``<!-- readme-test: world 4 -->``) runs first, as
   written, in the fresh ranks: it initialises the world itself and destroys it; the parts
   then run in a world initialised again (tests/e2e/test_readme.py leaves these blocks here).

1. The collectives self-test: bind the prefill roles, check every collective on cp_kv and
   dcp_tp in float32/bfloat16/int64, eager and from a GraphModule, also through role
   aliases (tests/support/selftest_worker.py).
2. Prefill (dcp_compile.workers.prefill): every rank transforms the 2-layer demo model
   itself (the workers' default, rank 0 with transform's check: this launch keeps each
   rank's own transform covered, and that it is the same SPMD program on every rank), then
   runs a mixed chunked prefill;
   logits and caches match the single-device model (tests/passes/test_prefill_dcp.py's
   comparison).
3. Decode (dcp_compile.workers.decode): the test transforms once and every rank loads the
   weightless program file (``--program``, runtime/program/program_file.py) and reads only
   its own weight shards from a safetensors checkpoint (``--checkpoint``); greedy decode of prompts of 1, 31,
   33 and 32 tokens (an empty shard, lengths around the interleave period) for 16 steps
   gives the single-device model's tokens, and logits within 1e-4.
4. The torch.compile backend (tests/support/backend_worker.py over dcp_compile.workers.compiled):
   every rank compiles the single-device model with ``backend="dcp"`` (found by name),
   ``fullgraph=True``, and decodes 8 steps of the same prompts: the single-device tokens,
   logits within 1e-4; ``DCP_COMPILE_DUMP`` covers the backend's compiles; a model with a
   graph break raises DCPTransformError on every rank (never runs unsharded).

The numerics of these layouts and many more (tp8/dcp4 among them) are covered on threads
(tests/passes/test_prefill_dcp.py, test_decode_dcp.py); this launch proves that real processes,
with process groups bound per role over gloo and weight shards cut per rank, compute them.
"""

from __future__ import annotations

import json

import pytest
import torch

from dcp_compile.runtime.distributed.launch import run_torchrun
from dcp_compile.verify import PrefillRun, run_prefill_reference
from dcp_compile.models.demo import demo_model
from dcp_compile.workers import decode, prefill

from helpers import assert_close_report, single_device_reference
from test_prefill_dcp import _assert_matches, mixed_plan
from test_readme import BLOCKS

pytestmark = pytest.mark.multiprocess  # one 4-rank torchrun world, ~20-40 s on two cores

WORLD = 4
SELFTEST = ["--dcp", "2", "--mode", "prefill", "--roles", "cp_kv", "dcp_tp", "--aliases"]
PREFILL_S, PREFILL_PLAN, PREFILL_SEED = 36, mixed_plan(36, 2, 8), 5
DECODE_LENGTHS, DECODE_STEPS = [1, 31, 33, 32], 16
BACKEND_STEPS = 8
README_BLOCKS = [b for b in BLOCKS if "world" in b.tags]   # page blocks this world runs


def write_checkpoint(model, directory):
    """``model``'s state dict as a one-file safetensors checkpoint (the demo model is no
    transformers model: its own parameter names)."""
    from safetensors.torch import save_file
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              directory / "model.safetensors")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun_world")
    prefill_argv = ["--dcp", "2", "--tp", str(WORLD), "--block-size", "8", "--context-len",
                    str(PREFILL_S), "--layers", "2", "--plan", json.dumps(PREFILL_PLAN),
                    "--seed", str(PREFILL_SEED), "--out-dir", str(tmp / "prefill")]
    decode_argv = ["--dcp", "2", "--steps", str(DECODE_STEPS), "--lengths",
                   ",".join(map(str, DECODE_LENGTHS)), "--out", str(tmp / "tokens.json"),
                   "--program", str(tmp / "decode.dcp"), "--checkpoint", str(tmp / "ckpt")]
    backend_argv = ["--dcp", "2", "--steps", str(BACKEND_STEPS), "--lengths",
                    ",".join(map(str, DECODE_LENGTHS)), "--out", str(tmp / "backend.json"),
                    "--dump", str(tmp / "dump")]
    program = decode.build_program(decode.parse(decode_argv), tp=WORLD, check=False)
    program.save(tmp / "decode.dcp", weights=False)
    write_checkpoint(demo_model(), tmp / "ckpt")
    readme = []
    for b in README_BLOCKS:
        readme.append(tmp / _script_name(b))
        readme[-1].write_text(b.code)
    proc = run_torchrun(WORLD, "tests.support.world_worker",
                        ["--readme", json.dumps([str(p) for p in readme]),
                         "--selftest", json.dumps(SELFTEST), "--prefill",
                         json.dumps(prefill_argv), "--decode", json.dumps(decode_argv),
                         "--backend", json.dumps(backend_argv)],
                        timeout=600)
    return {"tmp": tmp, "stdout": proc.stdout, "prefill_argv": prefill_argv}


def _script_name(block) -> str:
    """A block's script file, unique over the pages: ``docs_runtime.md_line140.py``."""
    return f"{block.page.replace('/', '_')}_line{block.line}.py"


def test_readme_torchrun_blocks_run_as_written(world):
    assert README_BLOCKS, "no block of a page is tagged <!-- readme-test: world 4 -->"
    for b in README_BLOCKS:
        assert int(b.tags["world"]) == WORLD, f"{b.where}: world {b.tags['world']}"
        for rank in range(WORLD):
            assert f"readme block {_script_name(b)} ok rank={rank}" in world["stdout"]


def test_torchrun_gloo_selftest(world):
    for rank in range(WORLD):
        assert f"selftest ok rank={rank} checks=72" in world["stdout"]


def test_torchrun_gloo_prefill_matches_single_device(world):
    """Two layers, a mixed chunked prefill; each rank transformed the model itself."""
    args = prefill.parse(world["prefill_argv"])
    model, prog = prefill.build_program(args, PREFILL_PLAN, check=False)
    ref = run_prefill_reference(model, prog, prefill.plan_tokens(PREFILL_PLAN, PREFILL_SEED))
    runs = [PrefillRun(**torch.load(world["tmp"] / "prefill" / f"rank{r}.pt"))
            for r in range(WORLD)]
    _assert_matches(prog, runs, ref, what="torchrun ")


def _decoded_like_single_device(path, steps: int) -> dict:
    """Rank 0's tokens and logits (json at ``path``) against the single-device model's."""
    got = json.loads(path.read_text())
    ref = single_device_reference(DECODE_LENGTHS, steps)
    assert got["tokens"] == ref.tokens
    for t, (g, r) in enumerate(zip(got["logits"], ref.logits)):
        assert_close_report(torch.tensor(g), r, atol=1e-4, what=f"step {t}")
    return got


def test_torchrun_gloo_decode_matches_single_device(world):
    """Every rank loaded the weightless program file the test wrote and read its shards from
    the checkpoint."""
    _decoded_like_single_device(world["tmp"] / "tokens.json", DECODE_STEPS)
    for rank in range(WORLD):
        assert f"decode_worker rank={rank} ok" in world["stdout"]


def test_torchrun_gloo_compiled_model_decodes_the_single_device_tokens(world):
    got = _decoded_like_single_device(world["tmp"] / "backend.json", BACKEND_STEPS)
    for err in got["graph_break_errors"]:
        assert err is not None and err["inner"] == "DCPTransformError", err
        assert "graph break" in err["message"]
    dump = world["tmp"] / "dump"
    backend_dump = dump / "backend-decode"
    steps_dumped = sorted(p.parent.name for p in backend_dump.glob("*/manifest.json"))
    assert steps_dumped == ["context", "decode"]
    assert (backend_dump / "index.html").exists() and (dump / "index.html").exists()
    assert not list(dump.glob("transform-*"))   # the other parts ran without a dump
