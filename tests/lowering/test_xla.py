"""Lowered programs on a real XLA compiler (PJRT CPU through jaxlib): compiled once per step
for tp replicas, run SPMD on host devices, compared with the single-device model.

XLA:CPU needs its host device count (XLA_FLAGS) before jax initialises its CPU backend; this
module asks for MAX_TP devices at import. If jax was initialised with fewer devices earlier in
this process, each case runs in a fresh child process instead (``_in_xla_process``).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

if __name__ == "__main__":        # child process of _in_xla_process: this worktree first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
    from tests.support.suite_path import install   # the suite's import path, as conftest sets it
    install()

pytest.importorskip("jax", reason="XLA tests need jax/jaxlib (pip install -e '.[xla]')")
pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir (the stablehlo extra)")

import dcp_compile  # noqa: E402
from dcp_compile import xla as X  # noqa: E402
from dcp_compile.runtime.errors import DCPTransformError  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402

from full_runs import full  # noqa: E402
from lowering_helpers import XLA_SHAPES, lowered_for, program_for  # noqa: E402
from xla_process import child_main, in_xla_process  # noqa: E402

MAX_TP = 8
X.request_host_devices(MAX_TP)

SHAPES = XLA_SHAPES
LENGTHS = (3, 7)
DECODE_STEPS, CHUNKS = 4, 2
FP32_ATOL = 1e-4
# bf16 weights and caches: 8 mantissa bits, and the partial / combined attention and the
# sharded matmuls sum in another order than the single device (same bound as the threaded
# bf16 test in test_decode_dcp.py). Measured on XLA: <= 0.032.
BF16_ATOL = 0.1
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def _program(tp, dcp, mode, dtype="f32", combine="all_gather"):
    """(model, program, lowered), shared by the cases (and, through lowering_helpers, the
    other lowering tests of this process) that use the same program."""
    options = {"check": False}      # every case compares every step with the model
    if combine != "all_gather":
        options["combine"] = combine
    model, prog = program_for(tp, dcp, mode, DTYPES[dtype], SHAPES, layers=1, **options)
    _, lowered = lowered_for(tp, dcp, mode, None, DTYPES[dtype], SHAPES, layers=1, **options)
    X.check_lowered_for_xla(lowered)             # what lower_for_xla adds to the lowering
    return model, prog, lowered


_COMPILE, _EXECUTABLES = X.compile_module, {}


def _compile_once(source, devices, *, step, path=None, effort="optimized"):
    """X.compile_module, once per (module source, devices, effort) in this process: a case
    that runs a program another case compiled reuses its executables (an executable is
    immutable; each executor owns its buffers)."""
    key = (source, tuple(d.id for d in devices), effort)
    if key not in _EXECUTABLES:
        _EXECUTABLES[key] = _COMPILE(source, devices, step=step, path=path, effort=effort)
    return _EXECUTABLES[key]


def _sharing_executables(case):
    @functools.wraps(case)
    def run(*args):
        with mock.patch.object(X, "compile_module", _compile_once):
            return case(*args)
    return run


@_sharing_executables
def case_verify(tp, dcp, mode, dtype, combine="all_gather", source="text") -> dict:
    """One verification on XLA; returns the report (runs here or in a child process)."""
    model, prog, lowered = _program(tp, dcp, mode, dtype, combine)
    atol = FP32_ATOL if dtype == "f32" else BF16_ATOL
    kinds = {step: sorted({(c.kind, c.channel_handle is not None) for c in m.collectives})
             for step, m in lowered.modules.items()}
    if mode == "decode" and dtype == "bf16":
        return {"bf16": _bf16_decode(model, prog, lowered), "kinds": kinds}
    if mode == "decode":
        report = X.verify(model, prog, _prompts(), DECODE_STEPS, atol=atol, lowered=lowered,
                          source=source)
    else:
        report = X.verify_prefill(model, prog, _prompts(), CHUNKS, atol=atol, lowered=lowered,
                                  source=source)
    return {"report": report.to_json(), "kinds": kinds}


def _bf16_decode(model, prog, lowered) -> dict:
    """bf16 greedy decode: logits within BF16_ATOL at every step up to and including the
    first where a token differs; a differing token is allowed only where the reference's top
    two logits are closer than that tolerance (a near tie bf16 rounding may flip)."""
    from dcp_compile.verify import run_reference
    ref, _ = run_reference(model, prog, _prompts(), DECODE_STEPS)
    got = X.generate(prog, _prompts(), DECODE_STEPS, lowered=lowered)
    errors, flips = [], []
    for t, (g, e) in enumerate(zip(got.logits, ref.logits)):
        errors.append(float((g.float() - e.float()).abs().max()))
        top2 = e.float().topk(2, dim=-1).values
        for b in range(len(LENGTHS)):
            if got.tokens[b][t] != ref.tokens[b][t]:
                flips.append({"step": t, "row": b,
                              "margin": float(top2[b, 0] - top2[b, 1])})
        if flips:
            break                   # the sequences differ from here on
    return {"errors": errors, "flips": flips, "steps": len(errors)}


@_sharing_executables
def case_wrong_rank(tp, dcp) -> dict:
    """The comparison can fail: replicas fed each other's tp_rank compute wrong logits."""
    from dcp_compile.verify import run_reference
    from dcp_compile.runtime.serving.engine import Engine
    from dcp_compile.runtime.errors import DCPInputError
    model, prog, lowered = _program(tp, dcp, "decode")
    executor = X.XLAExecutor(prog, lowered, effort=X.VERIFY_EFFORT)   # case_verify's build
    ids, pos = torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64)
    try:                              # the step contract runs before anything executes
        executor.step("decode", ids, pos, torch.full((2, 2), 99, dtype=torch.int64))
        refused = None
    except DCPInputError as e:
        refused = e.rule
    executor.prefix[-1] = executor.replicas.per_rank(
        [torch.tensor((r + 1) % tp, dtype=torch.int64) for r in range(tp)])
    engine = Engine(executor, SHAPES, block_size=16, dcp=dcp, prompt_kind="context")
    ref, _ = run_reference(model, prog, _prompts(), 1)
    before = executor._caches[0]
    got = engine.prefill(_prompts())
    return {"error": float((got - ref.logits[0]).abs().max()), "refused": refused,
            "donated": before.is_deleted()}


