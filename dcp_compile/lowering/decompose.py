"""Lower a DCP program to StableHLO: one module per step kind, collectives on real replica groups.

This is the route the Neuron vLLM plugin's compiler takes (FX -> AOTAutograd-style ATen ->
torch-mlir -> StableHLO -> neuronx-cc), run here as far as anything real reaches on CPU:

  program graph: ATen + dcp.* custom ops + _c10d_functional collectives on role placeholders
   1 check_lowerable     analysis: every op has a lowering, every shape is static
   2 mark_collectives    collective + wait_tensor -> dcp_lower.collective(x, kind, role, n, site)
                         (a collective of a role whose groups have one rank is the identity and
                         is elided)
   3 decompose           make_fx with ops.DECOMPOSITIONS and torch-mlir's own table: ATen only
                         (plus exact integer floor division / remainder: torch-mlir would
                         lower them through f64 / to a truncating stablehlo.remainder). Each
                         distinct op call is traced once and copied for the calls that repeat
                         it (the layers), then repeated calls on the same arguments merge
   4 import              torch-mlir's FxImporter: torch dialect; a marker is a torch.operator
   5 emit_collectives    each marker -> stablehlo.all_gather | reduce_scatter | all_reduce |
                         all_to_all with *every* group of its role (the full partition of
                         range(tp)), a channel handle and use_global_device_ids (all_to_all has
                         neither: see emit_collectives), built through the MLIR Python
                         bindings between torch_c casts
   6 torch-mlir          torchdynamo-export-to-torch-backend-pipeline (our stablehlo ops are
                         opaque to it), then torch-backend-to-stablehlo-backend-pipeline
   7 finalize            rewrite rules (FINALIZE_RULES): arith.constant -> stablehlo.constant,
                         static dynamic_iota -> iota, constant folding of reshape/convert (no
                         f64 left); canonicalize; then the contract: only stablehlo and func
                         ops, static shapes, no custom_call
   8 serialize           text and a StableHLO portable artifact (VHLO bytecode). VHLO keeps a
                         collective's channel id but not its channel type (it reads back as 0);
                         XLA uses only the id for collectives.

One module serves every rank: the rank is its ``tp_rank`` input (``mhlo.num_replicas = tp``,
replica groups name global device ids = tp ranks). KV caches are inputs and are returned
updated; each cache input carries ``tf.aliasing_output`` (the XLA convention for a donated
buffer) naming the result that replaces it.
"""

from __future__ import annotations

import functools
import operator
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.fx import GraphModule, Node

from runtime.errors import DCPLoweringError
from runtime.names import META_LAYER, META_NODE, META_PASS, ROLE_PREFIX, is_cache_input


TARGETS = ("stablehlo",)
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
COLLECTIVE_OPS = ("stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_reduce",
                  "stablehlo.all_to_all")


# ------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveSite:
    """A collective of the FX graph, before lowering (analysis result)."""

    site: int
    kind: str                        # all_gather | reduce_scatter | all_reduce | all_to_all
    role: str
    group_size: int
    reduce: str | None               # "sum", ... for all_reduce / reduce_scatter
    node: str
    pass_name: str
    layer: int | None
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class LoweredCollective:
    """A collective as it stands in the lowered module, joined with where it came from."""

    kind: str
    dim: int | None                  # gather / scatter dimension (all_to_all: split = concat)
    replica_groups: list[list[int]]
    channel_handle: int | None      # None: all_to_all (cross-replica, see emit_collectives)
    role: str | None
    node: str | None
    pass_name: str | None
    layer: int | None
    shape: tuple[int, ...]           # operand shape
    dtype: str

    def to_json(self) -> dict:
        return {"kind": self.kind, "dim": self.dim, "replica_groups": self.replica_groups,
                "channel_handle": self.channel_handle, "role": self.role, "node": self.node,
                "pass": self.pass_name, "layer": self.layer, "shape": list(self.shape),
                "dtype": self.dtype}


@dataclass
class LoweredModule:
    """One step kind lowered: the module's text, its portable artifact and its collectives."""

    step: str
    text: str
    artifact: bytes
    target_version: str
    collectives: list[LoweredCollective]
    elided: list[CollectiveSite]
    input_names: list[str]
    output_names: list[str]
    seconds: dict[str, float]
    paths: dict[str, str] = field(default_factory=dict)

    def parse(self, context=None):
        """The module parsed back (in a fresh context unless one is given)."""
        from torch_mlir import ir
        ctx = context or new_context(stablehlo_only=True)
        with ctx:
            return ir.Module.parse(self.text)

    def op_counts(self) -> dict[str, int]:
        return op_counts(self.text)

    def to_json(self) -> dict:
        return {"step": self.step, "target_version": self.target_version,
                "text_bytes": len(self.text.encode()), "artifact_bytes": len(self.artifact),
                "ops": sum(self.op_counts().values()),
                "inputs": self.input_names, "outputs": self.output_names,
                "collectives": [c.to_json() for c in self.collectives],
                "elided_collectives": [{"kind": s.kind, "role": s.role, "node": s.node}
                                       for s in self.elided],
                "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
                "paths": dict(self.paths)}


