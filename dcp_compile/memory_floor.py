"""A compiled step against its memory floor: XLA's own bytes accessed next to the ideal.

A decode step is memory bound: at the least it reads this rank's weights once, this rank's
KV of the context bucket once, and moves the step's own activations (inputs, logits, the new
token's KV). ``ideal_bytes`` is that floor, per rank; ``bytes_accessed`` is what XLA's cost
analysis of the compiled module counts (``LoadedExecutable.cost_analysis()``, the same
HloCostAnalysis XLA schedules by). The ratio says how much a lowering wastes on top of the
floor — whole-cache copies, metadata recomputed per layer, masks materialised at full size.
``bytes_by_op`` attributes the counted bytes to the module's top-level HLO instructions
(XLA's cost analysis of each instruction alone) to find them.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import torch

from dcp_compile.runtime.names import RANK_INPUT

# Ops whose operands HloCostAnalysis does not count as read (names, views, tuples).
_FREE_OPS = ("parameter", "constant", "bitcast", "get-tuple-element", "tuple")


@dataclass(frozen=True)
class IdealBytes:
    """The floor of one step on one rank, in bytes."""

    weights: int          # this rank's weight shards, read once
    kv: int               # this rank's KV of the bucket, read once
    activations: int      # step inputs, logits, the KV the step writes

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations

    def to_json(self) -> dict:
        return {**asdict(self), "total": self.total}


def ideal_bytes(program, kind: str, bucket: int, rank: int = 0) -> IdealBytes:
    """The memory floor of step ``kind`` of ``program``'s context bucket ``bucket``."""
    from dcp_compile.runtime.serving.step_contract import StepContract
    state = program.state_dict_for(rank)
    weights = sum(_nbytes(t) for name, t in state.items() if name != RANK_INPUT)
    view = program.for_bucket(bucket)
    contract = StepContract.for_program(view, kind)
    spec = program.cache_spec()
    token_kv = spec.bytes_per_token()   # one rank's
    batch, tokens = contract.batch, contract.tokens
    kv = batch * (bucket // program.config.dcp) * token_kv
    logits_elem = torch.empty((), dtype=program.facts.cache_dtype or torch.float32).element_size()
    inputs = 8 * batch * (2 * tokens + contract.max_blocks)     # ids, positions, block table
    activations = inputs + batch * tokens * (contract.vocab_size * logits_elem + token_kv)
    return IdealBytes(weights=weights, kv=kv, activations=activations)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def xla_cost(executable) -> dict[str, float]:
    """``bytes_accessed`` and ``flops`` of a compiled executable (XLA's cost analysis)."""
    analysis = executable.cost_analysis()
    if isinstance(analysis, list):      # older jaxlib: one dict per partition
        analysis = analysis[0]
    return {"bytes_accessed": float(analysis.get("bytes accessed", math.nan)),
            "flops": float(analysis.get("flops", math.nan))}


_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\((.*?)\)(, .*)?$")


def bytes_by_op(executable) -> list[tuple[int, str, str]]:
    """(bytes, instruction, opcode) of each top-level instruction of the entry computation of
    a compiled executable, largest first: XLA's own cost analysis of that one instruction
    (its fusion or op alone in a module, on parameters of its operands' shapes). The rows
    sum to ``xla_cost(executable)["bytes_accessed"]`` (HloCostAnalysis is a sum over the
    entry's instructions)."""
    from jax._src.lib import xla_client
    from jaxlib import _hlo
    client = executable.client
    text = executable.hlo_modules()[0].to_string()
    head, entry = text.split("\nENTRY", 1)
    header, computations = head.split("\n", 1)
    body = entry[entry.index("{\n") + 2:entry.rindex("\n}")]
    types: dict[str, str] = {}
    rows = []
    for line in body.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, type_text, opcode, operands, attributes = m.groups()
        types[name] = type_text
        if opcode in _FREE_OPS:
            continue
        params = []
        for i, operand in enumerate(dict.fromkeys(re.findall(r"%([\w.\-]+)", operands))):
            params.append(f"  %p{i} = {types[operand]} parameter({i})")
            operands = re.sub(rf"%{re.escape(operand)}(?![\w.\-])", f"%p{i}", operands)
        attributes = re.sub(r", metadata=\{[^}]*\}", "", attributes or "")
        module = _hlo.hlo_module_from_text(
            f"{header.split(',')[0]}\n{computations}\nENTRY %one {{\n" + "\n".join(params) +
            f"\n  ROOT %{name} = {type_text} {opcode}({operands}){attributes}\n}}\n")
        cost = xla_client._xla.hlo_module_cost_analysis(client, module)
        rows.append((int(cost.get("bytes accessed", 0)), name, opcode))
    return sorted(rows, reverse=True)


def bucket_table(executor, program) -> dict[int, dict[str, dict]]:
    """``{bucket: {step kind: {bytes_accessed, ideal_bytes, ratio, flops, seconds}}}`` of an
    XLAExecutor's compiled modules; ``seconds`` is the median time of the steps that ran in
    that bucket (None if none did)."""
    import statistics
    from dcp_compile.runtime.program.buckets import bucket_of_width
    c = program.config
    table: dict[int, dict[str, dict]] = {}
    for (kind, width), executable in sorted(executor.executables.items(),
                                            key=lambda kv: (kv[0][1], kv[0][0])):
        bucket = bucket_of_width(width, block_size=c.block_size, dcp=c.dcp)
        cost = xla_cost(executable)
        ideal = ideal_bytes(program, kind, bucket)
        times = executor.step_seconds.get((kind, width), [])
        # a plain str key (not the StepKind enum): the table is JSON and crosses processes
        table.setdefault(bucket, {})[str(getattr(kind, "value", kind))] = {
            "bytes_accessed": int(cost["bytes_accessed"]), "ideal_bytes": ideal.total,
            "ratio": round(cost["bytes_accessed"] / ideal.total, 3),
            "ideal": ideal.to_json(), "flops": int(cost["flops"]),
            "seconds": statistics.median(times) if times else None}
    return table


def format_bucket_table(table: dict[int, dict[str, dict]]) -> str:
    """The table bench_xla prints: one row per (bucket, step kind)."""
    lines = [f"{'bucket':>7} {'step':<8} {'XLA bytes':>11} {'ideal':>11} {'ratio':>6} "
             f"{'weights':>10} {'KV':>9} {'act':>7} {'step ms':>8}"]
    for bucket, kinds in table.items():
        for kind, row in kinds.items():
            ideal = row["ideal"]
            ms = "-" if row["seconds"] is None else f"{1e3 * row['seconds']:.2f}"
            lines.append(f"{bucket:>7} {kind:<8} {row['bytes_accessed']:>11} "
                         f"{row['ideal_bytes']:>11} {row['ratio']:>6.2f} "
                         f"{ideal['weights']:>10} {ideal['kv']:>9} {ideal['activations']:>7} "
                         f"{ms:>8}")
    return "\n".join(lines)
