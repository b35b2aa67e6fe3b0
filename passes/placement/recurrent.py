"""The placement rule of a recurrent op (``dcp.gated_delta_net``, ``dcp.kimi_delta_attention``,
``dcp.mamba2_ssm``, ``dcp.short_conv``, ``dcp.rg_lru``; docs/hybrid.md): it needs the whole
sequence of each row, in order, with the row's state.

Over the tensor-parallel ranks, an op with a row in ``HEAD_CUTS`` whose sizes allow it runs
cut by heads (vLLM's layout): its inputs are the rank's heads' channels and heads (the
projections before it column-parallel, segment by segment for ``[q | k | v]``), its state
caches hold the rank's heads only, and its output reaches the output projection sharded (a
row-parallel linear: one all-reduce per layer). The decision is ``HEAD_CUTS[op]``'s, one
function of the op's sizes and tp (``runtime/kernels/recurrent.py``), which the program's
state cache reads too. Any other op, or sizes that do not allow the cut, runs whole on every
rank: its inputs replicated, so are its output and its state caches (exact, no collective).
Over the DCP group: decode tokens are replicated already; a prefill chunk under sequence
parallelism is gathered before the op (passes/sequence_parallel.py) and the rank's own tokens
kept after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx import Node

from dcp_compile.runtime.kernels.recurrent import (NO_HEAD_CUT, gated_delta_net_cut,
                                                   kimi_delta_attention_cut,
                                                   lightning_attention_cut, mamba2_cut,
                                                   mamba2_whole_bc, short_conv_cut)
from dcp_compile.runtime.kernels.rg_lru import rg_lru_cut

from ..infra import linears_reached
from ..op_classes import RECURRENT_OPS
from .lattice import R, Refusal, Seg, Shard, show
from .node_args import fake, shape_of, tensor_args
from .rules import RULES, Rule
from .weights import decide_weight

LINEAR = torch.ops.aten.linear.default
HEAD_CUT_META = "dcp_head_cut"        # node meta of a recurrent op cut by heads: its HeadCut
LAYOUT_META = "dcp_recurrent_layout"  # node meta of every recurrent op: "head cut" or why not


@dataclass(frozen=True)
class HeadCut:
    """A recurrent op cut by heads over ``tp``: the placement of each tensor argument (by
    position; the others replicated), of each output, which arguments are state caches (graph
    inputs, placed like KV caches) and the integer arguments that become the rank's count."""

    inputs: dict[int, Shard]
    outputs: tuple[Shard, ...]
    states: tuple[int, ...]
    local_ints: dict[int, int]


