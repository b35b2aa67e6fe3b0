"""The demo programs the lowering tests share (built once per test process), and their
lowered modules.

Transforming and lowering (torch-mlir) a program takes seconds; several tests and files
(test_lowering, test_lowering_interpreter, test_lowering_reuse, test_xla) make claims about
the same program, so each is built and lowered once per process, keyed by its build
arguments. Tests only read what they get: a test that edits a program copies it first.

The programs are built with ``check=False``: transform's check runs the program against the
model and changes neither (tests/frontends/test_transform_check.py), and it was most of the build (the
tp=8/dcp=4 decode check decodes past a vblock on 8 threads: ~8 of its ~10 CPU-s). The
lowered programs are compared with the model by the interpreter and XLA tests instead.
"""

from __future__ import annotations

import torch

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.serving.engine import StepShapes

SHAPES = StepShapes(batch=2, context_len=16, max_blocks=4, num_blocks=8)
LAYERS = 2
# The one-layer programs test_xla compiles and runs (smaller: XLA compiles take seconds).
XLA_SHAPES = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5)

_programs: dict = {}
_lowered: dict = {}


def _key(tp, dcp, mode, dtype, shapes, layers, options):
    return (tp, dcp, mode, dtype, shapes, layers, tuple(sorted(options.items())))


def program_for(tp, dcp, mode, dtype=torch.float32, shapes=SHAPES, *, layers=LAYERS,
                **options):
    """(model, program): the demo model of ``layers`` layers, transformed (transform's own
    defaults but ``check=False``, plus ``options``)."""
    options = {"check": False, **options}
    key = _key(tp, dcp, mode, dtype, shapes, layers, options)
    if key not in _programs:
        model = demo_model(DemoConfig(num_layers=layers), dtype=dtype)
        _programs[key] = (model, dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode,
                                                       shapes=shapes, **options))
    return _programs[key]


def lowered_for(tp, dcp, mode, tmp_path_factory=None, dtype=torch.float32, shapes=SHAPES, *,
                layers=LAYERS, **options):
    """(program, LoweringResult) of program_for's program; with ``tmp_path_factory`` its
    modules are also written to a directory (paths, lowering.json)."""
    from dcp_compile.lowering import lower, write
    options = {"check": False, **options}
    key = _key(tp, dcp, mode, dtype, shapes, layers, options)
    if key not in _lowered:
        _, prog = program_for(tp, dcp, mode, dtype, shapes, layers=layers, **options)
        _lowered[key] = (prog, lower(prog, target="stablehlo"))
    prog, result = _lowered[key]
    if tmp_path_factory is not None and getattr(result, "out_dir", None) is None:
        write(result, tmp_path_factory.mktemp(f"lower_tp{tp}_dcp{dcp}_{mode}"))
    return prog, result
