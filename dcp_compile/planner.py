"""The planner: every layout of a model on N ranks, priced from its compiled program.

``plan(model_or_config, ranks=N, context_len=L, batch=B, hardware=...)`` enumerates the
layouts the project's topology allows (tp = N, dcp dividing it, experts by TP or EP for a
mixture of experts, the decode combine, the interleave size), compiles each on the meta
device (no weights) and reads its sizes from the program itself:

- weight bytes: the shard shapes of ``program.shards`` over ``program.constants``;
- KV bytes read: ``program.cache_spec().bytes_per_token()`` times the tokens the busiest
  rank holds at context L (``runtime.layout.local_filled``, the formula the graph runs);
- collectives: every collective node of the decode graph, its bytes from
  ``node.meta["val"]`` and its group size from the program's topology;
- FLOPs: the decode graph's contractions, attention and expert nodes (:data:`FLOP_RULES`).

A hardware profile (dcp_compile.hardware) turns them into a predicted decode step time
(:func:`predict`); layouts are ranked by it. A layout that breaks a rule is listed with the
rule (the DCPConfigError or refusal the compiler raises), never dropped.

``mode="prefill"`` ranks prefill layouts (dcp, experts, interleave, and the chunk: prompt
tokens per sequence per step) by time to first token: a prompt of L tokens is
``ceil(L / chunk)`` prefill steps of the compiled chunk shape, each priced from the prefill
graph with the prior context it runs after (:func:`prefill_breakdown`), summed
(:func:`time_to_first_token`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum

import torch

from dcp_compile.hardware import HardwareProfile, profile as hardware_profile
from dcp_compile.passes.op_classes import CONTRACTIONS
from dcp_compile.runtime.config import COMBINES, DCPConfig
from dcp_compile.runtime.distributed.roles import COLLECTIVES, role_of
from dcp_compile.runtime.errors import DCPError, DCPInputError
from dcp_compile.runtime.layout import local_filled
from dcp_compile.runtime.names import Mode, StepKind


class Term(StrEnum):
    """The terms a decode step's predicted time is the sum (or max) of."""
    WEIGHTS = "weights"          # reading this rank's weight shards
    KV = "kv"                    # reading this rank's KV of the context
    FLOPS = "flops"              # arithmetic at peak
    COLLECTIVES = "collectives"  # latency + wire bytes over the link
    OPS = "ops"                  # eager dispatch per graph op (this machine only)


@dataclass(frozen=True)
class Layout:
    tp: int
    dcp: int
    expert_parallel: bool = False
    combine: str = "all_gather"
    interleave_size: int = 16
    block_size: int = 16
    chunk: int = 0               # prefill: prompt tokens per sequence per step; 0: decode

    def label(self) -> str:
        parts = [f"tp{self.tp}", f"dcp{self.dcp}"]
        if self.expert_parallel:
            parts.append("ep")
        if self.dcp > 1:
            # prefill has one combine (the LSE all-gather of the spec's step 7)
            parts += ([] if self.chunk else [self.combine.replace("_", "-")]) + \
                [f"i{self.interleave_size}"]
        if self.chunk:
            parts.append(f"chunk{self.chunk}")
        return " ".join(parts)


@dataclass(frozen=True)
class Breakdown:
    """One rank's decode step at context L, read from the program."""
    weight_bytes: int
    kv_bytes: int
    kv_tokens: int                  # tokens of each sequence the busiest rank holds
    kv_bytes_per_token: int         # one rank's, every layer
    collective_bytes: int           # on the wire per rank per step (ring algorithms)
    collective_count: int           # collectives per step on groups of > 1 rank
    collectives: dict               # '<op>@<role>' -> count per step
    flops: int
    graph_ops: int                  # call_function nodes of the decode graph
    expert_bytes: int = 0           # of weight_bytes: the routed experts' (dcp.moe inputs)
    weight_bytes_read: int = 0      # what a step reads: experts no token routes to skipped


