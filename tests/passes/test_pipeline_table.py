"""The pipeline is data (dcp_compile.passes.pipeline.PIPELINE, built from named stages): 
docs/architecture.md lists it, transform(), the torch.compile backend and the dump follow it, a row whose
passes are out of order is refused naming the pass and the property; post-conditions raise."""

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
from dcp_compile.passes.infra import CAPTURED, DCPPass, Property, TransformContext
from dcp_compile.runtime.serving.engine import StepShapes

from suite_path import ROOT  # noqa: E402  (the repository root)

PASSES_PAGE = ROOT / "docs" / "architecture.md"   # its "Passes" section
SMALL = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5)
STEPS = pipeline.STEPS_BY_MODE
# The passes a paged model's capture makes unnecessary (it takes its caches already).
OPTIONAL = {cls.name for cls in pipeline.OPTIONAL}


def documented_pipeline() -> dict[str, list[str]]:
    """The page's "Passes" list: ``- `step`: `pass`, `pass`, ...`` items (may wrap)."""
    text = PASSES_PAGE.read_text()
    section = text.split("\n## Passes\n", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^- `(\w+)`: (.+?)(?=^- |^$)", section, flags=re.M | re.S)
    return {step: re.findall(r"`(\w+)`", passes) for step, passes in items}


def test_every_modes_step_kinds_have_a_row():
    chunked = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5, chunk_len=4)
    assert {s for mode in pipeline.STEPS_BY_MODE for s in pipeline.steps_of(mode, chunked)} \
        == set(pipeline.PIPELINE)


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
    """A paged model (no cache insertion): capture, then exactly its row."""
    prog = dcp_compile.transform(demo_model(DemoConfig(num_layers=1)), tp=4, dcp=2,
                                 mode=mode, shapes=SMALL, check=False)
    assert tuple(prog.graphs) == STEPS[mode]
    for step in STEPS[mode]:
        row = [n for n in pipeline.pass_names(step) if n not in OPTIONAL]
        assert _ran(prog, step) == row


def test_an_ordinary_model_runs_the_optional_capture_prologue():
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


def _backend_history(model) -> list[str]:
    """The pass names the torch.compile backend's program ran for the decode step."""
    from torch._dynamo.exc import BackendCompilerFailed

    from dcp_compile.backend import BackendOptions, build_program, kv_cache_spec
    ran = []

    def grab(gm, example_inputs):
        program, _ = build_program(gm, example_inputs, BackendOptions(tp=4, dcp=2))
        ran.extend(r.name for r in program.history)
        raise RuntimeError("grabbed")

    caches = kv_cache_spec(model, tp=4, dcp=2, num_blocks=SMALL.num_blocks).allocate()
    ids = torch.zeros(SMALL.batch, 1, dtype=torch.int64)
    table = torch.arange(SMALL.batch * SMALL.max_blocks).view(SMALL.batch, SMALL.max_blocks)
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed), torch.no_grad():
        torch.compile(model, backend=grab, fullgraph=True)(ids, ids.clone(), table, caches)
    return ran


def test_the_table_drives_transform_and_the_backend(monkeypatch):
    """Editing the table (here: a witness pass after insert_rank) changes what transform()
    and the torch.compile backend run, with no other code change."""
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
    ran = _backend_history(model)
    assert ran == [n for n in pipeline.pass_names("decode") if n not in OPTIONAL]
    assert ran[ran.index("insert_rank") + 1] == "witness"


def test_the_dump_records_the_steps_pipeline(tmp_path):
    dcp_compile.transform(demo_model(DemoConfig(num_layers=1)), tp=4, dcp=2, mode="decode",
                          shapes=SMALL, dump_dir=tmp_path, check=False)
    for step in STEPS["decode"]:
        manifest = json.loads((tmp_path / step / "manifest.json").read_text())
        assert manifest["pipeline"] == pipeline.pass_names(step)
        ran = [e["pass"] for e in manifest["entries"]]
        assert ran[0] == "capture" and ran[1:] == [n for n in manifest["pipeline"]
                                                  if n not in OPTIONAL]


# ------------------------------------------------------------------------------------------
# Stages and the order of a row: requires / ensures as Property values, checked
# ------------------------------------------------------------------------------------------

