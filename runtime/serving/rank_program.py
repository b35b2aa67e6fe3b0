"""RankProgram: a DCPProgram loaded on one rank (roles bound, weights attached)."""

from __future__ import annotations

import threading
import weakref

import torch
from torch.fx import Graph, GraphModule

from dcp_compile.runtime.kernels.eager import call_kernels_directly, specialize_for_eager
from dcp_compile.runtime.errors import DCPInputError, DCPWorldError
from dcp_compile.runtime.names import RANK_INPUT, STATE_SNAPSHOT_SLOT
from dcp_compile.runtime.distributed.roles import bound_collectives
from dcp_compile.runtime.serving.state_cache import state_rows
from dcp_compile.runtime.serving.step_contract import StepContract


def copy_graph(graph: Graph) -> Graph:
    """A structurally independent copy (node args may then be edited per rank)."""
    g = Graph()
    g.output(g.graph_copy(graph, {}))
    return g


def copy_graph_module(gm: GraphModule) -> GraphModule:
    return GraphModule(gm, copy_graph(gm.graph))


def _inductor(gm: GraphModule):
    # Static shapes (one graph per step kind and bucket); the functional collectives stay in
    # the graph, so Inductor sees and may reorder them.
    return torch.compile(gm, backend="inductor", dynamic=False, fullgraph=True)


# Bound eager graphs, by source graph -> (its code, the rank's group names): ranks of a world
# that share group names, and a rank of the next threaded world, share one bound graph (it is
# a pure function of its inputs; binding costs ~20 ms a graph and rank at tp8). The source's
# code is in the key, so a graph edited and recompiled after a load is bound again.
_BOUND_EAGER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BINDING = threading.Lock()     # the ranks of a threaded world load at once: bind once


# How a loaded rank runs its (eager-specialized, bound) graphs: compile mode -> wrapper.
COMPILERS = {"eager": lambda gm: gm, "inductor": _inductor}


