"""Collectives and their roles: the one table of collective ops, and binding roles.

A collective names a role (``tp``, ``dcp``, ``world``, ``dcp_tp``, ``cp_kv``) through the
placeholder group name ``dcp_role:<role>`` (``dcp_compile.runtime.names.ROLE_PREFIX``); loading a program
binds each role to something real, so the graph is the same for every rank. Three places bind
roles, all through :func:`bound_collectives`: ``dcp_compile.runtime.serving.rank_program`` (role -> this rank's
process-group name), ``dcp_compile.runtime.distributed.neuron`` (role -> replica groups of torch_xla calls) and the
lowering (role -> replica groups of StableHLO collectives). The passes emit the role names
(``dcp_compile.passes.collectives``); the runtime reads them, so they live here, below both.

:data:`COLLECTIVES` describes each ``_c10d_functional`` collective once: where its arguments
are, what it does to the shape and which StableHLO op it is. The lowering, the Neuron binding
and the placement analysis read it; :data:`REDUCTIONS` spells each reduction per backend.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch.fx import Graph, Node

from dcp_compile.runtime.names import ROLE_PREFIX

_F = torch.ops._c10d_functional

# Every _c10d_functional collective gathers, scatters or splits dim 0 of its input.
COLLECTIVE_DIM = 0

# What a collective does to dim 0 on a group of n ranks (the other dims pass through).
_DIM_SIZE: dict[str, Callable[[int, int], int]] = {
    "gather": operator.mul,             # concatenates every rank's input
    "scatter": operator.floordiv,       # keeps this rank's 1/n slice
    "exchange": lambda size, n: size,   # splits into n parts and concatenates those received
    "elementwise": lambda size, n: size,
}


@dataclass(frozen=True)
class CollectiveKind:
    """One ``_c10d_functional`` collective: argument positions, shape effect, StableHLO op."""

    name: str                       # all_gather | reduce_scatter | all_reduce | all_to_all
    group_arg: int                  # its group name (dcp_role:<role> in a program)
    size_arg: int | None            # the group size it declares (None: its group's size)
    reduce_arg: int | None          # its reduction ("sum", ...); None: no reduction
    split_args: tuple[int, ...]     # its split sizes (output, input): each must split evenly
    dim: str                        # effect on dim 0: a key of _DIM_SIZE
    stablehlo: str                  # the StableHLO op it lowers to
    stablehlo_dim_attr: str | None  # that op's attribute naming the dim (None: elementwise)

    def result_shape(self, shape, n: int) -> list[int]:
        """The result's shape for an input of ``shape`` on groups of ``n`` ranks."""
        out = list(shape)
        out[COLLECTIVE_DIM] = _DIM_SIZE[self.dim](out[COLLECTIVE_DIM], n)
        return out


COLLECTIVES: dict[Any, CollectiveKind] = {
    # all_gather_into_tensor(x, group_size, group_name)
    _F.all_gather_into_tensor.default: CollectiveKind(
        "all_gather", group_arg=2, size_arg=1, reduce_arg=None, split_args=(), dim="gather",
        stablehlo="stablehlo.all_gather", stablehlo_dim_attr="all_gather_dim"),
    # reduce_scatter_tensor(x, reduce_op, group_size, group_name)
    _F.reduce_scatter_tensor.default: CollectiveKind(
        "reduce_scatter", group_arg=3, size_arg=2, reduce_arg=1, split_args=(), dim="scatter",
        stablehlo="stablehlo.reduce_scatter", stablehlo_dim_attr="scatter_dimension"),
    # all_reduce(x, reduce_op, group_name)
    _F.all_reduce.default: CollectiveKind(
        "all_reduce", group_arg=2, size_arg=None, reduce_arg=1, split_args=(),
        dim="elementwise", stablehlo="stablehlo.all_reduce", stablehlo_dim_attr=None),
    # all_to_all_single(x, output_split_sizes, input_split_sizes, group_name)
    _F.all_to_all_single.default: CollectiveKind(
        "all_to_all", group_arg=3, size_arg=None, reduce_arg=None, split_args=(1, 2),
        dim="exchange", stablehlo="stablehlo.all_to_all", stablehlo_dim_attr="split_dimension"),
}
KINDS: dict[str, CollectiveKind] = {k.name: k for k in COLLECTIVES.values()}
# The wait every collective's result goes through (a no-op once bound to replica groups).
WAIT_TARGET = _F.wait_tensor.default


@dataclass(frozen=True)
class Reduction:
    stablehlo: str      # the StableHLO op of the reducer region
    xla: str            # torch_xla.core.xla_model's reduce type constant


REDUCTIONS: dict[str, Reduction] = {
    "sum": Reduction("stablehlo.add", "REDUCE_SUM"),
    "max": Reduction("stablehlo.maximum", "REDUCE_MAX"),
    "min": Reduction("stablehlo.minimum", "REDUCE_MIN"),
    "product": Reduction("stablehlo.multiply", "REDUCE_MUL"),
}


def role_name(role: str) -> str:
    return ROLE_PREFIX + role


def role_of(node: Node) -> str | None:
    """The role a collective node runs on (None for other nodes)."""
    kind = COLLECTIVES.get(node.target) if node.op == "call_function" else None
    if kind is None:
        return None
    name = node.args[kind.group_arg]
    return name[len(ROLE_PREFIX):] if isinstance(name, str) and name.startswith(
        ROLE_PREFIX) else name


def uneven_splits(node: Node, kind: CollectiveKind) -> list | None:
    """The split sizes of an all_to_all that does not split evenly (None when it does)."""
    splits = [node.args[i] for i in kind.split_args if node.args[i] is not None]
    return splits if any(len(set(s)) > 1 for s in splits) else None


@dataclass(frozen=True)
class BoundCollective:
    """A collective node of a program graph with its role and what that role is bound to."""

    node: Node
    kind: CollectiveKind
    role: str
    binding: Any


def bound_collectives(graph: Graph, bindings: Mapping[str, Any], *,
                      error: type[Exception], fix: str, binder: str = "the topology",
                      where: Callable[[Node], str] = lambda n: f"at node {n.name}"
                      ) -> list[BoundCollective]:
    """Every collective of ``graph`` in graph order with its role's binding (``bindings[role]``).

    The one place roles are resolved. A role ``bindings`` lacks raises ``error`` naming the
    collective (``where(node)`` says where it is), the role, the bound roles and ``fix``.
    """
    found = []
    for node in graph.nodes:
        role = role_of(node)
        if role is None:
            continue
        kind = COLLECTIVES[node.target]
        if role not in bindings:
            raise error(f"collective {kind.name} {where(node)} runs on role {role!r}, which "
                        f"{binder} does not have: roles are {sorted(bindings)}. {fix}.")
        found.append(BoundCollective(node, kind, role, bindings[role]))
    return found
