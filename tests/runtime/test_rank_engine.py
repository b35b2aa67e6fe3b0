"""One rank factory (runtime/rank_engine.rank_engine: bind -> load -> allocate -> executor ->
Engine) and one comparator (dcp_compile.compare.token_errors), used everywhere."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dcp_compile.compare import token_errors
from dcp_compile.runtime.serving.rank_engine import RecordingExecutor, poison_garbage

from suite_path import ROOT  # noqa: E402  (the repository root)


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


def _small_program():
    import dcp_compile
    from dcp_compile.models.demo import DemoConfig, demo_model
    from dcp_compile.runtime.serving.engine import StepShapes
    model = demo_model(DemoConfig(num_layers=1))
    return dcp_compile.transform(model, tp=4, dcp=2, check=False,
                                 shapes=StepShapes.fitting(2, 8, 16, block_size=16, dcp=2))


def test_ranks_with_the_same_group_names_share_one_bound_graph_and_an_edit_rebinds():
    """Loading binds each graph once per (graph code, group names): ranks of one DCP group
    (same names) share it, ranks of the other group get their own, and a graph edited and
    recompiled after a load is bound again (its edit runs)."""
    from dcp_compile.runtime.distributed.world import bind_roles, run_threaded
    from dcp_compile.verify import run_threaded_program
    from helpers import prompts_of
    program = _small_program()

    def graphs(rank):
        loaded = program.load(rank, bind_roles(program.topology, rank))
        return loaded.graphs["decode"], loaded.eager_kernels["decode"]
    out = run_threaded(4, graphs)
    assert out[0][0] is out[1][0] and out[2][0] is out[3][0] and out[0][0] is not out[2][0]
    assert out[0][1] == out[2][1] and out[0][1] is not out[1][1]   # counts: a copy per rank
    assert out[0][0] is run_threaded(4, graphs)[0][0]               # the next world too

    prompts = prompts_of([3, 5])
    before = run_threaded_program(program, prompts, 2)[0].result.logits
    gm = program.graphs["decode"]
    for node in gm.graph.nodes:          # the decode step's logits, doubled
        if node.op == "output":
            with gm.graph.inserting_before(node):
                doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor,
                                                 (node.args[0][0], 2.0))
            doubled.meta["val"] = node.args[0][0].meta["val"]
            node.args = ((doubled, *node.args[0][1:]),)
    gm.recompile()
    after = run_threaded_program(program, prompts, 2)[0].result.logits
    assert torch.equal(after[0], before[0])              # the context step: unchanged
    assert torch.allclose(after[1], 2 * before[1])       # the decode step: edited, rebound


def test_shared_names_give_every_rank_one_bound_graph_and_exclude_explicit_names():
    """``shared_names=True`` binds the groups under the aliases every rank shares: all four
    ranks (two DCP groups) load the very same bound decode graph. Passing names as well is
    refused: the shared names are the ones bound here."""
    import pytest

    from dcp_compile.runtime.serving.rank_engine import load_rank
    from dcp_compile.runtime.distributed.world import run_threaded
    program = _small_program()
    decode = run_threaded(4, lambda rank: load_rank(program, rank, shared_names=True)
                          .graphs["decode"])
    assert all(g is decode[0] for g in decode)
    with pytest.raises(ValueError, match="group_names or shared_names=True, not both"):
        load_rank(program, 0, {"cp_kv": "x"}, shared_names=True)
