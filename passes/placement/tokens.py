"""The token dim (prefill): the placement rules, with tokens as the "sharded" dim."""

from __future__ import annotations

import torch
from torch.fx import Node

from .lattice import R, Refusal, Seg, Shard, show
from .node_args import fake
from .rules import aligned_dim, rule_for


def token_dim(n: Node, dims: dict[Node, int], tokens: int) -> int:
    """Where the token dim (size ``tokens``, at ``dims[a]`` of each input ``a`` that carries
    it) is in ``n``'s output, if ``n`` keeps tokens apart: the op's placement rule must map a
    token-sharded input to an output sharded on one dim of exactly ``tokens`` elements.
    Inputs without tokens are replicated (broadcast); a per-token side input aligned with the
    token dim counts as token-sharded (callers gather or refuse it). Refusal otherwise."""
    rule = rule_for(n.target)
    if rule is None:
        raise Refusal(f"{n.target} has no placement rule")
    seg = (Seg(tokens, tokens),)
    out_nd = fake(n).ndim if isinstance(fake(n), torch.Tensor) else None
    first = next(iter(dims))
    first_nd = fake(first).ndim if isinstance(fake(first), torch.Tensor) else out_nd
    j = None if out_nd is None else dims[first] + out_nd - first_nd

    def P(a):
        if a in dims:
            return Shard(dims[a], seg, "seq")
        v = fake(a)
        if j is not None and isinstance(v, torch.Tensor):
            k = aligned_dim(n, a, j)
            if k is not None and k < v.ndim and v.shape[k] == tokens and tokens > 1:
                return Shard(k, seg, "seq")
        return R

    out = rule.forward(n, P)
    outs = out if isinstance(out, tuple) else (out,)
    if not outs or any(not isinstance(o, Shard) or o.segs != seg for o in outs) \
            or len({o.dim for o in outs}) != 1:
        raise Refusal(f"{n.target} does not keep the token dim whole ({show(out)})")
    return outs[0].dim