@dataclass
class LoweringResult:
    target: str
    modules: dict[str, LoweredModule]
    groups: dict[str, list[list[int]]]
    tp: int
    out_dir: str | None = None

    def __getitem__(self, step: str) -> LoweredModule:
        return self.modules[step]

    def to_json(self) -> dict:
        return {"target": self.target, "tp": self.tp, "groups": self.groups,
                "out_dir": self.out_dir,
                "steps": {s: m.to_json() for s, m in self.modules.items()}}

    def format_table(self) -> str:
        lines = [f"lowered to {self.target} (one module per step, rank = input tp_rank, "
                 f"replica groups over {self.tp} ranks)"]
        for step, m in self.modules.items():
            lines.append(f"  {step}: {sum(m.op_counts().values())} ops, text "
                         f"{len(m.text.encode())} B, portable artifact {len(m.artifact)} B "
                         f"(StableHLO {m.target_version}), lowered in "
                         f"{sum(m.seconds.values()):.2f} s")
            for p in ("text", "artifact"):
                if p in m.paths:
                    lines.append(f"    {p}: {m.paths[p]}")
            lines.append(f"    {'ch':>3}  {'collective':<15} {'dim':>3}  {'role':<7} "
                         f"{'layer':>5}  {'operand':<22} replica groups")
            for c in m.collectives:
                operand = f"{c.dtype}{list(c.shape)}"
                layer = "-" if c.layer is None else str(c.layer)
                ch = "-" if c.channel_handle is None else c.channel_handle
                lines.append(f"    {ch:>3}  {c.kind:<15} "
                             f"{'-' if c.dim is None else c.dim:>3}  {c.role or '?':<7} "
                             f"{layer:>5}  {operand:<22} {c.replica_groups}")
            if m.elided:
                lines.append(f"    elided {len(m.elided)} collective(s) on one-rank groups "
                             f"(identity): " + ", ".join(sorted({f'{s.kind}@{s.role}'
                                                                 for s in m.elided})))
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------


def lower(program, target: str = "stablehlo", out_dir: str | Path | None = None, *,
          steps: Sequence[str] | None = None, target_version: str | None = None,
          elide_trivial: bool = True) -> LoweringResult:
    """Lower every step kind of ``program`` (a :class:`~runtime.dcp_program.DCPProgram`).

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
    for step in wanted:
        modules[step] = lower_graph(program.graphs[step], step=step, groups=topo.groups,
                                    tp=topo.tp, target_version=target_version,
                                    elide_trivial=elide_trivial, module_attrs=meta,
                                    input_shapes=_rank_input_shapes(program, step),
                                    cache=cache)
    result = LoweringResult(target=target, modules=modules, groups=topo.groups, tp=topo.tp)
    if out_dir is not None:
        write(result, out_dir)
    return result


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
    t = time.perf_counter()
    check_lowerable(gm, step)
    marked, sites, elided = mark_collectives(gm, step, groups, elide_trivial=elide_trivial)
    seconds["mark"] = time.perf_counter() - t
    t = time.perf_counter()
    decomposed = decompose(marked, step, input_shapes=input_shapes, cache=cache)
    sites = _resolve_site_shapes(decomposed, sites)
    seconds["decompose"] = time.perf_counter() - t
    input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    output_names = _output_names(gm)
    caches = [n for n in input_names if is_cache_input(n)]
    if len(output_names) == 1 + len(caches):
        # DCPProgram's calling convention: (logits, *new_kv_caches).
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
    t = time.perf_counter()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(x) for x in example_inputs]
    traced = make_fx(fn, tracing_mode="fake")(*fakes)
    check_lowerable(traced, name)
    decomposed = decompose(traced, name)
    seconds["decompose"] = time.perf_counter() - t
    names = [n.name for n in traced.graph.nodes if n.op == "placeholder"]
    return _lower_decomposed(decomposed, step=name, sites=[], elided=[], groups={}, tp=1,
                             target_version=target_version, seconds=seconds,
                             input_names=names, output_names=_output_names(traced),
                             module_attrs=None)


def write(result: LoweringResult, out_dir: str | Path) -> LoweringResult:
    """Write each module's text and portable artifact, and lowering.json, into ``out_dir``."""
    import json
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for step, m in result.modules.items():
        text_path = out / f"{step}.stablehlo.mlir"
        art_path = out / f"{step}.stablehlo.mlirbc"
        text_path.write_text(m.text)
        art_path.write_bytes(m.artifact)
        m.paths = {"text": str(text_path), "artifact": str(art_path)}
    result.out_dir = str(out)
    (out / "lowering.json").write_text(json.dumps(result.to_json(), indent=1))
    return result


# ------------------------------------------------------------------------------------------
# 1. Analysis: can this graph be lowered?
# ------------------------------------------------------------------------------------------


def _collective_targets() -> dict:
    F = torch.ops._c10d_functional
    return {F.all_gather_into_tensor.default: "all_gather",
            F.reduce_scatter_tensor.default: "reduce_scatter",
            F.all_reduce.default: "all_reduce",
            F.all_to_all_single.default: "all_to_all"}