@dataclass(frozen=True)
class Prediction:
    seconds: dict                   # Term -> seconds
    step_seconds: float             # prefill: the whole prompt (time to first token)
    dominant: str                   # the Term with the most seconds
    unpriced: tuple = ()            # terms a profile has no number for (left out)
    steps: int = 1                  # steps priced: prefill's chunks of the prompt


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    bucket: int                     # the context bucket a decode at L runs in
    breakdown: Breakdown            # prefill: the last chunk's step (the most prior context)
    prediction: Prediction
    kv_capacity: int | None         # sequences of length L that fit after the weights
    tokens_per_s_per_chip: float    # prefill: prompt tokens

    def to_json(self) -> dict:
        return {"layout": asdict(self.layout), "label": self.layout.label(),
                "bucket": self.bucket, "breakdown": asdict(self.breakdown),
                "prediction": asdict(self.prediction), "kv_capacity": self.kv_capacity,
                "tokens_per_s_per_chip": self.tokens_per_s_per_chip}


@dataclass(frozen=True)
class Refused:
    layout: Layout
    rule: str

    def to_json(self) -> dict:
        return {"layout": asdict(self.layout), "label": self.layout.label(), "rule": self.rule}


@dataclass
class Plan:
    model: str
    ranks: int
    context_len: int
    batch: int
    hardware: HardwareProfile
    ranked: list = field(default_factory=list)     # Candidates, fastest first
    refused: list = field(default_factory=list)    # Refused
    mode: str = Mode.DECODE

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    def to_json(self) -> dict:
        return {"model": self.model, "mode": str(self.mode), "ranks": self.ranks,
                "context_len": self.context_len,
                "batch": self.batch, "hardware": self.hardware.to_json(),
                "ranked": [c.to_json() for c in self.ranked],
                "refused": [r.to_json() for r in self.refused]}

    def format_table(self) -> str:
        prefill = self.mode == Mode.PREFILL
        lines = [f"{self.model}: {self.mode} on {self.ranks} ranks, "
                 f"{'prompt' if prefill else 'context'} {self.context_len}, batch "
                 f"{self.batch}, on {self.hardware.name}",
                 f"{'layout':<28} {'TTFT us' if prefill else 'step us':>10} "
                 f"{'tok/s/chip':>11} {'capacity':>9} "
                 f"{'weights MB':>11} {'KV MB':>8} {'coll KB':>8} {'#coll':>6} "
                 f"{'GFLOP':>7}  dominant"]
        for c in self.ranked:
            b, p = c.breakdown, c.prediction
            cap = "?" if c.kv_capacity is None else str(c.kv_capacity)
            lines.append(f"{c.layout.label():<28} {p.step_seconds * 1e6:10.1f} "
                         f"{c.tokens_per_s_per_chip:11.1f} {cap:>9} "
                         f"{b.weight_bytes / 1e6:11.2f} {b.kv_bytes / 1e6:8.2f} "
                         f"{b.collective_bytes / 1e3:8.1f} {b.collective_count:6d} "
                         f"{b.flops / 1e9:7.3f}  {p.dominant}")
        unpriced = sorted({t for c in self.ranked for t in c.prediction.unpriced})
        if unpriced:
            lines.append(f"not priced (the profile has no number): {', '.join(unpriced)}")
        for r in self.refused:
            lines.append(f"refused {r.layout.label()}: {r.rule}")
        return "\n".join(lines)


# -- what the program says ----------------------------------------------------------------

def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def weight_bytes(program, rank: int = 0) -> int:
    """Bytes of ``rank``'s weight shards: the program's shard specs over its (possibly
    meta) constants; equals the sizes of ``state_dict_for(rank)`` without the rank input."""
    total = 0
    for name in program.weight_inputs:
        full = program.constants[name]
        spec = program.shards.get(name)
        shape = spec.shape(full.shape) if spec is not None else tuple(full.shape)
        total += _nbytes(shape, full.dtype)
    return total


def _val(node):
    return node.meta.get("val") if hasattr(node, "meta") else None


# Wire bytes one rank sends for a collective of n ranks (ring algorithms), from its input
# and output bytes: a row per CollectiveKind name (runtime/distributed/roles.py).
WIRE_BYTES = {
    "all_gather": lambda inp, out, n: out * (n - 1) / n,
    "reduce_scatter": lambda inp, out, n: inp * (n - 1) / n,
    "all_reduce": lambda inp, out, n: 2 * inp * (n - 1) / n,
    "all_to_all": lambda inp, out, n: inp * (n - 1) / n,
}


