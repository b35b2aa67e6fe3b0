"""torch.compile backend "dcp": entry point, options, same numerics as transform(), graph
breaks and unsupported constructs as clear errors (the real torchrun + gloo world: the
backend part of tests/e2e/test_torchrun_world.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed, Unsupported

import dcp_compile
from dcp_compile import verify as V
from dcp_compile.backend import (BackendOptions, build_program, kv_cache_spec,
                                 merge_programs)
from dcp_compile.runtime.errors import DCPConfigError, DCPTransformError, DCPWorldError
from dcp_compile.models.demo import DemoConfig, DemoLlama, demo_model
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes
from dcp_compile.runtime.serving.kv_cache import KVCacheSpec
from dcp_compile.runtime.distributed.world import run_threaded

from backend_worker import PrintingDemo
from helpers import assert_close_report, prompts_of

from suite_path import ROOT  # noqa: E402  (the repository root)
SHAPES = StepShapes(batch=3, context_len=17, max_blocks=2, num_blocks=7)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step_inputs(shapes: StepShapes, tokens: int, caches):
    ids = torch.zeros(shapes.batch, tokens, dtype=torch.int64)
    positions = torch.arange(tokens).expand(shapes.batch, -1).contiguous()
    table = torch.zeros(shapes.batch, shapes.max_blocks, dtype=torch.int64)
    return ids, positions, table, caches


def _inner(excinfo) -> BaseException:
    """The backend's own exception inside Dynamo's BackendCompilerFailed."""
    assert isinstance(excinfo.value, BackendCompilerFailed), excinfo.value
    return excinfo.value.inner_exception


# ------------------------------------------------------------------------------------------
# Registration and options
# ------------------------------------------------------------------------------------------


def test_backend_name_resolves_through_the_entry_point_without_importing_dcp_compile():
    code = ("import sys, torch\n"
            "from torch._dynamo.backends.registry import lookup_backend\n"
            "assert 'dcp' in torch._dynamo.list_backends()\n"
            "assert not [m for m in sys.modules if m.startswith('dcp_compile')]\n"
            "fn = lookup_backend('dcp')\n"
            "print(fn.__module__, fn.__name__)\n")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["dcp_compile.backend", "dcp_backend"]


def test_options_are_checked_and_the_factory_is_the_module():
    from dcp_compile import backend
    fn = backend(tp=4, dcp=2, mode="decode")
    assert callable(fn) and fn.__name__ == "dcp"
    assert fn.options == BackendOptions(dcp=2, tp=4, mode="decode")
    with pytest.raises(DCPConfigError, match=r"TP % DCP == 0: tp=3, dcp=2"):
        backend(tp=3, dcp=2)
    with pytest.raises(DCPConfigError, match=r"unknown torch.compile options .*'dpc'"):
        BackendOptions.from_dict({"tp": 4, "dpc": 2})
    with pytest.raises(DCPConfigError, match="options has no 'dcp'"):
        BackendOptions.from_dict({"tp": 4})


def test_options_reach_the_backend_through_torch_compile():
    model = demo_model(DemoConfig(num_layers=1))
    caches = kv_cache_spec(model, tp=4, dcp=2, num_blocks=5).allocate()
    compiled = torch.compile(model, backend="dcp", options={"tp": 4, "dcp": 3})
    with pytest.raises(BackendCompilerFailed) as e, torch.no_grad():
        compiled(*_step_inputs(StepShapes(batch=2, max_blocks=2, num_blocks=5), 8, caches))
    assert isinstance(_inner(e), DCPConfigError) and "tp=4, dcp=3" in str(_inner(e))


# ------------------------------------------------------------------------------------------
# Numerics: the backend's programs are transform()'s
# ------------------------------------------------------------------------------------------


class _Grabbed(Exception):
    pass


def _backend_program(model, tp: int, dcp: int, tokens: int, shapes: StepShapes,
                     mode: str = "decode"):
    """Compile through Dynamo, build the backend's DCPProgram inside the backend, stop."""
    got = []
    opts = BackendOptions(tp=tp, dcp=dcp, mode=mode)

    def grab(gm, example_inputs):
        program, capture = build_program(gm, example_inputs, opts)
        program.constants = {name: example_inputs[i] for name, i in capture.weights}
        got.append(program)
        raise _Grabbed

    caches = kv_cache_spec(model, tp=tp, dcp=dcp, num_blocks=shapes.num_blocks,
                           mode=mode).allocate()
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed), torch.no_grad():
        torch.compile(model, backend=grab, fullgraph=True)(
            *_step_inputs(shapes, tokens, caches))
    return got[0]


