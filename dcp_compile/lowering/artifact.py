"""The lowered artifact: modules, their files and report, and reading them back.

LoweredModule (one step kind: text, portable artifact, collectives joined with the FX sites
they came from) and LoweringResult (every step, the report table, lowering.json); step 8,
serialize: text -> StableHLO portable artifact (VHLO bytecode). VHLO keeps a collective's
channel id but not its channel type (it reads back as 0); XLA uses only the id for
collectives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcp_compile.runtime.errors import DCPLoweringError
from dcp_compile.runtime.distributed.roles import COLLECTIVES

from .prepare import CollectiveSite
from .stablehlo import _walk, new_context

# The StableHLO collectives a lowered module can hold (dcp_compile.runtime.distributed.roles.COLLECTIVES).
COLLECTIVE_OPS = tuple(kind.stablehlo for kind in COLLECTIVES.values())
_DIM_ATTRS = tuple(kind.stablehlo_dim_attr for kind in COLLECTIVES.values()
                   if kind.stablehlo_dim_attr)


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
    # Step kind and context bucket (tokens) of a bucketed program's module ("decode_64").
    kind: str | None = None
    bucket: int | None = None

    def parse(self, context=None):
        """The module parsed back (in a fresh context unless one is given)."""
        from torch_mlir import ir
        ctx = context or new_context(stablehlo_only=True)
        with ctx:
            return ir.Module.parse(self.text)

    def op_counts(self) -> dict[str, int]:
        return op_counts(self.text)

    def to_json(self) -> dict:
        return {"step": self.step, "kind": self.kind or self.step, "bucket": self.bucket,
                "target_version": self.target_version,
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


# -- 8. serialize ----------------------------------------------------------------------------


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


# -- Reading modules back: collectives, op counts --------------------------------------------


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
        for key in _DIM_ATTRS:
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
