"""Neuron (Trainium): the collective backend of NxD's traced route.

Two routes reach a NeuronCore (see docs/lowering.md, "Neuron (Trainium)"):

1. The current Neuron vLLM plugin's: torch.compile -> FX passes -> AOTAutograd -> torch-mlir ->
   StableHLO -> neuronx-cc. ``dcp_compile.lowering`` produces that StableHLO, collectives
   included, and is checked on CPU.
2. NxD / NxDI's (the older one): every rank traces one SPMD graph on torch_xla lazy tensors,
   with collectives issued as ``torch_xla.core.xla_model`` calls over *explicit replica
   groups* — the full partition of the ranks, e.g. ``groups=[[0, 1, 2, 3], [4, 5, 6, 7]]``,
   as ``parallel_state.get_*_replica_groups()`` return them — and the rank as per-rank state
   (NxD's SPMDRank), so that one compiled graph serves every rank.

This module is route 2's backend. :func:`bind_xla_collectives` rewrites a program graph's
``_c10d_functional`` collectives on role placeholders into calls of ``xm.all_gather`` /
``xm.reduce_scatter`` / ``xm.all_reduce`` / ``xm.all_to_all`` with ``groups`` = every group of
the role; :class:`NeuronStepModule` wraps one step kind for one rank as an ``nn.Module`` whose
weight shards and ``tp_rank`` are buffers (what ``neuronx_distributed.trace`` traces per rank).

``torch_xla`` and ``neuronx_distributed`` are imported lazily and are never dependencies
(neither is on PyPI for real; the packages there with those names are placeholders).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.fx import GraphModule

from dcp_compile.runtime.errors import DCPNeuronError
from dcp_compile.runtime.names import RANK_INPUT
from dcp_compile.runtime.distributed.roles import COLLECTIVE_DIM, REDUCTIONS, WAIT_TARGET, bound_collectives, uneven_splits

__all__ = ["DCPNeuronError", "NeuronStepModule", "bind_xla_collectives", "collective_calls",
           "neuron_available", "use_xla_module", "xla_all_gather", "xla_all_reduce",
           "xla_all_to_all", "xla_reduce_scatter"]


# ------------------------------------------------------------------------------------------
# Lazy torch_xla / neuronx_distributed
# ------------------------------------------------------------------------------------------

_xm_override: list[Any] = [None]


def neuron_available() -> tuple[bool, str]:
    """Whether torch_xla and neuronx_distributed import here; the reason when they don't."""
    for name in ("torch_xla", "torch_xla.core.xla_model", "neuronx_distributed"):
        try:
            __import__(name)
        except Exception as e:  # an ImportError, or a placeholder package failing on import
            return False, (f"{name} does not import ({type(e).__name__}: {e}); the Neuron SDK "
                           f"(torch-neuronx, neuronx-distributed) comes from the AWS Neuron "
                           f"pip repository on a Trainium/Inferentia host, not from PyPI")
    return True, "torch_xla and neuronx_distributed import"


def _xm():
    """torch_xla.core.xla_model (or the module installed by use_xla_module)."""
    if _xm_override[0] is not None:
        return _xm_override[0]
    try:
        import torch_xla.core.xla_model as xm
    except Exception as e:
        raise DCPNeuronError(f"the NxD collective backend needs torch_xla: {type(e).__name__}: "
                             f"{e}. Install the Neuron SDK (torch-neuronx) on a Trainium host, "
                             f"or lower with dcp_compile.lowering on CPU.") from e
    return xm


@contextlib.contextmanager
def use_xla_module(xm):
    """Route the backend's calls to ``xm`` (an object with torch_xla.core.xla_model's
    collective functions), e.g. a recording stand-in in tests."""
    previous = _xm_override[0]
    _xm_override[0] = xm
    try:
        yield xm
    finally:
        _xm_override[0] = previous


# ------------------------------------------------------------------------------------------
# The collective functions a bound graph calls (module-level, so FX code can name them)
# ------------------------------------------------------------------------------------------

# NxD passes pin_layout=False for its model-parallel collectives (every rank runs the same
# program, so there is no layout to pin across differing programs).
_PIN_LAYOUT = False


def _reduce_type(xm, reduce: str):
    if reduce not in REDUCTIONS:
        raise DCPNeuronError(f"no torch_xla reduction for {reduce!r}: supported are "
                             f"{sorted(REDUCTIONS)}.")
    return getattr(xm, REDUCTIONS[reduce].xla)


def xla_all_gather(x: torch.Tensor, dim: int, groups: list[list[int]]) -> torch.Tensor:
    return _xm().all_gather(x, dim=dim, groups=groups, pin_layout=_PIN_LAYOUT)


def xla_reduce_scatter(x: torch.Tensor, reduce: str, dim: int,
                       groups: list[list[int]]) -> torch.Tensor:
    xm = _xm()
    return xm.reduce_scatter(_reduce_type(xm, reduce), x, scale=1.0, scatter_dim=dim,
                             shard_count=len(groups[0]), groups=groups,
                             pin_layout=_PIN_LAYOUT)


def xla_all_reduce(x: torch.Tensor, reduce: str, groups: list[list[int]]) -> torch.Tensor:
    xm = _xm()
    return xm.all_reduce(_reduce_type(xm, reduce), x, groups=groups, pin_layout=_PIN_LAYOUT)


def xla_all_to_all(x: torch.Tensor, dim: int, groups: list[list[int]]) -> torch.Tensor:
    return _xm().all_to_all(x, split_dimension=dim, concat_dimension=dim,
                            split_count=len(groups[0]), groups=groups,
                            pin_layout=_PIN_LAYOUT)


