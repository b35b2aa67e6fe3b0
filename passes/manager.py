"""The pass manager: fixed order, lint + shape re-propagation after each pass, history, dump."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dcp_compile.errors import DCPTransformError


@dataclass
class PassRecord:
    """One entry of a program's history."""

    name: str
    step: str
    modified: bool
    matched: dict[str, Any]
    inserted: dict[str, int]
    seconds: float
    code: str = field(default="", repr=False)

    def to_json(self) -> dict:
        return {"name": self.name, "step": self.step, "modified": self.modified,
                "matched": _jsonable(self.matched), "inserted": dict(self.inserted),
                "seconds": round(self.seconds, 6)}


def repropagate(gm: GraphModule) -> None:
    """Recompute every node's meta['val'] from the placeholders' fake values."""
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(inputs)
    if mode is None:
        raise DCPTransformError("graph inputs carry no fake tensors; capture with "
                                "torch.export so that every node has meta['val'].")
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)


def run_passes(gm: GraphModule, passes: list, *, step: str,
               on_pass: Callable[[PassRecord, GraphModule], None] | None = None
               ) -> tuple[GraphModule, list[PassRecord]]:
    """Run ``passes`` in order; after each: lint, recompile, re-propagate, record, dump."""
    history: list[PassRecord] = []
    if on_pass is not None:
        on_pass(PassRecord("capture", step, True, {}, {}, 0.0, gm.code), gm)
    for p in passes:
        name = getattr(p, "name", type(p).__name__)
        start = time.perf_counter()
        result = p(gm)
        if result is not None:
            gm = result.graph_module
        modified = bool(result.modified) if result is not None else True
        try:
            gm.graph.lint()
            if modified:  # an unmodified graph keeps its (accurate) meta['val']
                gm.recompile()
                repropagate(gm)
        except DCPTransformError:
            raise
        except Exception as e:  # a pass left an ill-formed graph: say which one
            raise DCPTransformError(f"pass {name} left an invalid graph for step {step!r}: "
                                    f"{type(e).__name__}: {e}") from e
        record = PassRecord(name, step, modified, dict(getattr(p, "matched", {})),
                            dict(getattr(p, "inserted", {})),
                            time.perf_counter() - start, gm.code)
        history.append(record)
        if on_pass is not None:
            on_pass(record, gm)
    return gm, history


def write_code_dump(dump_dir: str | Path, index: int, record: PassRecord) -> Path:
    """The graph after a pass as readable Python, one file per (step, pass)."""
    path = Path(dump_dir) / record.step / f"{index:02d}_{record.name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# step={record.step} pass={record.name} "
                    f"inserted={dict(record.inserted)}\n" + record.code)
    return path


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