def _wait_target():
    return torch.ops._c10d_functional.wait_tensor.default


def provenance(node: Node) -> tuple[str, str]:
    """(FX node name, pass that introduced it) — 'capture' for nodes of the model's own graph."""
    custom = node.meta.get("custom") or {}
    if META_NODE in custom:
        return custom[META_NODE], custom[META_PASS]
    return node.name, node.meta.get(META_PASS) or "capture"


def _op_name(target) -> str:
    return getattr(target, "_name", None) or getattr(target, "__name__", str(target))


def check_lowerable(gm: GraphModule, step: str) -> None:
    """Raise DCPLoweringError for the first op without a lowering or shape that is not static."""
    from runtime.ops import DECOMPOSITIONS
    collectives = _collective_targets()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function"):
            _check_static(node, step)
        if node.op in ("call_module", "call_method"):
            name, pass_name = provenance(node)
            raise DCPLoweringError(
                f"cannot lower {node.op} {node.target!r} at node {name} (introduced by pass "
                f"{pass_name}, step {step!r}): only ATen-level call_function graphs lower. "
                f"Capture with torch.export so that the graph is flat.")
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem or target in collectives or target == _wait_target():
            continue
        if target in DECOMPOSITIONS:
            continue
        namespace = getattr(target, "namespace", None)
        if isinstance(target, torch._ops.OpOverload) and namespace in ("aten", "prims"):
            continue
        name, pass_name = provenance(node)
        raise DCPLoweringError(
            f"cannot lower op {_op_name(target)} at node {name} (introduced by pass "
            f"{pass_name}, step {step!r}): it has no decomposition to ATen. Add one to "
            f"runtime.ops.DECOMPOSITIONS (a plain-torch reference implementation), or "
            f"emit ATen ops in pass {pass_name}.")


def _check_static(node: Node, step: str) -> None:
    vals = node.meta.get("val")
    for v in (vals if isinstance(vals, (list, tuple)) else [vals]):
        if not isinstance(v, torch.Tensor):
            continue
        if all(isinstance(d, int) for d in v.shape):
            continue
        name, pass_name = provenance(node)
        raise DCPLoweringError(
            f"cannot lower a dynamic shape: node {name} (op {_op_name(node.target)}, "
            f"introduced by pass {pass_name}, step {step!r}) has shape {tuple(v.shape)}. "
            f"Lowered modules have static shapes only: build the program for fixed StepShapes "
            f"and pad + mask instead of slicing to data-dependent sizes.")


# ------------------------------------------------------------------------------------------
# 2. Collectives -> markers that survive decomposition and import
# ------------------------------------------------------------------------------------------


@torch.library.custom_op("dcp_lower::collective", mutates_args=())
def _collective_marker(x: torch.Tensor, kind: str, role: str, group_size: int,
                       site: int) -> torch.Tensor:
    """Where a collective stood; only traced (fake) and rewritten to StableHLO, never run."""
    raise DCPLoweringError("dcp_lower.collective is a lowering marker and cannot run; run the "
                           "program's own graph (DCPProgram.load) instead.")


@_collective_marker.register_fake
def _(x, kind, role, group_size, site):
    shape = list(x.shape)
    if kind == "all_gather":
        shape[0] *= group_size
    elif kind == "reduce_scatter":
        shape[0] //= group_size
    return x.new_empty(shape)


def _role_of(node: Node) -> str:
    name = node.args[-1]
    if isinstance(name, str) and name.startswith(ROLE_PREFIX):
        return name[len(ROLE_PREFIX):]
    return name


def find_collectives(gm: GraphModule, step: str,
                     groups: dict[str, list[list[int]]]) -> list[tuple[Node, CollectiveSite]]:
    """Every collective of the graph, in graph order, with its role's group size checked."""
    collectives = _collective_targets()
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in collectives:
            continue
        kind = collectives[node.target]
        role = _role_of(node)
        name, pass_name = provenance(node)
        if role not in groups:
            raise DCPLoweringError(
                f"collective {kind} at node {name} (introduced by pass {pass_name}, step "
                f"{step!r}) runs on role {role!r}, which the topology does not have: roles "
                f"are {sorted(groups)}. Emit collectives on a topology role "
                f"(passes.collectives.role_name).")
        size = len(groups[role][0])
        if kind == "all_gather":
            declared, reduce = node.args[1], None
        elif kind == "reduce_scatter":
            declared, reduce = node.args[2], node.args[1]
        elif kind == "all_reduce":
            declared, reduce = size, node.args[1]
        else:
            declared, reduce = size, None
            splits = [s for s in node.args[1:3] if s is not None]
            if any(len(set(s)) > 1 for s in splits):
                raise DCPLoweringError(
                    f"cannot lower all_to_all_single with unequal splits {splits} at node "
                    f"{name} (introduced by pass {pass_name}, step {step!r}): "
                    f"stablehlo.all_to_all splits evenly. Pad to equal splits.")
        if declared != size:
            raise DCPLoweringError(
                f"collective {kind} at node {name} (introduced by pass {pass_name}, step "
                f"{step!r}) declares group size {declared}, but role {role!r} has groups of "
                f"{size}: {groups[role]}. Fix the pass or the topology.")
        if reduce is not None and reduce not in _REDUCERS:
            raise DCPLoweringError(
                f"cannot lower reduction {reduce!r} of {kind} at node {name} (introduced by "
                f"pass {pass_name}, step {step!r}). Use one of {sorted(_REDUCERS)}.")
        x = node.args[0].meta["val"]
        out = node.meta["val"]
        found.append((node, CollectiveSite(
            site=len(found), kind=kind, role=role, group_size=size, reduce=reduce, node=name,
            pass_name=pass_name, layer=node.meta.get(META_LAYER), in_shape=tuple(x.shape),
            out_shape=tuple(out.shape), dtype=x.dtype)))
    return found