# dcp_compile.runtime.distributed.roles.COLLECTIVES kind name -> the function a bound graph calls for it.
XLA_COLLECTIVES = {"all_gather": xla_all_gather, "reduce_scatter": xla_reduce_scatter,
                   "all_reduce": xla_all_reduce, "all_to_all": xla_all_to_all}


# ------------------------------------------------------------------------------------------
# Binding a program graph
# ------------------------------------------------------------------------------------------


def bind_xla_collectives(gm: GraphModule, groups: dict[str, list[list[int]]]) -> GraphModule:
    """A copy of ``gm`` whose collectives call torch_xla with explicit replica groups.

    ``groups`` is the topology's role -> every group of the role (``Topology.groups``). The
    graph stays the same for every rank: groups are the full partition, never this rank's.
    """
    from dcp_compile.runtime.serving.rank_program import copy_graph_module

    out = copy_graph_module(gm)
    for node in list(out.graph.nodes):
        if node.op == "call_function" and node.target == WAIT_TARGET:
            node.replace_all_uses_with(node.args[0])
            out.graph.erase_node(node)
    for c in bound_collectives(out.graph, groups, error=DCPNeuronError,
                               fix="Bind the program's own topology"):
        node, kind = c.node, c.kind
        splits = uneven_splits(node, kind)
        if splits:
            raise DCPNeuronError(f"all_to_all_single with unequal splits {splits} at "
                                 f"{node.name}: xm.all_to_all splits evenly. Pad to "
                                 f"equal splits.")
        # xla_<kind>(x, [reduce,] [dim,] groups): see the functions above.
        args = ((node.args[0],)
                + ((node.args[kind.reduce_arg],) if kind.reduce_arg is not None else ())
                + ((COLLECTIVE_DIM,) if kind.dim != "elementwise" else ())
                + ([list(map(int, grp)) for grp in c.binding],))
        target = XLA_COLLECTIVES[kind.name]
        with out.graph.inserting_before(node):
            new = out.graph.call_function(target, args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        out.graph.erase_node(node)
    out.graph.lint()
    out.recompile()
    return out


class NeuronStepModule(torch.nn.Module):
    """One step kind of a program on one rank, for NxD's per-rank trace.

    Weight shards and ``tp_rank`` are buffers (per-rank state, like NxD's SPMDRank), so the
    traced graph is identical on every rank. ``forward(input_ids, positions, block_table,
    *kv_caches) -> (logits, *new_kv_caches)``; :attr:`input_output_aliases` maps each cache
    argument index to the output index that replaces it. ``bucket`` (tokens; default the
    full capacity) picks the context bucket's graph: trace one module per (step, bucket)
    and run the one of the smallest bucket holding the batch (runtime/program/buckets.py).
    """

    def __init__(self, program, step: str, rank: int, bucket: int | None = None):
        super().__init__()
        program = program.for_bucket(bucket if bucket is not None else program.capacity)
        self.bucket = program.capacity
        if step not in program.graphs:
            raise DCPNeuronError(f"program has no step {step!r}: it has "
                                 f"{list(program.graphs)}.")
        self.step = step
        self.graph_module = bind_xla_collectives(program.graphs[step],
                                                 program.topology.groups)
        state = program.state_dict_for(rank)
        self._names = list(program.weight_inputs) + [RANK_INPUT]
        for i, name in enumerate(self._names):
            self.register_buffer(f"state_{i}", state[name])
        n_caches = 2 * program.cache_spec().num_layers     # cache pairs, not layers (shared KV)
        self.input_output_aliases = {3 + k: 1 + k for k in range(n_caches)}

    def forward(self, input_ids, positions, block_table, *kv_caches):
        state = [getattr(self, f"state_{i}") for i in range(len(self._names))]
        return tuple(self.graph_module(*state, input_ids, positions, block_table, *kv_caches))


def collective_calls(gm: GraphModule) -> list[tuple[str, tuple]]:
    """(function name, non-tensor args) of every torch_xla collective in a bound graph."""
    names = {fn: name for name, fn in XLA_COLLECTIVES.items()}
    return [(names[n.target], tuple(a for a in n.args[1:]))
            for n in gm.graph.nodes if n.op == "call_function" and n.target in names]


def step_fns(program, rank: int) -> dict:
    """kind -> ``fn(input_ids, positions, block_table, caches) -> (logits, caches)`` over one
    NeuronStepModule per (step kind, context bucket): a step runs the module of its block
    table's width (the Engine picks the smallest bucket holding the batch)."""
    modules = {}
    for bucket in program.buckets:
        view = program.for_bucket(bucket)
        for kind in view.graphs:
            modules[kind, view.shapes.max_blocks] = NeuronStepModule(program, kind, rank,
                                                                     bucket)

    def fn_of(kind):
        def fn(input_ids, positions, block_table, caches):
            module = modules.get((kind, block_table.shape[-1]))
            if module is None:
                raise DCPNeuronError(
                    f"no {kind!r} module for a block table of {block_table.shape[-1]} "
                    f"entries: the program's widths are "
                    f"{sorted(w for k, w in modules if k == kind)}. Build the step's block "
                    f"table for one of its buckets (Engine(buckets=program.buckets)).")
            out = module(input_ids, positions, block_table, *caches)
            return out[0], list(out[1:])
        return fn
    return {kind: fn_of(kind) for kind in program.graphs}