def main_step(program) -> str:
    """The step a program is ranked by: its prefill chunk, or its decode step."""
    return StepKind.PREFILL if program.config.mode == Mode.PREFILL else StepKind.DECODE


def collective_sizes(program, step: str = StepKind.DECODE):
    """``[(key, wire bytes per rank, group size)]`` of every collective of ``step``'s graph on
    a group of more than one rank (a size-1 group is a local copy)."""
    rows = []
    for n in program.graphs[step].graph.nodes:
        if n.op != "call_function" or n.target not in COLLECTIVES:
            continue
        role = role_of(n)
        size = len(program.topology.groups[role][0])
        if size <= 1:
            continue
        kind = COLLECTIVES[n.target]
        inp, out = _val(n.args[0]), _val(n)
        wire = WIRE_BYTES[kind.name](_nbytes(inp.shape, inp.dtype),
                                     _nbytes(out.shape, out.dtype), size)
        rows.append((f"{n.target._opname}@{role}", wire, size))
    return rows


def _contraction_flops(node, ctx) -> int:
    a, out = _val(node.args[0]), _val(node)
    return 2 * out.numel() * a.shape[-1]


def _attention_flops(node, ctx) -> int:
    # q [B, S, Hq, Dq] against kv_tokens keys and values [.., Dv]: QK^T and PV.
    q, values = _val(node.args[0]), _val(node.args[6])
    b, s, hq, dq = q.shape
    return 2 * b * s * hq * ctx["kv_tokens"] * (dq + values.shape[-1])


def _moe_flops(node, ctx) -> int:
    # Each token runs top_k experts; a rank holds 1/tp of each (TP) or of the experts (EP).
    x, ids, gate_up, down = (_val(node.args[i]) for i in (0, 1, 3, 4))
    per_expert = (gate_up[0].numel() + down[0].numel())
    share = 1 / ctx["tp"] if ctx["expert_parallel"] else 1
    return int(2 * x.shape[0] * ids.shape[-1] * per_expert * share)


def _flop_rules():
    rules = {op: _contraction_flops for op in CONTRACTIONS}
    rules[torch.ops.dcp.partial_attention.default] = _attention_flops
    rules[torch.ops.dcp.moe.default] = _moe_flops
    return rules


def graph_flops(program, kv_tokens: int, step: str = StepKind.DECODE) -> int:
    """FLOPs of one rank's ``step`` (:func:`_flop_rules`; other ops are counted as free)."""
    rules = _flop_rules()
    c = program.config
    ctx = {"kv_tokens": kv_tokens, "tp": c.tp, "expert_parallel": c.expert_parallel}
    return int(sum(rules[n.target](n, ctx) for n in program.graphs[step].graph.nodes
                   if n.op == "call_function" and n.target in rules))


def expert_weights_read(program, step: str | None = None) -> tuple[int, int]:
    """(bytes of this rank's routed-expert weights, the bytes a decode step is expected to
    read of them): each ``dcp.moe`` node's expert tensors, times the chance an expert is
    routed to by at least one of the step's T tokens, ``1 - (1 - k / E) ** T`` with
    uniform routing (k experts per token of E)."""
    c = program.config
    total = read = 0
    for n in program.graphs[step or main_step(program)].graph.nodes:
        if n.op != "call_function" or n.target != torch.ops.dcp.moe.default:
            continue
        x, ids, gate_up, down = (_val(n.args[i]) for i in (0, 1, 3, 4))
        local = _nbytes(gate_up.shape, gate_up.dtype) + _nbytes(down.shape, down.dtype)
        experts = gate_up.shape[0] * (c.tp if c.expert_parallel else 1)
        touched = 1 - (1 - ids.shape[-1] / experts) ** x.shape[0]
        total += local
        read += int(local * touched)
    return total, read


def has_experts(program) -> bool:
    return any(n.op == "call_function" and n.target == torch.ops.dcp.moe.default
               for n in program.graphs[main_step(program)].graph.nodes)


def busiest_rank_tokens(context_len: int, config: DCPConfig) -> int:
    """Tokens of a sequence of ``context_len`` the busiest DCP rank holds (spec:
    local_filled), so what that rank's attention reads."""
    return max(local_filled(context_len, r, **config.layout_kwargs())
               for r in range(config.dcp))


