"""Decode DCP with real processes: torchrun, 4 gloo ranks (tp=4, dcp=2)."""

import json

import pytest
import torch

from dcp_compile.runtime.launch import run_torchrun

from helpers import assert_close_report, single_device_reference


@pytest.mark.multiprocess
def test_torchrun_gloo_decode_matches_single_device(tmp_path):
    lengths, steps = [1, 31, 33, 32], 16
    out = tmp_path / "tokens.json"
    run_torchrun(4, "dcp_compile.workers.decode",
                 ["--dcp", "2", "--steps", str(steps), "--lengths",
                  ",".join(map(str, lengths)), "--out", str(out)], timeout=300)
    got = json.loads(out.read_text())
    ref = single_device_reference(lengths, steps)
    assert got["tokens"] == ref.tokens
    for t, (g, r) in enumerate(zip(got["logits"], ref.logits)):
        assert_close_report(torch.tensor(g), r, atol=1e-4, what=f"step {t}")