def mark_collectives(gm: GraphModule, step: str, groups: dict[str, list[list[int]]], *,
                     elide_trivial: bool = True
                     ) -> tuple[GraphModule, list[CollectiveSite], list[CollectiveSite]]:
    """A copy of ``gm`` with each collective a marker (or, on one-rank groups, its input) and
    every ``wait_tensor`` gone. Each node records its provenance in ``meta['custom']``, which
    make_fx copies onto the nodes it decomposes it into."""
    from runtime.program import copy_graph_module
    out = copy_graph_module(gm)
    for node in out.graph.nodes:
        name, pass_name = provenance(node)
        node.meta["custom"] = {**(node.meta.get("custom") or {}), META_NODE: name,
                               META_PASS: pass_name}
    wait = _wait_target()
    for node in list(out.graph.nodes):
        if node.op == "call_function" and node.target == wait:
            node.replace_all_uses_with(node.args[0])
            out.graph.erase_node(node)
    sites, elided = [], []
    for node, site in find_collectives(out, step, groups):
        if elide_trivial and site.group_size == 1:
            node.replace_all_uses_with(node.args[0])
            elided.append(site)
        else:
            site = CollectiveSite(**{**site.__dict__, "site": len(sites)})
            with out.graph.inserting_before(node):
                marker = out.graph.call_function(
                    torch.ops.dcp_lower.collective.default,
                    (node.args[0], site.kind, site.role, site.group_size, site.site))
            marker.meta.update(node.meta)
            node.replace_all_uses_with(marker)
            sites.append(site)
        out.graph.erase_node(node)
    out.graph.lint()
    out.recompile()
    return out, sites, elided


