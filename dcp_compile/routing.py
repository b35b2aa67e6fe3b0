"""Which experts a mixture-of-experts program routes each token to, on every rank, and how
that compares with the model's own routing (the bf16 measurement of docs/benchmarks.md "MoE
routing in bf16": benchmarks/bench_moe_routing.py; tests/frontends/test_moe_routing.py).

* :func:`trace_routing` — a copy of a program whose every ``dcp.moe`` first hands its
  ``topk_ids`` (with the step's positions) to a :class:`RoutingTrace`, per rank. The recorder
  is a Python call inside the graph, so the copy runs on eager ranks only (threads, torchrun).
* :func:`model_routing` — forward pre-hooks on a transformers model's experts modules: the
  experts each token of a plain forward was routed to, and the router's selection scores
  (what top-k ranks: the logits, or sigmoid(logits) + the score-correction bias).
* :func:`compare_routing` — per (MoE layer, sequence, position): does the program's expert
  set differ from the model's (a flip), and how close were the swapped experts' scores.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor

import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime.program.dcp_program import DCPProgram
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.serving.rank_program import copy_graph_module
from dcp_compile.runtime.distributed.world import current_rank

MOE = torch.ops.dcp.moe.default
POSITIONS = "positions"

# (layer, sequence, position) -> the sorted expert ids chosen there.
Choices = dict[tuple[int, int, int], tuple[int, ...]]


@dataclass
class RoutingTrace:
    """Every traced ``dcp.moe`` call: rank -> [(MoE layer, positions [B, S], ids [B, S, k])]."""

    calls: dict[int, list[tuple[int, Tensor, Tensor]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, layer: int, positions: Tensor, ids: Tensor) -> Tensor:
        rank = current_rank() or 0
        entry = (layer, positions.clone(), ids.reshape(*positions.shape, -1).clone())
        with self._lock:
            self.calls.setdefault(rank, []).append(entry)
        return ids

    def choices(self, rank: int) -> Choices:
        """Rank ``rank``'s expert sets by (layer, sequence, position); padding skipped."""
        out: Choices = {}
        for layer, positions, ids in self.calls.get(rank, []):
            for b, s in (positions >= 0).nonzero().tolist():
                out[layer, b, int(positions[b, s])] = tuple(sorted(ids[b, s].tolist()))
        return out


def trace_routing(program: DCPProgram) -> tuple[DCPProgram, RoutingTrace]:
    """A copy of ``program`` whose every dcp.moe records its routing into the returned trace."""
    trace = RoutingTrace()
    graphs = {}
    for kind, gm in program.graphs.items():
        gm = copy_graph_module(gm)
        positions = next((n for n in gm.graph.nodes
                          if n.op == "placeholder" and n.name == POSITIONS), None)
        moe = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == MOE]
        for layer, node in enumerate(moe):
            ids = node.args[1]
            tokens = ids.meta["val"].shape[0]
            if positions is None or positions.meta["val"].numel() != tokens:
                raise DCPInputError(
                    f"cannot trace the routing of {kind!r} step's {node.name}: its {tokens} "
                    f"tokens are not the step's positions "
                    f"({None if positions is None else tuple(positions.meta['val'].shape)}). "
                    f"Trace a decode-mode program (its context and decode steps route every "
                    f"token of the batch on every rank).")
            with gm.graph.inserting_before(node):
                traced = gm.graph.call_function(trace.record, (layer, positions, ids))
            traced.meta["val"] = ids.meta["val"]
            node.replace_input_with(ids, traced)
        gm.recompile()
        graphs[kind] = gm
    return dataclasses.replace(program, graphs=graphs, bucket_graphs={}), trace


# What a router's top-k ranks, by whether it has a score-correction bias (DeepSeek-V3's
# noaux_tc, GLM4-MoE): softmax routers rank the logits; those rank sigmoid + bias.
SELECTION_SCORES = {
    False: lambda logits, router: logits,
    True: lambda logits, router: logits.sigmoid() + router.e_score_correction_bias.float(),
}
ROUTER_NAMES = ("gate", "router")


def _experts_modules(model) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(experts, router) of each MoE layer in order: the stacked experts module and its
    sibling router (a [E, H] weight)."""
    out = []
    for name, mod in model.named_modules():
        if not (hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj")
                and getattr(mod.gate_up_proj, "dim", lambda: 0)() == 3):
            continue
        parent = model.get_submodule(name.rpartition(".")[0])
        router = next((getattr(parent, r) for r in ROUTER_NAMES if hasattr(parent, r)), None)
        if router is None or getattr(router, "weight", None) is None:
            raise DCPInputError(f"MoE block {name} has no router named one of {ROUTER_NAMES} "
                                f"with a weight. Trace a transformers MoE model.")
        out.append((mod, router))
    return out


def group_scores(scores: Tensor, router) -> Tensor | None:
    """Group-limited routers (DeepSeek-V3 ``noaux_tc``): each expert group's score, the sum
    of its two best experts' scores [T, G], by which the groups are picked; else None."""
    groups = getattr(router, "num_group", 1) or 1
    if groups == 1:
        return None
    return scores.view(scores.shape[0], groups, -1).topk(2, dim=-1).values.sum(-1)


@dataclass
class ModelRouting:
    """Per MoE layer: [positions, k] chosen ids, [positions, E] selection scores (fp32) and,
    for a group-limited router, [positions, G] group scores, of the model's last forward
    (one sequence, batch 1)."""

    ids: list[Tensor] = field(default_factory=list)
    scores: list[Tensor] = field(default_factory=list)
    groups: list[Tensor | None] = field(default_factory=list)


