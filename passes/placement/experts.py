"""Mixture of experts in the placement analysis: ``dcp.moe``'s rule (a row of ``RULES``), the
cuts of its stacked expert weights, and how its pending sum is carried to one all-reduce."""

from __future__ import annotations

import torch

import dcp_compile.runtime.ops  # noqa: F401  (registers torch.ops.dcp.moe)
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.names import MOE_ROLE_META, MOE_ROUTER, MOE_SHARED_GATE

from ..infra import source_of
from .lattice import R, Partial, Refusal, Seg, Shard, show
from .node_args import node_arg, shape_of, tensor_args
from .rules import RULES, Rule

aten = torch.ops.aten
MOE = torch.ops.dcp.moe.default
LINEAR = aten.linear.default


def expert_shards(n, config) -> tuple[Shard, Shard]:
    """The cuts of dcp.moe's (gate_up_proj [E, 2I, H], down_proj [E, H, I]) over full TP:
    expert parallel partitions E; tensor parallel cuts I ([gate; up] segment by segment)."""
    num_experts, two_i, _ = shape_of(n.args[3])
    if config.expert_parallel:
        ep = Shard(0, (Seg(num_experts, config.tp),), "mlp")
        return ep, ep
    inner = Seg(two_i // 2, config.tp)
    return Shard(1, (inner, inner), "mlp"), Shard(2, (inner,), "mlp")


def _moe_fw(n, P):
    """Replicated tokens and routing x experts cut by TP or EP -> a pending sum over TP."""
    for a, what in zip(n.args[:3], ("tokens", "expert ids", "routing weights")):
        if P(a) != R:
            raise Refusal(f"the {what} ({a.name}) are {show(P(a))}; every rank must route "
                          f"the same replicated tokens")
    gate_up, down = P(n.args[3]), P(n.args[4])
    if not (isinstance(gate_up, Shard) and isinstance(down, Shard)):
        raise Refusal(f"expert weights are {show(gate_up)} and {show(down)}, not cut over TP")
    ep = gate_up.dim == 0 and down.dim == 0 and gate_up == down
    tp = (gate_up.dim, down.dim) == (1, 2) and len(gate_up.segs) == 2 \
        and gate_up.segs[0] == gate_up.segs[1] == down.segs[0] and gate_up.axis == down.axis
    if not (ep or tp):
        raise Refusal(f"expert weights are cut as {show(gate_up)} and {show(down)}: neither "
                      f"by expert (EP) nor by intermediate dim (TP)")
    return Partial(gate_up.axis, experts=True)


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


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
    if n.target in _VIEWS and len(ins) == 1:
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
    (``expert_shards``), its tokens and routing replicated; the router's linears (and a
    shared expert's sigmoid gate) run whole, so every rank routes alike
    (passes/canonicalize_moe.py)."""
    for n in analysis.nodes:
        if n.target == MOE:
            for w, p in zip(n.args[3:5], expert_shards(n, analysis.cfg)):
                if w not in analysis.params:
                    raise DCPTransformError(
                        f"expert weight {w.name} of {n.name} ({source_of(n)}) is not a "
                        f"parameter: it cannot be cut. Pass the stacked expert parameters "
                        f"to dcp.moe directly.")
                analysis.decide(w, p, n)
            for a in n.args[:3]:
                analysis.require(a, R, n)
        elif n.target == LINEAR and n.meta.get(MOE_ROLE_META) in (MOE_ROUTER, MOE_SHARED_GATE):
            for w in n.args[1:]:
                if w in analysis.params:
                    analysis.decide(w, R, n)
            analysis._set_linear(n, "replicated")   # run whole on every rank