class RankProgram:
    """Callable per step kind: ``step_fn(kind)(input_ids, positions, block_table, caches)``.

    ``group_names`` maps each role the program uses to this rank's process-group name (as
    returned by ``dcp_compile.runtime.distributed.world.bind_roles``).

    Every step checks its inputs against the step contract (``dcp_compile.runtime.serving.step_contract``)
    before the graph runs, so a bad input raises ``DCPInputError`` with no cache written and
    no collective entered. What the caller still owns: each row's first position is its
    sequence's length, and the caches hold that sequence's KV below it (the Engine checks
    the first part; a gap would attend to whatever the sequence's blocks held before).

    The graphs run eagerly, so loading swaps in the eager kernels (``dcp_compile.runtime.kernels.eager``): each
    step writes the caches it is given in place (and returns those same tensors) and its
    attention reads only the live block-table span. ``eager_kernels[kind]`` counts the swaps.
    ``compile="inductor"`` then compiles each graph with Inductor (``COMPILERS``; compiled on
    its first run, once per step kind and bucket).
    """

    def __init__(self, program, rank: int, group_names: dict[str, str], *,
                 max_model_len: int | None = None, compile: str = "eager",
                 checkpoint=None):
        if compile not in COMPILERS:
            raise DCPInputError(f"unknown compile mode for a loaded program: {compile!r}. "
                                f"Use one of {sorted(COMPILERS)}.")
        self.compile = compile
        self.program = program
        self.rank = rank
        state = program.state_dict_for(rank) if checkpoint is None else \
            program.state_dict_for(rank, checkpoint=checkpoint)
        self._prefix = [state[n] for n in program.weight_inputs] + [state[RANK_INPUT]]
        device = self._prefix[0].device
        # One (graphs, contracts) per context bucket, by block-table width: a step runs the
        # graph of its table's width (the Engine picks the bucket; runtime/program/buckets.py).
        self._by_width = {}
        for bucket in program.buckets:
            view = program.for_bucket(bucket)
            contracts = {kind: StepContract.for_program(view, kind, device=device,
                                                        max_model_len=max_model_len)
                         for kind in view.graphs}
            graphs, kernels = self._bind(view, group_names)
            self._by_width[view.shapes.max_blocks] = (graphs, contracts)
        # The full-capacity bucket's, as before buckets.
        self.graphs, self.contracts, self.eager_kernels = graphs, contracts, kernels
        # A hybrid's width-K decode step also takes state_snapshot_slot [B, K] (last input)
        self.snapshot_steps = {kind for kind, gm in program.graphs.items()
                               if any(n.op == "placeholder" and n.name == STATE_SNAPSHOT_SLOT
                                      for n in gm.graph.nodes)}

    def _bind(self, program, group_names):
        graphs, eager_kernels = {}, {}
        names = tuple(sorted(group_names.items()))
        for kind, gm in program.graphs.items():
            key = (gm.code, names)
            with _BINDING:
                shared = _BOUND_EAGER.setdefault(gm, {}) if self.compile == "eager" else {}
                if key not in shared:
                    shared[key] = self._bind_graph(kind, gm, group_names)
                graphs[kind], kernels = shared[key]
            eager_kernels[kind] = dict(kernels)
        return graphs, eager_kernels

    def _bind_graph(self, kind: str, gm: GraphModule, group_names):
        graph = copy_graph(gm.graph)
        kernels = specialize_for_eager(graph)
        if self.compile == "eager":   # Inductor compiles the ops themselves
            call_kernels_directly(graph)
        for c in bound_collectives(
                graph, group_names, error=DCPWorldError, fix="Bind every role of the topology",
                binder=f"rank {self.rank}'s process groups",
                where=lambda n: f"at node {n.name} (step {kind!r})"):
            c.node.update_arg(c.kind.group_arg, c.binding)
        # Built after every edit: one code generation per graph (copying, specializing and
        # binding a GraphModule each generated its code again).
        return COMPILERS[self.compile](GraphModule(gm, graph)), kernels

    def run(self, kind: str, input_ids, positions, block_table, caches, *,
            state_slot=None, states=None, snapshot_slot=None):
        """One step; a hybrid program's also takes each row's ``state_slot`` and the state
        caches (``program.state_spec()``'s order) and returns ``(logits, caches, states)``.
        Its width-K decode step also takes ``snapshot_slot`` ``[B, K]`` (where the state
        after each token is kept, -1: none; default all -1)."""
        if states is None and self.program.state_spec() is not None:
            raise DCPInputError(
                "this program is a hybrid model's: its steps take each row's state slot and "
                "the recurrent-state caches. Pass state_slot= and states= "
                "(program.state_spec().allocate_inputs()); rank_engine does.")
        if states is not None and self.program.state_spec() is None:
            raise DCPInputError(
                "this program has no recurrent-state caches (no recurrent layer): call it "
                "without state_slot= and states=.")
        if kind not in self.graphs:
            raise DCPInputError(f"this program has no {kind!r} step: it has "
                                f"{sorted(self.graphs)}. Run one of those.")
        caches = list(caches)
        width = block_table.shape[-1] if getattr(block_table, "dim", lambda: 0)() == 2 \
            else None
        # An unknown width runs the full bucket, whose contract names the expected shape.
        graphs, contracts = self._by_width.get(width, (self.graphs, self.contracts))
        if states is None:
            contracts[kind].check(input_ids, positions, block_table, caches)
            out = graphs[kind](*self._prefix, input_ids, positions, block_table, *caches)
            return out[0], list(out[1:])
        fresh, lengths = state_rows(positions)
        snap = ()
        if kind in self.snapshot_steps:
            snap = (torch.full_like(positions, -1) if snapshot_slot is None
                    else snapshot_slot,)
        elif snapshot_slot is not None:
            raise DCPInputError(
                f"this program's {kind!r} step keeps no state snapshots (only a width-K "
                f"decode step of a hybrid program does). Call it without snapshot_slot=.")
        contracts[kind].check(input_ids, positions, block_table, caches,
                              state_slot=state_slot, fresh=fresh,
                              snapshot_slot=snap[0] if snap else None)
        out = graphs[kind](*self._prefix, input_ids, positions, block_table, *caches,
                           state_slot, fresh, lengths, *states, *snap)
        n = len(caches)
        return out[0], list(out[1:1 + n]), list(out[1 + n:])

    def step_fn(self, kind: str):
        def fn(input_ids, positions, block_table, caches, **state):
            return self.run(kind, input_ids, positions, block_table, caches, **state)
        return fn

    def step_fns(self) -> dict:
        return {kind: self.step_fn(kind) for kind in self.graphs}

