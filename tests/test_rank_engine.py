"""One rank factory (runtime/rank_engine.rank_engine: bind -> load -> allocate -> executor ->
Engine) and one comparator (dcp_compile.compare.token_errors), used everywhere."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dcp_compile.compare import token_errors
from dcp_compile.runtime.rank_engine import RecordingExecutor, poison_garbage

ROOT = Path(__file__).resolve().parents[1]


def test_token_errors_flags_non_finite_and_ignores_padding():
    exp = torch.zeros(2, 3, 4)
    got = exp.clone()
    got[0, 0, 1] = 0.5                  # a real error
    got[0, 1, 2] = float("nan")         # never passes, even where the reference is 0
    got[1, 2, 0] = 9.0                  # on padding: not compared
    positions = torch.tensor([[0, 1, 2], [0, 1, -1]])
    assert token_errors(got, exp, positions).tolist() == [[0.5, float("inf"), 0.0],
                                                         [0.0, 0.0, 0.0]]
    assert token_errors(got[:, 0], exp[:, 0]).tolist() == [0.5, 0.0]   # [rows, vocab]


def test_poison_and_recording_executor():
    caches = [torch.zeros(3, 2), torch.zeros(3, 2)]
    poison_garbage(caches)
    assert all(c[-1].isnan().all() and not c[:-1].isnan().any() for c in caches)

    class Twice:
        caches = ["c"]

        def step(self, kind, ids, positions, table):
            return ids * 2
    rec = RecordingExecutor(Twice())
    out = rec.step("decode", torch.ones(1, 1), torch.zeros(1, 1), None)
    assert rec.logits == [out] and rec.positions[0].tolist() == [[0.0]] and rec.caches == ["c"]


def test_ranks_are_set_up_in_one_place():
    """No module of the compiler, the workers or the benchmarks binds, loads and wraps a
    rank by hand: they call rank_engine. check.py reads no private helper of verify."""
    pattern = re.compile(r"\.load\(rank, (bind_roles|names)\b")
    by_hand = [p.relative_to(ROOT).as_posix()
               for folder in ("dcp_compile", "benchmarks", "runtime")
               for p in (ROOT / folder).rglob("*.py") if pattern.search(p.read_text())]
    assert by_hand == []
    check = (ROOT / "dcp_compile" / "check.py").read_text()
    assert not re.search(r"from \.verify import [^\n]*\b_\w", check)
