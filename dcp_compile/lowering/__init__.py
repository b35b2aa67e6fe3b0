"""Lower a DCP program to StableHLO: one module per step kind, collectives on real replica groups.

This is the route the Neuron vLLM plugin's compiler takes (FX -> AOTAutograd-style ATen ->
torch-mlir -> StableHLO -> neuronx-cc), run here as far as anything real reaches on CPU. The
steps, in the order lower_graph calls them (module: function):

  program graph: ATen + dcp.* custom ops + _c10d_functional collectives on role placeholders
   1 prepare.check_lowerable      every op has a lowering, every shape is static
   2 prepare.mark_collectives     collective + wait_tensor -> dcp_lower.collective(x, kind,
                                  role, n, site) (on a one-rank group: elided, the identity)
   3 decompose.decompose          make_fx with ops.DECOMPOSITIONS and torch-mlir's table: ATen
                                  only; each distinct op call traced once, copied for the
                                  layers that repeat it; repeated calls merged
   4 stablehlo.import_graph       torch-mlir's FxImporter: torch dialect
   5 stablehlo.emit_collectives   each marker -> stablehlo.all_gather | reduce_scatter |
                                  all_reduce | all_to_all with *every* group of its role
   6 stablehlo.run_torch_mlir     torch-mlir's torch-backend and StableHLO pipelines
   7 finalize.finalize            rewrite rules (finalize.FINALIZE_RULES), canonicalize, the
     finalize.check_contract      contract (only stablehlo/func ops, static shapes, no
     finalize.annotate            custom_call), names, replica count and cache aliasing
   8 artifact.serialize           text and a StableHLO portable artifact (VHLO bytecode)

``artifact`` also holds the results (LoweredModule, LoweringResult, write, reading collectives
back) and ``interpreter`` runs lowered modules in the StableHLO reference interpreter.

One module serves every rank: the rank is its ``tp_rank`` input (``mhlo.num_replicas = tp``,
replica groups name global device ids = tp ranks). KV caches are inputs and are returned
updated; each cache input carries ``tf.aliasing_output`` (the XLA convention for a donated
buffer) naming the result that replaces it; a hybrid program's recurrent-state caches
(``state_caches_<i>``, after the KV caches) likewise (recurrent.py: the recurrent ops'
rules). What each collective is (arguments, shape effect, StableHLO op) comes from
dcp_compile.runtime.distributed.roles.COLLECTIVES, the one table of collectives.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule, Node

from dcp_compile.runtime.errors import DCPLoweringError
from dcp_compile.runtime.names import is_cache_input, is_state_cache_input

from .artifact import (COLLECTIVE_OPS, LoweredCollective, LoweredModule, LoweringResult,
                       _join_sites, collectives_in, deserialize, op_counts, serialize, write)
from .decompose import (DecompositionCache, _resolve_site_shapes, check_decomposed, decompose,
                        decompose_by_op, decompose_whole, decomposition_table,
                        eliminate_common_calls, op_call_key)
from .finalize import FINALIZE_RULES, annotate, check_contract, finalize
from .interpreter import (InterpreterExecutor, interpreter_available, run_interpreter,
                          run_interpreter_spmd)
from .prepare import (CollectiveSite, _rank_input_shapes, check_lowerable, find_collectives,
                      mark_collectives, provenance)
from .stablehlo import (FUNC_NAME, canonicalize, emit_collectives, import_graph, new_context,
                        run_torch_mlir)

__all__ = [
    "COLLECTIVE_OPS", "CollectiveSite", "DCPLoweringError", "DecompositionCache",
    "FINALIZE_RULES", "FUNC_NAME", "InterpreterExecutor", "LoweredCollective", "LoweredModule",
    "LoweringResult", "TARGETS", "check_contract", "check_decomposed", "check_lowerable",
    "collectives_in", "decompose", "decompose_by_op", "decompose_whole", "decomposition_table",
    "deserialize", "eliminate_common_calls", "emit_collectives", "finalize", "find_collectives",
    "interpreter_available", "lower", "lower_function", "module_name", "lower_graph", "mark_collectives",
    "new_context", "op_call_key", "op_counts", "provenance", "run_interpreter",
    "run_interpreter_spmd", "serialize", "write",
]

TARGETS = ("stablehlo",)


def lower(program, target: str = "stablehlo", out_dir: str | Path | None = None, *,
          steps: Sequence[str] | None = None, target_version: str | None = None,
          elide_trivial: bool = True) -> LoweringResult:
    """Lower every step kind of ``program`` (a :class:`~dcp_compile.runtime.program.dcp_program.DCPProgram`).

    A program with context buckets gets one module per (step kind, bucket): the full bucket's
    named by the step kind, the smaller ones ``<step>_<bucket>`` (:func:`module_name`).
    With ``out_dir``, writes ``<step>.stablehlo.mlir`` (text), ``<step>.stablehlo.mlirbc``
    (portable artifact for ``target_version``, default: this StableHLO's current version) and
    ``lowering.json`` (the summary). Raises :class:`DCPLoweringError` naming the op and the
    pass that introduced it when a graph cannot be lowered.
    """
    if target not in TARGETS:
        raise DCPLoweringError(f"unknown lowering target: {target!r}. Use one of {TARGETS}.")
    topo = program.topology
    wanted = list(steps) if steps is not None else list(program.graphs)
    missing = [s for s in wanted if s not in program.graphs]
    if missing:
        raise DCPLoweringError(f"program has no step {missing}: it has {list(program.graphs)}. "
                               f"Lower one of those.")
    meta = {"dcp.tp": topo.tp, "dcp.dcp": topo.dcp, "dcp.mode": topo.mode}
    modules, cache = {}, DecompositionCache()
    for bucket in program.buckets:           # one module per (step kind, context bucket)
        view = program.for_bucket(bucket)
        for step in wanted:
            name = module_name(step, bucket, program)
            modules[name] = lower_graph(view.graphs[step], step=name, groups=topo.groups,
                                        tp=topo.tp, target_version=target_version,
                                        elide_trivial=elide_trivial,
                                        module_attrs={**meta, "dcp.bucket": bucket}
                                        if program.bucket_graphs else meta,
                                        input_shapes=_rank_input_shapes(view, step),
                                        cache=cache)
            modules[name].kind, modules[name].bucket = step, bucket
    result = LoweringResult(target=target, modules=modules, groups=topo.groups, tp=topo.tp)
    if out_dir is not None:
        write(result, out_dir)
    return result


def module_name(step: str, bucket: int, program) -> str:
    """A module's name: the step kind for the full-capacity bucket (as without buckets),
    ``<step>_<bucket>`` for a smaller bucket."""
    return step if bucket == program.capacity else f"{step}_{bucket}"


def lower_graph(gm: GraphModule, *, step: str, groups: dict[str, list[list[int]]], tp: int,
                target_version: str | None = None, elide_trivial: bool = True,
                module_attrs: dict[str, Any] | None = None,
                input_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                cache: DecompositionCache | None = None) -> LoweredModule:
    """Lower one program graph (calling convention of DCPProgram) to a StableHLO module.

    ``input_shapes`` (placeholder name -> (shape, dtype)) overrides the graph's own input
    metadata, e.g. with the per-rank shapes the program is run with. ``cache``: decomposed
    op calls to reuse (see decompose), e.g. shared by the steps of one program.
    """
    seconds: dict[str, float] = {}
    with _timed(seconds, "mark"):
        check_lowerable(gm, step)                                                       # 1
        marked, sites, elided = mark_collectives(gm, step, groups,                      # 2
                                                 elide_trivial=elide_trivial)
    with _timed(seconds, "decompose"):
        decomposed = decompose(marked, step, input_shapes=input_shapes, cache=cache)   # 3
        sites = _resolve_site_shapes(decomposed, sites)
    input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    output_names = _output_names(gm)
    caches = [n for n in input_names if is_cache_input(n) or is_state_cache_input(n)]
    if len(output_names) == 1 + len(caches):
        # DCPProgram's calling convention: (logits, *new_kv_caches, *new_state_caches).
        output_names = ["logits"] + [f"new_{n}" for n in caches]
    return _lower_decomposed(decomposed, step=step, sites=sites, elided=elided, groups=groups,
                             tp=tp, target_version=target_version, seconds=seconds,
                             input_names=input_names, output_names=output_names,
                             module_attrs=module_attrs)


def lower_function(fn: Callable, example_inputs: Sequence[torch.Tensor], *,
                   name: str = "function", target_version: str | None = None) -> LoweredModule:
    """Lower a plain function of tensors (e.g. one DCP primitive) as a standalone module.

    Only the example inputs' shapes and dtypes are used. The function may call ``dcp.*`` ops
    (lowered through their decompositions) but no collectives.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    seconds: dict[str, float] = {}
    with _timed(seconds, "decompose"):
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = [mode.from_tensor(x) for x in example_inputs]
        traced = make_fx(fn, tracing_mode="fake")(*fakes)
        check_lowerable(traced, name)
        decomposed = decompose(traced, name)
    names = [n.name for n in traced.graph.nodes if n.op == "placeholder"]
    return _lower_decomposed(decomposed, step=name, sites=[], elided=[], groups={}, tp=1,
                             target_version=target_version, seconds=seconds,
                             input_names=names, output_names=_output_names(traced),
                             module_attrs=None)


def _lower_decomposed(dgm: GraphModule, *, step: str, sites: list[CollectiveSite],
                      elided: list[CollectiveSite], groups: dict[str, list[list[int]]],
                      tp: int, target_version: str | None, seconds: dict[str, float],
                      input_names: list[str], output_names: list[str],
                      module_attrs: dict[str, Any] | None) -> LoweredModule:
    """Steps 4-8 on a decomposed graph (``seconds`` gets each step's time)."""
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo

    ctx = new_context()
    with _timed(seconds, "import"):
        module = import_graph(dgm, ctx)                                                 # 4
    with _timed(seconds, "torch_mlir"):
        with ctx, ir.Location.unknown():
            emit_collectives(module, sites, groups, step)                               # 5
        run_torch_mlir(module, dgm, step)                                               # 6
    with _timed(seconds, "finalize"), ctx, ir.Location.unknown():
        finalize(module)                                                                # 7
        canonicalize(module, dgm, step)
        check_contract(module, step)
        annotate(module, step, tp, input_names, output_names, module_attrs)
        text = module.operation.get_asm(large_elements_limit=None)
    with _timed(seconds, "serialize"):
        version = target_version or _stablehlo.get_current_version()
        artifact = serialize(text, version)                                             # 8
    return LoweredModule(step=step, text=text, artifact=artifact, target_version=version,
                         collectives=_join_sites(collectives_in(text), sites), elided=elided,
                         input_names=input_names, output_names=output_names, seconds=seconds)


@contextlib.contextmanager
def _timed(seconds: dict[str, float], key: str):
    t = time.perf_counter()
    yield
    seconds[key] = time.perf_counter() - t


def _output_names(gm: GraphModule) -> list[str]:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out if isinstance(out, (list, tuple)) else [out]
    return [a.name if isinstance(a, Node) else repr(a) for a in out]
