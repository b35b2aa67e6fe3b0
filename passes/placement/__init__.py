"""Placement analysis: how every tensor of the graph is laid out over the tensor-parallel ranks.

Run before any rewrite (``analyze``); :mod:`dcp_compile.passes.shard_tensor_parallel` then follows it.

A placement says what rank r holds of a tensor:
  * ``Replicate()``: the whole tensor.
  * ``Shard(dim, segs, axis)``: along ``dim`` the full tensor is the concatenation of
    segments ``segs``; rank r holds, of each segment, piece ``(r % group) // replicas`` of
    ``pieces`` equal pieces, concatenated in segment order. One segment is an ordinary shard
    (a GQA KV head replicated on consecutive ranks has ``replicas > 1``); several segments are
    a fused projection's output whose parts are each sharded (vLLM's QKVParallelLinear,
    MergedColumnParallelLinear): ``[q; k; v]`` rows, ``[gate; up]``, ``[q; gate]``.
    ``axis`` names the group: ``attn`` (attention heads: full TP in decode, dcp_tp in
    prefill) or ``mlp`` (full TP).
  * ``Partial(axis, scale)``: a pending sum over the axis (a row-parallel linear, or a
    mean/sum over a sharded dim); the rewrite all-reduces it at once, so its consumers read
    ``Replicate()``.

Rules are data: ``RULES`` maps an op (or an op family, found by ``rule_for``) to a forward
rule (input placements -> output placement) and a backward rule (a placement required of
the output -> what each input must be). Shape ops map dims with torch.distributed.tensor's
own view dim maps (``_view_ops.view_groups``, ``dim_transpose``, ``expand``...). DTensor's
sharding propagator itself is not used: its placements cannot say "segment by segment" or
"piece i on ``replicas`` consecutive ranks", which fused projections and GQA need.

Where the roles come from: ``dcp.attention``'s q/k/v must be sharded on their head dim
(q by heads over the attention group, k/v by KV heads, replicated when there are fewer KV
heads than ranks); that requirement runs backward to the projections (a column shard, segment
by segment for a fused one) and to any parameter on the way (a norm weight over all heads).
The attention output runs forward to a linear, which becomes row-parallel. A linear whose
input is still unknown after that (an MLP's down projection) is made row-parallel over full
TP, and its requirement runs backward to the MLP's column projections. A linear reaching the
output is the vocab-parallel LM head; an embedding is vocab-parallel. Finally a strict
forward pass recomputes every placement from the decided weights and checks the attention
inputs and graph outputs: any op without a rule for its input placements, any conflict, is
a ``DCPTransformError`` naming the op, the placements and the source line. Ops whose inputs
are all replicated need no rule (every rank computes the same thing).

The package, by job: ``lattice`` (the placements and segments), ``node_args`` (what rules read
of a node), ``dim_maps`` (shape ops' dim maps, both directions), ``rules`` (the ``RULES``
table by op family), ``plan`` (the result and the projections' roles), ``analysis`` (the
driver and its errors), ``tokens`` (``token_dim`` for prefill), ``weights`` (a weight read
through casts and transposes; which linear is the LM head).
"""

from .analysis import analyze
from . import recurrent  # noqa: F401  (adds the recurrent ops' row to RULES)
from .dim_maps import DIM_MAPS
from .lattice import R, Partial, Placement, Refusal, Replicate, Seg, Shard, canon, show
from .plan import PlacementPlan, head_shards, linears_ahead
from .rules import RULES, Rule, aligned_dim, rule_for, slice_bounds, split_ranges
from .node_args import weight_param
from .tokens import HAND_PLACED_DIMS, carried_dim, token_dim

__all__ = ["Seg", "Shard", "Replicate", "Partial", "R", "Placement", "Refusal", "canon",
           "show", "Rule", "RULES", "rule_for", "aligned_dim", "DIM_MAPS", "slice_bounds",
           "split_ranges", "PlacementPlan", "head_shards", "analyze", "token_dim",
           "carried_dim", "HAND_PLACED_DIMS", "weight_param", "linears_ahead"]
