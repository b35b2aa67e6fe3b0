"""Defining a ``dcp`` custom op, and the Python function behind each one.

:func:`dcp_op` is ``torch.library.custom_op("dcp::<name>")`` that also keeps the function it
was defined from in ``PYTHON_KERNELS``. A loaded eager program calls those functions directly
(:func:`dcp_compile.runtime.kernels.eager.call_kernels_directly`): through the dispatcher every call
of a custom op goes through its autograd wrapper (even under ``no_grad``: a threaded tp=8
decode run took 12.5-13.2 CPU-s through it, 10.8-11.1 direct), and the first call in a
process imports ``torch._dynamo`` (custom_op disables Dynamo around its kernels: a fresh
process's first threaded run of a loaded program took 1.73 CPU-s, 0.43 direct). The ops
themselves stay what the program's graphs, export, Inductor and the StableHLO lowering see.
"""

from __future__ import annotations

from typing import Callable

import torch

# "<name>" of dcp::<name> -> the function the op was defined from (same signature).
PYTHON_KERNELS: dict[str, Callable] = {}


def dcp_op(name: str, *, mutates_args: tuple[str, ...] = ()):
    """Decorator: define ``dcp::<name>`` from the function, and record the function."""
    def define(fn: Callable):
        PYTHON_KERNELS[name] = fn
        return torch.library.custom_op(f"dcp::{name}", mutates_args=mutates_args)(fn)
    return define


def op_of(target):
    """The op a graph node's target stands for: ``torch.ops.dcp.<name>.default`` for a
    function of ``PYTHON_KERNELS`` (a loaded eager graph's), else the target itself."""
    for name, fn in PYTHON_KERNELS.items():
        if fn is target:
            return getattr(torch.ops.dcp, name).default
    return target
