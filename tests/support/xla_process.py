"""A lowering test's case on XLA:CPU with ``max_tp`` host devices: in this process when jax
already has them, else in a fresh child process of the test module (XLA reads its device
count once, when it starts), whose result comes back through a ``torch.save`` file.

A test module using it ends with ``if __name__ == "__main__": child_main(globals())``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import torch

from suite_path import ROOT


def xla_ready(max_tp: int) -> bool:
    import jax
    return len(jax.devices("cpu")) >= max_tp


def in_xla_process(module_globals: dict, case: str, *args, tmp_path, max_tp: int):
    """``module_globals[case](*args)`` where XLA:CPU has ``max_tp`` devices."""
    if xla_ready(max_tp):
        return module_globals[case](*args)
    out = tmp_path / "case.pt"
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max_tp}"
    proc = subprocess.run([sys.executable, module_globals["__file__"], case, repr(args),
                           str(out)], env=env, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def run_lowered_alone(fn, inputs, name: str):
    """``fn`` lowered alone (``lower_function``) and run on one XLA:CPU device on ``inputs``:
    (the lowered module, its outputs as torch tensors)."""
    from dcp_compile import xla as X
    from dcp_compile.lowering import lower_function
    device = X.host_devices(1)
    lowered = lower_function(fn, inputs, name=name)
    executable = X.compile_module(lowered.text, device, step=name, effort=X.VERIFY_EFFORT)
    got = [X._to_torch(a) for a in executable.execute(
        [X._jax().device_put(X._to_numpy(x), device[0]) for x in inputs])]
    return lowered, got


def child_main(module_globals: dict) -> None:
    """The child process: run the named case on its arguments, save what it returns."""
    name, args, out = sys.argv[1], ast.literal_eval(sys.argv[2]), sys.argv[3]
    torch.save(module_globals[name](*args), out)
