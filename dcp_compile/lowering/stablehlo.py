"""Steps 4-6 of the lowering: drive torch-mlir from the decomposed graph to StableHLO.

4 import_graph       torch-mlir's FxImporter: torch dialect; a marker is a torch.operator
5 emit_collectives   each marker -> stablehlo.all_gather | reduce_scatter | all_reduce |
                     all_to_all (dcp_compile.runtime.distributed.roles.COLLECTIVES), built through the MLIR Python
                     bindings between torch_c casts
6 run_torch_mlir     torchdynamo-export-to-torch-backend-pipeline, then
                     torch-backend-to-stablehlo-backend-pipeline; a failure names the FX
                     nodes (and passes) behind the ops it could not lower

Also the MLIR helpers the later steps share: new_context, _walk.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch
from torch.fx import GraphModule

from dcp_compile.runtime.errors import DCPLoweringError
from dcp_compile.runtime.distributed.roles import COLLECTIVE_DIM, KINDS, REDUCTIONS

from .prepare import CollectiveSite, provenance

FUNC_NAME = "main"
# StableHLO channel type DEVICE_TO_DEVICE (stablehlo spec: channel_handle).
_DEVICE_TO_DEVICE = 1
# The marker op a collective becomes before import; torch-mlir imports it as torch.operator.
_MARKER_MLIR_NAME = "torch.dcp_lower.collective"
_PIPELINE_TORCH = ("builtin.module(func.func(torch-match-quantized-custom-ops), "
                   "torchdynamo-export-to-torch-backend-pipeline{ extra-library=})")
_PIPELINE_STABLEHLO = ("builtin.module(torch-backend-to-stablehlo-backend-pipeline"
                       "{allow-non-finites=true})")
_PIPELINE_CLEANUP = "builtin.module(func.func(canonicalize))"


def new_context(*, stablehlo_only: bool = False):
    """An MLIR context with the torch and StableHLO dialects (and torch_c, which only loads as
    a dependency of torch-mlir's conversion passes: run one on an empty module)."""
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.passmanager import PassManager

    _cache_dialect_lookups()
    ctx = ir.Context()
    _stablehlo.register_dialect(ctx)
    if stablehlo_only:
        return ctx
    torch_d.register_dialect(ctx)
    with ctx:
        PassManager.parse("builtin.module(torch-func-backend-type-conversion-for-stablehlo)"
                          ).run(ir.Module.parse("module {}").operation)
    if not ctx.is_dialect_loaded("torch_c"):
        raise DCPLoweringError("torch-mlir did not load its torch_c dialect; this torch-mlir "
                               "build cannot host StableHLO collectives in torch IR.")
    return ctx


def import_graph(dgm: GraphModule, ctx):
    """Step 4: torch-mlir's FxImporter, the decomposed graph -> a module in the torch dialect
    (a collective marker becomes a torch.operator)."""
    from torch_mlir.extras.fx_importer import FxImporter
    importer = FxImporter(context=ctx)
    importer.import_stateless_graph(dgm.graph, func_name=FUNC_NAME)
    return importer.module


def run_torch_mlir(module, dgm: GraphModule, step: str) -> None:
    """Step 6: torch-mlir's pipelines, torch dialect -> StableHLO (our collectives are
    opaque to them)."""
    _run_pipeline(module, _PIPELINE_TORCH, "torch backend", dgm, step)
    _run_pipeline(module, _PIPELINE_STABLEHLO, "StableHLO backend", dgm, step)


def canonicalize(module, dgm: GraphModule, step: str) -> None:
    _run_pipeline(module, _PIPELINE_CLEANUP, "cleanup", dgm, step)


def _cache_dialect_lookups() -> None:
    """Put mlir_dialects on the bindings' dialect search path, once (see its docstring)."""
    from torch_mlir._mlir_libs import _mlir
    prefix = f"{__package__}.mlir_dialects"
    if prefix not in _mlir.globals.dialect_search_modules:
        _mlir.globals.append_dialect_search_prefix(prefix)


def _element_type(dtype: torch.dtype):
    from torch_mlir import ir
    table = {torch.float32: ir.F32Type.get, torch.bfloat16: ir.BF16Type.get,
             torch.float16: ir.F16Type.get, torch.float64: ir.F64Type.get,
             torch.int64: lambda: ir.IntegerType.get_signless(64),
             torch.int32: lambda: ir.IntegerType.get_signless(32),
             torch.int8: lambda: ir.IntegerType.get_signless(8),
             torch.bool: lambda: ir.IntegerType.get_signless(1)}
    if dtype not in table:
        raise DCPLoweringError(f"cannot lower a collective on dtype {dtype}: supported dtypes "
                               f"are {sorted(str(d) for d in table)}. Cast before the "
                               f"collective.")
    return table[dtype]()


def _walk(op) -> Iterator:
    """Every operation nested in ``op`` (pre-order), safe against erasing the yielded op."""
    for region in op.regions:
        for block in region.blocks:
            for child in list(block.operations):
                yield child.operation
                yield from _walk(child.operation)


def emit_collectives(module, sites: list[CollectiveSite], groups: dict[str, list[list[int]]],
                     step: str) -> None:
    """Step 5: replace each marker (torch.operator) by the StableHLO collective of its site,
    with *every* group of its role (the full partition of range(tp)), a channel handle and
    use_global_device_ids (all_to_all has neither, see below), between torch_c casts."""
    import numpy as np
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo

    markers = [op for op in _walk(module.operation) if op.name == "torch.operator"
               and ir.StringAttr(op.attributes["name"]).value == _MARKER_MLIR_NAME]
    if len(markers) != len(sites):
        raise DCPLoweringError(f"step {step!r}: {len(sites)} collectives were marked but "
                               f"{len(markers)} reached torch-mlir.")
    i64 = ir.IntegerType.get_signless(64)
    for op in markers:
        site = sites[ir.IntegerAttr(op.operands[4].owner.attributes["value"]).value]
        kind = KINDS[site.kind]
        elem = _element_type(site.dtype)
        in_type = ir.RankedTensorType.get(list(site.in_shape), elem)
        out_type = ir.RankedTensorType.get(list(site.out_shape), elem)
        dim = ir.IntegerAttr.get(i64, COLLECTIVE_DIM)
        attrs = {"replica_groups": ir.DenseElementsAttr.get(
            np.asarray(groups[site.role], dtype=np.int64))}
        if site.kind == "all_to_all":
            # stablehlo.all_to_all has no use_global_device_ids, and a channel would make its
            # groups partition ids: without one they are replica ids = tp ranks, as for the
            # other collectives (flattened ids with num_partitions = 1).
            attrs.update(split_dimension=dim, concat_dimension=dim,
                         split_count=ir.IntegerAttr.get(i64, site.group_size))
        else:
            attrs.update(channel_handle=_stablehlo.ChannelHandle.get(site.site + 1,
                                                                     _DEVICE_TO_DEVICE),
                         use_global_device_ids=ir.UnitAttr.get())
        if kind.stablehlo_dim_attr:
            attrs[kind.stablehlo_dim_attr] = dim
        loc = ir.Location.name(f"{step}/{site.node} ({site.pass_name})")
        ip = ir.InsertionPoint(op)
        builtin = ir.Operation.create("torch_c.to_builtin_tensor", results=[in_type],
                                      operands=[op.operands[0]], ip=ip, loc=loc)
        coll = ir.Operation.create(kind.stablehlo, results=[out_type],
                                   operands=[builtin.result], attributes=attrs,
                                   regions=1 if site.reduce else 0, ip=ip, loc=loc)
        if site.reduce:
            scalar = ir.RankedTensorType.get([], elem)
            block = coll.regions[0].blocks.append(scalar, scalar)
            with ir.InsertionPoint(block):
                r = ir.Operation.create(REDUCTIONS[site.reduce].stablehlo, results=[scalar],
                                        operands=list(block.arguments), loc=loc)
                ir.Operation.create("stablehlo.return", operands=[r.result], loc=loc)
        back = ir.Operation.create("torch_c.from_builtin_tensor", results=[op.results[0].type],
                                   operands=[coll.result], ip=ip, loc=loc)
        op.results[0].replace_all_uses_with(back.result)
        op.erase()


def _run_pipeline(module, pipeline: str, what: str, dgm: GraphModule | None, step: str):
    from torch_mlir import ir
    from torch_mlir.passmanager import PassManager
    try:
        with module.context:
            PassManager.parse(pipeline).run(module.operation)
    except ir.MLIRError as e:
        messages = [d.message for d in e.error_diagnostics] or [str(e)]
        raise DCPLoweringError(f"torch-mlir's {what} pipeline failed on step {step!r}: "
                               f"{'; '.join(messages)}{_blame(module, messages, dgm)}"
                               ) from None


def _unlowered_ops(module, messages: list[str]) -> set[str]:
    """The torch-dialect ops a failed pipeline's diagnostics name or, when they name none,
    the ones it left behind."""
    from torch_mlir import ir
    names = set(re.findall(r"\b(torch\.(?:aten|prims)\.[\w.]+)", " ".join(messages)))
    if names:
        return names
    for op in _walk(module.operation):
        if op.name.startswith(("torch.aten.", "torch.prims.")):
            names.add(op.name)
        elif op.name == "torch.operator":
            names.add(ir.StringAttr(op.attributes["name"]).value)
    return names


def _blame(module, messages: list[str], dgm: GraphModule | None) -> str:
    """Name the FX nodes (and the passes that introduced them) behind the unlowered ops."""
    ops = _unlowered_ops(module, messages)
    blamed = []
    for node in (dgm.graph.nodes if dgm is not None else []):
        if node.op != "call_function" or not hasattr(node.target, "_schema"):
            continue
        schema = node.target._schema
        ns, _, name = schema.name.partition("::")
        mlir = f"torch.{ns}.{name}"
        if schema.overload_name and f"{mlir}.{schema.overload_name}" in ops:
            mlir = f"{mlir}.{schema.overload_name}"
        if mlir in ops:
            origin, pass_name = provenance(node)
            blamed.append(f"{mlir} from node {origin} (introduced by pass {pass_name})")
    if blamed:
        return (". Not lowered: " + "; ".join(sorted(set(blamed))[:5]) + ". Give that op a "
                "decomposition torch-mlir can lower, or avoid it in that pass")
    if ops:
        return f". Not lowered: {sorted(ops)[:5]}"
    return ""
