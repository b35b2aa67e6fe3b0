"""Mixture of experts through the torch.compile backend: ``options={"expert_parallel": True}``
(dcp_compile/backend.py) partitions the experts over the tp ranks as transform() does.

The model is hf.prepare(Mixtral) (one layer of tests/frontends/test_moe.py's tiny config and seeded
weights), compiled with ``torch.compile(backend="dcp", fullgraph=True)`` on every rank of a threaded
tp=4/dcp=2 world; each rank decodes greedily with its own KV caches (the garbage block
NaN-poisoned before every step), and its tokens and logits must equal the model's OWN full forward (no cache) within 1e-4 over 4 decode steps.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dcp_compile import hf  # noqa: E402
from dcp_compile.backend import BackendOptions, kv_cache_spec  # noqa: E402
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes  # noqa: E402
from dcp_compile.runtime.errors import DCPConfigError, DCPWorldError  # noqa: E402
from dcp_compile.runtime.serving.rank_engine import poison_garbage  # noqa: E402
from dcp_compile.runtime.distributed.world import run_threaded  # noqa: E402

from helpers import assert_close_report, full_forward_reference, prompts_of  # noqa: E402
from test_backend import _step_inputs, fresh_dynamo  # noqa: E402,F401  (autouse: Dynamo reset)
import test_moe  # noqa: E402
from test_moe import MATRIX, build  # noqa: E402

TP, DCP, BLOCK, STEPS, LENGTHS = 4, 2, 4, 4, (1, 7, 12)
SHAPES = StepShapes(batch=3, context_len=12, max_blocks=4, num_blocks=13)


def test_expert_parallel_is_a_checked_backend_option():
    assert BackendOptions.from_dict({"tp": 4, "dcp": 2, "expert_parallel": True}) \
        .expert_parallel
    with pytest.raises(DCPConfigError, match=r"expert_parallel=.yes..*True or False"):
        BackendOptions.from_dict({"tp": 4, "dcp": 2, "expert_parallel": "yes"})


@pytest.mark.parametrize("ep", [False, True], ids=["tp_experts", "expert_parallel"])
def test_compiled_moe_model_matches_its_own_forward_on_every_rank(ep, monkeypatch):
    """One Mixtral layer (Dynamo traces transformers' Python: a second layer doubles the
    compile time and adds no case)."""
    if not ep and not MATRIX:
        pytest.skip("tensor-parallel experts through the backend run in the full matrix "
                    "(DCP_MOE_MATRIX=1)")
    import dcp_compile.backend as backend
    built = []

    def recording(*args):          # the backend's compiled steps, to check their structure
        built.append(step := build_step(*args))
        return step

    build_step = backend.build_step
    monkeypatch.setattr(backend, "build_step", recording)
    monkeypatch.setitem(test_moe.MODELS, "mixtral1", (
        "MixtralConfig", "MixtralForCausalLM",
        dict(test_moe.MODELS["mixtral"][2], num_hidden_layers=1)))
    model = build("mixtral1")
    wrapper = hf.prepare(model)
    compiled = torch.compile(wrapper, backend="dcp", fullgraph=True, dynamic=False,
                             options={"tp": TP, "dcp": DCP, "block_size": BLOCK,
                                      "expert_parallel": ep})
    spec = kv_cache_spec(wrapper, tp=TP, dcp=DCP, num_blocks=SHAPES.num_blocks,
                         block_size=BLOCK)
    prompts = prompts_of(LENGTHS, vocab=model.config.vocab_size)

    def rank_main(rank):
        executor = LocalExecutor(compiled, spec.allocate(), before_step=poison_garbage)
        engine = Engine(executor, SHAPES, block_size=BLOCK, dcp=DCP)
        with torch.no_grad():
            return engine.generate(prompts, STEPS)

    # Dynamo compiles each step kind once, here (outside a world the step then refuses to
    # run); four ranks' first calls at once would each compile it again.
    for tokens in (SHAPES.context_len, 1):
        with pytest.raises(DCPWorldError), torch.no_grad():
            compiled(*_step_inputs(SHAPES, tokens, spec.allocate()))
    runs = run_threaded(TP, rank_main)
    # Usually one compile per step kind; a rank's thread may still recompile one (Dynamo
    # guards on thread-local state), which costs time, not correctness.
    assert {s.step for s in built} == {"context", "decode"}
    cfg = model.config
    for s in built:     # each rank holds E/tp whole experts (EP) or every expert's I/tp (TP)
        assert s.program.config.expert_parallel is ep
        moe = [n for n in s.program.graphs[s.step].graph.nodes
               if n.target == torch.ops.dcp.moe.default]
        assert len(moe) == cfg.num_hidden_layers
        for n in moe:
            experts, two_i, _ = n.args[3].meta["val"].shape
            assert (experts, two_i) == ((cfg.num_local_experts // TP, 2 * cfg.intermediate_size)
                                        if ep else (cfg.num_local_experts,
                                                    2 * cfg.intermediate_size // TP))
    ref_tokens, ref_logits = full_forward_reference(model, prompts, STEPS)
    for rank, got in enumerate(runs):
        assert got.tokens == ref_tokens, f"rank {rank}"
        for t, step in enumerate(got.logits):
            for b in range(len(prompts)):
                assert_close_report(step[b], ref_logits[b][t], atol=1e-4,
                                    what=f"rank {rank} step {t} seq {b}")