def case_rejected_module() -> str:
    """A module XLA rejects: its error, naming the step, comes back as DCPXLAError."""
    bad = _MODULE.format(op="stablehlo.add %arg0, %arg0 : tensor<2x4xf32>").replace(
        "-> tensor<2x4xf32> {", "-> tensor<4x2xf32> {")
    try:
        X.compile_module(bad, X.host_devices(2), step="decode", path="bad.mlir")
    except X.DCPXLAError as e:
        return str(e)
    return "compiled"


def _in_xla_process(case: str, *args, tmp_path):
    return in_xla_process(globals(), case, *args, tmp_path=tmp_path, max_tp=MAX_TP)


# The default run's slice: each mode in each dtype, and each layout in each mode (decode:
# tp4/dcp2 f32, tp8/dcp4 bf16; prefill: tp8/dcp4 f32, tp4/dcp2 bf16). DCP_XLA_FULL=1 adds
# the other two f32 cells.
SLICE = {(4, 2, "decode", "f32"), (8, 4, "prefill", "f32"), (8, 4, "decode", "bf16"),
         (4, 2, "prefill", "bf16")}
CASES = [pytest.param(tp, dcp, mode, dtype, id=f"tp{tp}-dcp{dcp}-{mode}-{dtype}")
         for tp, dcp, mode, dtype in ((8, 4, "decode", "f32"), (8, 4, "prefill", "f32"),
                                      (4, 2, "decode", "f32"), (4, 2, "prefill", "f32"),
                                      (8, 4, "decode", "bf16"), (4, 2, "prefill", "bf16"))
         if full("DCP_XLA_FULL") or (tp, dcp, mode, dtype) in SLICE]


@pytest.mark.parametrize("tp,dcp,mode,dtype", CASES)
def test_lowered_program_on_xla_matches_the_single_device_model(tp, dcp, mode, dtype,
                                                                 tmp_path):
    got = _in_xla_process("case_verify", tp, dcp, mode, dtype, tmp_path=tmp_path)
    if "bf16" in got:
        bf16 = got["bf16"]
        assert max(bf16["errors"]) <= BF16_ATOL, bf16
        assert all(f["margin"] < 2 * BF16_ATOL for f in bf16["flips"]), bf16
        return
    report = got["report"]
    assert report["ok"], report
    assert report["tokens_agree"], report
    assert report["max_abs_error"] <= (FP32_ATOL if dtype == "f32" else BF16_ATOL), report
    # Every collective ran as XLA:CPU runs it: all_gather / reduce_scatter / all_reduce with
    # a channel (and global device ids); DCP collectives actually present.
    step = "decode" if mode == "decode" else "prefill"
    assert ("all_gather", True) in got["kinds"][step], got["kinds"]


def test_all_to_all_combine_on_xla(tmp_path):
    got = _in_xla_process("case_verify", 4, 2, "decode", "f32", "all_to_all", tmp_path=tmp_path)
    assert got["report"]["ok"], got["report"]
    assert ("all_to_all", False) in got["kinds"]["decode"], got["kinds"]    # no channel


