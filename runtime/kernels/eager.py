"""Eager kernels for a loaded program: in-place cache writes and live-span attention.

A DCP program's graphs are functional and static-shaped, which is what export and the
StableHLO lowering need: ``dcp.cache_write`` returns new caches (XLA aliases them to the
inputs) and ``dcp.partial_attention`` reads every slot the block table can address. Run
eagerly, the first copies every layer's caches on every step and the second reads the whole
block-table span, so a step would cost what the cache holds, not what the context holds.

Loading a program for an eager backend (``RankProgram``: threads, torchrun) therefore swaps
those ops for their eager kernels, by the table ``EAGER_KERNELS`` — a backend property, not
a second code path in the passes:

  dcp.cache_write         -> dcp.cache_write_          writes the owned rows in place; the
                                                        cache inputs are returned as outputs
  dcp.partial_attention   -> dcp.partial_attention_live reads the block-table entries the
                                                        batch's longest prior uses
  dcp.moe                 -> dcp.moe_grouped           sorts the choices by expert, one
                                                        matmul per expert (no [T, k] weight
                                                        gather)

Then every ``dcp`` op of the graph is called as the Python function it was defined from
(:func:`call_kernels_directly`, ``op_defs.PYTHON_KERNELS``): the same code without the
dispatcher's per-call autograd wrapper or its import of torch._dynamo. Only an eager
backend does this; Inductor compiles the ops.

The layout metadata (slot mapping, prior bound, current key positions) is already computed
once per step in the program's graphs (passes/dcp_decode.py, dcp_prefill.py): nothing here
deduplicates it.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from dcp_compile.runtime.kernels import ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.kernels.op_defs import PYTHON_KERNELS

dcp_ops = torch.ops.dcp


def _in_place_cache_write(graph: Graph, node: Node) -> None:
    """Replace ``caches' = cache_write(caches, ...)`` by ``cache_write_(caches, ...)`` and
    every use of caches' by the (now written) cache inputs."""
    kc, vc = node.args[:2]
    for cache in (kc, vc):
        others = [u.name for u in cache.users if u is not node]
        if cache.op != "placeholder" or others:
            raise DCPTransformError(
                f"cannot write the KV cache in place at node {node.name}: its cache operand "
                f"{cache.name} is {'used by ' + str(others) if others else 'not a program input'}"
                f", so overwriting it would change what they read. Keep each cache input "
                f"read only through its cache_write (as the DCP passes emit).")
    with graph.inserting_before(node):
        write = graph.call_function(dcp_ops.cache_write_.default, node.args, node.kwargs)
    write.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    for user in list(node.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise DCPTransformError(
                f"cannot write the KV cache in place at node {node.name}: its result is used "
                f"whole by {user.name} instead of through getitem. Index the (key, value) "
                f"result.")
        user.replace_all_uses_with((kc, vc)[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)


def _live_span_attention(graph: Graph, node: Node) -> None:
    node.target = dcp_ops.partial_attention_live.default


def _grouped_experts(graph: Graph, node: Node) -> None:
    node.target = dcp_ops.moe_grouped.default


# Op of the program graph -> rewrite into its eager kernel.
EAGER_KERNELS = {
    dcp_ops.cache_write.default: _in_place_cache_write,
    dcp_ops.partial_attention.default: _live_span_attention,
    dcp_ops.moe.default: _grouped_experts,        # sort by expert, one matmul per expert
}


def specialize_for_eager(graph: Graph) -> dict[str, int]:
    """Swap every functional cache write and static-span attention of ``graph`` (a copy owned
    by the caller, who builds its GraphModule after every edit: one code generation) for its
    eager kernel; returns how many of each op were swapped. (The step's layout metadata needs
    nothing here: the DCP passes emit it once per step.)"""
    counts: dict[str, int] = {}
    for node in list(graph.nodes):
        rewrite = EAGER_KERNELS.get(node.target) if node.op == "call_function" else None
        if rewrite is not None:
            key = node.target._opname
            rewrite(graph, node)
            counts[key] = counts.get(key, 0) + 1
    graph.lint()
    return counts


def call_kernels_directly(graph: Graph) -> int:
    """Retarget every ``dcp`` op call of ``graph`` (a copy the caller owns) to the Python
    function the op was defined from; returns how many calls were retargeted."""
    count = 0
    for node in graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
                and target.namespace == "dcp" and target._opname in PYTHON_KERNELS:
            node.target = PYTHON_KERNELS[target._opname]
            count += 1
    return count
