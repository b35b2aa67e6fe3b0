"""Program files (runtime/program/program_file.py): one transform serves every rank of a launch.

A loaded program must be the program: the same graphs (code, node names, the metadata the
runtime reads), weights, layout and context buckets, and on a threaded world the same
logits, bit for bit, as the fresh program, which match the single-device model. Loading
runs no pass code, and a file of another version, or not a program file, is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.program import codec
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.names import META_SCOPE
from dcp_compile.runtime.program.program_file import load_program, save_program
from dcp_compile.verify import run_threaded_program, verify, verify_prefill
from dcp_compile.workers import program_for

from suite_path import ROOT  # noqa: E402  (the repository root)
BLOCK = 4
PROMPTS = [[5, 9, 2], [7]]          # a 1-token prompt: a rank with an empty shard


@functools.lru_cache(maxsize=None)
def _fresh(mode: str):
    """tp=4/dcp=2 over 1 layer with context buckets (8 and 16 tokens below the full 32)."""
    model = demo_model(DemoConfig(num_layers=1))
    shapes = StepShapes(batch=2, context_len=8, max_blocks=4, num_blocks=9)
    return model, dcp_compile.transform(model, tp=4, dcp=2, mode=mode, block_size=BLOCK,
                                        shapes=shapes, buckets=[8, 16], check=False)


def _saved(mode: str, tmp_path) -> tuple:
    model, program = _fresh(mode)
    path = tmp_path / f"{mode}.dcp"
    program.save(path)
    return model, program, load_program(path)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_loaded_program_has_the_same_graphs_weights_and_layout(mode, tmp_path):
    _, fresh, loaded = _saved(mode, tmp_path)
    assert loaded.buckets == fresh.buckets == (8, 16, 32)
    for bucket in fresh.buckets:
        a, b = fresh.for_bucket(bucket), loaded.for_bucket(bucket)
        assert list(a.graphs) == list(b.graphs)
        for kind in a.graphs:
            assert b.graphs[kind].code == a.graphs[kind].code, (bucket, kind)
            for x, y in zip(a.graphs[kind].graph.nodes, b.graphs[kind].graph.nodes):
                assert x.name == y.name and x.meta.get(META_SCOPE) == y.meta.get(META_SCOPE)
                vx, vy = x.meta.get("val"), y.meta.get("val")
                if isinstance(vx, torch.Tensor):
                    assert (vy.shape, vy.stride(), vy.dtype) == (vx.shape, vx.stride(),
                                                                 vx.dtype), x.name
    for field in ("config", "topology", "shapes", "shards", "weight_inputs", "source"):
        assert getattr(loaded, field) == getattr(fresh, field), field
    assert loaded.facts == dataclasses.replace(fresh.facts, mask_theorems=None)
    assert loaded.constants.keys() == fresh.constants.keys()
    assert all(torch.equal(loaded.constants[k], v) for k, v in fresh.constants.items())
    for rank in range(4):
        assert all(torch.equal(x, y) for x, y in zip(loaded.state_dict_for(rank).values(),
                                                     fresh.state_dict_for(rank).values()))
    kind = "decode" if mode == "decode" else "prefill"
    assert loaded.collectives_per_layer(kind) == fresh.collectives_per_layer(kind)
    assert loaded.report is None   # the compile report stays with the compiler


def test_loaded_decode_program_runs_bit_for_bit_like_the_fresh_one(tmp_path):
    model, fresh, loaded = _saved("decode", tmp_path)
    steps = 13   # from the 8-token bucket across 16 into the full 32
    with torch.no_grad():
        runs = [run_threaded_program(p, PROMPTS, steps, poison_garbage=True)
                for p in (fresh, loaded)]
    for a, b in zip(*runs):
        assert a.result.tokens == b.result.tokens
        assert all(torch.equal(x, y) for x, y in zip(a.result.logits, b.result.logits))
        assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
                   for x, y in zip(a.caches, b.caches))
    report = verify(model, loaded, PROMPTS, steps)   # and the model's own tokens
    assert report.ok, report


def test_loaded_prefill_program_matches_the_fresh_one_and_the_model(tmp_path):
    model, fresh, loaded = _saved("prefill", tmp_path)
    prompts = [[3] * 13, [4, 8]]
    got, want = (verify_prefill(model, p, prompts, 3) for p in (loaded, fresh))
    assert got.ok, got
    assert got.step_errors == want.step_errors and got.lengths == want.lengths


def test_loading_runs_no_compiler_or_pass_code(tmp_path):
    _, program = _fresh("decode")
    path = tmp_path / "p.dcp"
    program.save(path)
    code = ("import sys\n"
            "from dcp_compile.runtime.program.program_file import load_program\n"
            f"p = load_program({str(path)!r})\n"
            "p.state_dict_for(3); print(p.summary())\n"
            "bad = sorted(m for m in sys.modules if m.startswith('dcp_compile.') and\n"
            "             not m.startswith('dcp_compile.runtime'))\n"
            "print('non-runtime modules:', bad)\n"
            "sys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert '"steps": ["context", "decode"]' in proc.stdout


def _rewrite(path, **changes):
    """The file at ``path`` with its header's fields ``changes`` (its body as it was)."""
    path.write_bytes(codec.pack(_split(path.read_bytes())[1], **changes))


