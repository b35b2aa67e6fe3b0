"""The frontend protocol: what a frontend gives the driver (:class:`Frontend`) and one
captured step (:class:`StepCapture`). Its own module so that the frontends import it without
importing the package that picks among them (no import cycle)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import nn
from torch.fx import GraphModule

from dcp_compile.passes.infra import CAPTURED, Property
from dcp_compile.runtime.program.facts import ModelFacts

if TYPE_CHECKING:
    from dcp_compile.passes.infra import DCPPass, TransformContext
    from dcp_compile.runtime.config import DCPConfig
    from dcp_compile.runtime.serving.engine import StepShapes


# What a captured paged step (the model takes positions, block table and caches) holds.
PAGED_STEP: frozenset[Property] = CAPTURED | {Property.PAGED_CACHE, Property.POSITIONS_LIFTED}


@dataclass
class StepCapture:
    """One captured step: its graph and how the program feeds it."""

    gm: GraphModule
    user_inputs: list[str]           # step input placeholders, in order
    weight_inputs: list[str]         # weight/buffer placeholders, in graph order
    seconds: float = 0.0             # how long the capture took (history, progress)
    # placeholder -> the full weight (asked once, of the first step's capture)
    constants: Callable[[], dict[str, torch.Tensor]] = field(default=dict, repr=False)
    # What the graph holds as captured (passes.infra.Property): the pipeline checks its
    # row's order from it. A paged step signature gives what the cache insertion ensures.
    provides: frozenset[Property] = CAPTURED
    # placeholder -> the model's parameter names (DCPProgram.weight_names), and FQN -> the
    # checkpoint tensors of a weight held in another form (DCPProgram.weight_sources)
    weight_names: Callable[[], dict[str, tuple[str, ...]]] = field(default=dict, repr=False)
    weight_sources: Callable[[], dict] = field(default=dict, repr=False)

    @property
    def first_user_input(self) -> str:
        """The placeholder the rank input goes before (insert_rank)."""
        return self.user_inputs[0]


class Frontend(Protocol):
    """Where a program's graphs come from (see the module doc)."""

    source: str                      # the dump's label: "transform", "torch.compile backend"
    dump_name: str                   # the dump folder's prefix (dump_root_for)
    shapes: "StepShapes"             # the static shapes the steps are captured at

    def steps(self, mode: str) -> tuple[str, ...]:
        """The step kinds a program of ``mode`` gets from this frontend, in capture order."""

    def at_shapes(self, shapes: "StepShapes") -> "Frontend":
        """This frontend for the same model at other static shapes (a context bucket's
        narrower block table): no model checks or wrapping again."""

    def capture(self, step: str, config: "DCPConfig") -> StepCapture:
        """Stage 0: ``step``'s ATen graph (``config``: the layout asked for; its block size
        shapes the caches)."""

    def prologue(self, ctx: "TransformContext", captured: StepCapture) -> list["DCPPass"]:
        """The optional passes of the table (``pipeline.OPTIONAL``) this graph needs."""

    def facts(self) -> ModelFacts:
        """What the frontend knows about the model before the passes run."""

    def reference(self) -> nn.Module | None:
        """The forward ``check=`` compares with (paged step signature); None: none."""

    def accept(self, config: "DCPConfig") -> None:
        """Refuse a validated config this frontend's inputs cannot run (raises)."""

    def state_cache(self, tp: int):
        """One rank's recurrent-state caches (runtime/serving/state_cache.StateCacheSpec) of
        a hybrid model's program, None for any other (docs/hybrid.md)."""



def forward_params(model: nn.Module) -> dict:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}