# ------------------------------------------------------------------------------------------
# 3. Decomposition to ATen
# ------------------------------------------------------------------------------------------


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
    """torch-mlir's FX decomposition table, every dcp op's reference implementation, and
    exact integer floor division / remainder (see _int_div_mode, _int_remainder)."""
    from runtime.ops import DECOMPOSITIONS
    aten = torch.ops.aten
    table = dict(_torch_mlir_decompositions())
    table.update(DECOMPOSITIONS)
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
    graph with make_fx; both give the same graph op for op (tests/test_lowering_reuse.py).
    Then calls repeated on the same arguments are merged (eliminate_common_calls): most of a
    layer's decomposed index arithmetic is the same as every other layer's, and torch-mlir's
    canonicalizer grows faster than linearly with the duplicates (measured: 0.35 -> 3.2 s for
    8 -> 24 layers of the 8B context step). ``cache`` may be shared by several graphs (the
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
    """op-call signature -> its decomposed graph; counts how many calls were traced."""
    graphs: dict = field(default_factory=dict)
    traced: int = 0
    copied: int = 0


def decompose_by_op(gm: GraphModule, specs: list[tuple[tuple[int, ...], torch.dtype]], *,
                    cache: DecompositionCache | None = None) -> GraphModule:
    """Decompose op by op in graph order: an op call whose signature (op_call_key) was
    traced before is copied from that trace instead of being traced again.

    Equivalent to decompose_whole: make_fx decomposes each op on its own fake inputs, and
    the result of a decomposition depends only on the op, its non-tensor arguments and its
    inputs' shapes, strides and dtypes, which is what the key holds."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = cache if cache is not None else DecompositionCache()
    table = decomposition_table()
    mode = FakeTensorMode()
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
                cache.graphs[key] = _trace_op_call(node.target, args, kwargs, inputs, table,
                                                   mode)
                cache.traced += 1
            else:
                cache.copied += 1
            env[node] = _copy_decomposition(graph, root, cache.graphs[key], inputs, node)
        else:
            name, pass_name = provenance(node)
            raise DCPLoweringError(f"cannot decompose {node.op} {node.target!r} at node {name} "
                                   f"(introduced by pass {pass_name}): only placeholders and "
                                   f"call_function nodes lower. Capture with torch.export.")
    eliminate_common_calls(graph)
    return GraphModule(root, graph)


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
                f"a decomposition to ATen (runtime.ops.DECOMPOSITIONS).")


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


def _rank_input_shapes(program, step: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-rank shapes of the KV cache inputs, from the program's cache_spec() — the shapes
    every rank is run with (the same on every rank). The graph's own cache placeholders may
    carry the single-device KV head count in meta['val'] (ShardTensorParallel leaves them so
    at the time of writing; nothing downstream of them checks heads in fake mode)."""
    spec = program.cache_spec(program.facts.get("dtype"))
    return {n.name: (tuple(spec.shape), spec.dtype) for n in program.graphs[step].graph.nodes
            if n.op == "placeholder" and is_cache_input(n.name)}


# ------------------------------------------------------------------------------------------
# 4-8. Import, collectives, torch-mlir pipelines, finalize, serialize
# ------------------------------------------------------------------------------------------


def new_context(*, stablehlo_only: bool = False):
    """An MLIR context with the torch and StableHLO dialects (and torch_c, which only loads as
    a dependency of torch-mlir's conversion passes: run one on an empty module)."""
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.passmanager import PassManager

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


def _lower_decomposed(dgm: GraphModule, *, step: str, sites: list[CollectiveSite],
                      elided: list[CollectiveSite], groups: dict[str, list[list[int]]],
                      tp: int, target_version: str | None, seconds: dict[str, float],
                      input_names: list[str], output_names: list[str],
                      module_attrs: dict[str, Any] | None) -> LoweredModule:
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo
    from torch_mlir.extras.fx_importer import FxImporter

    ctx = new_context()
    t = time.perf_counter()
    importer = FxImporter(context=ctx)
    importer.import_stateless_graph(dgm.graph, func_name=FUNC_NAME)
    module = importer.module
    seconds["import"] = time.perf_counter() - t

    t = time.perf_counter()
    with ctx, ir.Location.unknown():
        emit_collectives(module, sites, groups, step)
    _run_pipeline(module, _PIPELINE_TORCH, "torch backend", dgm, step)
    _run_pipeline(module, _PIPELINE_STABLEHLO, "StableHLO backend", dgm, step)
    seconds["torch_mlir"] = time.perf_counter() - t

    t = time.perf_counter()
    with ctx, ir.Location.unknown():
        finalize(module)
        _run_pipeline(module, _PIPELINE_CLEANUP, "cleanup", dgm, step)
        check_contract(module, step)
        _annotate(module, step, tp, input_names, output_names, module_attrs)
    text = module.operation.get_asm(large_elements_limit=None)
    seconds["finalize"] = time.perf_counter() - t

    t = time.perf_counter()
    version = target_version or _stablehlo.get_current_version()
    artifact = serialize(text, version)
    seconds["serialize"] = time.perf_counter() - t

    return LoweredModule(step=step, text=text, artifact=artifact, target_version=version,
                         collectives=_join_sites(collectives_in(text), sites), elided=elided,
                         input_names=input_names, output_names=output_names, seconds=seconds)


def _output_names(gm: GraphModule) -> list[str]:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out if isinstance(out, (list, tuple)) else [out]
    return [a.name if isinstance(a, Node) else repr(a) for a in out]


_REDUCERS = {"sum": "stablehlo.add", "max": "stablehlo.maximum", "min": "stablehlo.minimum",
             "product": "stablehlo.multiply"}


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
    """Replace each marker (torch.operator) by the StableHLO collective of its site."""
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
        elem = _element_type(site.dtype)
        in_type = ir.RankedTensorType.get(list(site.in_shape), elem)
        out_type = ir.RankedTensorType.get(list(site.out_shape), elem)
        attrs = {"replica_groups": ir.DenseElementsAttr.get(
            np.asarray(groups[site.role], dtype=np.int64))}
        if site.kind == "all_to_all":
            # stablehlo.all_to_all has no use_global_device_ids, and a channel would make its
            # groups partition ids: without one they are replica ids = tp ranks, as for the
            # other collectives (flattened ids with num_partitions = 1).
            attrs.update(split_dimension=ir.IntegerAttr.get(i64, 0),
                         concat_dimension=ir.IntegerAttr.get(i64, 0),
                         split_count=ir.IntegerAttr.get(i64, site.group_size))
        else:
            attrs.update(channel_handle=_stablehlo.ChannelHandle.get(site.site + 1,
                                                                     _DEVICE_TO_DEVICE),
                         use_global_device_ids=ir.UnitAttr.get())
        if site.kind == "all_gather":
            attrs["all_gather_dim"] = ir.IntegerAttr.get(i64, 0)
        elif site.kind == "reduce_scatter":
            attrs["scatter_dimension"] = ir.IntegerAttr.get(i64, 0)
        loc = ir.Location.name(f"{step}/{site.node} ({site.pass_name})")
        ip = ir.InsertionPoint(op)
        builtin = ir.Operation.create("torch_c.to_builtin_tensor", results=[in_type],
                                      operands=[op.operands[0]], ip=ip, loc=loc)
        coll = ir.Operation.create(f"stablehlo.{site.kind}", results=[out_type],
                                   operands=[builtin.result], attributes=attrs,
                                   regions=1 if site.reduce else 0, ip=ip, loc=loc)
        if site.reduce:
            scalar = ir.RankedTensorType.get([], elem)
            block = coll.regions[0].blocks.append(scalar, scalar)
            with ir.InsertionPoint(block):
                r = ir.Operation.create(_REDUCERS[site.reduce], results=[scalar],
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


# -- 7. finalize: rewrite rules, then the contract ------------------------------------------


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


def _annotate(module, step: str, tp: int, input_names: list[str], output_names: list[str],
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
    # Cache k of the inputs comes back as result 1 + k (calling convention of DCPProgram).
    cache_inputs = [i for i, n in enumerate(input_names) if is_cache_input(n)]
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


# -- 8. serialization -----------------------------------------------------------------------


def serialize(text: str, target_version: str) -> bytes:
    """The StableHLO portable artifact (VHLO bytecode) of a module given as text."""
    from torch_mlir._mlir_libs import _stablehlo
    try:
        return bytes(_stablehlo.serialize_portable_artifact_str(text, target_version))
    except Exception as e:
        raise DCPLoweringError(f"StableHLO portable serialization failed for target version "
                               f"{target_version}: {e}. Use a version between "
                               f"{_stablehlo.get_minimum_version()} and "
                               f"{_stablehlo.get_current_version()}.") from e


def deserialize(artifact: bytes, context=None) -> Any:
    """A portable artifact back to a StableHLO module."""
    from torch_mlir._mlir_libs import _stablehlo
    ctx = context or new_context(stablehlo_only=True)
    return _stablehlo.deserialize_portable_artifact(ctx, artifact)


# ------------------------------------------------------------------------------------------
# Reading modules back: collectives, op counts
# ------------------------------------------------------------------------------------------


def collectives_in(module_or_text) -> list[dict]:
    """Every StableHLO collective of a module (text or parsed), in order, read from the IR."""
    import numpy as np
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo
    if isinstance(module_or_text, str):
        ctx = new_context(stablehlo_only=True)
        with ctx:
            module = ir.Module.parse(module_or_text)
    else:
        module = module_or_text
    found = []
    for op in _walk(module.operation):
        if op.name not in COLLECTIVE_OPS:
            continue
        a = op.attributes
        groups = np.array(ir.DenseIntElementsAttr(a["replica_groups"])).tolist()
        dim = None
        for key in ("all_gather_dim", "scatter_dimension", "split_dimension"):
            if key in a:
                dim = ir.IntegerAttr(a[key]).value
        handle = _stablehlo.ChannelHandle(a["channel_handle"]).handle \
            if "channel_handle" in a else None
        operand = ir.RankedTensorType(op.operands[0].type)
        found.append({"kind": op.name.split(".", 1)[1], "dim": dim, "replica_groups": groups,
                      "channel_handle": handle,
                      "use_global_device_ids": "use_global_device_ids" in a,
                      "shape": tuple(operand.shape), "dtype": str(operand.element_type),
                      "location": str(op.location)})
    return found


def _join_sites(found: list[dict], sites: list[CollectiveSite]) -> list[LoweredCollective]:
    """Pair the module's collectives with the graph's sites: in order (torch-mlir keeps the
    order of side-effecting ops), checked by kind and channel handle."""
    if len(found) != len(sites) or any(
            c["kind"] != s.kind or c["channel_handle"] not in (None, s.site + 1)
            for c, s in zip(found, sites)):
        raise DCPLoweringError(
            f"the lowered module's collectives "
            f"{[(c['kind'], c['channel_handle']) for c in found]} do not match the graph's "
            f"{[(s.kind, s.site + 1) for s in sites]}.")
    return [LoweredCollective(kind=c["kind"], dim=c["dim"], replica_groups=c["replica_groups"],
                              channel_handle=c["channel_handle"], role=s.role, node=s.node,
                              pass_name=s.pass_name, layer=s.layer, shape=c["shape"],
                              dtype=c["dtype"])
            for c, s in zip(found, sites)]


def op_counts(text: str) -> dict[str, int]:
    """Operation name -> count, from a module's text (generic and custom forms)."""
    counts: dict[str, int] = {}
    for name in re.findall(r'(?:=\s*|^\s*)"?((?:stablehlo|func|arith|chlo|tensor|torch)'
                           r'\.[a-z_]+)"?', text, flags=re.M):
        counts[name] = counts.get(name, 0) + 1
    return counts


# ------------------------------------------------------------------------------------------
# The StableHLO reference interpreter (ships in torch-mlir's _stablehlo bindings)
# ------------------------------------------------------------------------------------------


def interpreter_available() -> tuple[bool, str]:
    """Whether the StableHLO reference interpreter can be called here, and why not."""
    try:
        from torch_mlir._mlir_libs import _stablehlo
    except ImportError as e:
        return False, f"torch-mlir's StableHLO bindings do not import: {e}"
    if not hasattr(_stablehlo, "eval_module"):
        return False, "this torch-mlir build has no stablehlo eval_module"
    return True, "torch_mlir._mlir_libs._stablehlo.eval_module"


def run_interpreter(module: LoweredModule | str, inputs: Sequence[torch.Tensor]
                    ) -> list[torch.Tensor]:
    """Run a module without collectives (tp=1, or a standalone function) on CPU tensors with
    the StableHLO reference interpreter; see :func:`run_interpreter_spmd` for ranks."""
    return run_interpreter_spmd(module, [inputs])[0]


def run_interpreter_spmd(module: LoweredModule | str,
                         inputs_per_rank: Sequence[Sequence[torch.Tensor]], *,
                         isolate: bool | None = None) -> list[list[torch.Tensor]]:
    """Run one lowered module on every rank at once in the StableHLO reference interpreter.

    With several ranks, the module's function runs as the program of each of ``len(
    inputs_per_rank)`` replicas under ``interpreter.run_parallel`` (num_replicas = ranks,
    num_partitions = 1), so its collectives move real data between the replicas of their
    replica groups. Returns each rank's results. bf16/f16 results come back through an
    appended convert to f32 (the bindings cannot hand them to numpy) and are cast back.

    Limits of the interpreter (stablehlo/reference): run_parallel runs the replicas on a
    thread pool as large as this machine's CPUs, and a collective waits 3 s for its group,
    then aborts the process. So more ranks than CPUs is refused here, and with several ranks
    the run happens in a child process (``isolate``, default: ranks > 1) whose abort becomes
    a DCPLoweringError. A module with ops outside stablehlo/func, or with collectives but one
    rank, is refused too.
    """
    import os

    text = module.text if isinstance(module, LoweredModule) else module
    ranks = len(inputs_per_rank)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if ranks > (cpus or 1):
        raise DCPLoweringError(
            f"the StableHLO reference interpreter runs {ranks} ranks on a pool of {cpus} "
            f"threads (one per CPU here) and its collectives wait only 3 s for the group: "
            f"{ranks} ranks would deadlock. Run on a machine with >= {ranks} CPUs, or lower "
            f"a program with tp <= {cpus}.")
    if isolate if isolate is not None else ranks > 1:
        return _run_isolated(text, inputs_per_rank)
    return _run_in_process(text, inputs_per_rank)


def _run_isolated(text: str, inputs_per_rank) -> list[list[torch.Tensor]]:
    """run_interpreter_spmd in a child process (python -m dcp_compile.lowering)."""
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory(prefix="dcp_interp_") as tmp:
        job, out = Path(tmp) / "job.pt", Path(tmp) / "out.pt"
        torch.save({"text": text, "inputs": [list(x) for x in inputs_per_rank]}, job)
        proc = subprocess.run([sys.executable, "-m", "dcp_compile.lowering", "interpret",
                               str(job), str(out)], capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise DCPLoweringError(
                f"the StableHLO reference interpreter failed on {len(inputs_per_rank)} ranks "
                f"(exit {proc.returncode}): {tail}. 'rendezvous timed out' means a rank reached "
                f"a collective 3 s before another: a loaded machine, or too much work between "
                f"collectives (use smaller shapes).")
        return torch.load(out)


def _run_in_process(text: str, inputs_per_rank) -> list[list[torch.Tensor]]:
    import numpy as np
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo

    ranks = len(inputs_per_rank)
    ctx = new_context(stablehlo_only=True)
    _stablehlo.register_interpreter_dialect(ctx)
    with ctx, ir.Location.unknown():
        parsed = ir.Module.parse(text)
        ops = list(_walk(parsed.operation))
        bad = sorted({op.name for op in ops if op.name.split(".", 1)[0] not in _ALLOWED_DIALECTS
                      or op.name in _FORBIDDEN_OPS})
        if bad:
            raise DCPLoweringError(f"the StableHLO reference interpreter cannot run {bad}. "
                                   f"Run a module that lower() produced.")
        ids = sorted({i for c in collectives_in(parsed) for g in c["replica_groups"]
                      for i in g})
        if ids and (ranks == 1 or ids != list(range(ranks))):
            raise DCPLoweringError(
                f"the module's collectives span replicas {ids}, but {ranks} rank(s) of inputs "
                f"were given: the interpreter cannot run stablehlo.all_* collectives in one "
                f"process. Pass one input list per rank ({len(ids)}).")
        funcs = [op for op in ops if op.name == "func.func"]
        func = next(f for f in funcs if ir.StringAttr(f.attributes["sym_name"]).value
                    == FUNC_NAME)
        ftype = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
        for r, inputs in enumerate(inputs_per_rank):
            if len(inputs) != len(ftype.inputs):
                raise DCPLoweringError(f"module takes {len(ftype.inputs)} inputs, rank {r} "
                                       f"gave {len(inputs)}.")
        narrow = _widen_results(func, ftype)
        results_per_rank = len(ftype.results)
        if ranks > 1:
            _wrap_in_run_parallel(parsed, func, ranks)
        args = [_to_attribute(x, t) for inputs in inputs_per_rank
                for x, t in zip(inputs, ftype.inputs)]
        results = _stablehlo.eval_module(parsed, args)
        out = []
        for r in range(ranks):
            mine = []
            for i, a in enumerate(results[r * results_per_rank:(r + 1) * results_per_rank]):
                t = torch.from_numpy(np.array(a).copy())
                mine.append(t.to(narrow[i]) if i in narrow else t)
            out.append(mine)
        return out


def _to_attribute(x: torch.Tensor, expected):
    import numpy as np
    from torch_mlir import ir
    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        import ml_dtypes     # numpy's bfloat16
        attr = ir.DenseElementsAttr.get(x.float().numpy().astype(ml_dtypes.bfloat16),
                                        type=ir.BF16Type.get())
    else:
        attr = ir.DenseElementsAttr.get(np.array(x.numpy(), order="C"))
    if str(attr.type) != str(expected):
        raise DCPLoweringError(f"interpreter input: module expects {expected}, got "
                               f"{attr.type}.")
    return attr


def _wrap_in_run_parallel(module, func, ranks: int) -> None:
    """Rename ``main`` to the per-rank program; a new ``main`` runs it on ``ranks`` replicas
    (interpreter.run_parallel, the reference interpreter's process grid)."""
    from torch_mlir import ir
    program = "dcp_rank_program"
    func.attributes["sym_name"] = ir.StringAttr.get(program)
    ftype = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    inputs, results = list(ftype.inputs) * ranks, list(ftype.results) * ranks
    with ir.InsertionPoint(module.body):
        main = ir.Operation.create(
            "func.func", regions=1,
            attributes={"sym_name": ir.StringAttr.get(FUNC_NAME),
                        "function_type": ir.TypeAttr.get(ir.FunctionType.get(inputs, results))})
    block = main.regions[0].blocks.append(*inputs)
    with ir.InsertionPoint(block):
        grid = ir.ArrayAttr.get([ir.ArrayAttr.get([ir.FlatSymbolRefAttr.get(program)])
                                 for _ in range(ranks)])
        run = ir.Operation.create("interpreter.run_parallel", results=results,
                                  operands=list(block.arguments),
                                  attributes={"programs": grid})
        ir.Operation.create("func.return", operands=list(run.results))


class InterpreterExecutor:
    """A runtime.engine executor that runs a program's lowered modules in the StableHLO
    reference interpreter, every rank at once (:func:`run_interpreter_spmd`), each rank with
    its weight shards, ``tp_rank`` and KV caches. ``step`` returns rank 0's logits after
    checking that every rank computed the same ones.

    So ``Engine(InterpreterExecutor(program, lower(program)), ...)`` serves requests with
    the lowered StableHLO instead of the FX graphs — on CPU, slowly, and for at most as many
    ranks as this machine has CPUs (see run_interpreter_spmd).
    """

    def __init__(self, program, lowered: LoweringResult, *, isolate: bool = False):
        from runtime.names import RANK_INPUT
        self.lowered, self.isolate = lowered, isolate
        self.tp = program.topology.tp
        self.prefix = []
        for rank in range(self.tp):
            state = program.state_dict_for(rank)
            self.prefix.append([state[n] for n in program.weight_inputs] + [state[RANK_INPUT]])
        self.caches = [program.cache_spec().allocate() for _ in range(self.tp)]

    def step(self, kind, input_ids, positions, block_table):
        if kind not in self.lowered.modules:
            raise DCPLoweringError(f"no lowered {kind!r} module: lowered steps are "
                                   f"{list(self.lowered.modules)}.")
        inputs = [prefix + [input_ids, positions, block_table] + caches
                  for prefix, caches in zip(self.prefix, self.caches)]
        outs = run_interpreter_spmd(self.lowered[kind], inputs, isolate=self.isolate)
        self.caches = [list(out[1:]) for out in outs]
        for rank, out in enumerate(outs[1:], start=1):
            if not torch.equal(out[0], outs[0][0]):
                raise DCPLoweringError(f"{kind} step: rank {rank}'s logits differ from rank "
                                       f"0's (max {float((out[0] - outs[0][0]).abs().max())}).")
        return outs[0][0]


def _widen_results(func, ftype) -> dict[int, torch.dtype]:
    """Append stablehlo.convert to f32 before the return for bf16/f16 results."""
    from torch_mlir import ir
    narrow_types = {"bf16": torch.bfloat16, "f16": torch.float16}
    block = func.regions[0].blocks[0]
    ret = list(block.operations)[-1]
    narrow, new_results = {}, []
    operands = list(ret.operands)
    for i, t in enumerate(ftype.results):
        rt = ir.RankedTensorType(t)
        name = str(rt.element_type)
        if name in narrow_types:
            wide = ir.RankedTensorType.get(list(rt.shape), ir.F32Type.get())
            conv = ir.Operation.create("stablehlo.convert", results=[wide],
                                       operands=[operands[i]], ip=ir.InsertionPoint(ret))
            ret.operands[i] = conv.result
            narrow[i] = narrow_types[name]
            new_results.append(wide)
        else:
            new_results.append(t)
    if narrow:
        func.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get(list(ftype.inputs), new_results))
    return narrow


def _main(argv: list[str]) -> int:
    """``python -m dcp_compile.lowering interpret JOB OUT``: the child of _run_isolated."""
    if len(argv) != 3 or argv[0] != "interpret":
        print("usage: python -m dcp_compile.lowering interpret JOB.pt OUT.pt")
        return 2
    job = torch.load(argv[1])
    torch.save(_run_in_process(job["text"], job["inputs"]), argv[2])
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_main(sys.argv[1:]))
