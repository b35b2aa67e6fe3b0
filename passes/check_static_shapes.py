"""Reject graphs with symbolic shapes: every DCP program has static shapes (a graph per context bucket)."""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.passes.infra.pass_base import PassResult

from dcp_compile.runtime.errors import DCPTransformError
from .infra import DCPPass, Property, source_of


class CheckStaticShapes(DCPPass):
    name = "check_static_shapes"
    required = frozenset({Property.ATEN_GRAPH})
    ensured = frozenset({Property.STATIC_SHAPES})

    def call(self, gm):
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape):
                if any(free_unbacked_symbols(s) for s in v.shape):
                    raise DCPTransformError(
                        f"node {n.name} has a dynamic shape {tuple(v.shape)} that depends on "
                        f"the data (boolean-mask indexing or nonzero) at {source_of(n)}: DCP "
                        f"programs have static shapes. Compute it over the whole tensor "
                        f"and select with torch.where instead of indexing by a mask.")
                raise DCPTransformError(
                    f"input or node {n.name} has a dynamic shape {tuple(v.shape)}: DCP "
                    f"programs have static shapes (one graph per step kind, padded and "
                    f"masked). Capture with static example inputs (no dynamic_shapes, "
                    f"torch.compile(dynamic=False)).")
        return PassResult(gm, False)
