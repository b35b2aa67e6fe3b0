"""Linears that run whole on every rank by the module they are traced in (hyper-connections).

``WHOLE_LINEARS`` (rules as data): the module's class as ``nn_module_stack`` names it -> why.

The sweeps cut a linear by what reaches it: a requirement from attention (column), a sharded
input (row), or, failing both, the first undecided linear whose input is still unknown is
taken for an MLP down projection. A small per-token mixing projection that feeds none of
those roles is then mistaken for one: HY-V4's hyper-connections mix the ``hc_mult`` residual
streams ``[hc_mult * hidden] -> 2 * hc_mult`` stream weights per token (``F.linear(flat,
self.fn)``), which the analysis took for the MLP's down projection and refused ("required to
be Replicate and Shard"). Such a linear runs whole on a replicated input, as vLLM runs these
(ReplicatedLinear): its weight is a few thousand numbers and no collective is needed.
Running a linear whole on a replicated input is exact whatever its module computes (an input
that is not replicated is refused by the strict check), so a row pins no source hash.
docs/moe-mla.md: HY-V4."""

from __future__ import annotations

from torch.fx import Node

from dcp_compile.runtime.errors import DCPTransformError

from ..infra import source_of
from .lattice import R
from .node_args import weight_param
from .weights import decide_weight

_HY4 = "transformers.models.hy_v4.modeling_hy_v4"
WHOLE_LINEARS = {
    f"{_HY4}.HYV4HyperConnection": "a hyper-connection's stream mix: [hc_mult * hidden] -> "
                                   "2 * hc_mult stream weights per token",
    f"{_HY4}.HYV4HyperHead": "the final hyper-connection collapse: [hc_mult * hidden] -> "
                             "hc_mult stream weights per token",
}


def module_class(n: Node) -> str | None:
    """The class of the innermost module ``n`` was traced in (its nn_module_stack), or None."""
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    cls = next(reversed(stack.values()))[1]
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


def place_whole_linears(analysis) -> list[Node]:
    """Decide before the sweeps: every linear traced in a ``WHOLE_LINEARS`` module runs
    whole (weight replicated, input required replicated). Returns those linears."""
    found = []
    for n in analysis.linear_nodes:
        if module_class(n) not in WHOLE_LINEARS or n in analysis.linears:
            continue
        if weight_param(n.args[1]) not in analysis.params:
            raise DCPTransformError(
                f"linear {n.name} ({source_of(n)}) of a {module_class(n)} (run whole: "
                f"{WHOLE_LINEARS[module_class(n)]}) reads a computed weight, not a "
                f"parameter; dcp_compile/passes/placement/whole.py reads the module's own "
                f"parameter")
        decide_weight(analysis, n, n.args[1], R)
        if len(n.args) > 2 and n.args[2] is not None:
            analysis.decide(n.args[2], R, n)
        analysis._set_linear(n, "replicated")
        analysis.require(n.args[0], R, n)
        found.append(n)
    return found
