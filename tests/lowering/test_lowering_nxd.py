"""NxD's traced route: the torch_xla collective backend (dcp_compile.runtime.distributed.neuron) with a
threaded stand-in for torch_xla's collectives, and on a real Neuron host."""

from __future__ import annotations

import json
import threading

import pytest
import torch

pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir (pip install torch-mlir)")

from helpers import assert_close_report  # noqa: E402
from lowering_helpers import LAYERS, program_for  # noqa: E402


class ThreadedXM:
    """Stands in for torch_xla.core.xla_model on CPU threads (one thread per rank): the same
    call signatures NxD uses, with real data exchanged inside each replica group."""

    REDUCE_SUM, REDUCE_MAX, REDUCE_MIN, REDUCE_MUL = "sum", "max", "min", "mul"

    def __init__(self):
        self.local = threading.local()
        self.lock = threading.Lock()
        self.slots: dict = {}
        self.calls: list = []

    def _exchange(self, x, groups):
        rank, i = self.local.rank, self.local.count
        self.local.count += 1
        group = next(g for g in groups if rank in g)
        if rank == 0:
            self.calls.append((i, [list(g) for g in groups]))
        with self.lock:
            slot = self.slots.setdefault((i, tuple(group)),
                                         {"vals": {}, "barrier": threading.Barrier(len(group))})
        slot["vals"][rank] = x
        slot["barrier"].wait(timeout=60)
        return [slot["vals"][r] for r in group], group.index(rank)

    def all_gather(self, x, dim=0, groups=None, output=None, pin_layout=True):
        assert pin_layout is False and groups is not None
        vals, _ = self._exchange(x, groups)
        return torch.cat(vals, dim)

    def reduce_scatter(self, reduce_type, x, scale, scatter_dim, shard_count, groups=None,
                       output=None, pin_layout=True):
        assert reduce_type == self.REDUCE_SUM and shard_count == len(groups[0])
        vals, index = self._exchange(x, groups)
        return (sum(vals) * scale).chunk(shard_count, scatter_dim)[index]

    def all_reduce(self, reduce_type, x, scale=1.0, groups=None, pin_layout=True):
        assert reduce_type == self.REDUCE_SUM
        vals, _ = self._exchange(x, groups)
        return sum(vals) * scale


def test_nxd_backend_binds_explicit_full_replica_groups():
    from dcp_compile.runtime.distributed.neuron import bind_xla_collectives, collective_calls
    _, prog = program_for(8, 4, "decode")
    bound = bind_xla_collectives(prog.graphs["decode"], prog.topology.groups)
    calls = collective_calls(bound)
    assert not [n for n in bound.graph.nodes if "_c10d_functional" in str(n.target)]
    dcp_calls = [c for c in calls if c[1][-1] == [[0, 1, 2, 3], [4, 5, 6, 7]]]
    tp_calls = [c for c in calls if c[1][-1] == [list(range(8))]]
    assert len(dcp_calls) + len(tp_calls) == len(calls)
    assert sorted(name for name, _ in dcp_calls) == (["all_gather"] * 2 * LAYERS
                                                     + ["reduce_scatter"] * LAYERS)
    assert sorted(name for name, _ in tp_calls) == ["all_gather"] + ["all_reduce"] * (
        2 * LAYERS + 1)


def test_nxd_backend_decodes_like_the_single_device_model_with_a_threaded_xm():
    """The NxD-bound program on 4 rank threads, with a CPU stand-in for torch_xla's
    collectives, generates the single-device model's tokens and logits."""
    from dcp_compile.runtime.serving.rank_engine import prompt_kind
    from dcp_compile.verify import run_reference
    from dcp_compile.runtime.serving.engine import Engine, LocalExecutor
    from dcp_compile.runtime.distributed.neuron import NeuronStepModule, use_xla_module

    from helpers import prompts_of
    model, prog = program_for(4, 2, "decode")
    prompts, steps = prompts_of((3, 14)), 3
    ref, _ = run_reference(model, prog, prompts, steps)
    xm = ThreadedXM()
    results, errors = {}, {}

    def rank_main(rank):
        try:
            xm.local.rank, xm.local.count = rank, 0
            fns = {}
            for kind in prog.graphs:
                mod = NeuronStepModule(prog, kind, rank)
                fns[kind] = (lambda m: lambda ids, pos, table, caches: (
                    lambda out: (out[0], list(out[1:])))(m(ids, pos, table, *caches)))(mod)
            engine = Engine(LocalExecutor(fns, prog.cache_spec().allocate()), prog.shapes,
                            block_size=prog.config.block_size, dcp=prog.config.dcp,
                            prompt_kind=prompt_kind(prog))
            with torch.no_grad():
                results[rank] = engine.generate(prompts, steps)
        except BaseException as e:  # reported below, per rank
            errors[rank] = e

    with use_xla_module(xm):
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    groups_used = {json.dumps(g) for _, g in xm.calls}
    assert groups_used == {json.dumps([[0, 1, 2, 3]]), json.dumps([[0, 1], [2, 3]])}
    for rank, res in results.items():
        assert res.tokens == ref.tokens, rank
        for t, (got, exp) in enumerate(zip(res.logits, ref.logits)):
            assert_close_report(got, exp, atol=1e-4, what=f"rank {rank} step {t}")


def test_nxd_backend_on_real_torch_xla():
    from dcp_compile.runtime.distributed.neuron import neuron_available
    ok, reason = neuron_available()
    if not ok:
        pytest.skip(reason)
    import torch_xla.core.xla_model as xm  # noqa: F401  (the real module, on a Neuron host)

    from dcp_compile.runtime.distributed.neuron import NeuronStepModule
    _, prog = program_for(4, 2, "decode")
    mod = NeuronStepModule(prog, "decode", 0)
    assert mod.input_output_aliases == {3 + k: 1 + k for k in range(2 * LAYERS)}
