"""The placement rule of a recurrent op (``dcp.gated_delta_net``, ``dcp.kimi_delta_attention``,
``dcp.mamba2_ssm``, ``dcp.short_conv``; docs/hybrid.md): it needs the whole sequence of each row, in order, with
the row's state.

Over the tensor-parallel ranks the op runs whole on every rank: its inputs (the mixer's
projections, conv weight, gates) replicated, so are its output and its state caches (exact,
no collective: the weights of the projections before it are replicated, those after it see a
replicated input). Cutting the op by heads (``gated_delta_net_head_shard``,
``mamba2_head_shard``) is the next step. Over the DCP group: decode tokens are replicated
already; a prefill chunk under sequence parallelism is gathered before the op
(passes/sequence_parallel.py) and the rank's own tokens kept after it.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..infra import linears_reached
from ..op_classes import RECURRENT_OPS
from .lattice import R, Refusal, show
from .node_args import fake, tensor_args
from .rules import RULES, Rule
from .weights import decide_weight

LINEAR = torch.ops.aten.linear.default


def recurrent_fw(n: Node, P):
    """Every input replicated -> every output replicated; anything else refused."""
    cut = [(a.name, P(a)) for a in tensor_args(n) if P(a) != R]
    if cut:
        raise Refusal(
            f"the recurrent op {n.target} runs whole on every rank (replicated weights); "
            f"its inputs {', '.join(f'{a} is {show(p)}' for a, p in cut)}")
    out = fake(n)
    return tuple(R for _ in out) if isinstance(out, (tuple, list)) else R


def recurrent_bw(n: Node, req):
    """Whatever is asked of its output, the op reads its inputs whole."""
    return {a: R for a in tensor_args(n)}


def _module_path(n: Node) -> str | None:
    stack = n.meta.get("nn_module_stack")
    return next(reversed(stack.values()))[0] if stack else None


def mixer_linears(n: Node, nodes) -> list[Node]:
    """The linears of the recurrent op ``n``'s own module (the mixer: its low-rank gates too,
    Kimi Linear's ``f_a_proj -> f_b_proj`` and ``g_a_proj -> g_b_proj``, which the sweeps
    would otherwise cut column / row with an all-reduce inside the mixer)."""
    mixer = _module_path(n)
    if mixer is None:
        return []
    return [x for x in nodes if x.op == "call_function" and x.target == LINEAR
            and (_module_path(x) or "").startswith(mixer + ".")]


def place_recurrent(analysis) -> None:
    """Decide before the sweeps: a recurrent op reads its inputs whole, and the linears its
    inputs come from (the mixer's input projections) and its output reaches before the next
    linear (the mixer's output projection) run whole too, on a replicated input (no
    collective; the head cut comes later, docs/hybrid.md); so does every other linear of the
    mixer's module (its gates' low-rank chains)."""
    for n in analysis.nodes:
        if n.op != "call_function" or n.target not in RECURRENT_OPS:
            continue
        for a in tensor_args(n):
            analysis.require(a, R, n)
        # the projections before it too: decided now, not left for the MLP-down heuristic
        # while their input is unknown (Zamba2's mixer reads the shared block's output)
        before = linears_reached(tensor_args(n), lambda x: x.all_input_nodes)
        after = linears_reached(list(n.users), lambda x: list(x.users))
        for lin in dict.fromkeys(before + after + mixer_linears(n, analysis.nodes)):
            if lin in analysis.linears:
                continue
            decide_weight(analysis, lin, lin.args[1], R)
            if len(lin.args) > 2 and lin.args[2] is not None:
                analysis.decide(lin.args[2], R, lin)
            analysis._set_linear(lin, "replicated")
            analysis.require(lin.args[0], R, lin)


for _op in RECURRENT_OPS:
    RULES[_op] = Rule("recurrent op (whole sequence in order; replicated)", recurrent_fw,
                      recurrent_bw)