@contextlib.contextmanager
def model_routing(model):
    """Record each MoE layer's routing of ``model``'s forwards (batch 1) into a ModelRouting
    (cleared at every forward's first MoE layer)."""
    routing = ModelRouting()
    blocks = _experts_modules(model)
    if not blocks:
        raise DCPInputError(f"{type(model).__name__} has no stacked experts modules "
                            f"(gate_up_proj [E, 2I, H]). Trace a transformers MoE model.")

    def hook_for(layer, router):
        def hook(module, args, kwargs):
            x, ids = args[0] if args else kwargs["hidden_states"], \
                args[1] if len(args) > 1 else kwargs["top_k_index"]
            if layer == 0:
                for recorded in (routing.ids, routing.scores, routing.groups):
                    recorded.clear()
            logits = x.float() @ router.weight.float().t()
            if getattr(router, "bias", None) is not None:     # gpt-oss's router linear
                logits = logits + router.bias.float()
            scores = SELECTION_SCORES[hasattr(router, "e_score_correction_bias")](logits, router)
            routing.ids.append(ids.detach().clone())
            routing.scores.append(scores.detach())
            routing.groups.append(group_scores(scores.detach(), router))
        return hook

    handles = [m.register_forward_pre_hook(hook_for(i, r), with_kwargs=True)
               for i, (m, r) in enumerate(blocks)]
    try:
        yield routing
    finally:
        for h in handles:
            h.remove()


@dataclass
class RoutingComparison:
    """Expert-set decisions compared: ``decisions`` (layer, token) pairs, ``choices`` expert
    picks (decisions x k); ``flips`` decisions whose sets differ, of which ``cascades``
    downstream of a flip in an earlier MoE layer at this token or an earlier one of its
    sequence (the input then differs by a whole expert's output, not by rounding);
    ``flip_gaps`` the score gap of each first (not downstream) flip's
    swapped experts in the model's own scores; ``margins`` each decision's top-k margin
    (k-th minus (k+1)-th score), sorted."""

    decisions: int = 0
    choices: int = 0
    flips: int = 0
    cascades: int = 0
    flip_gaps: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)

    def flips_below(self, gap: float) -> int:
        """First flips whose swapped experts' scores were within ``gap`` (near ties)."""
        return sum(g < gap for g in self.flip_gaps)

    def near_ties(self, margin: float) -> int:
        """Decisions whose top-k margin is below ``margin`` (where a flip can happen)."""
        return bisect.bisect_left(self.margins, margin)

    def merged(self, other: "RoutingComparison") -> "RoutingComparison":
        return RoutingComparison(self.decisions + other.decisions, self.choices + other.choices,
                                 self.flips + other.flips, self.cascades + other.cascades,
                                 self.flip_gaps + other.flip_gaps,
                                 sorted(self.margins + other.margins))


def _swap_gap(mine, chosen, scores: Tensor, groups: Tensor | None) -> float:
    """How close the model was to the program's choice: the score gap between the weakest
    expert it lost and the strongest it gained; for a group-limited router whose swap
    crosses groups, the smaller of that and the two groups' score gap (the group pick)."""
    lost = [e for e in mine if e not in chosen]
    gained = [e for e in chosen if e not in mine]
    a, b = lost[int(scores[lost].argmin())], gained[int(scores[gained].argmax())]
    gap = float((scores[a] - scores[b]).abs())
    if groups is not None:
        size = scores.numel() // groups.numel()
        if a // size != b // size:
            gap = min(gap, float((groups[a // size] - groups[b // size]).abs()))
    return gap


def _downstream(flip: tuple[int, int, int], flips: list[tuple[int, int, int]]) -> bool:
    """Whether an earlier MoE layer flipped at this token or an earlier one of its sequence
    (whose keys and values this token's later layers attend to)."""
    layer, seq, pos = flip
    return any(f_layer < layer and f_seq == seq and f_pos <= pos
               for f_layer, f_seq, f_pos in flips)


def compare_routing(got: Choices, reference: dict[int, ModelRouting]) -> RoutingComparison:
    """``got``: a program's choices; ``reference``: sequence -> the model's routing of that
    sequence (positions from 0). Every position the program routed must be in the model's."""
    out = RoutingComparison()
    flips = []                   # (layer, sequence, position, score gap of the swap)
    for (layer, seq, pos), chosen in sorted(got.items()):
        ref = reference[seq]
        if layer >= len(ref.ids) or pos >= ref.ids[layer].shape[0]:
            raise DCPInputError(f"the program routed layer {layer}, sequence {seq}, position "
                                f"{pos}, which the model's forward did not. Run the model "
                                f"over every position the program saw.")
        mine = tuple(sorted(ref.ids[layer][pos].tolist()))
        scores = ref.scores[layer][pos]
        k = len(mine)
        top = scores.sort(descending=True).values
        out.decisions += 1
        out.choices += k
        out.margins.append(float(top[k - 1] - top[k]) if k < top.numel() else float("inf"))
        if chosen != mine:
            groups = ref.groups[layer][pos] if ref.groups and ref.groups[layer] is not None \
                else None
            flips.append((layer, seq, pos, _swap_gap(mine, chosen, scores, groups)))
    where = [f[:3] for f in flips]
    for *at, gap in flips:
        if _downstream(tuple(at), where):
            out.cascades += 1
        else:
            out.flip_gaps.append(gap)
    out.flips = len(flips)
    out.margins.sort()
    return out