def bucket_for(context_len: int, config: DCPConfig) -> int:
    """The context bucket a decode step at ``context_len`` (writing one token more) runs in:
    the smallest multiple of the vblock that holds ``context_len + 1`` tokens."""
    return -(-(context_len + 1) // config.vblock) * config.vblock


def breakdown(program, context_len: int, config: DCPConfig | None = None) -> Breakdown:
    """One rank's decode step at ``context_len`` of ``program`` (``config``: the layout to
    read the KV tokens with, default the program's; an interleave variant shares the graph)."""
    config = config or program.config
    return _step_breakdown(program, StepKind.DECODE, busiest_rank_tokens(context_len, config))


def prefill_breakdown(program, prior: int, config: DCPConfig | None = None) -> Breakdown:
    """One rank's prefill step of a prefill-mode ``program``: a chunk of
    ``program.shapes.context_len`` tokens per sequence after ``prior`` tokens of context.
    The busiest rank's attention reads its share of the prior and of the chunk (the chunk's
    queries are gathered over the DCP group; its keys stay where they are written), and its
    KV traffic is that share (the prior read, the chunk's own written)."""
    config = config or program.config
    held = busiest_rank_tokens(prior + program.shapes.context_len, config)
    return _step_breakdown(program, StepKind.PREFILL, held)


def _step_breakdown(program, step: str, tokens: int) -> Breakdown:
    """One rank's ``step`` whose attention reads ``tokens`` tokens of each sequence."""
    per_token = program.cache_spec().bytes_per_token()
    rows = collective_sizes(program, step)
    counts: dict[str, int] = {}
    for key, _, _ in rows:
        counts[key] = counts.get(key, 0) + 1
    weights = weight_bytes(program)
    experts, experts_read = expert_weights_read(program, step)
    return Breakdown(
        weight_bytes=weights, expert_bytes=experts,
        weight_bytes_read=weights - experts + experts_read,
        kv_bytes=program.shapes.batch * tokens * per_token, kv_tokens=tokens,
        kv_bytes_per_token=per_token,
        collective_bytes=int(sum(w for _, w, _ in rows)), collective_count=len(rows),
        collectives=dict(sorted(counts.items())),
        flops=graph_flops(program, tokens, step),
        graph_ops=sum(1 for n in program.graphs[step].graph.nodes
                      if n.op == "call_function"))


# -- pricing --------------------------------------------------------------------------------

def predict(b: Breakdown, hw: HardwareProfile, ranks: int) -> Prediction:
    """Predicted decode step seconds of breakdown ``b`` on ``hw``: memory and arithmetic
    overlap (the larger counts), collectives and eager dispatch add. On a shared host (the
    threaded world) the ranks take turns on its cores."""
    # A shared host runs min(ranks, cores) ranks' kernels at once; their op dispatch, under
    # the GIL, one at a time.
    share = math.ceil(ranks / min(ranks, hw.cores or ranks)) if hw.shared_host else 1
    dispatch = ranks if hw.shared_host else 1
    unpriced = []
    seconds = {}

    def rate(term, amount, per_second):
        if per_second is None:
            unpriced.append(term)
            seconds[term] = 0.0
        else:
            seconds[term] = share * amount / per_second

    rate(Term.WEIGHTS, b.weight_bytes_read, hw.memory_bandwidth)
    rate(Term.KV, b.kv_bytes, hw.kv_bandwidth or hw.memory_bandwidth)
    rate(Term.FLOPS, b.flops, hw.peak_flops)
    coll = 0.0
    if hw.link_bandwidth is None:
        unpriced.append("collective bandwidth")
    else:
        coll += b.collective_bytes / hw.link_bandwidth
    if hw.link_latency is None:
        if b.collective_count:
            unpriced.append("collective latency")
    else:
        coll += b.collective_count * hw.link_latency
    seconds[Term.COLLECTIVES] = coll
    seconds[Term.OPS] = dispatch * b.graph_ops * hw.op_overhead
    step = (max(seconds[Term.WEIGHTS] + seconds[Term.KV], seconds[Term.FLOPS])
            + seconds[Term.COLLECTIVES] + seconds[Term.OPS])
    dominant = max(seconds, key=seconds.get)
    return Prediction(seconds={str(k): v for k, v in seconds.items()}, step_seconds=step,
                      dominant=str(dominant), unpriced=tuple(dict.fromkeys(map(str, unpriced))))


def time_to_first_token(program, context_len: int, hw: HardwareProfile, ranks: int,
                        config: DCPConfig | None = None) -> tuple[Breakdown, Prediction]:
    """(the last chunk's breakdown, the prompt's prediction): a prompt of ``context_len``
    tokens runs ``ceil(context_len / chunk)`` steps of the program's static chunk shape (the
    last one padded), step i after ``i * chunk`` tokens of prior context; each is priced by
    :func:`predict` and the terms are summed."""
    chunk = program.shapes.context_len
    steps = -(-context_len // chunk)
    parts = [predict(b, hw, ranks) for b in
             (prefill_breakdown(program, i * chunk, config) for i in range(steps))]
    seconds = {t: sum(p.seconds[t] for p in parts) for t in parts[0].seconds}
    return prefill_breakdown(program, (steps - 1) * chunk, config), Prediction(
        seconds=seconds, step_seconds=sum(p.step_seconds for p in parts),
        dominant=max(seconds, key=seconds.get), steps=steps,
        unpriced=tuple(dict.fromkeys(u for p in parts for u in p.unpriced)))


def kv_capacity(b: Breakdown, hw: HardwareProfile, ranks: int, batch: int) -> int | None:
    """Sequences of the context length whose KV fits in memory after the weights (a shared
    host holds every rank's)."""
    if hw.memory_bytes is None:
        return None
    share = ranks if hw.shared_host else 1
    free = hw.memory_bytes - share * b.weight_bytes
    per_sequence = share * b.kv_bytes / batch
    if free <= 0:
        return 0
    return int(free // per_sequence) if per_sequence else None


# -- enumeration -----------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _model_of(model_or_config):
    """(model, label): an nn.Module as is; a config, config path or checkpoint directory as
    its transformers causal LM on the meta device (dcp_compile.meta_init.meta_model)."""
    if isinstance(model_or_config, torch.nn.Module):
        return model_or_config, type(model_or_config).__name__
    from dcp_compile.meta_init import meta_model
    model = meta_model(model_or_config)
    return model, f"{type(model).__name__} (meta)"


# Prefill chunks tried by default (prompt tokens per sequence per step), capped at the prompt.
DEFAULT_CHUNKS = (512, 2048, 8192)


def plan(model_or_config, *, ranks: int, context_len: int, batch: int = 1,
         mode: str = Mode.DECODE, hardware="this-machine", block_size: int = 16,
         interleave_sizes=None, dcps=None, combines=None, chunks=None) -> Plan:
    """Every layout of ``model_or_config`` on ``ranks`` ranks ranked by predicted decode step
    time at ``context_len`` with ``batch`` sequences on ``hardware`` (a name of
    dcp_compile.hardware.HARDWARE_NAMES or a HardwareProfile). ``interleave_sizes``: the
    interleave sizes to try (default 1 and ``block_size``); ``dcps``, ``combines``: only
    these DCP degrees and decode combines (default: every divisor of ``ranks``, every
    combine). ``mode="prefill"``: prefill layouts ranked by time to first token for a prompt
    of ``context_len`` tokens, each with a chunk of ``chunks`` (default
    :data:`DEFAULT_CHUNKS` capped at the prompt) and, by default, the interleave equal to
    the block size (a KV producer's rule)."""
    for name, value in (("ranks", ranks), ("context_len", context_len), ("batch", batch),
                        ("block_size", block_size)):
        _check_count(name, value)
    if mode not in (Mode.DECODE, Mode.PREFILL):
        raise DCPInputError(f"plan ranks decode or prefill layouts: mode={mode!r}. Use "
                            f"mode='decode' (step time) or mode='prefill' (time to first "
                            f"token).")
    prefill = mode == Mode.PREFILL
    if prefill and combines is not None:
        raise DCPInputError(f"combines={combines!r} is a decode knob: prefill has one combine "
                            f"(the LSE all-gather of the spec's step 7). Leave it out with "
                            f"mode='prefill'.")
    if not prefill and chunks is not None:
        raise DCPInputError(f"chunks={chunks!r} is a prefill knob (prompt tokens per step): "
                            f"use it with mode='prefill'.")
    if prefill:
        for c in chunks or ():
            _check_count("each chunk", c)
        chunks = sorted(set(chunks or (min(c, context_len) for c in DEFAULT_CHUNKS)))
    hw = hardware_profile(hardware)
    model, label = _model_of(model_or_config)
    # A prefill program is a KV producer: its interleave must equal the block size (the
    # DI rule), so only that is tried unless asked.
    interleaves = sorted(set(interleave_sizes or
                             ((block_size,) if prefill else (1, block_size))))
    result = Plan(model=label, ranks=ranks, context_len=context_len, batch=batch, hardware=hw,
                  mode=Mode(mode))
    experts = None
    for dcp in (d for d in _divisors(ranks) if dcps is None or d in dcps):
        for ep in (False, True):
            if ep and experts is False:
                continue
            for combine in (_chosen(COMBINES, combines) if dcp > 1 and not prefill
                            else COMBINES[:1]):
                for chunk in (chunks if prefill else (0,)):
                    for layout, program, config in _programs(
                            model, Layout(ranks, dcp, ep, combine, block_size, block_size,
                                          chunk),
                            interleaves, context_len, batch, result):
                        if experts is None:
                            experts = has_experts(program)
                        if ep and not experts:
                            break
                        result.ranked.append(_candidate(program, layout, config, context_len,
                                                        batch, hw))
    result.ranked.sort(key=lambda c: c.prediction.step_seconds)
    return result


def _check_count(name, value):
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise DCPInputError(f"plan needs {name} to be an int >= 1: {name}={value!r}. "
                            f"Pass e.g. {name}=4.")


def _programs(model, base: Layout, interleaves, context_len, batch, result: Plan):
    """``(layout, program, config)`` of ``base`` at each interleave size. A decode program
    is compiled once (its graph, weights and collectives do not depend on the interleave;
    only who holds which token does, priced by the config); a prefill program once per
    interleave (its chunk's slice of owned tokens is cut by it). A refusal is recorded in
    ``result.refused`` and yields nothing."""
    sizes = interleaves if base.dcp > 1 else (base.block_size,)
    program = None if base.chunk else _compile(model, base, context_len, batch, result)
    if not base.chunk and program is None:
        return
    for interleave in sizes:
        layout = replace(base, interleave_size=interleave)
        if base.chunk:
            program = _compile(model, layout, context_len, batch, result)
            if program is None:
                continue
        try:
            config = program.config.replace(interleave_size=interleave)
        except DCPError as e:
            result.refused.append(Refused(layout, str(e)))
            continue
        yield layout, program, config


def _chosen(allowed, chosen):
    if chosen is None:
        return allowed
    bad = [c for c in chosen if c not in allowed]
    if bad:
        raise DCPInputError(f"unknown combine {bad}: use some of {list(allowed)}.")
    return tuple(chosen)


def _compile(model, layout: Layout, context_len: int, batch: int, result: Plan):
    from dcp_compile.driver import transform
    from dcp_compile.runtime.serving.engine import StepShapes
    step_tokens = layout.chunk or min(context_len, layout.block_size)
    shapes = StepShapes.fitting(batch, step_tokens, context_len + 1,
                                block_size=layout.block_size, dcp=layout.dcp)
    try:
        return transform(
            model, tp=layout.tp, dcp=layout.dcp,
            mode=Mode.PREFILL if layout.chunk else Mode.DECODE,
            block_size=layout.block_size, interleave_size=layout.interleave_size,
            combine=layout.combine, expert_parallel=layout.expert_parallel, shapes=shapes,
            check=False, stack_traces=False)
    except DCPError as e:
        result.refused.append(Refused(layout, str(e)))
        return None


def _candidate(program, layout, config, context_len, batch, hw) -> Candidate:
    if layout.chunk:
        b, p = time_to_first_token(program, context_len, hw, layout.tp, config)
        tokens = batch * context_len            # prompt tokens per time to first token
    else:
        b = breakdown(program, context_len, config)
        p = predict(b, hw, layout.tp)
        tokens = batch                          # one token per sequence per step
    return Candidate(layout=layout, bucket=bucket_for(context_len, config), breakdown=b,
                     prediction=p, kv_capacity=kv_capacity(b, hw, layout.tp, batch),
                     tokens_per_s_per_chip=tokens / p.step_seconds / layout.tp)
