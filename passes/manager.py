"""The pass runner: passes in a fixed order; after each, lint, shape propagation (the
service in :mod:`.propagation`), history, dump."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.fx import GraphModule

from dcp_compile.runtime.errors import DCPCompilerBug, DCPError, DCPTransformError

from . import propagation
from .diagnose import explain


@dataclass
class PassRecord:
    """One entry of a program's history."""

    name: str
    step: str
    modified: bool
    matched: dict[str, Any]
    inserted: dict[str, int]
    seconds: float
    code: str = field(default="", repr=False)  # the graph's Python; kept when dumping
    propagated: int = 0  # nodes whose meta['val'] was recomputed after the pass

    def to_json(self) -> dict:
        return {"name": self.name, "step": self.step, "modified": self.modified,
                "matched": _jsonable(self.matched), "inserted": dict(self.inserted),
                "seconds": round(self.seconds, 6), "propagated": self.propagated}


def name_the_features(error: DCPTransformError, gm: GraphModule) -> DCPTransformError:
    """A pass's refusal, with the model features behind it named (passes.diagnose): "no
    attention recognised" in a Bloom graph is ALiBi, in a Mamba graph an SSM."""
    extra = explain(gm)
    if extra and error.args and isinstance(error.args[0], str) and extra not in error.args[0]:
        error.args = (f"{error.args[0]} {extra}",) + error.args[1:]
    return error


def run_passes(gm: GraphModule, passes: list, *, step: str,
               on_pass: Callable[[PassRecord, GraphModule], None] | None = None,
               check_propagation: bool | None = None
               ) -> tuple[GraphModule, list[PassRecord]]:
    """Run ``passes`` in order; after each: lint, re-propagate, record, dump (recompile).

    Shapes are re-propagated only from the nodes a pass changed (see ``propagation.changed_nodes``).
    ``check_propagation`` (default: env DCP_COMPILE_FULL_PROPAGATION=1) then also
    re-propagates the whole graph and raises if any node's value differs.
    """
    if check_propagation is None:
        check_propagation = os.environ.get(propagation.FULL_PROPAGATION_ENV, "") \
            not in ("", "0")
    history: list[PassRecord] = []
    # Python code is regenerated per pass only for the dump/progress callback (which shows
    # it); otherwise once at the end: recompiling is a large share of a pass's time.
    stale_code = False
    if on_pass is not None:
        on_pass(PassRecord("capture", step, True, {}, {}, 0.0, gm.code), gm)
    for p in passes:
        name = getattr(p, "name", type(p).__name__)
        start = time.perf_counter()
        before = propagation.snapshot(gm)
        try:
            result = p(gm)
        except DCPTransformError as e:
            raise name_the_features(e, gm)
        except DCPError:
            raise
        except Exception as e:      # not a refusal: a bug of the pass, named
            raise DCPCompilerBug(f"pass {name} (step {step!r})", e) from e
        if result is not None:
            gm = result.graph_module
        modified = bool(result.modified) if result is not None else True
        propagated = 0
        try:
            gm.graph.lint()
            if modified:  # an unmodified graph keeps its (accurate) meta['val']
                if on_pass is not None:
                    gm.recompile()
                else:
                    stale_code = True
                propagated = propagation.propagate_changed(
                    gm, propagation.changed_nodes(gm, before), before)
        except DCPError:
            raise
        except Exception as e:  # a pass left an ill-formed graph: a bug of that pass
            raise DCPCompilerBug(f"pass {name} (step {step!r}), which left an invalid "
                                 f"graph", e) from e
        seconds = time.perf_counter() - start
        if check_propagation:
            bad = propagation.propagation_mismatches(gm)
            if bad:
                raise DCPTransformError(
                    f"incremental shape propagation after pass {name} (step {step!r}) "
                    f"differs from a full one on {len(bad)} nodes: {bad[:5]}. The pass "
                    f"changed a node without changing its op/target/args/kwargs or "
                    f"meta['val']; replace the node instead of mutating it.")
        record = PassRecord(name, step, modified, dict(getattr(p, "matched", {})),
                            dict(getattr(p, "inserted", {})), seconds,
                            gm.code if on_pass is not None else "", propagated=propagated)
        history.append(record)
        if on_pass is not None:
            on_pass(record, gm)
    if stale_code:
        gm.recompile()
    return gm, history


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    if isinstance(x, torch.Size):
        return list(x)
    return str(x)
