"""Mixture of experts in the placement analysis: ``dcp.moe``'s rule (a row of ``RULES``), the
cuts of its stacked expert weights, and how its pending sum is carried to one all-reduce."""

from __future__ import annotations

import torch

import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.moe)
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.kernels.moe import ARG, LAYOUTS, ExpertLayout
from dcp_compile.runtime.names import MOE_ROLE_META, MOE_ROUTER, MOE_SHARED_GATE

from ..infra import source_of
from ..op_classes import RESHAPES
from .lattice import R, Partial, Refusal, Seg, Shard, show
from .node_args import node_arg, shape_of, tensor_args
from .rules import RULES, Rule

aten = torch.ops.aten
MOE = torch.ops.dcp.moe.default
LINEAR = aten.linear.default


# The weight operands of dcp.moe (runtime/kernels/moe.py), each cut by ``expert_cuts``.
WEIGHTS = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias")


def expert_cuts(n, tp: int, expert_parallel: bool) -> dict[str, object]:
    """What rank r holds of each of dcp.moe's weight operands (the layout's dims):

    - expert parallel: experts [r E/tp, (r+1) E/tp) of every weight and bias;
    - tensor parallel: 1/tp of each expert's intermediate dim I. Concatenated [gate; up] is
      cut segment by segment; interleaved gate/up (gate0, up0, gate1, ...) in contiguous
      blocks of 2I/tp columns, whole (gate, up) pairs since tp divides I; ungated (the up
      projection alone) in one segment of I/tp. The down bias is no
      sum over I: it stays whole on every rank and only intermediate slice 0 adds it (dcp.moe's
      ``inner_rank``, set by shard_tensor_parallel), so the all-reduce counts it once."""
    form = LAYOUTS[ExpertLayout(n.args[ARG["layout"]])]
    gate_up = shape_of(n.args[ARG["gate_up_proj"]])
    if expert_parallel:
        ep = Shard(0, (Seg(gate_up[0], tp),), "mlp")
        return dict.fromkeys(WEIGHTS, ep)
    width = gate_up[form.gate_up_inner_dim]
    inner = Seg(width // form.projections, tp)
    gate_up_segs = (Seg(width, tp),) if form.interleaved else (inner,) * form.projections
    return {"gate_up_proj": Shard(form.gate_up_inner_dim, gate_up_segs, "mlp"),
            "down_proj": Shard(form.down_inner_dim, (inner,), "mlp"),
            "gate_up_bias": Shard(1, gate_up_segs, "mlp"),
            "down_bias": R}


def _weights(n):
    """(operand name, node) of the weights this dcp.moe has (biases are optional)."""
    return [(w, n.args[ARG[w]]) for w in WEIGHTS if n.args[ARG[w]] is not None]


def _moe_fw(n, P):
    """Replicated tokens and routing x experts cut by TP or EP -> a pending sum over TP."""
    for a, what in zip(n.args[:3], ("tokens", "expert ids", "routing weights")):
        if P(a) != R:
            raise Refusal(f"the {what} ({a.name}) are {show(P(a))}; every rank must route "
                          f"the same replicated tokens")
    gate_up = P(n.args[ARG["gate_up_proj"]])
    if not isinstance(gate_up, Shard):
        raise Refusal(f"expert weights gate_up_proj are {show(gate_up)}, not cut over TP")
    tp = gate_up.segs[0].pieces
    got = {w: P(a) for w, a in _weights(n)}
    for ep in (False, True):
        cuts = expert_cuts(n, tp, ep)
        if all(got[w] == cuts[w] for w in got):
            return Partial(gate_up.axis, experts=True)
    cut = ", ".join(f"{w} {show(p)}" for w, p in got.items())
    raise Refusal(f"expert weights are cut as {cut}: neither by expert (EP) nor by "
                  f"intermediate dim (TP)")




def carry_experts_sum(n, P):
    """An experts' pending sum (``Partial(experts=True)``) stays pending through ops linear in
    it — views, a sum with other pending sums on the same axis (a shared expert's row-parallel
    output), a product with a replicated factor (a shared expert's sigmoid gate) — so that the
    MoE block ends in one all-reduce. None: not carried (the op reads it reduced)."""
    ins = tensor_args(n)
    ps = [P(a) for a in ins]
    pending = [p for p in ps if isinstance(p, Partial)]
    gated = n.target == aten.mul.Tensor and any(_shared_expert_gate(a) for a in ins)
    if not pending or not (gated or any(p.experts for p in pending)):
        return None
    axis, scale = pending[0].axis, pending[0].scale
    if any((p.axis, p.scale) != (axis, scale) for p in pending):
        return None
    out = Partial(axis, scale, experts=True)
    if n.target in RESHAPES and len(ins) == 1:
        return out
    if n.target == aten.add.Tensor and len(pending) == len(ins) == 2 \
            and node_arg(n, 2, "alpha", 1) == 1:
        return out
    if n.target == aten.mul.Tensor and len(pending) == 1 and all(
            p == R for p in ps if not isinstance(p, Partial)):
        return out
    return None


def _shared_expert_gate(a) -> bool:
    """sigmoid(shared_expert_gate(x)): the gate in front of a shared expert, whose pending
    sum joins the routed experts' (passes/canonicalize_moe.py names the gate linear)."""
    return a.op == "call_function" and a.target == aten.sigmoid.default and \
        a.args[0].meta.get(MOE_ROLE_META) == MOE_SHARED_GATE


def _moe_bw(n, req):
    raise Refusal("the experts' output is a pending sum over the ranks; it cannot be "
                  "required sharded")


RULES[MOE] = Rule("mixture of experts (TP or EP experts)", _moe_fw,
                                        _moe_bw)


def place_experts(analysis) -> None:
    """Decide before the sweeps: dcp.moe's stacked expert weights are cut by TP or EP
    (``expert_cuts``), its tokens and routing replicated; the router's linears (and a
    shared expert's sigmoid gate) run whole, so every rank routes alike
    (passes/canonicalize_moe.py)."""
    for n in analysis.nodes:
        if n.target == MOE:
            cuts = expert_cuts(n, analysis.cfg.tp, analysis.cfg.expert_parallel)
            for what, w in _weights(n):
                if w not in analysis.params:
                    raise DCPTransformError(
                        f"expert weight {w.name} of {n.name} ({source_of(n)}) is not a "
                        f"parameter: it cannot be cut. Pass the stacked expert parameters "
                        f"to dcp.moe directly.")
                analysis.decide(w, cuts[what], n)
            for a in n.args[:3]:
                analysis.require(a, R, n)
        elif n.target == LINEAR and n.meta.get(MOE_ROLE_META) in (MOE_ROUTER, MOE_SHARED_GATE):
            for w in n.args[1:]:
                if w in analysis.params:
                    analysis.decide(w, R, n)
            analysis._set_linear(n, "replicated")   # run whole on every rank

