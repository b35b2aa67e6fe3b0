"""The pipeline is data (dcp_compile.passes.pipeline.PIPELINE): docs/architecture.md lists it, transform(), the
torch.compile backend's transform_graph and the dump follow it; post-conditions raise."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.fx.passes.infra.pass_base import PassResult

import dcp_compile
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.models.plain import plain_llama
from dcp_compile.passes import pipeline
from dcp_compile.passes.infra import DCPPass, TransformContext
from dcp_compile.passes.insert_paged_cache import InsertPagedCache
from dcp_compile.runtime.serving.engine import StepShapes

from suite_path import ROOT  # noqa: E402  (the repository root)

PASSES_PAGE = ROOT / "docs" / "architecture.md"   # its "Passes" section
SMALL = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5)
STEPS = pipeline.STEPS_BY_MODE


def documented_pipeline() -> dict[str, list[str]]:
    """The page's "Passes" list: ``- `step`: `pass`, `pass`, ...`` items (may wrap)."""
    text = PASSES_PAGE.read_text()
    section = text.split("\n## Passes\n", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^- `(\w+)`: (.+?)(?=^- |^$)", section, flags=re.M | re.S)
    return {step: re.findall(r"`(\w+)`", passes) for step, passes in items}


def test_every_modes_step_kinds_have_a_row():
    assert {s for steps in pipeline.STEPS_BY_MODE.values() for s in steps} == \
        set(pipeline.PIPELINE)


def test_the_page_lists_the_table_in_order():
    listed = documented_pipeline()
    assert listed == {step: pipeline.pass_names(step) for step in pipeline.PIPELINE}


def test_the_pages_pass_descriptions_cover_every_pass_of_the_table():
    text = PASSES_PAGE.read_text()
    section = text.split("\n## Passes\n", 1)[1].split("\n## ", 1)[0]
    described = set(re.findall(r"^\| `(\w+)`(?: / `(\w+)`)?", section, flags=re.M))
    names = {n for pair in described for n in pair if n}
    assert names == {cls.name for row in pipeline.PIPELINE.values() for cls in row}


def _ran(program, step):
    return [r.name for r in program.history if r.step == step]


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_transform_runs_each_step_kinds_row(mode):
    """A paged model (no insert_paged_cache): capture, then exactly its row."""
    prog = dcp_compile.transform(demo_model(DemoConfig(num_layers=1)), tp=4, dcp=2,
                                 mode=mode, shapes=SMALL, check=False)
    assert tuple(prog.graphs) == STEPS[mode]
    for step in STEPS[mode]:
        row = [n for n in pipeline.pass_names(step) if n != InsertPagedCache.name]
        assert _ran(prog, step) == row


def test_an_ordinary_model_runs_the_optional_cache_insertion_first():
    model = plain_llama(DemoConfig(num_layers=1, hidden_size=64, num_q_heads=8,
                                   intermediate_size=96))
    prog = dcp_compile.transform(model, tp=4, dcp=2, mode="decode", shapes=SMALL,
                                 block_size=4, check=False)
    for step in STEPS["decode"]:
        assert _ran(prog, step) == pipeline.pass_names(step)


class Witness(DCPPass):
    """Changes nothing; its history entry shows where the table put it."""

    name = "witness"

    def call(self, gm):
        return PassResult(gm, False)


def test_the_table_drives_transform_and_transform_graph(monkeypatch):
    """Editing the table (here: a witness pass after insert_rank) changes what transform()
    and the backend's transform_graph run, with no other code change."""
    at = {step: [c.name for c in row].index("insert_rank") + 1
          for step, row in pipeline.PIPELINE.items()}
    table = {step: row[:at[step]] + (Witness,) + row[at[step]:]
             for step, row in pipeline.PIPELINE.items()}
    monkeypatch.setattr(pipeline, "PIPELINE", table)
    model = demo_model(DemoConfig(num_layers=1))
    prog = dcp_compile.transform(model, tp=4, dcp=2, mode="decode", shapes=SMALL,
                                 check=False)
    for step in ("context", "decode"):
        ran = _ran(prog, step)
        i = ran.index("insert_rank")
        assert ran[i:i + 2] == ["insert_rank", "witness"]

    from dcp_compile.capture import capture, example_step_inputs
    from dcp_compile.driver import transform_graph
    captured = capture(model, example_step_inputs(
        SMALL.batch, 1, SMALL.max_blocks, model.kv_cache_shape(SMALL.num_blocks, 16), 1,
        device="cpu", dtype=torch.float32))
    config = DCPConfig(tp=4, dcp=2, mode="decode", block_size=16)
    _, records, _ = transform_graph(captured.gm, config, "decode",
                                    first_user_input=captured.user_inputs[0])
    assert [r.name for r in records] == [n for n in pipeline.pass_names("decode")
                                         if n != InsertPagedCache.name]


def test_the_dump_records_the_steps_pipeline(tmp_path):
    dcp_compile.transform(demo_model(DemoConfig(num_layers=1)), tp=4, dcp=2, mode="decode",
                          shapes=SMALL, dump_dir=tmp_path, check=False)
    for step in STEPS["decode"]:
        manifest = json.loads((tmp_path / step / "manifest.json").read_text())
        assert manifest["pipeline"] == pipeline.pass_names(step)
        ran = [e["pass"] for e in manifest["entries"]]
        assert ran[0] == "capture" and ran[1:] == [n for n in manifest["pipeline"]
                                                  if n != InsertPagedCache.name]


def test_an_unknown_step_kind_is_refused():
    ctx = TransformContext(config=DCPConfig(tp=4, dcp=2, mode="decode", block_size=16),
                           step="verify")
    with pytest.raises(DCPTransformError, match=r"no pipeline for step kind 'verify'.*"
                                                r"\['context', 'decode', 'prefill'\]"):
        pipeline.passes_for(ctx, "input_ids")


# ------------------------------------------------------------------------------------------
# ensures: post-conditions raise DCPTransformError, also under python -O
# ------------------------------------------------------------------------------------------

ENSURES_VIOLATION = """
import torch
from torch.fx import Graph, GraphModule
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.passes.infra import TransformContext
from dcp_compile.passes.insert_rank import InsertRank

g = Graph()
g.output(g.placeholder("input_ids"))     # no tp_rank input: insert_rank's post-condition
gm = GraphModule(torch.nn.Module(), g)
ctx = TransformContext(config=DCPConfig(tp=4, dcp=2, mode="decode", block_size=16),
                       step="decode")
try:
    InsertRank(ctx, "input_ids").ensures(gm)
except DCPTransformError as e:
    print("raised:", e)
else:
    print("passed")
"""


def test_an_ensures_violation_raises_even_under_python_O(capsys):
    """The same script in this process and under ``python -O`` (asserts stripped): ensures
    raise DCPTransformError either way (a child process only for -O: a process each costs
    an import of torch)."""
    exec(compile(ENSURES_VIOLATION, "<ensures>", "exec"), {})
    plain = capsys.readouterr().out
    out = subprocess.run([sys.executable, "-O", "-c", ENSURES_VIOLATION], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for stdout in (plain, out.stdout):
        assert stdout.startswith("raised: pass insert_rank broke its post-condition, not "
                                 "exactly one tp_rank input: []. This is a bug"), stdout


def test_each_rewrites_post_condition_names_what_is_left():
    """The attention rewrites' ensures, run on a graph that still has its attention."""
    from dcp_compile.capture import capture, example_step_inputs
    from dcp_compile.passes.canonicalize_attention import CanonicalizeAttention
    from dcp_compile.passes.dcp_decode import DCPContext, DCPDecode

    model = demo_model(DemoConfig(num_layers=1))
    captured = capture(model, example_step_inputs(
        SMALL.batch, 1, SMALL.max_blocks, model.kv_cache_shape(SMALL.num_blocks, 16), 1,
        device="cpu", dtype=torch.float32))
    ctx = TransformContext(config=DCPConfig(tp=4, dcp=2, mode="decode", block_size=16),
                           step="decode")
    with pytest.raises(DCPTransformError, match=r"canonicalize_attention broke its post-"
                                                r"condition, dcp.paged_attention nodes left"):
        CanonicalizeAttention(ctx).ensures(captured.gm)
    gm = CanonicalizeAttention(ctx)(captured.gm).graph_module
    for rewrite in (DCPDecode, DCPContext):
        with pytest.raises(DCPTransformError, match=rf"{rewrite.name} broke its post-"
                                                    r"condition, dcp.attention nodes left"):
            rewrite(ctx).ensures(gm)


def test_dcp_prefill_without_sequence_parallel_is_refused():
    """No silent fallback: dcp_prefill names the pass that must run first."""
    from dcp_compile.capture import capture, example_step_inputs
    from dcp_compile.passes.canonicalize_attention import CanonicalizeAttention
    from dcp_compile.passes.dcp_prefill import DCPPrefill

    model = demo_model(DemoConfig(num_layers=1))
    captured = capture(model, example_step_inputs(
        SMALL.batch, 8, SMALL.max_blocks, model.kv_cache_shape(SMALL.num_blocks, 8), 1,
        device="cpu", dtype=torch.float32))
    ctx = TransformContext(config=DCPConfig(tp=4, dcp=2, mode="prefill", block_size=8),
                           step="prefill")
    gm = CanonicalizeAttention(ctx)(captured.gm).graph_module
    with pytest.raises(DCPTransformError, match="Run sequence_parallel before dcp_prefill"):
        DCPPrefill(ctx)(gm)