def _gated_delta_net_cut(n: Node, tp: int) -> HeadCut | str:
    """``dcp.gated_delta_net``: channels ``[q | k | v]`` cut by key heads segment by segment
    (conv weight and conv state alike), g, beta, the recurrent state and the output by value
    heads (``gated_delta_net_head_shard``'s slices); ``num_k_heads`` the rank's."""
    hk, dk, dv = n.args[9], n.args[10], n.args[11]
    why = gated_delta_net_cut(hk, tp)
    if why is not None:
        return why
    hv = shape_of(n.args[1])[2]
    qkv = (Seg(hk * dk, tp), Seg(hk * dk, tp), Seg(hv * dv, tp))
    heads = (Seg(hv, tp),)
    ch = lambda d: Shard(d, qkv, "mlp")      # noqa: E731
    hd = lambda d: Shard(d, heads, "mlp")    # noqa: E731
    return HeadCut({0: ch(2), 1: hd(2), 2: hd(2), 3: ch(0), 4: ch(1), 5: hd(1)},
                   (hd(2), ch(1), hd(1)), (4, 5), {9: hk // tp})


def _mamba2_cut(n: Node, tp: int) -> HeadCut | str:
    """``dcp.mamba2_ssm``: channels ``[x | B | C]`` cut by groups segment by segment (conv
    weight, bias and state alike; one group: x cut, B and C whole on every rank), dt, A_log,
    D, dt_bias, the ssm state and the output by heads (``mamba2_head_shard``'s slices);
    ``n_groups`` the rank's (one group: stays 1)."""
    groups, head_dim, state = n.args[12], n.args[13], n.args[14]
    heads = shape_of(n.args[1])[2]
    why = mamba2_cut(groups, heads, tp)
    if why is not None:
        return why
    whole = mamba2_whole_bc(groups, tp)       # one group: B and C whole on every rank
    bc = Seg(groups * state, 1, tp) if whole else Seg(groups * state, tp)
    xbc = (Seg(heads * head_dim, tp), bc, bc)
    ch = lambda d: Shard(d, xbc, "mlp")                   # noqa: E731
    hd = lambda d: Shard(d, (Seg(heads, tp),), "mlp")     # noqa: E731
    inputs = {0: ch(2), 1: hd(2), 2: ch(0), 4: hd(0), 5: hd(0), 6: hd(0), 7: ch(1), 8: hd(1)}
    if isinstance(n.args[3], Node):                       # the conv bias
        inputs[3] = ch(0)
    return HeadCut(inputs, (hd(2), ch(1), hd(1)), (7, 8), {} if whole else {12: groups // tp})


def _kimi_delta_attention_cut(n: Node, tp: int) -> HeadCut | str:
    """``dcp.kimi_delta_attention``: channels ``[q | k | v]`` cut by heads segment by segment
    (conv weight and conv state alike), g ``[B, S, H, dk]``, beta, the recurrent state and
    the output by heads; ``num_heads`` the rank's."""
    heads, dim = n.args[9], n.args[10]
    why = kimi_delta_attention_cut(heads, tp)
    if why is not None:
        return why
    ch = lambda d: Shard(d, (Seg(heads * dim, tp),) * 3, "mlp")    # noqa: E731
    hd = lambda d: Shard(d, (Seg(heads, tp),), "mlp")               # noqa: E731
    return HeadCut({0: ch(2), 1: hd(2), 2: hd(2), 3: ch(0), 4: ch(1), 5: hd(1)},
                   (hd(2), ch(1), hd(1)), (4, 5), {9: heads // tp})


def _lightning_cut(n: Node, tp: int) -> HeadCut | str:
    """``dcp.lightning_attention``: q, k, v, the slope, the recurrent state and the output by
    heads (each head's recurrence is its own)."""
    heads = shape_of(n.args[0])[2]
    why = lightning_attention_cut(heads, tp)
    if why is not None:
        return why
    hd = lambda d: Shard(d, (Seg(heads, tp),), "mlp")     # noqa: E731
    return HeadCut({0: hd(2), 1: hd(2), 2: hd(2), 3: hd(0), 4: hd(1)}, (hd(2), hd(1)), (4,), {})


def _feeds_a_recurrent_op(n: Node) -> bool:
    """Whether ``n``'s output reaches another recurrent op of its own mixer (Mamba-1: its
    conv is a ``dcp.short_conv`` whose output ``dcp.mamba_ssm`` reads)."""
    mixer = module_path(n)
    if mixer is None:
        return False
    seen, stack = set(), list(n.users)
    while stack:
        u = stack.pop()
        path = module_path(u) or ""
        if u in seen or u.op != "call_function" or \
                not (path == mixer or path.startswith(mixer + ".")):
            continue
        if u.target in RECURRENT_OPS:
            return True
        seen.add(u)
        stack.extend(u.users)
    return False


def _rg_lru_cut(n: Node, tp: int) -> HeadCut | str:
    """``dcp.rg_lru``: the gates' block-diagonal weights and biases by heads, x,
    ``recurrent_param``, the state and the output by the heads' contiguous channels."""
    heads = shape_of(n.args[2])[0]
    why = rg_lru_cut(heads, tp)
    if why is not None:
        return why
    width = shape_of(n.args[0])[2]
    ch = lambda d: Shard(d, (Seg(width, tp),), "mlp")     # noqa: E731
    hd = lambda d: Shard(d, (Seg(heads, tp),), "mlp")     # noqa: E731
    return HeadCut({0: ch(2), 1: hd(0), 2: hd(0), 3: hd(0), 4: hd(0), 5: ch(0), 6: ch(1)},
                   (ch(2), ch(1)), (6,), {})


def _short_conv_cut(n: Node, tp: int) -> HeadCut | str:
    """``dcp.short_conv`` cut by channels (x, conv weight, bias, state, output): feeding a
    ``dcp.rg_lru`` (RecurrentGemma's block), by that op's heads' channels, or not at all when
    the RG-LRU runs replicated; on its own (LFM2's), by channels where tp divides them.
    Mamba-1's conv (Jamba, Zamba) stays whole: its ``dcp.mamba_ssm`` has no cut."""
    rg = [u for g in n.users for u in g.users
          if u.op == "call_function" and u.target == torch.ops.dcp.rg_lru.default]
    if len(rg) == 1:
        cut = _rg_lru_cut(rg[0], tp)
        if not isinstance(cut, HeadCut):
            return cut
    elif _feeds_a_recurrent_op(n):
        return NO_HEAD_CUT
    else:
        why = short_conv_cut(shape_of(n.args[0])[2], tp)
        if why is not None:
            return why
    ch = lambda d: Shard(d, (Seg(shape_of(n.args[0])[2], tp),), "mlp")    # noqa: E731
    inputs = {0: ch(2), 1: ch(0), 3: ch(1)}
    if isinstance(n.args[2], Node):                       # the conv bias
        inputs[2] = ch(0)
    return HeadCut(inputs, (ch(2), ch(1)), (3,), {})


# op -> its head cut over tp (or the reason it runs replicated). Ops not listed run replicated.
HEAD_CUTS: dict[object, Callable[[Node, int], HeadCut | str]] = {
    torch.ops.dcp.gated_delta_net.default: _gated_delta_net_cut,
    torch.ops.dcp.mamba2_ssm.default: _mamba2_cut,
    torch.ops.dcp.rg_lru.default: _rg_lru_cut,
    torch.ops.dcp.lightning_attention.default: _lightning_cut,
    torch.ops.dcp.kimi_delta_attention.default: _kimi_delta_attention_cut,
    torch.ops.dcp.short_conv.default: _short_conv_cut,
}


def head_cut(n: Node, tp: int) -> HeadCut | str:
    """The op's head cut over ``tp``, or why it runs with replicated weights."""
    rule = HEAD_CUTS.get(n.target)
    return rule(n, tp) if rule is not None else NO_HEAD_CUT


def _wanted(n: Node) -> dict[Node, object]:
    """What the op reads of each tensor argument: its head cut's placement, else whole."""
    cut = n.meta.get(HEAD_CUT_META)
    out = {a: R for a in tensor_args(n)}
    if cut is not None:
        for i, p in cut.inputs.items():
            out[n.args[i]] = p
    return out


def recurrent_fw(n: Node, P):
    """Inputs as the op reads them (cut by heads, or whole) -> its outputs so; else refused."""
    cut = n.meta.get(HEAD_CUT_META)
    bad = [(a.name, P(a), p) for a, p in _wanted(n).items() if P(a) != p]
    if bad:
        layout = "cut by heads" if cut is not None else "whole on every rank (replicated weights)"
        raise Refusal(
            f"the recurrent op {n.target} runs {layout}; its inputs "
            f"{', '.join(f'{a} is {show(p)}, not {show(w)}' for a, p, w in bad)}")
    if cut is not None:
        return cut.outputs
    out = fake(n)
    return tuple(R for _ in out) if isinstance(out, (tuple, list)) else R


def recurrent_bw(n: Node, req):
    """Whatever is asked of its output, the op reads its inputs as its layout says."""
    return _wanted(n)


def module_path(n: Node) -> str | None:
    """The innermost module ``n`` was traced in (its nn_module_stack), or None."""
    stack = n.meta.get("nn_module_stack")
    return next(reversed(stack.values()))[0] if stack else None


def mixer_linears(n: Node, nodes) -> list[Node]:
    """The linears of the recurrent op ``n``'s own module (the mixer: its low-rank gates too,
    Kimi Linear's ``f_a_proj -> f_b_proj`` and ``g_a_proj -> g_b_proj``, which the sweeps
    would otherwise cut column / row with an all-reduce inside the mixer)."""
    mixer = module_path(n)
    if mixer is None:
        return []
    return [x for x in nodes if x.op == "call_function" and x.target == LINEAR
            and (module_path(x) or "").startswith(mixer + ".")]


def place_recurrent(analysis) -> None:
    """Decide before the sweeps. An op cut by heads (``HEAD_CUTS``) requires its inputs cut
    so (the backward sweep makes its input projections column-parallel, the forward sweep its
    output projection row-parallel) and its state caches are known cut, as KV caches are.
    Any other reads its inputs whole, and the linears its inputs come from (the mixer's input
    projections) and its output reaches before the next linear (the mixer's output
    projection) run whole too, on a replicated input (no collective); so does every other
    linear of the mixer's module (its gates' low-rank chains)."""
    for n in analysis.nodes:
        if n.op != "call_function" or n.target not in RECURRENT_OPS:
            continue
        cut = head_cut(n, analysis.cfg.tp)
        n.meta[LAYOUT_META] = "head cut" if isinstance(cut, HeadCut) else f"replicated ({cut})"
        if isinstance(cut, HeadCut):
            n.meta[HEAD_CUT_META] = cut
            for i in cut.states:
                analysis.state_inputs[n.args[i]] = cut.inputs[i]
                analysis._set_known(n.args[i], cut.inputs[i])
            for a, p in _wanted(n).items():
                if a in analysis.state_inputs:
                    continue
                if isinstance(p, Shard) and a.op == "call_function" and \
                        analysis.P(a) is None and len(tensor_args(a)) == 1 and \
                        tensor_args(a)[0] in analysis.params:
                    # a weight seen through a view (conv1d.weight.squeeze(1)): cut the
                    # parameter now, before the forward sweep places the view whole
                    analysis._adopt_through_views(n, {a: p})
                analysis.require(a, p, n)
            # the input projections read the layer's input whole (column-parallel), decided
            # now: Zamba2's mixer input adds the shared block's output through a linear,
            # which must then run whole, not be taken for a down projection
            for lin in linears_reached(tensor_args(n), lambda x: x.all_input_nodes):
                analysis.require(lin.args[0], R, lin)
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
    RULES[_op] = Rule("recurrent op (whole sequence in order; cut by heads or replicated)",
                      recurrent_fw, recurrent_bw)
