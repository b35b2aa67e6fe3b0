"""transform(): capture a model per step kind, run the pass pipeline, return a DCPProgram."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dcp_compile.passes.pipeline import STEPS_BY_MODE, passes_for

from .capture import capture, constant_values, example_step_inputs
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransformError
from .ordinary import capture_ordinary
from dcp_compile.runtime.dcp_program import DCPProgram
from dcp_compile.runtime.topology import topology



def _model_facts(model) -> dict:
    """Layer count and cache layout: from the model's own hooks (demo, HF adapter)."""
    if not hasattr(model, "kv_cache_shape") or not hasattr(model, "num_layers"):
        raise DCPTransformError(
            f"{type(model).__name__} does not describe its KV cache: it needs "
            f"`num_layers` and `kv_cache_shape(num_blocks, block_size)` (the built-in demo "
            f"model has them; wrap Hugging Face models with dcp_compile.hf.prepare).")
    return {"num_layers": model.num_layers}


def transform(model: torch.nn.Module, tp: int, dcp: int, mode: str = "decode", *,
              block_size: int = 16, interleave_size: int | None = None,
              kv_role: str | None = None, shapes=None, dump_dir: str | Path | None = None,
              certificate=None, progress: bool = False, combine: str = "all_gather",
              combine_dtype: str = "float32", check: bool | None = None,
              buckets=None) -> DCPProgram:
    """Rewrite ``model`` into its DCP form for ``tp`` ranks with DCP degree ``dcp``.

    ``shapes`` (dcp_compile.runtime.engine.StepShapes) fixes the static batch, prompt-chunk length,
    block-table width and cache blocks. The transform proves the layout first and never
    returns a partially rewritten graph: any failure raises. ``progress=True`` reports each
    capture and pass on stderr as it finishes (useful for large models). ``combine`` and
    ``combine_dtype`` choose the decode combine (DCPConfig; README "Decode step cost").

    ``buckets`` (context lengths in tokens, each a multiple of ``block_size * dcp``) adds one
    graph per (step kind, bucket) over the same weights, with a block table of
    ``bucket / (block_size * dcp)`` entries; the full capacity (``shapes.max_blocks``) is
    always the last bucket (dcp_compile.runtime.buckets; README "Context buckets").

    ``check`` runs one step of each emitted graph on the threaded world against ``model`` on
    seeded random inputs and raises DCPCheckError (a DCPTransformError) instead of returning
    a program whose logits differ (dcp_compile.check: steps, inputs, tolerance). ``None``:
    on when the weights are real and the model within the bound of
    ``check.skip_reasons`` (small enough that this takes seconds), off otherwise;
    ``True`` on a meta model raises.
    """
    from . import check as checking
    from dcp_compile.passes.dump import dump_root_for, pass_dump
    from dcp_compile.passes.infra import TransformContext
    from dcp_compile.passes.manager import run_passes
    from dcp_compile.runtime.engine import StepShapes

    config = DCPConfig(tp=tp, dcp=dcp, mode=mode, block_size=block_size,
                       interleave_size=interleave_size, kv_role=kv_role, combine=combine,
                       combine_dtype=combine_dtype)
    from .ordinary import FullForwardReference, OrdinaryStep, model_kind
    user_model = model
    kind = model_kind(model)
    if kind == "hf_prepare":
        from .hf import prepare  # attention already "dcp_paged": the fast path
        model = prepare(model)
    ordinary = kind == "ordinary"
    if ordinary:  # no cache, no hooks: the insert_paged_cache pass adds the cache
        model = OrdinaryStep(model)
    shapes = shapes or StepShapes()
    from dcp_compile.runtime.buckets import check_buckets
    buckets = check_buckets(buckets, block_size=block_size, dcp=dcp,
                            max_blocks=shapes.max_blocks)
    facts = {} if ordinary else _model_facts(model)
    check = checking.resolve(check, model, tp, shapes)
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    dtype = params[0].dtype if params else torch.float32
    cache_shape = None if ordinary else model.kv_cache_shape(shapes.num_blocks, block_size)
    dump_path = dump_root_for("transform", config.mode, dump_dir)  # or $DCP_COMPILE_DUMP

    graphs, history, shards = {}, [], {}
    constants, weight_inputs = None, None
    for step in STEPS_BY_MODE[config.mode]:
        tokens = 1 if step == "decode" else shapes.context_len
        t0 = time.perf_counter()
        if ordinary:
            captured = capture_ordinary(model, shapes.batch, tokens, device=device)
        else:
            captured = capture(model, example_step_inputs(
                shapes.batch, tokens, shapes.max_blocks, cache_shape, facts["num_layers"],
                device=device, dtype=dtype))
        capture_seconds = time.perf_counter() - t0
        if progress:
            _report(f"[{step}] captured {len(captured.gm.graph.nodes)} nodes "
                    f"({capture_seconds:.1f}s)")
        ctx = TransformContext(config=config, step=step, model_facts=facts,
                               certificate=certificate)
        insert_cache = _insert_cache_pass(ctx, model, captured, shapes) if ordinary else None
        dump = pass_dump(dump_path, step, source="transform", config=config)
        try:
            gm, records = run_passes(captured.gm, passes_for(ctx, captured.user_inputs[0],
                                                             insert_cache=insert_cache),
                                     step=step, on_pass=_with_progress(dump, progress))
            records[0].matched["capture_seconds"] = round(capture_seconds, 4)
        finally:  # a failed pass leaves the dump up to it
            if dump is not None:
                dump.close(ctx.config, ctx.certificate)
        config, certificate, facts = ctx.config, ctx.certificate, ctx.model_facts
        graphs[step] = gm
        history += records
        shards.update(ctx.shards)
        if constants is None:
            constants = constant_values(model, captured)
            weight_inputs = list(captured.params) + list(captured.buffers)
    program = DCPProgram(config=config, topology=topology(tp, dcp, mode, config=config),
                         certificate=certificate, graphs=graphs, history=history,
                         shapes=shapes, constants=constants, shards=shards,
                         weight_inputs=weight_inputs, num_layers=facts["num_layers"],
                         dump_dir=str(dump_path) if dump_path else None,
                         facts={"dtype": facts.get("cache_dtype", dtype)})
    program.bucket_graphs = _bucket_graphs(
        user_model, program, buckets[:-1], tp=tp, dcp=dcp, mode=mode, block_size=block_size,
        interleave_size=interleave_size, kv_role=kv_role, combine=combine,
        combine_dtype=combine_dtype, progress=progress)
    if check:  # an ordinary model's reference is its own full forward (no cache)
        reference = FullForwardReference(user_model) if ordinary else model
        report = checking.check_program(reference, program)  # raises: no program
        program.facts["check"] = report.to_json()
        if progress:
            _report(f"[check] {report.steps}: max errors {report.step_errors} <= "
                    f"{report.tolerance:.2g} ({report.seconds:.2f}s)")
    return program


