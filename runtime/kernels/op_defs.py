"""Defining a ``dcp`` custom op, and the Python function behind each one.

:func:`dcp_op` is ``torch.library.custom_op("dcp::<name>")`` that also keeps the function it
was defined from in ``PYTHON_KERNELS``. A loaded eager program calls those functions directly
(:func:`dcp_compile.runtime.kernels.eager.call_kernels_directly`): through the dispatcher every call
of a custom op goes through its autograd wrapper (even under ``no_grad``: a threaded tp=8
decode run took 12.5-13.2 CPU-s through it, 10.8-11.1 direct), and the first call in a
process imports ``torch._dynamo`` (custom_op disables Dynamo around its kernels: a fresh
process's first threaded run of a loaded program took 1.73 CPU-s, 0.43 direct). The ops
themselves stay what the program's graphs, export, Inductor and the StableHLO lowering see.

Every op returns contiguous tensors, its kernel and its fake alike (:func:`_contiguous`): a
fake that says "contiguous" over a kernel that returns a transposed view lets a ``view`` pass
shape propagation at transform time and fail at run time (nanoGPT's ``y.transpose(1, 2)
.contiguous().view(B, T, C)`` after attention, the transpose folded into the op's output).
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Callable

import torch

# "<name>" of dcp::<name> -> the function the op was defined from (same signature).
PYTHON_KERNELS: dict[str, Callable] = {}


def _contiguous(out):
    if isinstance(out, torch.Tensor):
        return out.contiguous()
    if isinstance(out, (tuple, list)):
        return type(out)(_contiguous(o) for o in out)
    return out


def _laid_out(fn: Callable) -> Callable:
    """``fn`` with every tensor it returns contiguous (module doc)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return _contiguous(fn(*args, **kwargs))
    # custom_op reads the schema from the signature, resolved where ``fn`` was written.
    run.__signature__ = inspect.signature(fn, eval_str=True)
    run.__annotations__ = typing.get_type_hints(fn)
    del run.__wrapped__
    return run


def dcp_op(name: str, *, mutates_args: tuple[str, ...] = ()):
    """Decorator: define ``dcp::<name>`` from the function, and record the function. The
    kernel and the fake registered later both return contiguous tensors."""
    def define(fn: Callable):
        kernel = _laid_out(fn)
        PYTHON_KERNELS[name] = kernel
        op = torch.library.custom_op(f"dcp::{name}", mutates_args=mutates_args)(kernel)
        register_fake = op.register_fake
        op.register_fake = lambda fake: register_fake(_laid_out(fake))
        return op
    return define


def op_of(target):
    """The op a graph node's target stands for: ``torch.ops.dcp.<name>.default`` for a
    function of ``PYTHON_KERNELS`` (a loaded eager graph's), else the target itself."""
    for name, fn in PYTHON_KERNELS.items():
        if fn is target:
            return getattr(torch.ops.dcp, name).default
    return target