def test_each_row_is_its_stages_in_order_with_the_steps_dcp_rewrite_last():
    for step, row in pipeline.PIPELINE.items():
        stages = [c for stage in pipeline.Stage if stage is not pipeline.Stage.DCP_REWRITE
                  for c in pipeline.STAGES[stage]]
        assert row == tuple(stages) + pipeline.DCP_REWRITE[step]
    assert [s.value for s in pipeline.Stage] == [
        "capture prologue", "canonicalize", "prove", "shard", "dcp rewrite"]


def test_every_pass_declares_what_it_requires_and_ensures():
    for cls in {c for row in pipeline.PIPELINE.values() for c in row}:
        assert cls.required and cls.ensured, cls.name
        assert all(isinstance(p, Property) for p in cls.required | cls.ensured), cls.name


def _swap(row, a: str, b: str):
    names = [c.name for c in row]
    i, j = names.index(a), names.index(b)
    out = list(row)
    out[i], out[j] = out[j], out[i]
    return out


MISORDERED = {  # id -> (the row, the pass and the missing property the refusal names)
    "rank-input-before-proof": (_swap(pipeline.PIPELINE["decode"], "validate_and_prove",
                                      "insert_rank"),
                                r"pass insert_rank requires \['proven'\].*"
                                r"Run \['validate_and_prove'\] before insert_rank"),
    "shard-before-rank-input": (_swap(pipeline.PIPELINE["decode"], "insert_rank",
                                      "shard_tensor_parallel"),
                                r"pass shard_tensor_parallel requires \['rank_input'\]"),
    "dcp-prefill-before-sequence-parallel": (
        _swap(pipeline.PIPELINE["prefill"], "sequence_parallel", "dcp_prefill"),
        r"pass dcp_prefill requires \['sequence_parallel'\]"),
    "lift-before-cache": (_swap(pipeline.PIPELINE["decode"], "insert_paged_cache",
                                "lift_positions"),
                          r"pass lift_positions requires \['paged_cache'\]"),
    "no-mla-absorption": ([c for c in pipeline.PIPELINE["context"]
                           if c.name != "absorb_latent_attention"],
                          r"pass insert_paged_cache requires \['latent_absorbed'\].*"
                          r"Run \['absorb_latent_attention'\]"),
}


@pytest.mark.parametrize("case", list(MISORDERED))
def test_a_misordered_row_is_refused_naming_the_pass_and_property(case):
    row, message = MISORDERED[case]
    with pytest.raises(DCPTransformError, match=message):
        pipeline.check_order(row, CAPTURED)


def test_a_pass_that_ensures_what_the_capture_gives_is_refused():
    """A paged capture takes its caches already: a cache insertion after it is refused."""
    from dcp_compile.frontends.protocol import PAGED_STEP
    with pytest.raises(DCPTransformError, match=r"pass insert_paged_cache ensures "
                                                r"\['paged_cache'\].*already holds"):
        pipeline.check_order(pipeline.PIPELINE["decode"], PAGED_STEP)


def test_a_row_built_without_the_prologue_it_needs_is_refused():
    """An ordinary capture (no caches) given no prologue: the first pass that needs the
    cache names it, instead of running on a graph without one."""
    ctx = TransformContext(config=DCPConfig(tp=4, dcp=2, mode="decode", block_size=16),
                           step="decode")
    with pytest.raises(DCPTransformError, match=r"pass canonicalize_attention requires "
                                                r"\['paged_cache'\] for step decode"):
        pipeline.passes_for(ctx, "input_ids")


def test_the_tables_rows_are_checked_when_built(monkeypatch):
    """row() checks what it builds: a stage edited out of order fails at import."""
    stages = dict(pipeline.STAGES)
    stages[pipeline.Stage.SHARD] = tuple(reversed(stages[pipeline.Stage.SHARD]))
    monkeypatch.setattr(pipeline, "STAGES", stages)
    with pytest.raises(DCPTransformError, match=r"pass shard_tensor_parallel requires "
                                                r"\['rank_input'\] in the decode row"):
        pipeline.row("decode")


def test_an_unknown_step_kind_is_refused():
    ctx = TransformContext(config=DCPConfig(tp=4, dcp=2, mode="decode", block_size=16),
                           step="verify")
    with pytest.raises(DCPTransformError, match=r"no pipeline for step kind 'verify'.*"
                                                r"\['chunk', 'context', 'decode', 'prefill'\]"):
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
