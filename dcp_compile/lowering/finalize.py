"""Step 7 of the lowering: rewrite rules (FINALIZE_RULES), then the module's contract.

finalize         FINALIZE_RULES, op name -> rule: arith.constant -> stablehlo.constant, static
                 dynamic_iota -> iota, constant folding of reshape/convert (no f64 left),
                 a scatter of a few cache rows -> row updates (cache_writes.py)
(canonicalize)   MLIR's canonicalizer, run between the two (stablehlo.canonicalize)
check_contract   only stablehlo and func ops, static shapes, no custom_call
annotate         module name and replica count, argument/result names, cache aliasing
"""

from __future__ import annotations

from typing import Any, Callable

from dcp_compile.runtime.errors import DCPLoweringError
from dcp_compile.runtime.names import is_cache_input, is_state_cache_input

from .cache_writes import row_scatter_to_updates
from .stablehlo import _walk


def _arith_constant(op):
    """arith.constant of a tensor (left by torch-mlir's scalar handling) -> stablehlo.constant."""
    from torch_mlir import ir
    if not _is_ranked(op.results[0].type):
        return None
    return ir.Operation.create("stablehlo.constant", results=[op.results[0].type],
                               attributes={"value": op.attributes["value"]},
                               ip=ir.InsertionPoint(op), loc=op.location)


def _dynamic_iota(op):
    """dynamic_iota whose result shape is static (arange of a constant) -> iota."""
    from torch_mlir import ir
    result_type = ir.RankedTensorType(op.results[0].type)
    if not result_type.has_static_shape:
        return None
    return ir.Operation.create("stablehlo.iota", results=[result_type],
                               attributes={"iota_dimension": op.attributes["iota_dimension"]},
                               ip=ir.InsertionPoint(op), loc=op.location)


def _is_ranked(t) -> bool:
    from torch_mlir import ir
    return t.typeid == ir.RankedTensorType.static_typeid


def _convert_constant(op):
    """convert of a constant -> the converted constant (torch-mlir's f64 scalars become f32
    in the module, not at run time: NeuronCores have no f64)."""
    import numpy as np
    from torch_mlir import ir
    source = op.operands[0].owner
    if not isinstance(source, (ir.Operation, ir.OpView)) or \
            source.operation.name != "stablehlo.constant":
        return None
    result_type = ir.RankedTensorType(op.results[0].type)
    element = str(result_type.element_type)
    if element == "bf16":
        import ml_dtypes     # numpy's bfloat16
        target = ml_dtypes.bfloat16
    else:
        target = {"f32": np.float32, "f16": np.float16, "f64": np.float64, "i64": np.int64,
                  "i32": np.int32, "i1": np.bool_}.get(element)
    try:
        value = np.array(ir.DenseElementsAttr(source.operation.attributes["value"]))
    except Exception:   # element types numpy cannot take (bf16 sources): leave the convert
        return None
    if target is None or value.dtype.kind not in "fiub":
        return None
    if target is not np.bool_ and value.dtype.kind == "f" and np.dtype(target).kind in "iu":
        return None     # float -> int conversion rounding: leave it to the compiler
    converted = value.astype(target).reshape(result_type.shape)
    attr = (ir.DenseElementsAttr.get(converted, type=result_type.element_type)
            if element == "bf16" else ir.DenseElementsAttr.get(converted, type=result_type))
    return ir.Operation.create("stablehlo.constant", results=[result_type],
                               attributes={"value": attr}, ip=ir.InsertionPoint(op),
                               loc=op.location)


def _reshape_constant(op):
    """reshape of a constant -> the reshaped constant (lets _convert_constant fold next)."""
    from torch_mlir import ir
    source = op.operands[0].owner
    if not isinstance(source, (ir.Operation, ir.OpView)) or \
            source.operation.name != "stablehlo.constant":
        return None
    value = ir.DenseElementsAttr(source.operation.attributes["value"])
    if not value.is_splat:
        return None
    result_type = ir.RankedTensorType(op.results[0].type)
    attr = ir.DenseElementsAttr.get_splat(result_type, value.get_splat_value())
    return ir.Operation.create("stablehlo.constant", results=[result_type],
                               attributes={"value": attr}, ip=ir.InsertionPoint(op),
                               loc=op.location)