def test_backend_programs_match_transform_and_the_single_device_model_on_threads():
    """tp=4, dcp=2: the context (S>1) and decode (S=1) programs the backend builds have
    transform()'s collectives and decode the single-device model's tokens."""
    model = demo_model()
    context = _backend_program(model, 4, 2, SHAPES.context_len, SHAPES)
    decode = _backend_program(model, 4, 2, 1, SHAPES)
    assert list(context.graphs) == ["context"] and list(decode.graphs) == ["decode"]
    program = merge_programs(context, decode)
    # The reference's structure only (the default check of the demo model at tp=4/dcp=2 is
    # test_transform_check's); the backend's program is verified below.
    reference = dcp_compile.transform(model, tp=4, dcp=2, shapes=SHAPES, check=False)
    for step in ("context", "decode"):
        assert program.collectives_per_layer(step) == reference.collectives_per_layer(step)
        assert program.model_collectives(step) == reference.model_collectives(step)
        assert [r.name for r in program.history if r.step == step] == \
            [r.name for r in reference.history if r.step == step]
    assert sorted(program.weight_inputs) == sorted(reference.weight_inputs)
    assert program.shards == reference.shards
    report = V.verify(model, program, prompts_of([5, 17, 3]), 6)
    assert report.tokens_agree and report.ok, report.to_json()


def test_backend_prefill_program_matches_the_single_device_model_on_threads():
    model = demo_model(DemoConfig(num_layers=1))
    shapes = StepShapes(batch=2, context_len=16, max_blocks=4, num_blocks=9)
    program = _backend_program(model, 4, 2, shapes.context_len, shapes, mode="prefill")
    assert list(program.graphs) == ["prefill"]
    report = V.verify_prefill(model, program, prompts_of([20, 33]), chunks=3)
    assert report.ok, report.to_json()


@pytest.mark.parametrize("how", ["name", "factory"])
def test_compiled_model_in_a_one_rank_world_matches_single_device(how):
    model = demo_model(DemoConfig(num_layers=1))
    prompts, steps = prompts_of([5, 17, 3]), 4
    spec = kv_cache_spec(model, tp=1, dcp=1, num_blocks=SHAPES.num_blocks)
    with torch.no_grad():
        ref = Engine(LocalExecutor(model, spec.allocate()), SHAPES,
                     block_size=16).generate(prompts, steps)
    if how == "name":
        compiled = torch.compile(model, backend="dcp", options={"tp": 1, "dcp": 1},
                                 fullgraph=True)
    else:
        from dcp_compile import backend
        compiled = torch.compile(model, backend=backend(tp=1, dcp=1), fullgraph=True)

    def rank_main(rank):
        engine = Engine(LocalExecutor(compiled, spec.allocate()), SHAPES, block_size=16)
        return engine.generate(prompts, steps)

    with torch.no_grad():
        [got] = run_threaded(1, rank_main)
    assert got.tokens == ref.tokens
    for t, (g, r) in enumerate(zip(got.logits, ref.logits)):
        assert_close_report(g, r, atol=1e-5, what=f"step {t}")


# ------------------------------------------------------------------------------------------
# Clear errors, never a silent unsharded fallback
# ------------------------------------------------------------------------------------------


