"""The step a model compiled with ``torch.compile(backend="dcp")`` runs: this rank's program
of one step kind, inside an initialised torch.distributed world.

On its first call on a rank it binds the topology's process groups
(:func:`dcp_compile.runtime.distributed.world.bind_roles`, once per world) and cuts this rank's weight shards from
the weights Dynamo passes in; every call runs this rank's program. The program (a DCPProgram
of one graph) and the argument positions come from the compiler (``dcp_compile.backend``);
nothing here compiles.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

from dcp_compile.runtime.errors import DCPWorldError

from dcp_compile.runtime.serving.rank_engine import load_rank
from dcp_compile.runtime.distributed.world import bind_roles

__all__ = ["DCPCompiledStep"]

# (id of the default group, topology key) -> (default group, role -> group name): bind once
# per world. The group object is kept so that its id cannot be reused by a later world.
_bound: dict[tuple, tuple[Any, dict[str, str]]] = {}
_bound_lock = threading.Lock()


def _group_names(topo, rank: int) -> dict[str, str]:
    world = dist.group.WORLD
    key = (id(world), rank, topo.tp, topo.dcp, topo.mode,
           tuple((r, tuple(map(tuple, g))) for r, g in topo.groups.items()))
    with _bound_lock:
        hit = _bound.get(key)
    if hit is not None and hit[0] is world:
        return hit[1]
    names = bind_roles(topo, rank)  # collective: every rank reaches it on its first call
    with _bound_lock:
        _bound[key] = (world, names)
    return names


class DCPCompiledStep:
    """What backend "dcp" hands Dynamo for one graph: runs this rank's program of one step.

    ``program`` is the DCPProgram (one graph, ``step``), with history, certificate and
    weight shard specs. Weights are cut per rank on that rank's first call, from the
    weights Dynamo passes in; later weight updates are not seen (recompile instead).
    """

    def __init__(self, program, step: str, *, weight_args: list[int], user_args: list[int],
                 compile: str = "eager"):
        self.compile = compile     # rank_program.COMPILERS: "eager" | "inductor"
        self.program = program
        self.step = step
        self.weight_args = weight_args
        self.user_args = user_args
        self._loaded: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, *args):
        rank = self._rank()
        loaded = self._loaded.get((id(_world()), rank))
        if loaded is None:
            loaded = self._load(rank, args)
        ids, positions, table, *caches = (args[i] for i in self.user_args)
        logits, new_caches = loaded.run(self.step, ids, positions, table, caches)
        return (logits, *new_caches)

    def _rank(self) -> int:
        tp = self.program.config.tp
        if not (dist.is_available() and dist.is_initialized()):
            raise DCPWorldError(
                f"a model compiled with backend 'dcp' (tp={tp}) runs one rank of a "
                f"torch.distributed world, and none is initialised. Launch {tp} ranks with "
                f"torchrun and call dcp_compile.runtime.distributed.launch.init_distributed_from_env() first (or run "
                f"inside dcp_compile.runtime.distributed.world.run_threaded).")
        if dist.get_world_size() != tp:
            raise DCPWorldError(f"world size does not match the compiled program: "
                                f"world_size={dist.get_world_size()}, tp={tp}. Launch {tp} "
                                f"ranks, or compile with options={{'tp': "
                                f"{dist.get_world_size()}}}.")
        return dist.get_rank()

    def _load(self, rank: int, args):
        program = self.program
        with self._lock:
            if not program.constants:
                program.constants = {name: args[i] for name, i in
                                     zip(program.weight_inputs, self.weight_args)}
        loaded = load_rank(program, rank, _group_names(program.topology, rank),
                           compile=self.compile)
        with self._lock:
            self._loaded[(id(_world()), rank)] = loaded
        return loaded


def _world():
    return dist.group.WORLD