# op name -> rule(op) returning the replacement op (same results) or None to leave it.
FINALIZE_RULES: dict[str, Callable] = {
    "arith.constant": _arith_constant,
    "stablehlo.dynamic_iota": _dynamic_iota,
    "stablehlo.reshape": _reshape_constant,
    "stablehlo.convert": _convert_constant,
    # A decode step's cache write: row updates XLA does in place (lowering/cache_writes.py).
    "stablehlo.scatter": row_scatter_to_updates,
}


def finalize(module) -> dict[str, int]:
    """Apply FINALIZE_RULES once over the module; returns how many ops each rule rewrote."""
    counts: dict[str, int] = {}
    for op in list(_walk(module.operation)):
        rule = FINALIZE_RULES.get(op.name)
        if rule is None:
            continue
        name = op.name
        new = rule(op)
        if new is None:
            continue
        for old_result, new_result in zip(op.results, new.results):
            old_result.replace_all_uses_with(new_result)
        op.erase()
        counts[name] = counts.get(name, 0) + 1
    return counts


_ALLOWED_DIALECTS = ("stablehlo", "func")
_FORBIDDEN_OPS = ("stablehlo.custom_call",)


def check_contract(module, step: str) -> None:
    """Only stablehlo/func ops, no custom calls, every value statically shaped."""
    from torch_mlir import ir
    for op in _walk(module.operation):
        dialect = op.name.split(".", 1)[0]
        if dialect not in _ALLOWED_DIALECTS or op.name in _FORBIDDEN_OPS:
            raise DCPLoweringError(
                f"lowered step {step!r} still contains {op.name} at {op.location}: the module "
                f"must be pure StableHLO with no custom calls. Add a rewrite rule to "
                f"dcp_compile.lowering.FINALIZE_RULES or avoid the op that produces it.")
        values = list(op.results)
        for region in op.regions:
            for block in region.blocks:
                values += list(block.arguments)
        for v in values:
            if _is_ranked(v.type) and ir.RankedTensorType(v.type).has_static_shape:
                continue
            raise DCPLoweringError(f"lowered step {step!r} has a value of non-static type "
                                   f"{v.type} ({op.name} at {op.location}). Lowered modules "
                                   f"have static shapes only.")


def annotate(module, step: str, tp: int, input_names: list[str], output_names: list[str],
              module_attrs: dict[str, Any] | None) -> None:
    """Module: name, replica count; func: argument/result names, cache aliasing."""
    from torch_mlir import ir
    i32 = ir.IntegerType.get_signless(32)
    attrs = module.operation.attributes
    attrs["sym_name"] = ir.StringAttr.get(f"dcp_{step}")
    attrs["mhlo.num_replicas"] = ir.IntegerAttr.get(i32, tp)
    attrs["mhlo.num_partitions"] = ir.IntegerAttr.get(i32, 1)
    for key, value in (module_attrs or {}).items():
        attrs[key] = (ir.IntegerAttr.get(ir.IntegerType.get_signless(64), value)
                      if isinstance(value, int) else ir.StringAttr.get(str(value)))
    func = next(op for op in _walk(module.operation) if op.name == "func.func")
    # Cache k of the inputs comes back as result 1 + k (calling convention of DCPProgram:
    # the KV caches, then a hybrid's recurrent-state caches).
    cache_inputs = [i for i, n in enumerate(input_names)
                    if is_cache_input(n) or is_state_cache_input(n)]
    alias = {i: 1 + k for k, i in enumerate(cache_inputs)} if len(output_names) == \
        1 + len(cache_inputs) else {}
    arg_attrs = []
    for i, name in enumerate(input_names):
        entry = {"dcp.name": ir.StringAttr.get(name)}
        if i in alias:
            entry["tf.aliasing_output"] = ir.IntegerAttr.get(i32, alias[i])
        arg_attrs.append(ir.DictAttr.get(entry))
    func.attributes["arg_attrs"] = ir.ArrayAttr.get(arg_attrs)
    func.attributes["res_attrs"] = ir.ArrayAttr.get(
        [ir.DictAttr.get({"dcp.name": ir.StringAttr.get(n)}) for n in output_names])
