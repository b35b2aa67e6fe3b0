"""``compile="inductor"``: each rank's graph compiled by Inductor (CPU here), the functional
collectives kept in the graph, logits equal to the eager program's and the model's own.

Compiling takes minutes on a shared 2-core machine (one Inductor compile per rank and step
kind), so the numerical case runs with ``DCP_INDUCTOR=1``; the option checks always run.
"""

from __future__ import annotations


import pytest
import torch

import dcp_compile
from dcp_compile.backend import BackendOptions
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes
from dcp_compile.runtime.errors import DCPConfigError, DCPInputError
from full_runs import full  # noqa: E402

SHAPES = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5)


def _program():
    model = demo_model(DemoConfig(num_layers=1, num_kv_heads=1))
    return model, dcp_compile.transform(model, tp=2, dcp=2, shapes=SHAPES, check=False)


def test_unknown_compile_modes_are_refused():
    _, program = _program()
    with pytest.raises(DCPInputError, match="unknown compile mode"):
        program.load(0, {}, compile="tensorrt")
    with pytest.raises(DCPConfigError, match="unknown compile mode"):
        BackendOptions.from_dict({"dcp": 2, "compile": "tensorrt"})
    assert BackendOptions.from_dict({"dcp": 2, "compile": "inductor"}).compile == "inductor"


@pytest.mark.skipif(not full("DCP_INDUCTOR"),
                    reason="Inductor compiles take minutes here; set DCP_INDUCTOR=1")
def test_inductor_program_matches_eager_and_the_model():
    from dcp_compile import verify as V
    from dcp_compile.runtime.distributed.world import bind_roles, run_threaded
    model, program = _program()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7)]
    ref, _ = V.run_reference(model, program, prompts, 4)

    def rank_main(rank):
        out = {}
        for mode in ("eager", "inductor"):
            loaded = program.load(rank, bind_roles(program.topology, rank), compile=mode)
            engine = Engine(LocalExecutor(loaded.step_fns(), program.cache_spec().allocate()),
                            program.shapes, block_size=16, dcp=2, prompt_kind="context")
            with torch.no_grad():
                out[mode] = engine.generate(prompts, 4)
        return out

    for out in run_threaded(2, rank_main, timeout=1800):
        assert out["inductor"].tokens == out["eager"].tokens == ref.tokens
        for got, eager, exp in zip(out["inductor"].logits, out["eager"].logits, ref.logits):
            assert float((got - eager).abs().max()) <= 1e-5
            assert float((got - exp).abs().max()) <= 1e-4