class BranchyDemo(torch.nn.Module):
    """A data-dependent branch inside forward: a graph break under fullgraph=False."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, block_table, kv_caches):
        if positions.max() > 10_000:
            input_ids = input_ids * 0
        return self.model(input_ids, positions, block_table, kv_caches)


@pytest.mark.parametrize("wrapper,where", [(PrintingDemo, "print("),
                                           (BranchyDemo, "if positions.max()")],
                         ids=["print", "data-dependent-branch"])
def test_graph_break_is_a_dcp_transform_error(wrapper, where):
    model = demo_model(DemoConfig(num_layers=1))
    caches = kv_cache_spec(model, tp=4, dcp=2, num_blocks=5).allocate()
    compiled = torch.compile(wrapper(model), backend="dcp", options={"tp": 4, "dcp": 2},
                             fullgraph=False)
    with pytest.raises(BackendCompilerFailed) as e, torch.no_grad():
        compiled(*_step_inputs(StepShapes(batch=2, max_blocks=2, num_blocks=5), 8, caches))
    err = _inner(e)
    assert isinstance(err, DCPTransformError)
    assert "graph break in the compiled model" in str(err) and where in str(err)
    assert "unsharded" in str(err)


def test_graph_break_with_fullgraph_is_dynamos_error():
    model = demo_model(DemoConfig(num_layers=1))
    caches = kv_cache_spec(model, tp=4, dcp=2, num_blocks=5).allocate()
    compiled = torch.compile(PrintingDemo(model), backend="dcp",
                             options={"tp": 4, "dcp": 2}, fullgraph=True)
    with pytest.raises(Unsupported), torch.no_grad():
        compiled(*_step_inputs(StepShapes(batch=2, max_blocks=2, num_blocks=5), 8, caches))


def test_suppressed_dynamo_errors_still_never_run_unsharded():
    """With suppress_errors Dynamo would run the model eagerly; the backend hands it a
    graph that raises instead."""
    model = demo_model(DemoConfig(num_layers=1))
    caches = kv_cache_spec(model, tp=4, dcp=2, num_blocks=5).allocate()
    compiled = torch.compile(PrintingDemo(model), backend="dcp",
                             options={"tp": 4, "dcp": 2})
    with torch._dynamo.config.patch(suppress_errors=True), \
            pytest.raises(DCPTransformError, match="graph break"), torch.no_grad():
        compiled(*_step_inputs(StepShapes(batch=2, max_blocks=2, num_blocks=5), 8, caches))


class SDPADemo(DemoLlama):
    """Attention over contiguous K/V (SDPA): nothing paged to shard."""

    def forward(self, input_ids, positions, block_table, kv_caches):
        x = self.embed_tokens(input_ids)
        b, s, _ = x.shape
        for layer in self.layers:
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(b, s, -1, a.head_dim).transpose(1, 2)
            k = a.k_proj(h).view(b, s, -1, a.head_dim).transpose(1, 2)
            v = a.v_proj(h).view(b, s, -1, a.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        return self.lm_head(self.norm(x)), [c + 0 for c in kv_caches]


def test_unrecognised_attention_is_a_dcp_transform_error():
    model = SDPADemo(DemoConfig(num_layers=1)).eval()
    caches = kv_cache_spec(model, tp=4, dcp=2, num_blocks=5).allocate()
    compiled = torch.compile(model, backend="dcp", options={"tp": 4, "dcp": 2},
                             fullgraph=True)
    with pytest.raises(BackendCompilerFailed) as e, torch.no_grad():
        compiled(*_step_inputs(StepShapes(batch=2, max_blocks=2, num_blocks=5), 8, caches))
    assert isinstance(_inner(e), DCPTransformError)
    assert "unrecognised attention form" in str(_inner(e))


def test_full_model_caches_are_rejected_with_the_per_rank_shape():
    model = demo_model(DemoConfig(num_layers=1))     # 2 KV heads; a tp=4 rank holds 1
    c = model.config
    caches = KVCacheSpec(1, 5, 16, c.num_kv_heads, c.head_dim).allocate()
    compiled = torch.compile(model, backend="dcp", options={"tp": 4, "dcp": 2})
    with pytest.raises(BackendCompilerFailed) as e, torch.no_grad():
        compiled(*_step_inputs(StepShapes(batch=2, max_blocks=2, num_blocks=5), 8, caches))
    assert "have 2 KV heads" in str(_inner(e)) and "kv_cache_spec" in str(_inner(e))


def test_running_outside_a_world_is_a_dcp_world_error():
    model = demo_model(DemoConfig(num_layers=1))
    caches = kv_cache_spec(model, tp=4, dcp=2, num_blocks=5).allocate()
    compiled = torch.compile(model, backend="dcp", options={"tp": 4, "dcp": 2})
    with pytest.raises(DCPWorldError, match="no.*initialised|none is initialised"), \
            torch.no_grad():
        compiled(*_step_inputs(StepShapes(batch=2, max_blocks=2, num_blocks=5), 8, caches))
