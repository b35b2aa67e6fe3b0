"""Run a transformed program on a threaded world and compare it with the single-device model."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from dcp_compile.runtime.program.dcp_program import DCPProgram
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.names import StepKind
from dcp_compile.runtime.serving.rank_engine import RecordingExecutor, rank_engine

from .compare import token_errors


@dataclass
class RankRun:
    rank: int
    result: object                       # dcp_compile.runtime.serving.engine.GenerateResult
    caches: list[torch.Tensor]
    block_table: torch.Tensor
    lengths: list[int]
    states: list[torch.Tensor] | None = None    # a hybrid program's state caches, at the end


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
    # XLA: {bucket: {step kind: {bytes_accessed, ideal_bytes, seconds, ...}}} (memory_floor)
    buckets: dict | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        if out["buckets"] is None:
            del out["buckets"]
        return out


def reference_engine(program: DCPProgram, executor_for, *, fill=0.0):
    """An engine over the single-device model for ``program``'s shapes: the same sequences
    fit (dcp=1 block tables: one entry per block_size tokens, dcp times as many blocks).
    ``executor_for(caches)`` builds the executor around the freshly allocated caches."""
    from dataclasses import replace

    from dcp_compile.runtime.serving.engine import Engine
    c = program.config
    shapes = replace(program.shapes, max_blocks=program.shapes.max_blocks * c.dcp,
                     num_blocks=(program.shapes.num_blocks - 1) * c.dcp + 1)
    spec = program.cache_spec(program.facts.cache_dtype, num_blocks=shapes.num_blocks,
                              single_device=True)
    return Engine(executor_for(spec.allocate(fill=fill)), shapes, block_size=c.block_size)


def run_reference(model, program: DCPProgram, prompts, steps, *, fill=0.0):
    """The single-device model through the same engine (dcp=1 block tables)."""
    from dcp_compile.runtime.serving.engine import LocalExecutor
    engine = reference_engine(program, lambda caches: LocalExecutor(model, caches), fill=fill)
    with torch.no_grad():
        result = engine.generate(prompts, steps)
    return result, engine


def run_threaded_program(program: DCPProgram, prompts, steps, *, fill=0.0,
                         poison_garbage=False, timeout=300.0, from_reference=None,
                         checkpoint=None) -> list[RankRun]:
    """Every rank runs the same engine loop over its loaded program (SPMD), on threads;
    with ``checkpoint``, each reads only its own weight shards from that directory.

    ``from_reference=(ref_engine, first_logits)`` skips the program's own prompt step: each
    rank scatters the single-device engine's caches into its DCP layout and decodes from
    there.
    """
    from dcp_compile.runtime.serving.rank_engine import rank_engine
    from dcp_compile.runtime.distributed.world import run_threaded

    def rank_main(rank):
        engine = rank_engine(program, rank, shared_names=True, fill=fill, poison=poison_garbage,
                             checkpoint=checkpoint)
        with torch.no_grad():
            if from_reference is None:
                result = engine.generate(prompts, steps)
            else:
                ref_engine, first_logits = from_reference
                _start_from_reference(program, rank, engine, ref_engine)
                result = engine.continue_generate(first_logits, steps)
        table = engine.allocator.table(list(range(len(prompts))), program.shapes.max_blocks)
        return RankRun(rank, result, engine.executor.caches, table, list(engine.lengths),
                       getattr(engine.executor, "states", None))

    return run_threaded(program.config.tp, rank_main, timeout=timeout)


def _start_from_reference(program, rank, engine, ref_engine) -> None:
    from dcp_compile.runtime.transfer.cache_layout import scatter_cache
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


def verify(model, program: DCPProgram, prompts, steps: int, *, atol: float = 1e-4,
           checkpoint=None) -> VerifyReport:
    """Greedy-decode ``steps`` tokens both ways; compare logits every step and tokens.
    ``checkpoint``: every rank reads its weight shards from it (a weightless program)."""
    start = time.perf_counter()
    ref, _ = run_reference(model, program, prompts, steps)
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True,
                                checkpoint=checkpoint)
    errors, first = [], None
    tokens_agree = True
    for run in runs:
        tokens_agree &= run.result.tokens == ref.tokens
        for t, (got, exp) in enumerate(zip(run.result.logits, ref.logits)):
            err = float(token_errors(got, exp).max())
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


# ------------------------------------------------------------------------------------------
# Prefill programs: chunked prefill (a first chunk, then chunks that attend to the prior
# cache), compared chunk by chunk with the single-device model. A prefill program has no
# decode graph; a *chunk plan* is a list of chunks, each one token list per sequence (an
# empty list leaves that sequence out of the chunk).
# ------------------------------------------------------------------------------------------


@dataclass
class PrefillRun:
    """One engine's chunked prefill: every step's full logits and positions, final caches."""

    rank: int | None                      # None: the single-device reference
    logits: list[torch.Tensor]            # per chunk: [batch, context_len, vocab]
    positions: list[torch.Tensor]         # per chunk: [batch, context_len], -1 = padding
    caches: list[torch.Tensor]
    block_table: torch.Tensor
    lengths: list[int]


def chunk_plan_of(prompts: list[list[int]], chunks: int, *, max_chunk: int | None = None
                  ) -> list[list[list[int]]]:
    """Split each prompt into ``chunks`` consecutive chunks at unaligned boundaries.

    Cut i of a prompt of n tokens is at ``n*i // chunks``, moved one token right for odd i,
    so prior lengths are rarely multiples of interleave * dcp. Short prompts give empty
    chunks (that sequence sits the chunk out).
    """
    if not (isinstance(chunks, int) and chunks >= 1):
        raise DCPInputError(f"chunks must be a positive int: chunks={chunks!r}. Pass >= 1.")
    plan: list[list[list[int]]] = [[] for _ in range(chunks)]
    for p in prompts:
        n = len(p)
        cuts = [0]
        for i in range(1, chunks):
            cuts.append(min(max(n * i // chunks + i % 2, cuts[-1]), n))
        cuts.append(n)
        for i in range(chunks):
            plan[i].append(list(p[cuts[i]:cuts[i + 1]]))
    if max_chunk is not None:
        longest = max((len(c) for chunk in plan for c in chunk), default=0)
        if longest > max_chunk:
            raise DCPInputError(
                f"a chunk of {longest} tokens exceeds the program's context_len={max_chunk} "
                f"(prompt lengths {[len(p) for p in prompts]}, chunks={chunks}). Use more "
                f"chunks or a larger context_len.")
    return plan


def _check_plan(chunk_plan) -> int:
    if not chunk_plan or any(len(c) != len(chunk_plan[0]) for c in chunk_plan):
        raise DCPInputError(f"a chunk plan is a non-empty list of chunks with one token list "
                            f"per sequence each: sizes {[len(c) for c in chunk_plan]}. Give "
                            f"every chunk the same number of sequences.")
    return len(chunk_plan[0])


def run_chunks(engine, recorder, chunk_plan, rank, max_blocks) -> PrefillRun:
    """Feed ``chunk_plan`` to ``engine`` (whose executor is ``recorder``), chunk by chunk."""
    with torch.no_grad():
        for chunk in chunk_plan:
            engine.prefill(chunk)
    n = len(chunk_plan[0])
    table = engine.allocator.table(list(range(n)), max_blocks)
    return PrefillRun(rank, recorder.logits, recorder.positions, recorder.caches, table,
                      list(engine.lengths))


def run_prefill_reference(model, program: DCPProgram, chunk_plan, *, fill=0.0) -> PrefillRun:
    """The single-device model, chunk by chunk, through the same engine (dcp=1 tables)."""
    from dcp_compile.runtime.serving.engine import LocalExecutor
    _check_plan(chunk_plan)
    engine = reference_engine(
        program, lambda caches: RecordingExecutor(LocalExecutor(model, caches)), fill=fill)
    return run_chunks(engine, engine.executor, chunk_plan, None, engine.shapes.max_blocks)


def run_threaded_prefill(program: DCPProgram, chunk_plan, *, fill=0.0, poison_garbage=True,
                         timeout=300.0) -> list[PrefillRun]:
    """Every rank runs the same chunked prefill over its loaded program (SPMD), on threads.

    ``fill=float('nan')`` poisons every cache row first: a row the program never writes
    stays NaN, and one it reads without masking surfaces as NaN in the logits.
    """
    from dcp_compile.runtime.serving.rank_engine import rank_engine
    from dcp_compile.runtime.distributed.world import run_threaded
    _check_plan(chunk_plan)
    if StepKind.PREFILL not in program.graphs:
        raise DCPInputError(f"run_threaded_prefill needs a prefill program: this one has "
                            f"steps {sorted(program.graphs)}. Transform with mode='prefill'.")

    def rank_main(rank):
        engine = rank_engine(program, rank, shared_names=True, fill=fill,
                             poison=poison_garbage, record=True)
        return run_chunks(engine, engine.executor, chunk_plan, rank, program.shapes.max_blocks)

    return run_threaded(program.config.tp, rank_main, timeout=timeout)


def compare_prefill_logits(run: PrefillRun, ref: PrefillRun, *, atol: float
                           ) -> tuple[list[float], list[float], dict | None, bool]:
    """(last-token error per chunk, all-token error per chunk, first mismatch, argmax agree).

    Only real tokens (position >= 0) are compared; a non-finite logit counts as inf.
    """
    last_errs, all_errs, first, agree = [], [], None, True
    for t, (got, exp, pos) in enumerate(zip(run.logits, ref.logits, ref.positions)):
        valid = pos >= 0
        diff = token_errors(got, exp, pos)                                 # [batch, tokens]
        lens = valid.sum(1)
        rows = torch.nonzero(lens > 0).flatten()
        last = (lens - 1).clamp(min=0)
        last_diff = diff[rows, last[rows]]
        last_errs.append(float(last_diff.max()) if len(rows) else 0.0)
        all_errs.append(float(diff[valid].max()) if valid.any() else 0.0)
        agree &= bool((got[rows, last[rows]].argmax(-1) == exp[rows, last[rows]].argmax(-1))
                      .all())
        bad = (diff > atol) & valid
        if bad.any() and first is None:
            b, i = (int(x) for x in bad.nonzero()[0])
            first = {"rank": run.rank, "chunk": t, "row": b, "position": int(pos[b, i]),
                     "error": float(diff[b, i])}
    return last_errs, all_errs, first, agree


def check_prefill_caches(program: DCPProgram, runs: list[PrefillRun], ref: PrefillRun, *,
                         atol: float) -> dict | None:
    """Each rank's cache holds exactly the positions its cp_rank owns, equal (within
    ``atol``) to the single-device cache's entries for its KV heads; every other row except
    the garbage block is still NaN (the rank caches must have been allocated with NaN).
    Returns the first problem found, or None."""
    from dcp_compile.runtime.transfer.cache_layout import scatter_cache
    c, topo = program.config, program.topology
    for run in runs:
        expected = program.cache_spec().allocate(fill=float("nan"))
        scatter_cache(ref.caches, ref.block_table, ref.lengths, expected, run.block_table,
                      cp_rank=topo.cp_rank(run.rank), dcp=c.dcp, interleave=c.interleave_size,
                      kv_heads=topo.kv_heads_of(run.rank))
        # The garbage block takes padding's writes: compare every other block.
        keep = [b for b in range(len(expected[0])) if b != program.cache_spec().garbage_block]
        for i, (got, exp) in enumerate(zip(run.caches, expected)):
            got, exp = got[keep], exp[keep]
            written, owned = ~torch.isnan(got), ~torch.isnan(exp)
            if not torch.equal(written, owned):
                where = (written != owned).nonzero()[0].tolist()
                return {"rank": run.rank, "cache": i, "row": where[:2],
                        "problem": "written" if bool(written[tuple(where)]) else "unwritten"}
            err = float((got[owned] - exp[owned]).abs().max()) if owned.any() else 0.0
            if err > atol:
                return {"rank": run.rank, "cache": i, "problem": "value", "error": err}
    return None


def verify_prefill(model, program: DCPProgram, chunk_plan, chunks: int | None = None, *,
                   atol: float = 1e-4, check_cache: bool = True) -> VerifyReport:
    """Chunked prefill both ways; compare every chunk's logits and the per-rank caches.

    ``chunk_plan`` is a list of chunks (one token list per sequence each); with ``chunks``
    given it is a list of whole prompts instead, split by :func:`chunk_plan_of`. The report's
    ``steps`` is the number of chunks, ``step_errors`` the last-token logit error of each
    chunk (max over ranks), ``tokens_agree`` whether every chunk's last-token argmax agrees;
    ``ok`` also requires every real token's logits within ``atol`` and, with
    ``check_cache``, each rank's cache to hold exactly its owned positions.
    """
    start = time.perf_counter()
    if chunks is not None:
        chunk_plan = chunk_plan_of(chunk_plan, chunks, max_chunk=program.shapes.context_len)
    ref = run_prefill_reference(model, program, chunk_plan)
    runs = run_threaded_prefill(program, chunk_plan,
                                fill=float("nan") if check_cache else 0.0)
    step_errors = [0.0] * len(chunk_plan)
    first, agree, max_err = None, True, 0.0
    for run in runs:
        last, every, mismatch, same = compare_prefill_logits(run, ref, atol=atol)
        step_errors = [max(a, b) for a, b in zip(step_errors, last)]
        max_err = max([max_err] + every)
        agree &= same
        first = first or mismatch
    if first is None and check_cache:
        problem = check_prefill_caches(program, runs, ref, atol=atol)
        if problem is not None:
            first = {"cache": problem}
    c = program.config
    return VerifyReport(ok=agree and first is None, max_abs_error=max_err, tokens_agree=agree,
                        tp=c.tp, dcp=c.dcp, mode=c.mode, steps=len(chunk_plan),
                        lengths=list(ref.lengths), step_errors=step_errors,
                        first_mismatch=first, seconds=time.perf_counter() - start)


# ------------------------------------------------------------------------------------------
# Speculative decoding: greedy drafts verified in width-K decode steps, compared token for
# token (and every verified position's logits) with the single-device model's plain greedy.
# ------------------------------------------------------------------------------------------


@dataclass
class SpecReport(VerifyReport):
    mean_accepted: float = 0.0          # tokens per row per verification step
    reused_tokens: int = 0              # prompt tokens served from the prefix cache
    spec: dict = field(default_factory=dict)


def generate_per_token(engine, prompts, steps, drafter):
    """``engine.generate`` as a SpecResult (logits per sequence per token) with or without
    a drafter, and the prompt tokens the prefix cache served."""
    from dcp_compile.runtime.serving.speculative import SpecResult, SpecStats
    with torch.no_grad():
        got = engine.generate(prompts, steps, drafter=drafter)
    if drafter is None:
        n = len(prompts)
        got = SpecResult(tokens=got.tokens,
                         logits=[[step[b] for step in got.logits] for b in range(n)],
                         stats=SpecStats(row_steps=n * steps, emitted=n * steps))
    return got, engine.allocator.reused_tokens


def draft_program_drafter(draft: DCPProgram, target: DCPProgram):
    """``drafter_for(rank)`` of a draft model given as another program of the same world
    (same tp; dcp 1 or the target's): each rank drafts with its own rank of it."""
    from dcp_compile.runtime.serving.speculative import ModelDrafter
    if draft.config.tp != target.config.tp or draft.config.dcp not in (1, target.config.dcp):
        raise DCPInputError(
            f"a draft program runs on the target's world: draft tp={draft.config.tp}, "
            f"dcp={draft.config.dcp}; target tp={target.config.tp}, dcp={target.config.dcp}. "
            f"Transform the draft model with the same tp and dcp=1 or dcp="
            f"{target.config.dcp}.")
    return lambda rank: ModelDrafter(rank_engine(draft, rank))


def verify_speculative(model, program: DCPProgram, prompts, steps: int, drafter_for, *,
                       atol: float = 1e-4, timeout: float = 300.0,
                       prefix_caching: bool = False) -> SpecReport:
    """Greedy speculative decoding of ``program`` on the threaded world (every rank runs the
    same loop with its own ``drafter_for(rank)``; None: plain greedy) against the
    single-device model's plain greedy decoding (no prefix cache): tokens, and the logits
    of every verified position. ``prefix_caching``: the program's engine shares prefixes."""
    from dcp_compile.runtime.distributed.world import run_threaded
    start = time.perf_counter()
    ref, _ = run_reference(model, program, prompts, steps)

    def rank_main(rank):
        engine = rank_engine(program, rank, poison=True, prefix_caching=prefix_caching)
        return generate_per_token(engine, prompts, steps,
                                  drafter_for(rank) if drafter_for else None)

    runs = run_threaded(program.config.tp, rank_main, timeout=timeout)
    return speculative_report(program, ref, [r for r, _ in runs], start, atol=atol,
                              lengths=[len(p) for p in prompts], reused_tokens=runs[0][1])


def speculative_report(program: DCPProgram, ref, runs, start: float, *, atol: float,
                       lengths: list[int], reused_tokens: int = 0) -> SpecReport:
    """Compare speculative results (one per rank, or one for an SPMD executor) with the
    reference's plain greedy GenerateResult: tokens, and every verified position's logits."""
    steps = len(ref.logits)
    errors, first, agree = [0.0] * steps, None, True
    for rank, run in enumerate(runs):
        agree &= run.tokens == ref.tokens
        for b, row in enumerate(run.logits):
            for t, got in enumerate(row):
                err = float((got.float() - ref.logits[t][b].float()).abs().max())
                err = err if torch.isfinite(got).all() else float("inf")
                errors[t] = max(errors[t], err)
                if err > atol and first is None:
                    first = {"rank": rank, "row": b, "token": t, "error": err}
    c, stats = program.config, runs[0].stats
    return SpecReport(ok=agree and first is None, max_abs_error=max(errors, default=0.0),
                      tokens_agree=agree, tp=c.tp, dcp=c.dcp, mode=c.mode, steps=steps,
                      lengths=lengths, step_errors=errors,
                      first_mismatch=first, seconds=time.perf_counter() - start,
                      mean_accepted=stats.mean_accepted, reused_tokens=reused_tokens,
                      spec=stats.to_json())
