"""Steps 1-2 of the lowering: check the graph lowers, and mark its collectives.

1 check_lowerable    every op has a lowering (ATen, a dcp op with a decomposition, a
                     collective), every shape is static
2 mark_collectives   collective + wait_tensor -> dcp_lower.collective(x, kind, role, n, site),
                     a marker that survives decomposition and import (a collective of a role
                     whose groups have one rank is the identity and is elided)

Roles resolve to their replica groups through dcp_compile.runtime.distributed.roles.bound_collectives; what each
collective's arguments are comes from dcp_compile.runtime.distributed.roles.COLLECTIVES.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from dcp_compile.runtime.errors import DCPLoweringError
from dcp_compile.runtime.kernels import sparse_attention  # noqa: F401  (registers dcp.index_*)
from dcp_compile.runtime.names import META_LAYER, META_NODE, META_PASS, is_cache_input
from dcp_compile.runtime.distributed.roles import COLLECTIVES, KINDS, REDUCTIONS, WAIT_TARGET, bound_collectives, \
    uneven_splits

from .recurrent import check_recurrent


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


# -- 1. Can this graph be lowered? -----------------------------------------------------------


def provenance(node: Node) -> tuple[str, str]:
    """(FX node name, pass that introduced it) — 'capture' for nodes of the model's own graph."""
    custom = node.meta.get("custom") or {}
    if META_NODE in custom:
        return custom[META_NODE], custom[META_PASS]
    return node.name, node.meta.get(META_PASS) or "capture"


def _op_name(target) -> str:
    return getattr(target, "_name", None) or getattr(target, "__name__", str(target))


# Ops with a reference implementation that the lowering refuses by name: op -> the message
# (formatted with op, name, pass_name, step), saying why and the fix. None at present:
# DeepSeek Sparse Attention's selection, once refused here for its stable sorts, orders its
# keys by one distinct integer per key (sparse_attention.dsa_key) and lowers.
NOT_LOWERED: dict = {}


def check_lowerable(gm: GraphModule, step: str) -> None:
    """Raise DCPLoweringError for the first op without a lowering or shape that is not static."""
    from dcp_compile.runtime.kernels.ops import DECOMPOSITIONS
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
        if target is operator.getitem or target in COLLECTIVES or target == WAIT_TARGET:
            continue
        if target in NOT_LOWERED:
            name, pass_name = provenance(node)
            raise DCPLoweringError(NOT_LOWERED[target].format(
                op=_op_name(target), name=name, pass_name=pass_name, step=step))
        if target in DECOMPOSITIONS:
            continue
        name, pass_name = provenance(node)
        if check_recurrent(node, step, f"at node {name} (introduced by pass {pass_name}, "
                                        f"step {step!r})"):
            continue
        namespace = getattr(target, "namespace", None)
        if isinstance(target, torch._ops.OpOverload) and namespace in ("aten", "prims"):
            continue
        name, pass_name = provenance(node)
        raise DCPLoweringError(
            f"cannot lower op {_op_name(target)} at node {name} (introduced by pass "
            f"{pass_name}, step {step!r}): it has no decomposition to ATen. Add one to "
            f"dcp_compile.runtime.kernels.ops.DECOMPOSITIONS (a plain-torch reference implementation), or "
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


# -- 2. Collectives -> markers ---------------------------------------------------------------


@torch.library.custom_op("dcp_lower::collective", mutates_args=())
def _collective_marker(x: torch.Tensor, kind: str, role: str, group_size: int,
                       site: int) -> torch.Tensor:
    """Where a collective stood; only traced (fake) and rewritten to StableHLO, never run."""
    raise DCPLoweringError("dcp_lower.collective is a lowering marker and cannot run; run the "
                           "program's own graph (DCPProgram.load) instead.")


@_collective_marker.register_fake
def _(x, kind, role, group_size, site):
    return x.new_empty(KINDS[kind].result_shape(x.shape, group_size))


def find_collectives(gm: GraphModule, step: str,
                     groups: dict[str, list[list[int]]]) -> list[tuple[Node, CollectiveSite]]:
    """Every collective of the graph, in graph order, with its role's group size checked."""
    def where(node):
        name, pass_name = provenance(node)
        return f"at node {name} (introduced by pass {pass_name}, step {step!r})"

    found = []
    for c in bound_collectives(gm.graph, groups, error=DCPLoweringError, where=where,
                               fix="Emit collectives on a topology role "
                                   "(dcp_compile.passes.collectives.role_name)"):
        node, kind, role = c.node, c.kind, c.role
        size = len(c.binding[0])
        declared = size if kind.size_arg is None else node.args[kind.size_arg]
        reduce = None if kind.reduce_arg is None else node.args[kind.reduce_arg]
        splits = uneven_splits(node, kind)
        if splits:
            raise DCPLoweringError(
                f"cannot lower all_to_all_single with unequal splits {splits} {where(node)}: "
                f"stablehlo.all_to_all splits evenly. Pad to equal splits.")
        if declared != size:
            raise DCPLoweringError(
                f"collective {kind.name} {where(node)} declares group size {declared}, but "
                f"role {role!r} has groups of {size}: {c.binding}. Fix the pass or the "
                f"topology.")
        if reduce is not None and reduce not in REDUCTIONS:
            raise DCPLoweringError(
                f"cannot lower reduction {reduce!r} of {kind.name} {where(node)}. Use one of "
                f"{sorted(REDUCTIONS)}.")
        x, out = node.args[0].meta["val"], node.meta["val"]
        name, pass_name = provenance(node)
        found.append((node, CollectiveSite(
            site=len(found), kind=kind.name, role=role, group_size=size, reduce=reduce,
            node=name, pass_name=pass_name, layer=node.meta.get(META_LAYER),
            in_shape=tuple(x.shape), out_shape=tuple(out.shape), dtype=x.dtype)))
    return found


def mark_collectives(gm: GraphModule, step: str, groups: dict[str, list[list[int]]], *,
                     elide_trivial: bool = True
                     ) -> tuple[GraphModule, list[CollectiveSite], list[CollectiveSite]]:
    """A copy of ``gm`` with each collective a marker (or, on one-rank groups, its input) and
    every ``wait_tensor`` gone. Each node records its provenance in ``meta['custom']``, which
    make_fx copies onto the nodes it decomposes it into."""
    from dcp_compile.runtime.serving.rank_program import copy_graph_module
    out = copy_graph_module(gm)
    for node in out.graph.nodes:
        name, pass_name = provenance(node)
        node.meta["custom"] = {**(node.meta.get("custom") or {}), META_NODE: name,
                               META_PASS: pass_name}
    for node in list(out.graph.nodes):
        if node.op == "call_function" and node.target == WAIT_TARGET:
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


def _rank_input_shapes(program, step: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-rank shapes of the KV cache inputs, from the program's cache_spec() — the shapes
    every rank is run with (the same on every rank). The graph's own cache placeholders may
    carry the single-device KV head count in meta['val'] (ShardTensorParallel leaves them so
    at the time of writing; nothing downstream of them checks heads in fake mode)."""
    spec = program.cache_spec(program.facts.cache_dtype)
    caches = [n.name for n in program.graphs[step].graph.nodes
              if n.op == "placeholder" and is_cache_input(n.name)]
    return {name: (shape, spec.dtype) for name, shape in zip(caches, spec.shapes())}
