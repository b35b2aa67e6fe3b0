"""The demo programs the lowering tests share (built once per test process), and their
lowered modules."""

from __future__ import annotations

import torch

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.engine import StepShapes

SHAPES = StepShapes(batch=2, context_len=16, max_blocks=4, num_blocks=8)
LAYERS = 2

_programs: dict = {}
_lowered: dict = {}


def program_for(tp, dcp, mode, dtype=torch.float32, shapes=SHAPES):
    key = (tp, dcp, mode, dtype, shapes)
    if key not in _programs:
        model = demo_model(DemoConfig(num_layers=LAYERS), dtype=dtype)
        _programs[key] = (model, dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode,
                                                       shapes=shapes))
    return _programs[key]


def lowered_for(tp, dcp, mode, tmp_path_factory, dtype=torch.float32):
    key = (tp, dcp, mode, dtype)
    if key not in _lowered:
        _, prog = program_for(tp, dcp, mode, dtype)
        out = tmp_path_factory.mktemp(f"lower_tp{tp}_dcp{dcp}_{mode}")
        from dcp_compile.lowering import lower
        _lowered[key] = (prog, lower(prog, target="stablehlo", out_dir=out))
    return _lowered[key]
