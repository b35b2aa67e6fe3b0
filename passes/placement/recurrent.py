"""The placement rule of a recurrent op (``dcp.gated_delta_net``, ``dcp.mamba2_ssm``,
``dcp.short_conv``; docs/hybrid.md): it needs the whole sequence of each row, in order, with
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

from torch.fx import Node

from ..infra import linears_reached
from ..op_classes import RECURRENT_OPS
from .lattice import R, Refusal, show
from .node_args import fake, tensor_args
from .rules import RULES, Rule
from .weights import decide_weight


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


def place_recurrent(analysis) -> None:
    """Decide before the sweeps: a recurrent op reads its inputs whole, and the linears its
    inputs come from (the mixer's input projections) and its output reaches before the next
    linear (the mixer's output projection) run whole too, on a replicated input (no
    collective; the head cut comes later, docs/hybrid.md)."""
    for n in analysis.nodes:
        if n.op != "call_function" or n.target not in RECURRENT_OPS:
            continue
        for a in tensor_args(n):
            analysis.require(a, R, n)
        # the projections before it too: decided now, not left for the MLP-down heuristic
        # while their input is unknown (Zamba2's mixer reads the shared block's output)
        before = linears_reached(tensor_args(n), lambda x: x.all_input_nodes)
        for lin in before + linears_reached(list(n.users), lambda x: list(x.users)):
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
