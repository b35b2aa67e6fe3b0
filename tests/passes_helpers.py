"""Build tiny "before" graphs and run a prefix of the pipeline on them (pass tests)."""

from __future__ import annotations

from collections import Counter

import torch

from dcp_compile.capture import capture, example_step_inputs
from runtime.config import DCPConfig
from dcp_compile.models import DemoConfig, demo_model
from passes.infra import TransformContext
from passes.manager import repropagate


def tiny_graph(*, tokens=1, batch=2, max_blocks=2, num_blocks=5, cfg=None, block=16):
    model = demo_model(cfg or DemoConfig(num_layers=1))
    ex = example_step_inputs(batch, tokens, max_blocks, model.kv_cache_shape(num_blocks, block),
                             model.num_layers, device="cpu", dtype=torch.float32)
    return model, capture(model, ex)


def run(gm, passes):
    for p in passes:
        res = p(gm)
        gm = res.graph_module if res is not None else gm
        gm.graph.lint()
        gm.recompile()
        repropagate(gm)
    return gm


def ctx_for(tp, dcp, step, mode="decode", interleave=None):
    return TransformContext(config=DCPConfig(tp=tp, dcp=dcp, mode=mode,
                                             interleave_size=interleave), step=step)


def op_counts(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
