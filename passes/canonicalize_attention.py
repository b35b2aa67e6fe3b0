"""Canonicalize every accepted attention form into one `dcp.attention` node per layer.

Accepted: `dcp.paged_attention` (the demo model, and Hugging Face models through the
attention implementation in dcp_compile.hf). Attention we do not recognise — SDPA or
flash/efficient kernels over contiguous K/V, which have no KV cache to shard — is an error
naming the node and its source, never a silently unsharded graph.
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassResult

import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.*)

from dcp_compile.runtime.errors import DCPTransformError

from .infra import KIND_ATTENTION, DCPPass, Property, ensure, source_of

ACCEPTED = (torch.ops.dcp.paged_attention.default, torch.ops.dcp.attention.default)


def _unrecognised_targets():
    aten = torch.ops.aten
    names = ["scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
             "_efficient_attention_forward"]
    out = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            out.update(getattr(packet, o) for o in packet.overloads())
    return out


UNRECOGNISED = _unrecognised_targets()
# dcp.attention's arguments after (q, k, v, caches, positions, block_table, scale).
OPTIONS = tuple(a.name for a in torch.ops.dcp.attention.default._schema.arguments[8:])


class CanonicalizeAttention(DCPPass):
    name = "canonicalize_attention"
    required = frozenset({Property.PAGED_CACHE})
    ensured = frozenset({Property.CANONICAL_ATTENTION})

    def call(self, gm):
        layer = 0
        for n in list(gm.graph.nodes):
            if n.op != "call_function":
                continue
            if n.target in UNRECOGNISED:
                raise DCPTransformError(
                    f"unrecognised attention form {n.target} at node {n.name} "
                    f"({source_of(n)}): it attends over contiguous K/V with no paged KV "
                    f"cache, so DCP cannot shard its sequence. Route attention through "
                    f"torch.ops.dcp.paged_attention (Hugging Face models: "
                    f"dcp_compile.hf.prepare).")
            if n.target in ACCEPTED:
                for arg, what in ((n.args[3], "key_cache"), (n.args[4], "value_cache")):
                    if arg.op != "placeholder":
                        raise DCPTransformError(
                            f"attention node {n.name} ({source_of(n)}) reads a {what} that "
                            f"is not a program input ({arg.name}): KV caches must be inputs, "
                            f"never module buffers or computed tensors.")
                n.target = torch.ops.dcp.attention.default
                # Options after scale (window, softcap, kv_shared, sinks) as keywords, however
                # the capture passed them: the passes read attn.args[:8] and attn.kwargs.
                n.kwargs = {**dict(zip(OPTIONS, n.args[8:])), **n.kwargs}
                n.args = n.args[:8]
                self.tag(n, KIND_ATTENTION, layer)
                layer += 1
        if layer == 0:
            raise DCPTransformError(
                "the model has no attention this compiler recognises (no "
                "dcp.paged_attention node): there is nothing to shard with DCP. Use a model "
                "whose attention goes through torch.ops.dcp.paged_attention.")
        self.record(layers=layer)
        return PassResult(gm, True)

    def ensures(self, gm):
        left = [n.name for n in gm.graph.nodes
                if n.target == torch.ops.dcp.paged_attention.default]
        ensure(not left, self.name, "dcp.paged_attention nodes left uncanonicalised", left)
