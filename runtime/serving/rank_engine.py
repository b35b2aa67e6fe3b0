"""One rank's serving loop built from a program, in one place: bind roles -> load -> allocate
caches -> executor -> Engine (check, verify, the workers and the benchmarks all build it so)."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from dcp_compile.runtime.garbage_block import LAST, garbage_block_id
from dcp_compile.runtime.program.dcp_program import DCPProgram
from dcp_compile.runtime.serving.engine import Engine, Executor, LocalExecutor, StepShapes
from dcp_compile.runtime.names import StepKind


class RecordingExecutor:
    """Pass-through executor that keeps each step's kind, full logits and positions (the
    engine keeps the last token's only)."""

    def __init__(self, inner: Executor):
        self.inner = inner
        self.kinds: list[str] = []
        self.logits: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []

    @property
    def caches(self):
        return self.inner.caches

    def step(self, kind, input_ids, positions, block_table, state_slot=None):
        logits = self.inner.step(kind, input_ids, positions, block_table,
                                 **({} if state_slot is None else {"state_slot": state_slot}))
        self.kinds.append(kind)
        self.logits.append(logits)
        self.positions.append(positions.clone())
        return logits


def poison_garbage(caches: list[torch.Tensor], garbage_block: int = LAST) -> None:
    """Re-poison the garbage block with NaN: a step that reads it unmasked shows NaN in its
    logits (a before_step hook)."""
    for c in caches:
        c[garbage_block_id(c.shape[0], garbage_block)] = float("nan")


def prompt_kind(program: DCPProgram) -> StepKind:
    """The step kind prompt chunks run as: a decode program's "context", else "prefill"."""
    return StepKind.CONTEXT if StepKind.CONTEXT in program.graphs else StepKind.PREFILL


def load_rank(program: DCPProgram, rank: int, group_names: dict[str, str] | None = None,
              *, compile: str = "eager", shared_names: bool = False, checkpoint=None):
    """``program`` loaded on ``rank`` (a RankProgram), its roles bound to this world's
    groups (default: ``world.bind_roles``, which creates them: every rank must call it);
    ``compile``: how each graph runs (``DCPProgram.load``); ``checkpoint``: a checkpoint
    directory the rank reads only its own weight shards from (``DCPProgram.state_dict_for``;
    a weightless program needs one).

    ``shared_names``: bind the groups under names every rank shares
    (``bind_roles(aliases=True)``), so the ranks of a threaded world load one bound graph per
    step kind instead of one each (binding generates and compiles its code). Only for a world
    that runs one program: binding aliases again replaces them, so a second program on the
    same world (a draft program) binds its own names."""
    from dcp_compile.runtime.distributed.world import bind_roles
    if group_names is None:
        group_names = bind_roles(program.topology, rank, aliases=shared_names)
    elif shared_names:
        raise ValueError("load_rank: pass group_names or shared_names=True, not both (the "
                         "shared names are bound here).")
    return program.load(rank, group_names, compile=compile, checkpoint=checkpoint)


def rank_engine(program: DCPProgram, rank: int, *, group_names: dict[str, str] | None = None,
                shared_names: bool = False, fill: float = 0.0, poison: bool = False,
                record: bool = False, shapes: StepShapes | None = None, prefix_caching: bool = False,
                wrap: Callable[[Executor], Executor] | None = None,
                checkpoint=None) -> Engine:
    """``rank``'s Engine over its loaded ``program``, in the current world.

    ``group_names``, ``shared_names``: as for :func:`load_rank`. ``fill`` initialises the
    caches (NaN shows a row the program never writes); ``poison`` re-poisons the garbage
    block before every step; ``record`` keeps every step's full logits (``engine.executor`` is then a
    :class:`RecordingExecutor`); ``prefix_caching`` shares full vblocks of identical
    prompt prefixes (runtime/serving/prefix_cache.py); ``wrap`` wraps the executor further;
    ``checkpoint``: as for :func:`load_rank`.
    """
    loaded = load_rank(program, rank, group_names, shared_names=shared_names,
                       checkpoint=checkpoint)
    garbage = program.config.garbage_block
    state = program.state_spec()      # a hybrid program's recurrent-state caches, or None
    executor: Executor = LocalExecutor(loaded.step_fns(),
                                       program.cache_spec().allocate(fill=fill),
                                       before_step=partial(poison_garbage, garbage_block=garbage)
                                       if poison else None,
                                       states=None if state is None else state.allocate_inputs())
    if record:
        executor = RecordingExecutor(executor)
    if wrap is not None:
        executor = wrap(executor)
    return Engine(executor, shapes or program.shapes, block_size=program.config.block_size,
                  dcp=program.config.dcp, prompt_kind=prompt_kind(program),
                  buckets=program.buckets if shapes is None else None,
                  prefix_caching=prefix_caching, garbage_block=garbage,
                  state_slots=None if state is None else state.num_slots)