def _bucket_graphs(model, program: DCPProgram, buckets, *, progress, **layout) -> dict:
    """Each smaller bucket's graphs: the same transform with that bucket's block-table width
    (the captured step's shapes are static), over the same weights; the certificate is
    reused, not proven again."""
    import dataclasses

    from dcp_compile.runtime.buckets import bucket_width
    out = {}
    for bucket in buckets:
        width = bucket_width(bucket, block_size=layout["block_size"], dcp=layout["dcp"])
        if progress:
            _report(f"[bucket {bucket}] block table of {width} entries")
        sub = transform(model, shapes=dataclasses.replace(program.shapes, max_blocks=width),
                        certificate=program.certificate, check=False, progress=progress,
                        **layout)
        if sub.weight_inputs != program.weight_inputs:
            raise DCPTransformError(
                f"context bucket {bucket} captured other weights than the full program: "
                f"{sub.weight_inputs[:4]}... vs {program.weight_inputs[:4]}... . Buckets "
                f"share one set of weights; report this model to dcp_compile.")
        out[bucket] = sub.graphs
    return out


def _insert_cache_pass(ctx, step_model, captured, shapes):
    """The cache insertion for an ordinary model's captured step (passes/insert_paged_cache)."""
    from dcp_compile.passes.insert_paged_cache import InsertPagedCache

    from .ordinary import declared_windows
    ctx.model_facts.update(num_blocks=shapes.num_blocks, max_blocks=shapes.max_blocks)
    inputs = captured.user_inputs
    return InsertPagedCache(ctx, token_input=inputs[0],
                            position_input=inputs[1] if len(inputs) > 1 else None,
                            constants=lambda: constant_values(step_model, captured),
                            windows=declared_windows(step_model.model))


def _report(line: str) -> None:
    import sys
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


def transform_graph(gm: torch.fx.GraphModule, config: DCPConfig, step: str, *,
                    first_user_input: str, model_facts: dict | None = None, certificate=None,
                    on_pass=None):
    """Run ``step``'s pass pipeline on an already captured ATen graph; the same passes, in
    the same order, as ``transform()`` runs after its torch.export capture.

    Entry point of the torch.compile backend (dcp_compile.backend), whose graph comes from
    AOTAutograd. ``first_user_input`` names the placeholder the ``tp_rank`` input goes before.
    Returns ``(gm, records, ctx)``: the rewritten graph, its PassRecords, and the
    TransformContext (validated config, certificate, weight shards).
    """
    from dcp_compile.passes.infra import TransformContext
    from dcp_compile.passes.manager import run_passes

    ctx = TransformContext(config=config, step=step, model_facts=dict(model_facts or {}),
                           certificate=certificate)
    gm, records = run_passes(gm, passes_for(ctx, first_user_input), step=step,
                             on_pass=on_pass)
    return gm, records, ctx
