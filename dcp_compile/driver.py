"""The compile driver: a frontend's capture (stage 0), the pipeline table, one DCPProgram.

``transform()`` (an ``nn.Module``: the paged or the ordinary frontend) and the torch.compile
backend (a Dynamo graph: the Dynamo frontend, ``dcp_compile.backend.build_program``) both
call :func:`compile_program`, the one place a ``DCPProgram`` is built. Per step kind it
captures the step (``Frontend.capture``), runs the frontend's prologue passes and the step's
row of ``dcp_compile.passes.pipeline.PIPELINE`` through the pass manager, and carries what
the passes returned (model facts, the validated config, the certificate, weight shards) into
the next step and the program. It never asks which kind of model it has.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dcp_compile.passes.pipeline import passes_for
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.program.dcp_program import DCPProgram
from dcp_compile.runtime.errors import DCPTransformError, compiler_bugs_named
from dcp_compile.runtime.program.facts import ModelFacts
from dcp_compile.runtime.names import Mode
from dcp_compile.runtime.topology import topology

from .capture import meta_to_host
from .frontends import Frontend, StepCapture, frontend_for
from .report import CompileReport

__all__ = ["CompileOptions", "compile_program", "passes_for", "transform"]


@dataclass(frozen=True)
class CompileOptions:
    """How to compile, apart from the layout (DCPConfig) and the model (the frontend)."""

    dump_dir: str | Path | None = None    # else $DCP_COMPILE_DUMP/<frontend.dump_name>-<mode>
    dump: bool = True                     # False: no dump files (trace artifacts still)
    certificate: object | None = None     # a certificate already proven for this layout
    check: bool | None = False            # transform(check=...); see dcp_compile.check
    progress: bool = False                # a line per capture and pass on stderr
    # Nodes record their user source line (capture.stack_traces): None = only when a dump
    # or TORCH_TRACE shows the graphs, or to name the line a refusal refuses.
    stack_traces: bool | None = None


def transform(model: torch.nn.Module, tp: int, dcp: int, mode: str = Mode.DECODE, *,
              block_size: int = 16, interleave_size: int | None = None,
              kv_role: str | None = None, shapes=None, dump_dir: str | Path | None = None,
              certificate=None, progress: bool = False, combine: str = "all_gather",
              combine_dtype: str = "float32", check: bool | None = None,
              expert_parallel: bool = False, buckets=None,
              stack_traces: bool | None = None, garbage_block: int = -1) -> DCPProgram:
    """Rewrite ``model`` into its DCP form for ``tp`` ranks with DCP degree ``dcp``.

    ``shapes`` (dcp_compile.runtime.serving.engine.StepShapes) fixes the static batch, prompt-chunk length,
    block-table width and cache blocks. The transform proves the layout first and never
    returns a partially rewritten graph: any failure raises. ``progress=True`` reports each
    capture and pass on stderr as it finishes (useful for large models). ``combine`` and
    ``combine_dtype`` choose the decode combine (DCPConfig; docs/runtime.md "Decode step cost").

    ``expert_parallel`` partitions a mixture-of-experts model's experts over the tp ranks
    instead of cutting each expert's intermediate dim (docs/moe-mla.md "Mixture of experts").

    ``buckets`` (context lengths in tokens, each a multiple of ``block_size * dcp``) adds one
    graph per (step kind, bucket) over the same weights, with a block table of
    ``bucket / (block_size * dcp)`` entries; the full capacity (``shapes.max_blocks``) is
    always the last bucket (dcp_compile.runtime.program.buckets; docs/lowering.md "Context buckets").

    ``garbage_block``: which cache block receives the masked writes and is never read: -1
    the last (dcp_compile's engine), 0 the first (vLLM's null block; runtime/garbage_block.py).

    ``stack_traces``: whether the graph nodes record the user source line they came from
    (``meta['stack_trace']``; dcp_compile.capture.stack_traces). ``None``: only when a dump
    (``dump_dir``, ``DCP_COMPILE_DUMP``) or ``TORCH_TRACE`` shows the graphs; a refusal is
    then compiled again with them to name its source line. ``False``: never (a refusal names
    the module instead).

    Raises only DCPError: a refusal by its type (DCPConfigError, DCPTransformError and its
    kinds), and any other exception a pass or frontend raises as a DCPCompilerBug naming
    where (a bug to report, not a limit of DCP).

    ``check`` runs one step of each emitted graph on the threaded world against ``model`` on
    seeded random inputs and raises DCPCheckError (a DCPTransformError) instead of returning
    a program whose logits differ (dcp_compile.check: steps, inputs, tolerance). ``None``:
    on when the weights are real and the model within the bound of
    ``check.skip_reasons`` (small enough that this takes seconds), off otherwise;
    ``True`` on a meta model raises.
    """
    with compiler_bugs_named(f"transform of {type(model).__name__} (tp={tp}, dcp={dcp}, "
                             f"mode={mode})"):
        return _transform(model, tp, dcp, mode, block_size=block_size,
                          interleave_size=interleave_size, kv_role=kv_role, shapes=shapes,
                          dump_dir=dump_dir, certificate=certificate, progress=progress,
                          combine=combine, combine_dtype=combine_dtype, check=check,
                          expert_parallel=expert_parallel, buckets=buckets,
                          stack_traces=stack_traces, garbage_block=garbage_block)


def _transform(model, tp, dcp, mode, *, block_size, interleave_size, kv_role, shapes,
               dump_dir, certificate, progress, combine, combine_dtype, check,
               expert_parallel, buckets, stack_traces, garbage_block) -> DCPProgram:
    from dcp_compile.runtime.program.buckets import check_buckets
    from dcp_compile.runtime.serving.engine import StepShapes
    config = DCPConfig(tp=tp, dcp=dcp, mode=mode, block_size=block_size,
                       interleave_size=interleave_size, kv_role=kv_role, combine=combine,
                       combine_dtype=combine_dtype, expert_parallel=expert_parallel,
                       garbage_block=garbage_block)
    sizes = check_buckets(buckets, block_size=block_size, dcp=dcp,
                          max_blocks=(shapes or StepShapes()).max_blocks)
    frontend = frontend_for(model, shapes)
    program = compile_program(frontend, config, CompileOptions(
        dump_dir=dump_dir, certificate=certificate, check=check, progress=progress,
        stack_traces=stack_traces))
    program.bucket_graphs = _bucket_graphs(frontend, program, config, sizes[:-1], progress,
                                           stack_traces)
    return program


def _bucket_graphs(frontend: Frontend, program: DCPProgram, config: DCPConfig, buckets,
                   progress, stack_traces: bool | None) -> dict:
    """Each smaller bucket's graphs: the program's frontend at that bucket's block-table
    width (a captured step's shapes are static) through the same rows, over the same
    weights. Only the steps are compiled: no program is built, the certificate is reused,
    not proven again, nothing is checked or dumped (the dump is the full program's)."""
    from dcp_compile.runtime.program.buckets import bucket_width
    options = CompileOptions(dump=False, certificate=program.certificate, check=False,
                             progress=progress, stack_traces=stack_traces)
    out = {}
    for bucket in buckets:
        width = bucket_width(bucket, block_size=config.block_size, dcp=config.dcp)
        if progress:
            _report(f"[bucket {bucket}] block table of {width} entries")
        steps = _compile_steps(frontend.at_shapes(replace(program.shapes, max_blocks=width)),
                               config, options, dump_path=None, traced=bool(stack_traces))
        if list(steps.first.weight_inputs) != list(program.weight_inputs):
            raise DCPTransformError(
                f"context bucket {bucket} captured other weights than the full program: "
                f"{steps.first.weight_inputs[:4]}... vs {program.weight_inputs[:4]}... . "
                f"Buckets share one set of weights; report this model to dcp_compile.")
        for gm in steps.graphs.values():
            meta_to_host(gm)
        out[bucket] = steps.graphs
    return out


def compile_program(frontend: Frontend, config: DCPConfig,
                    options: CompileOptions = CompileOptions()) -> DCPProgram:
    """Capture each of the frontend's step kinds, run its pipeline, build the DCPProgram.

    The steps are captured without source lines (:func:`~dcp_compile.capture.stack_traces`:
    10-25% of a transform's time) unless a pass dump or ``TORCH_TRACE`` will show the
    graphs. A refusal is compiled once more with them, so that it names the line it refuses.
    """
    from . import check as checking
    from dcp_compile.passes.dump import dump_root_for, dump_wanted

    reference = frontend.reference()
    check = _resolve_check(checking, options.check, reference, config, frontend)
    dump_path = dump_root_for(frontend.dump_name, config.mode, options.dump_dir) \
        if options.dump else None
    traced = options.stack_traces if options.stack_traces is not None else \
        dump_wanted(dump_path)
    try:
        steps = _compile_steps(frontend, config, options, dump_path, traced)
    except DCPTransformError as refusal:
        if traced or options.stack_traces is False:
            raise
        if options.progress:
            _report("[refused] compiling again with stack traces to name the source line")
        _compile_steps(frontend, config, options, dump_path, traced=True)  # raises it again
        raise DCPTransformError(
            f"{refusal} (compiled again with stack traces to name the source line, the "
            f"transform did not refuse: report this model to dcp_compile)") from refusal
    frontend.accept(steps.config)
    config, first, facts = steps.config, steps.first, steps.facts
    for gm in steps.graphs.values():
        meta_to_host(gm)
    program = DCPProgram(config=config, topology=topology(config.tp, config.dcp, config.mode,
                                                          config=config),
                         graphs=steps.graphs, shapes=frontend.shapes,
                         constants=first.constants(), shards=steps.shards,
                         weight_inputs=list(first.weight_inputs),
                         weight_names=first.weight_names(),
                         weight_sources=first.weight_sources(),
                         facts=replace(facts, cache_dtype=facts.cache_dtype or torch.float32),
                         source=frontend.source,
                         dump_dir=str(dump_path) if dump_path else None,
                         state_cache=frontend.state_cache(config.tp),
                         report=CompileReport(history=steps.history,
                                              certificate=steps.certificate))
    if check:
        report = checking.check_program(reference, program)  # raises: no program
        program.report.check = report
        if options.progress:
            _report(f"[check] {report.steps}: max errors {report.step_errors} <= "
                    f"{report.tolerance:.2g} ({report.seconds:.2f}s)")
    return program


@dataclass
class _Steps:
    """What capturing and rewriting every step kind gave (before the program is built)."""

    graphs: dict
    history: list
    shards: dict
    config: DCPConfig
    certificate: object
    facts: ModelFacts
    first: StepCapture


def _compile_steps(frontend: Frontend, config: DCPConfig, options: CompileOptions,
                   dump_path, traced: bool) -> _Steps:
    from .capture import stack_traces

    facts, certificate = frontend.facts(), options.certificate
    graphs, history, shards = {}, [], {}
    first: StepCapture | None = None
    # Plain strings from here on (the StepKind values): graphs, history and dumps are data
    # that is saved and loaded (torch.load's weights_only refuses unknown classes).
    for step in map(str, frontend.steps(config.mode)):
        with stack_traces(traced), \
                compiler_bugs_named(f"{type(frontend).__name__}.capture of step {step!r}"):
            captured = frontend.capture(step, config)
        if options.progress:
            _report(f"[{step}] captured {len(captured.gm.graph.nodes)} nodes "
                    f"({captured.seconds:.1f}s)")
        gm, records, ctx = _run_pipeline(frontend, captured, config, step, facts, certificate,
                                         dump_path, options.progress)
        config, certificate, facts = ctx.config, ctx.certificate, ctx.facts
        graphs[step], shards = gm, {**shards, **ctx.shards}
        history += records
        first = first or captured
    return _Steps(graphs, history, shards, config, certificate, facts, first)


def _resolve_check(checking, check, reference, config: DCPConfig, frontend) -> bool:
    if reference is None:
        if check:
            raise DCPTransformError(
                f"check=True needs the model's own forward to compare with, and the "
                f"{frontend.source} has none. Pass check=False, or transform the nn.Module "
                f"with dcp_compile.transform(check=True).")
        return False
    return checking.resolve(check, reference, config.tp, frontend.shapes)


def _run_pipeline(frontend: Frontend, captured: StepCapture, config: DCPConfig, step: str,
                  facts: ModelFacts, certificate, dump_path, progress: bool):
    """One step: the frontend's prologue and the step's row of the table, dumped."""
    from dcp_compile.passes.dump import pass_dump
    from dcp_compile.passes.infra import TransformContext
    from dcp_compile.passes.manager import run_passes

    ctx = TransformContext(config=config, step=step, facts=facts, certificate=certificate)
    dump = pass_dump(dump_path, step, source=frontend.source, config=config)
    try:
        gm, records = run_passes(captured.gm, passes_for(
            ctx, captured.first_user_input, prologue=frontend.prologue(ctx, captured),
            given=captured.provides), step=step, on_pass=_with_progress(dump, progress))
        records[0].matched["capture_seconds"] = round(captured.seconds, 4)
    finally:  # a failed pass leaves the dump up to it
        if dump is not None:
            dump.close(ctx.config, ctx.certificate)
    return gm, records, ctx


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _with_progress(on_pass, progress: bool):
    """Chain a progress line per finished pass in front of the dump callback."""
    if not progress:
        return on_pass

    def callback(record, gm):
        if record.name != "capture":
            done = dict(record.inserted) or {k: v for k, v in record.matched.items() if v}
            _report(f"[{record.step}] {record.name}: {done or 'checked'} "
                    f"({record.seconds:.2f}s)")
        if on_pass is not None:
            on_pass(record, gm)
    return callback

