"""tests/lowering/test_mla_xla.py's case: the MLA model's tp=8/dcp=8 decode program, lowered to
StableHLO and compiled by XLA:CPU for 8 replicas, against the model's own forward. Run as a
script (a fresh process, when the test's process initialised jax with fewer devices: XLA_FLAGS
must be set before jax starts), it prints the verify report as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":        # child process: this worktree first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
    from tests.support.suite_path import install   # the suite's import path, as conftest sets it
    install()

from dcp_compile import xla as X  # noqa: E402

X.request_host_devices(8)

import torch  # noqa: E402

import dcp_compile  # noqa: E402
from dcp_compile.models.mla import plain_mla  # noqa: E402
from dcp_compile.frontends.ordinary import FullForwardReference  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402


def report() -> dict:
    model = plain_mla(num_layers=1)
    program = dcp_compile.transform(model, tp=8, dcp=8, mode="decode", block_size=2,
                                    check=False, shapes=StepShapes(batch=2, context_len=17,
                                                                   max_blocks=2, num_blocks=5))
    lowered = X.lower_for_xla(program)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (1, 15)]
    return X.verify(FullForwardReference(model), program, prompts, 4, atol=1e-4,
                    lowered=lowered).to_json()


if __name__ == "__main__":
    print(json.dumps(report()))