def _split(data: bytes) -> tuple[dict, bytes]:
    """A program file's header and body (codec.pack's inverse, unchecked)."""
    n = int.from_bytes(data[len(codec.LEAD):len(codec.LEAD) + 8], "little")
    start = len(codec.LEAD) + 8
    return json.loads(data[start:start + n]), data[start + n:]


@pytest.mark.parametrize("changes,match", [
    ({"dcp_compile": "0.0.1"}, r"written by dcp_compile 0\.0\.1 with torch .*this is "
                               r"dcp_compile .*Transform the model again"),
    ({"torch": "2.12.0"}, r"with torch 2\.12\.0 .*Transform the model again"),
    ({"format": 0}, r"\(format 0\).*Transform the model again"),
    ({"magic": "something else"}, r"is not a program file"),
])
def test_another_version_or_another_file_is_refused(changes, match, tmp_path):
    _, program = _fresh("decode")
    path = tmp_path / "p.dcp"
    save_program(program, path)
    _rewrite(path, **changes)
    with pytest.raises(DCPInputError, match=match):
        load_program(path)


def test_unreadable_or_missing_files_are_refused(tmp_path):
    (tmp_path / "text.dcp").write_text("not a program")
    with pytest.raises(DCPInputError, match=r"text\.dcp is not a program file \(it does "
                                            r"not start with"):
        load_program(tmp_path / "text.dcp")
    with pytest.raises(DCPInputError, match="no program file at"):
        load_program(tmp_path / "missing.dcp")


def test_a_file_of_another_layout_is_refused_by_the_worker(tmp_path):
    _, program = _fresh("decode")
    path = tmp_path / "p.dcp"
    program.save(path)
    assert program_for(str(path), None, dcp=2, mode="decode").config == program.config
    with pytest.raises(DCPInputError, match=r"its dcp=2, the launch asks dcp=1.*Write the "
                                            r"program with the launch's layout"):
        program_for(str(path), None, dcp=1, mode="decode")


def test_a_graph_calling_an_unknown_function_is_not_saved(tmp_path):
    _, program = _fresh("decode")
    gm = program.graphs["decode"]
    node = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(node):
        odd = gm.graph.call_function(math.sqrt, (2.0,))
    try:
        with pytest.raises(DCPInputError, match=r"node sqrt of step 'decode': it calls "
                                                r"math\.sqrt.*PYTHON_TARGETS"):
            save_program(program, tmp_path / "p.dcp")
    finally:
        gm.graph.erase_node(odd)
    assert not (tmp_path / "p.dcp").exists()
    assert codec.PYTHON_TARGETS  # getitem (multi-output ops) is the one allowed
