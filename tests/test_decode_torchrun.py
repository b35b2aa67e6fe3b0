"""Decode DCP with real processes: torchrun, 4 gloo ranks (tp=4, dcp=2).

The test transforms the model once and writes the program file every rank loads
(``--program``): the launch proves what the ranks run together — process groups bound per
role over gloo, weight shards cut per rank, the greedy engine across processes — equals the
single-device model; each rank's own transform is the same call (``build_program``), proven
deterministic by tests/test_program_file.py and run per rank by the prefill launch
(tests/test_prefill_dcp.py)."""

import json

import pytest
import torch

from dcp_compile.runtime.launch import run_torchrun
from dcp_compile.workers.decode import build_program, parse

from helpers import assert_close_report, single_device_reference


@pytest.mark.multiprocess
def test_torchrun_gloo_decode_matches_single_device(tmp_path):
    lengths, steps = [1, 31, 33, 32], 16
    out, program = tmp_path / "tokens.json", tmp_path / "decode.dcp"
    argv = ["--dcp", "2", "--steps", str(steps), "--lengths", ",".join(map(str, lengths)),
            "--out", str(out), "--program", str(program)]
    build_program(parse(argv), tp=4, check=False).save(program)
    run_torchrun(4, "dcp_compile.workers.decode", argv, timeout=300)
    got = json.loads(out.read_text())
    ref = single_device_reference(lengths, steps)
    assert got["tokens"] == ref.tokens
    for t, (g, r) in enumerate(zip(got["logits"], ref.logits)):
        assert_close_report(torch.tensor(g), r, atol=1e-4, what=f"step {t}")