def test_portable_artifact_on_xla(tmp_path):
    """The .mlirbc artifact (VHLO bytecode) compiles and runs like the text."""
    got = _in_xla_process("case_verify", 4, 2, "decode", "f32", "all_gather", "artifact",
                          tmp_path=tmp_path)
    assert got["report"]["ok"], got["report"]


def test_a_wrong_rank_is_caught(tmp_path):
    got = _in_xla_process("case_wrong_rank", 4, 2, tmp_path=tmp_path)
    assert got["error"] > 1e-2, got
    assert got["refused"] is not None, got       # a block id past the cache: refused
    assert got["donated"], got     # the step consumed the cache buffers (tf.aliasing_output)


def test_a_module_xla_rejects_raises_with_the_step_and_path(tmp_path):
    message = _in_xla_process("case_rejected_module", tmp_path=tmp_path)
    assert message.startswith("XLA rejected the lowered 'decode' module (bad.mlir)"), message


# -- collective forms XLA:CPU aborts on: refused before compiling ---------------------------

_MODULE = """module @m attributes {{mhlo.num_replicas = 2 : i32}} {{
  func.func @main(%arg0: tensor<2x4xf32>) -> tensor<2x4xf32> {{
    %0 = {op}
    return %0 : tensor<2x4xf32>
  }}
}}"""
_CH = "channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, "
_A2A = ('"stablehlo.all_to_all"(%arg0) <{{{ch}concat_dimension = 0 : i64, replica_groups = '
        'dense<[[0, 1]]> : tensor<1x2xi64>, split_count = 2 : i64, split_dimension = 0 : i64}}>'
        ' : (tensor<2x4xf32>) -> tensor<2x4xf32>')
_PERMUTE = ('"stablehlo.collective_permute"(%arg0) <{{{ch}source_target_pairs = dense<[[0, 1], '
            '[1, 0]]> : tensor<2x2xi64>}}> : (tensor<2x4xf32>) -> tensor<2x4xf32>')
_BROADCAST = ('"stablehlo.collective_broadcast"(%arg0) <{replica_groups = dense<[[0, 1]]> : '
              'tensor<1x2xi64>}> : (tensor<2x4xf32>) -> tensor<2x4xf32>')


@pytest.mark.parametrize("op,name", [
    pytest.param(_A2A.format(ch=_CH), "all_to_all with a channel_handle", id="all_to_all"),
    pytest.param(_PERMUTE.format(ch=_CH), "collective_permute with a channel_handle",
                 id="collective_permute"),
    pytest.param(_BROADCAST, "collective_broadcast", id="collective_broadcast")])
def test_forms_xla_cpu_aborts_on_are_refused(op, name):
    text = _MODULE.format(op=op)
    with pytest.raises(DCPTransformError, match=f"step 'decode' line 3 has stablehlo.{name}"):
        X.check_xla_cpu_forms(text, step="decode")
    # ... by the executor too, before it asks for devices or compiles anything.
    lowered = SimpleNamespace(modules={"decode": SimpleNamespace(text=text, paths={})})
    with pytest.raises(DCPTransformError, match="XLA:CPU"):
        X.XLAExecutor(SimpleNamespace(topology=SimpleNamespace(tp=2)), lowered)


def case_compile_efforts() -> dict:
    """A module with collectives compiled at each COMPILE_EFFORT: XLA's optimised HLO and its
    cost analysis (what the memory-floor tests read), and the results."""
    import re
    import numpy as np
    text = _MODULE.format(op=_A2A.format(ch=""))
    devices = X.host_devices(2)
    x = torch.arange(16, dtype=torch.float32).reshape(2, 2, 4)
    replicas = X._Replicas(devices)
    got = {}
    for effort in X.COMPILE_EFFORT:
        ex = X.compile_module(text, devices, step="decode", effort=effort)
        hlo = re.sub(r"HloModule \S+", "", ex.hlo_modules()[0].to_string())
        out = ex.execute_sharded([replicas.per_rank([x[0], x[1]])])
        out = [np.asarray(b) for b in out.disassemble_into_single_device_arrays()[0]]
        got[effort] = {"hlo": hlo, "cost": ex.cost_analysis(), "out": out}
    try:
        X.compile_module(text, devices, step="decode", effort="max")
        got["unknown"] = None
    except X.DCPXLAError as e:
        got["unknown"] = str(e)
    return got


def test_compile_efforts_differ_only_in_machine_code(tmp_path):
    """"fast" (what the verifiers compile) and "optimized" give XLA the same optimised HLO and
    cost analysis, and the same results; an unknown effort is refused."""
    got = _in_xla_process("case_compile_efforts", tmp_path=tmp_path)
    fast, optimized = got["fast"], got["optimized"]
    assert fast["hlo"] == optimized["hlo"] and "all-to-all" in fast["hlo"]
    assert fast["cost"] == optimized["cost"]
    for a, b in zip(fast["out"], optimized["out"]):
        assert (a == b).all()
    assert got["unknown"].startswith("unknown compile effort 'max'"), got["unknown"]


