"""Step 3 of the lowering: decompose to ATen, each distinct op call traced once.

make_fx with dcp_compile.runtime.kernels.ops.DECOMPOSITIONS and torch-mlir's own table leaves ATen only (plus exact
integer floor division / remainder: torch-mlir would lower them through f64 / to a truncating
stablehlo.remainder). Each distinct op call is traced once (DecompositionCache) and copied for
the calls that repeat it (the layers); then repeated ATen calls on the same arguments merge
(eliminate_common_calls): the arithmetic inside the decompositions (a floor division and the
remainder of the same operands each expand to the same truncating division and sign fix-up;
the attention kernel's slot indices over the block table, the same in every layer). The
step's layout metadata is not among it: the DCP passes emit it once per step.
Collective markers (prepare) pass through unchanged.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from dcp_compile.runtime.errors import DCPLoweringError

from .prepare import CollectiveSite, _op_name, provenance


def _is_int(x) -> bool:
    return isinstance(x, int) or (isinstance(x, torch.Tensor) and not x.is_floating_point()
                                  and not x.is_complex())


def _floor_adjust(a, b):
    """(a // b, a mod b) on integers from truncating division (stablehlo.divide) alone."""
    q = torch.div(a, b, rounding_mode="trunc")
    r = a - q * b
    wrong_sign = (r != 0) & ((r < 0) != (b < 0))
    return torch.where(wrong_sign, q - 1, q), torch.where(wrong_sign, r + b, r)


def _int_div_mode(a, b, *, rounding_mode=None):
    # torch-mlir lowers an integer floor division through f64 (no f64 on NeuronCores).
    if rounding_mode != "floor" or not (_is_int(a) and _is_int(b)):
        return NotImplemented
    return _floor_adjust(a, b)[0]


def _int_remainder(a, b):
    # torch-mlir lowers an integer remainder to stablehlo.remainder, which truncates: wrong
    # sign for a negative dividend (torch.remainder(-7, 4) = 1, stablehlo gives -3).
    if not (_is_int(a) and _is_int(b)):
        return NotImplemented
    return _floor_adjust(a, b)[1]


def decomposition_table() -> dict:
    """torch-mlir's FX decomposition table, every dcp op's reference implementation (but
    decode attention: paged_attention.LOWERING_KERNELS), the recurrent ops of
    recurrent.RECURRENT_LOWERING, and exact integer floor division /
    remainder (see _int_div_mode, _int_remainder)."""
    from dcp_compile.runtime.kernels.ops import DECOMPOSITIONS

    from .paged_attention import LOWERING_KERNELS
    from .recurrent import RECURRENT_LOWERING
    aten = torch.ops.aten
    table = dict(_torch_mlir_decompositions())
    table.update(DECOMPOSITIONS)
    table.update(LOWERING_KERNELS)      # decode attention as XLA fuses it (paged_attention.py)
    table.update(RECURRENT_LOWERING)    # hybrid models' recurrent ops (recurrent.py)
    table.update({aten.div.Tensor_mode: _int_div_mode, aten.div.Scalar_mode: _int_div_mode,
                  aten.remainder.Tensor: _int_remainder,
                  aten.remainder.Scalar: _int_remainder})
    return table


@functools.lru_cache(maxsize=1)
def _torch_mlir_decompositions() -> dict:
    """torch-mlir's table (built once: building it walks every decomposition torch has)."""
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table
    return dict(get_decomposition_table())


def decompose(gm: GraphModule, step: str, *,
              input_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
              reuse: bool = True, cache: DecompositionCache | None = None) -> GraphModule:
    """``gm`` with every op replaced by its decomposition to ATen, on fake inputs of its
    placeholders' shapes (or of ``input_shapes``, by placeholder name).

    With ``reuse`` (the default) each distinct op call -- same op, same non-tensor arguments,
    same input shapes/strides/dtypes -- is traced once and its decomposition copied for every
    other call (see decompose_by_op): the layers of a model repeat the same calls, so the
    cost is that of one layer plus a graph copy per layer. ``reuse=False`` retraces the whole
    graph with make_fx; both give the same graph op for op (tests/lowering/test_lowering_reuse.py).
    Then calls repeated on the same arguments are merged (eliminate_common_calls): the
    decompositions' own index arithmetic repeats (see the module doc), and torch-mlir's
    canonicalizer grows faster than linearly with the duplicates (8B shape, 24 layers,
    loaded machine: torch-mlir 22.1 s without the merge, 7.7 s with it). ``cache`` may be shared by several graphs (the
    steps of one program)."""
    input_shapes = input_shapes or {}
    specs = [input_shapes.get(n.name, (tuple(n.meta["val"].shape), n.meta["val"].dtype))
             for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        out = decompose_by_op(gm, specs, cache=cache) if reuse else \
            decompose_whole(gm, specs)
    except DCPLoweringError:
        raise
    except Exception as e:
        raise DCPLoweringError(f"decomposing step {step!r} to ATen failed: "
                               f"{type(e).__name__}: {e}") from e
    check_decomposed(out, step)
    return out


def decompose_whole(gm: GraphModule, specs: list[tuple[tuple[int, ...], torch.dtype]]
                    ) -> GraphModule:
    """One make_fx retrace of the whole graph with decomposition_table()."""
    import torch.fx.traceback as fx_traceback
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        fakes = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    with fx_traceback.preserve_node_meta():
        out = make_fx(torch.fx.Interpreter(gm).run, decomposition_table=decomposition_table(),
                      tracing_mode="fake")(*fakes)
    if eliminate_common_calls(out.graph):
        out.recompile()
    return out


# Meta a decomposed node inherits from the node it comes from (what make_fx copies under
# preserve_node_meta that anything downstream reads: provenance, source locations).
_INHERITED_META = ("custom", "stack_trace", "nn_module_stack", "source_fn_stack")


@dataclass
class DecompositionCache:
    """op-call signature -> its decomposed graph. ``traced``: distinct calls decomposed for
    this cache (``remembered`` of them taken from the process's earlier traces, _TRACES);
    ``copied``: calls that copied one of them."""
    graphs: dict = field(default_factory=dict)
    traced: int = 0
    copied: int = 0
    remembered: int = 0


# (decomposition table, op-call key) -> its make_fx trace, for every lowering in this
# process: a trace depends on nothing else (see decompose_by_op), so the graphs a process
# lowers one after another -- the steps and buckets of a program, the same model at another
# tp, dcp or mode (whose unsharded calls keep their shapes), a test session -- trace each
# distinct call once. Bounded: the oldest trace goes first.
_TRACES: dict = {}
TRACES_KEPT = 4096


def decompose_by_op(gm: GraphModule, specs: list[tuple[tuple[int, ...], torch.dtype]], *,
                    cache: DecompositionCache | None = None) -> GraphModule:
    """Decompose op by op in graph order: an op call whose signature (op_call_key) was
    traced before is copied from that trace instead of being traced again.

    Equivalent to decompose_whole: make_fx decomposes each op on its own fake inputs, and
    the result of a decomposition depends only on the op, its non-tensor arguments and its
    inputs' shapes, strides and dtypes, which is what the key holds."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    # Lazy graph modules: the Python code of the per-op traces and of the result is generated
    # only if something runs them (lowering reads their graphs only), ~10 ms per op trace.
    with _use_lazy_graph_module(True):
        return _decompose_by_op(gm, specs, cache if cache is not None else
                                DecompositionCache(), FakeTensorMode())


def _decompose_by_op(gm: GraphModule, specs: list[tuple[tuple[int, ...], torch.dtype]],
                     cache: DecompositionCache, mode) -> GraphModule:
    from torch.fx._lazy_graph_module import _make_graph_module

    table = decomposition_table()
    table_key = frozenset(table.items())
    graph, root, env = torch.fx.Graph(), torch.nn.Module(), {}
    shapes = iter(specs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            shape, dtype = next(shapes)
            env[node] = graph.placeholder(node.name)
            with mode:
                env[node].meta["val"] = torch.empty(shape, dtype=dtype)
        elif node.op == "output":
            graph.output(torch.fx.node.map_arg(node.args[0], env.__getitem__))
        elif node.op == "call_function" and node.target is operator.getitem and \
                isinstance(env[node.args[0]], (list, tuple)):
            env[node] = env[node.args[0]][node.args[1]]     # a multi-output op's result
        elif node.op == "call_function" and node.target == torch.ops.dcp_lower.collective.default:
            env[node] = _copy_marker(graph, node, env, mode)  # one per site: nothing to reuse
        elif node.op == "call_function":
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            key, inputs = op_call_key(node.target, args, kwargs)
            if key not in cache.graphs:
                remembered = (table_key, key) in _TRACES
                cache.graphs[key] = _remembered_trace(table_key, key, node.target, args,
                                                      kwargs, inputs, table, mode)
                cache.traced += 1
                cache.remembered += remembered
            else:
                cache.copied += 1
            env[node] = _copy_decomposition(graph, root, cache.graphs[key], inputs, node)
        else:
            name, pass_name = provenance(node)
            raise DCPLoweringError(f"cannot decompose {node.op} {node.target!r} at node {name} "
                                   f"(introduced by pass {pass_name}): only placeholders and "
                                   f"call_function nodes lower. Capture with torch.export.")
    eliminate_common_calls(graph)
    return _make_graph_module(root, graph)


def _copy_marker(graph: torch.fx.Graph, node: Node, env: dict, mode) -> Node:
    """A collective marker as is (make_fx keeps it: it has no decomposition), with the
    result its fake implementation gives for the decomposed input."""
    args = torch.fx.node.map_arg(node.args, env.__getitem__)
    new = graph.call_function(node.target, args)
    with mode:
        x = args[0].meta["val"]
        new.meta["val"] = node.target(torch.empty_strided(tuple(x.shape), tuple(x.stride()),
                                                          dtype=x.dtype), *args[1:])
    new.meta.update({k: node.meta[k] for k in _INHERITED_META if k in node.meta})
    return new


def op_call_key(target, args, kwargs) -> tuple[tuple, list[Node]]:
    """(key, the tensor inputs in map_arg order). A tensor input (a Node) keys by shape,
    stride and dtype; any other argument by type and repr (1, 1.0 and True differ)."""
    inputs: list[Node] = []
    torch.fx.node.map_arg((args, kwargs), inputs.append)
    return (target, _signature((args, kwargs))), inputs


def _signature(x):
    if isinstance(x, Node):
        v = x.meta["val"]
        return ("tensor", tuple(v.shape), tuple(v.stride()), v.dtype)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_signature(a) for a in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _signature(v)) for k, v in x.items()))
    return (type(x).__name__, repr(x))


def _remembered_trace(table_key, key, target, args, kwargs, inputs: list[Node], table: dict,
                      mode) -> GraphModule:
    """_trace_op_call, once per (table, key) in this process (_TRACES)."""
    memo = (table_key, key)
    if memo not in _TRACES:
        if len(_TRACES) >= TRACES_KEPT:
            del _TRACES[next(iter(_TRACES))]
        _TRACES[memo] = _trace_op_call(target, args, kwargs, inputs, table, mode)
    return _TRACES[memo]


def _trace_op_call(target, args, kwargs, inputs: list[Node], table: dict, mode
                   ) -> GraphModule:
    """make_fx of one op call on fresh fake tensors of its inputs' shapes and strides."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with mode:
        fakes = [torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype)
                 for v in (x.meta["val"] for x in inputs)]

    def call(*tensors):
        it = iter(tensors)
        a, k = torch.fx.node.map_arg((args, kwargs), lambda _: next(it))
        return target(*a, **k)

    return make_fx(call, decomposition_table=table, tracing_mode="fake")(*fakes)


def _copy_decomposition(graph: torch.fx.Graph, root: torch.nn.Module, sub: GraphModule,
                        inputs: list[Node], origin: Node):
    """Append ``sub``'s nodes to ``graph`` reading ``inputs``; returns its outputs. Each
    copy inherits ``origin``'s provenance; constants are registered once on ``root``."""
    val_map: dict[Node, Any] = {}
    placeholders = iter(inputs)
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            val_map[n] = next(placeholders)
            continue
        if n.op == "output":
            return torch.fx.node.map_arg(n.args[0], val_map.__getitem__)
        if n.op == "get_attr":
            name = f"_dcp_const_{id(sub)}_{n.target}"
            if not hasattr(root, name):
                setattr(root, name, getattr(sub, n.target))
            new = graph.get_attr(name)
        else:
            new = graph.create_node(n.op, n.target,
                                    torch.fx.node.map_arg(n.args, val_map.__getitem__),
                                    torch.fx.node.map_arg(n.kwargs, val_map.__getitem__),
                                    name=n.name)
        new.meta = {**n.meta, **{k: origin.meta[k] for k in _INHERITED_META
                                 if k in origin.meta}}
        val_map[n] = new
    raise DCPLoweringError("a decomposed op graph has no output node.")


def eliminate_common_calls(graph: torch.fx.Graph) -> int:
    """Merge call_function nodes with the same op on the same arguments (the layers
    recompute the same masks and slot indices from the step inputs); returns how many
    were removed. Only deterministic ATen/prims ops: a seeded random op is never merged,
    and a collective marker differs by its site."""
    seen: dict[tuple, Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not _mergeable(node.target):
            continue
        key = (node.target, _hashable(node.args), _hashable(node.kwargs))
        if key is None or any(k is None for k in key[1:]):
            continue
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            removed += 1
    return removed


def _mergeable(target) -> bool:
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten",
                                                                                "prims"):
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags and \
        not target._schema.is_mutable


def _hashable(x):
    """A hashable form of FX arguments (nodes by identity, 1/1.0/True apart); None if none."""
    if isinstance(x, Node):
        return ("node", x)
    if isinstance(x, (list, tuple)):
        items = tuple(_hashable(a) for a in x)
        return None if any(i is None for i in items) else (type(x).__name__, items)
    if isinstance(x, dict):
        items = tuple((k, _hashable(v)) for k, v in x.items())
        return None if any(i is None for _, i in items) else ("dict", items)
    try:
        hash(x)
    except TypeError:
        return None
    return (type(x).__name__, repr(x))


def check_decomposed(out: GraphModule, step: str) -> None:
    """Only ATen/prims ops (and collective markers) are left after decomposition."""
    marker = torch.ops.dcp_lower.collective.default
    for node in out.graph.nodes:
        if node.op != "call_function" or node.target in (operator.getitem, marker):
            continue
        ns = getattr(node.target, "namespace", None)
        if ns not in ("aten", "prims"):
            name, pass_name = provenance(node)
            raise DCPLoweringError(
                f"cannot lower op {_op_name(node.target)} from node {name} (introduced by pass "
                f"{pass_name}, step {step!r}): it is still there after decomposition. Give it "
                f"a decomposition to ATen (dcp_compile.runtime.kernels.ops.DECOMPOSITIONS).")


def _resolve_site_shapes(decomposed: GraphModule,
                         sites: list[CollectiveSite]) -> list[CollectiveSite]:
    """Operand/result shapes of each collective as retraced (the inputs may be overridden)."""
    marker = torch.ops.dcp_lower.collective.default
    out = list(sites)
    for node in decomposed.graph.nodes:
        if node.op == "call_function" and node.target == marker:
            i = node.args[4]
            x, y = node.args[0].meta["val"], node.meta["val"]
            out[i] = CollectiveSite(**{**sites[i].__dict__, "in_shape": tuple(x.shape),
                                       "out_shape": tuple(y.shape), "dtype": x.dtype})
    return out
