"""Capture the tiny demo model and run passes on it through the real pass manager (the
numeric and structure tests of the whole pipeline; Before/Expected tests of one pass use
tests/support/before_expected.py)."""

from __future__ import annotations

from collections import Counter

import torch

from dcp_compile.capture import capture, example_step_inputs
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.passes.infra import TransformContext
from dcp_compile.passes.manager import run_passes


def tiny_graph(*, tokens=1, batch=2, max_blocks=2, num_blocks=5, cfg=None, block=16):
    model = demo_model(cfg or DemoConfig(num_layers=1))
    ex = example_step_inputs(batch, tokens, max_blocks, model.kv_cache_shape(num_blocks, block),
                             model.num_layers, device="cpu", dtype=torch.float32)
    return model, capture(model, ex)


def run(gm, passes, step=None):
    """Run ``passes`` in order through dcp_compile.passes.manager.run_passes (lint and shape propagation
    after each); ``step`` defaults to the first pass's context step."""
    step = step or passes[0].ctx.step
    gm, _ = run_passes(gm, passes, step=step)
    return gm


def ctx_for(tp, dcp, step, mode="decode", interleave=None):
    return TransformContext(config=DCPConfig(tp=tp, dcp=dcp, mode=mode,
                                             interleave_size=interleave), step=step)


def op_counts(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
