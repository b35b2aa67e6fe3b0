"""Run a transformed program on a threaded world and compare it with the single-device model."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from .program import DCPProgram


@dataclass
class RankRun:
    rank: int
    result: object                       # runtime.engine.GenerateResult
    caches: list[torch.Tensor]
    block_table: torch.Tensor
    lengths: list[int]


@dataclass
class VerifyReport:
    ok: bool
    max_abs_error: float
    tokens_agree: bool
    tp: int
    dcp: int
    mode: str
    steps: int
    lengths: list[int]
    step_errors: list[float] = field(default_factory=list)
    first_mismatch: dict | None = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def prompt_kind(program: DCPProgram) -> str:
    return "context" if "context" in program.graphs else "prefill"


def run_reference(model, program: DCPProgram, prompts, steps, *, fill=0.0):
    """The single-device model through the same engine (dcp=1 block tables)."""
    from dataclasses import replace

    from runtime.engine import Engine, LocalExecutor
    from runtime.kv_cache import KVCacheSpec
    c = program.config
    # One block-table entry covers block_size tokens here, not block_size * dcp.
    shapes = replace(program.shapes, max_blocks=program.shapes.max_blocks * c.dcp,
                     num_blocks=(program.shapes.num_blocks - 1) * c.dcp + 1)
    spec = KVCacheSpec(program.num_layers, shapes.num_blocks, c.block_size,
                       c.num_kv_heads, c.head_dim, program.facts.get("dtype", torch.float32))
    engine = Engine(LocalExecutor(model, spec.allocate(fill=fill)), shapes,
                    block_size=c.block_size)
    with torch.no_grad():
        result = engine.generate(prompts, steps)
    return result, engine


def run_threaded_program(program: DCPProgram, prompts, steps, *, fill=0.0,
                         poison_garbage=False, timeout=300.0, from_reference=None
                         ) -> list[RankRun]:
    """Every rank runs the same engine loop over its loaded program (SPMD), on threads.

    ``from_reference=(ref_engine, first_logits)`` skips the program's own prompt step: each
    rank scatters the single-device engine's caches into its DCP layout and decodes from
    there.
    """
    from runtime.engine import Engine, GenerateResult, LocalExecutor
    from runtime.world import bind_roles, run_threaded

    def rank_main(rank):
        names = bind_roles(program.topology, rank)
        loaded = program.load(rank, names)
        caches = program.cache_spec().allocate(fill=fill)
        executor = LocalExecutor(loaded.step_fns(), caches,
                                 before_step=_poison_garbage if poison_garbage else None)
        engine = Engine(executor, program.shapes, block_size=program.config.block_size,
                        dcp=program.config.dcp, prompt_kind=prompt_kind(program))
        with torch.no_grad():
            if from_reference is None:
                result = engine.generate(prompts, steps)
            else:
                ref_engine, first_logits = from_reference
                _start_from_reference(program, rank, engine, ref_engine)
                result = engine.continue_generate(first_logits, steps)
        table = engine.allocator.table(list(range(len(prompts))), program.shapes.max_blocks)
        return RankRun(rank, result, executor.caches, table, list(engine.lengths))

    return run_threaded(program.config.tp, rank_main, timeout=timeout)


def _start_from_reference(program, rank, engine, ref_engine) -> None:
    from runtime.cache_layout import scatter_cache
    lengths = list(ref_engine.lengths)
    n = len(lengths)
    engine.lengths = list(lengths)
    for b, length in enumerate(lengths):
        engine.allocator.ensure(b, length)
    table = engine.allocator.table(list(range(n)), program.shapes.max_blocks)
    ref_table = ref_engine.allocator.table(list(range(n)), ref_engine.shapes.max_blocks)
    scatter_cache(ref_engine.executor.caches, ref_table, lengths, engine.executor.caches,
                  table, cp_rank=program.topology.cp_rank(rank), dcp=program.config.dcp,
                  interleave=program.config.interleave_size,
                  kv_heads=program.topology.kv_heads_of(rank))


def _poison_garbage(caches):
    # Re-poison the garbage block before every step: any read of it would surface as NaN.
    for c in caches:
        c[-1] = float("nan")


def verify(model, program: DCPProgram, prompts, steps: int, *, atol: float = 1e-4
           ) -> VerifyReport:
    """Greedy-decode ``steps`` tokens both ways; compare logits every step and tokens."""
    start = time.perf_counter()
    ref, _ = run_reference(model, program, prompts, steps)
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True)
    errors, first = [], None
    tokens_agree = True
    for run in runs:
        tokens_agree &= run.result.tokens == ref.tokens
        for t, (got, exp) in enumerate(zip(run.result.logits, ref.logits)):
            err = float((got.float() - exp.float()).abs().max())
            if not torch.isfinite(got).all():
                err = float("inf")
            if run.rank == 0:
                errors.append(err)
            if err > atol and first is None:
                first = {"rank": run.rank, "step": t, "error": err}
    max_err = max(errors) if errors else 0.0
    c = program.config
    return VerifyReport(ok=tokens_agree and first is None, max_abs_error=max_err,
                        tokens_agree=tokens_agree, tp=c.tp, dcp=c.dcp, mode=c.mode,
                        steps=steps, lengths=[len(p) for p in prompts], step_errors=errors,
                        first_mismatch=first, seconds=time.perf_counter() - start)
