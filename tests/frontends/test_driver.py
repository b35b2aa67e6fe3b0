"""One compile driver (dcp_compile.driver.compile_program) for every frontend: which frontend a
model gets (FRONTEND_RULES), a new frontend needs no driver change, passes return what they
find, and the DCPProgram is built in one place."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp_compile.driver import CompileOptions, compile_program
from dcp_compile.frontends import frontend_for
from dcp_compile.frontends.ordinary import OrdinaryFrontend
from dcp_compile.frontends.paged import PagedFrontend
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.models.plain import plain_llama
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.program.facts import ModelFacts
from dcp_compile.runtime.names import StepKind

from suite_path import ROOT  # noqa: E402  (the repository root)
SMALL = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5)


class PagedArgsWithoutHooks(torch.nn.Module):
    def forward(self, input_ids, positions, block_table, kv_caches):
        return input_ids


class OrdinaryLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)

    def forward(self, input_ids):
        return self.embed(input_ids)


@pytest.mark.parametrize("model,frontend", [
    (demo_model(DemoConfig(num_layers=1)), PagedFrontend),
    (plain_llama(DemoConfig(num_layers=1)), OrdinaryFrontend),
    (OrdinaryLM(), OrdinaryFrontend),
], ids=["demo-paged", "plain-llama-ordinary", "any-lm-ordinary"])
def test_each_model_gets_its_frontend(model, frontend):
    assert type(frontend_for(model, SMALL)) is frontend


def test_a_paged_signature_without_the_cache_hooks_is_refused():
    with pytest.raises(DCPTransformError, match=r"PagedArgsWithoutHooks does not describe "
                                                r"its KV cache.*num_layers.*kv_cache_shape"):
        frontend_for(PagedArgsWithoutHooks())


class CountingFrontend(PagedFrontend):
    """A frontend the driver has never heard of: it records what the driver asked."""

    def __init__(self, model, shapes):
        super().__init__(model, shapes)
        self.asked: list[str] = []

    def capture(self, step, config):
        self.asked.append(f"capture {step}")
        return super().capture(step, config)

    def prologue(self, ctx, captured):
        self.asked.append(f"prologue {ctx.step} facts={ctx.facts.num_layers}")
        return []

    def accept(self, config):
        self.asked.append(f"accept heads={config.num_q_heads}")


def test_a_new_frontend_plugs_into_the_driver_unchanged():
    model = demo_model(DemoConfig(num_layers=1))
    front = CountingFrontend(model, SMALL)
    program = compile_program(front, DCPConfig(tp=4, dcp=2, mode="decode", block_size=16),
                              CompileOptions(check=False))
    heads = model.config.num_q_heads     # validate_and_prove found it in the graph
    assert front.asked == ["capture context", "prologue context facts=1",
                           "capture decode", "prologue decode facts=1",
                           f"accept heads={heads}"]
    assert tuple(program.graphs) == (StepKind.CONTEXT, StepKind.DECODE)
    assert (program.config.num_q_heads, program.num_layers) == (heads, 1)
    assert program.certificate.ok and program.shards


def test_the_ordinary_frontends_facts_come_from_the_cache_insertion():
    """An ordinary model states nothing up front; insert_paged_cache returns the layers and
    the cache dtype it finds, and the driver carries them into the program."""
    model = plain_llama(DemoConfig(num_layers=2, hidden_size=64, num_q_heads=8,
                                   intermediate_size=96))
    front = frontend_for(model, SMALL)
    assert front.facts() == ModelFacts()
    program = compile_program(front, DCPConfig(tp=4, dcp=2, mode="prefill", block_size=4),
                              CompileOptions(check=False))
    assert program.num_layers == 2 and program.facts.cache_dtype == torch.float32


def test_the_driver_builds_the_only_program_and_names_no_model_kind():
    source = (ROOT / "dcp_compile" / "driver.py").read_text()
    for kind in ("ordinary", "hf_prepare", "paged", "dynamo"):
        assert not re.search(rf"""["']{kind}["']""", source), kind
    built = [p.relative_to(ROOT).as_posix() for folder in ("dcp_compile", "passes")
             for p in (ROOT / folder).rglob("*.py") if "DCPProgram(" in p.read_text()]
    assert built == ["dcp_compile/driver.py"]


def test_check_true_without_a_reference_is_refused():
    class NoReference(PagedFrontend):
        def reference(self):
            return None
    front = NoReference(demo_model(DemoConfig(num_layers=1)), SMALL)
    with pytest.raises(DCPTransformError, match="check=True needs the model's own forward"):
        compile_program(front, DCPConfig(tp=2, dcp=1, mode="decode", block_size=16),
                        CompileOptions(check=True))


# -- source lines: recorded when the graphs will be read, or to explain a refusal ----------

class NonCausalLM(torch.nn.Module):
    """An encoder-style attention (no causal mask): the cache insertion refuses it."""

    def __init__(self, heads=4, dim=8):
        super().__init__()
        self.heads, self.embed = heads, torch.nn.Embedding(16, heads * dim)
        self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim, bias=False)
        self.head = torch.nn.Linear(heads * dim, 16, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.head(out.transpose(1, 2).reshape(b, s, -1))


class RecordingOrdinary(OrdinaryFrontend):
    """Records, per capture, whether FX was recording stack traces."""

    def __init__(self, model, shapes):
        super().__init__(model, shapes)
        self.traced: list[bool] = []

    def capture(self, step, config):
        self.traced.append(not torch.fx.config.do_not_emit_stack_traces)
        return super().capture(step, config)


def _nodes_with_source(program) -> list[str]:
    return [n.meta["stack_trace"] for gm in program.graphs.values() for n in gm.graph.nodes
            if n.meta.get("stack_trace")]


def test_graphs_carry_source_lines_only_when_a_dump_shows_them(tmp_path):
    model, config = demo_model(DemoConfig(num_layers=1)), DCPConfig(tp=4, dcp=2)
    plain = compile_program(PagedFrontend(model, SMALL), config, CompileOptions())
    dumped = compile_program(PagedFrontend(model, SMALL), config,
                             CompileOptions(dump_dir=tmp_path / "dump"))
    assert _nodes_with_source(plain) == []
    traces = _nodes_with_source(dumped)
    assert traces and any("models/demo.py" in t for t in traces), traces[:2]
    assert torch.fx.config.do_not_emit_stack_traces is False      # torch's setting, restored


def test_a_refusal_is_compiled_again_to_name_its_source_line():
    front = RecordingOrdinary(NonCausalLM(), SMALL)
    with pytest.raises(DCPTransformError, match="non-causal attention") as e:
        compile_program(front, DCPConfig(tp=2, dcp=1, mode="decode", block_size=4),
                        CompileOptions())
    assert front.traced == [False, True]      # refused untraced, then captured with lines
    assert re.search(r'test_driver\.py", line \d+', str(e.value)), str(e.value)
    assert torch.fx.config.do_not_emit_stack_traces is False


def test_stack_traces_true_records_them_without_a_dump_and_false_never_retries():
    model = demo_model(DemoConfig(num_layers=1))
    traced = compile_program(PagedFrontend(model, SMALL), DCPConfig(tp=4, dcp=2),
                             CompileOptions(stack_traces=True))
    assert _nodes_with_source(traced)
    front = RecordingOrdinary(NonCausalLM(), SMALL)
    with pytest.raises(DCPTransformError, match="non-causal attention") as e:
        compile_program(front, DCPConfig(tp=2, dcp=1, mode="decode", block_size=4),
                        CompileOptions(stack_traces=False))
    assert front.traced == [False]            # refused once, not compiled again
    assert "test_driver.py" not in str(e.value) and "at node " in str(e.value)


def test_the_driver_and_the_paged_frontend_load_without_transformers():
    """transformers (seconds of CPU to import) loads only when a Hugging Face model is
    transformed: the driver and the demo model's frontend do not import it (the
    supervisors build the demo program in a fresh process; docs/runtime.md)."""
    code = ("import sys, dcp_compile.driver, dcp_compile.frontends.paged; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')[:3])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