def test_forms_xla_cpu_runs_pass_the_check():
    X.check_xla_cpu_forms(_MODULE.format(op=_A2A.format(ch="")))           # no channel
    X.check_xla_cpu_forms(_MODULE.format(op=_PERMUTE.format(ch="")))


def test_missing_jax_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)
    ok, why = X.xla_available()
    assert not ok and "'.[xla]'" in why
    with pytest.raises(X.DCPXLAError, match=r"pip install -e '\.\[xla\]'"):
        X.host_devices(2)


@pytest.mark.parametrize("command", ["verify", "demo"])
def test_cli_backend_xla_without_jax_exits_2_naming_the_extra(command, capsys, monkeypatch):
    from dcp_compile import cli
    monkeypatch.setitem(sys.modules, "jax", None)
    parser = cli.build_parser()
    for action in parser._subparsers._group_actions[0].choices.values():
        action.set_defaults(_run=lambda args: pytest.fail("started work without jax"))
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    try:
        code = cli.main([command, "--tp", "4", "--dcp", "2", "--backend", "xla"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "--backend xla cannot run here" in err and "'.[xla]'" in err, err


def case_cli_verify() -> dict:
    """`dcp-compile verify --backend xla` through the CLI's main: its exit code and report."""
    import contextlib
    import io
    import json
    from dcp_compile import cli
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["verify", "--tp", "4", "--dcp", "2", "--steps", "2", "--backend",
                         "xla", "--json"])
    return {"code": code, "report": json.loads(out.getvalue().strip().splitlines()[-1])}


def test_cli_verify_backend_xla(tmp_path):
    """`dcp-compile verify --backend xla` end to end (here when jax has the devices, as the
    test process has; the next test shows the CLI asks for them itself)."""
    got = _in_xla_process("case_cli_verify", tmp_path=tmp_path)
    report = got["report"]
    assert got["code"] == 0
    assert report["ok"] and report["tp"] == 4 and report["max_abs_error"] <= FP32_ATOL, report


def test_cli_backend_xla_asks_for_its_devices_before_any_work(monkeypatch):
    """In a fresh process XLA_FLAGS has no device count: the CLI sets tp of them while it
    checks the options, before the command runs (and so before jax starts)."""
    from dcp_compile import cli
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    parser = cli.build_parser()
    seen = []
    for action in parser._subparsers._group_actions[0].choices.values():
        action.set_defaults(_run=lambda args: seen.append(os.environ.get("XLA_FLAGS")))
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main(["verify", "--tp", "4", "--dcp", "2", "--backend", "xla"]) == 0
    assert seen == ["--xla_force_host_platform_device_count=4"], seen


def case_moe_verify(mode, expert_parallel, model_id="mixtral") -> dict:
    """A MoE model (dcp.moe lowered through its static decomposition) at tp=8, TP experts or
    expert parallel, on XLA against the model's paged single-device form. gpt-oss: biased,
    interleaved, clamped-gate experts and attention sinks."""
    from dcp_compile import hf
    from test_moe import build
    model = build(model_id)
    wrapper = hf.prepare(model, max_model_len=model.config.max_position_embeddings)
    prog = dcp_compile.transform(wrapper, tp=8, dcp=4, mode=mode, block_size=4,
                                 interleave_size=2 if mode == "decode" else 4,
                                 shapes=StepShapes(batch=2, context_len=8, max_blocks=4,
                                                   num_blocks=9),
                                 check=False, expert_parallel=expert_parallel)
    report = X.verify(wrapper, prog, _prompts(), DECODE_STEPS if mode == "decode" else 1)
    return {"report": report.to_json()}


@pytest.mark.parametrize("model_id,ep", [("mixtral", False), ("mixtral", True),
                                         ("gpt_oss", False), ("gpt_oss", True)],
                         ids=["tp_experts", "expert_parallel", "gpt_oss-tp_experts",
                              "gpt_oss-expert_parallel"])
def test_moe_program_on_xla_matches_the_model(model_id, ep, tmp_path):
    from test_moe import MATRIX
    if (model_id, ep) == ("gpt_oss", True) and not MATRIX:
        pytest.skip("gpt-oss expert parallel on XLA is in the MoE matrix (DCP_MOE_MATRIX=1)")
    report = _in_xla_process("case_moe_verify", "decode", ep, model_id,
                             tmp_path=tmp_path)["report"]
    assert report["ok"] and report["tp"] == 8, report


if __name__ == "__main__":        # child process of _in_xla_process
    child_main(globals())
