"""What the placement analysis decided (:class:`PlacementPlan`), the shards attention needs,
and the role of each projection, found by walking from attention to the nearest linears."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Node

import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.*)

from dcp_compile.runtime.names import MEMORY_KWARGS, POSITION_BIAS_KWARGS

from ..infra import linears_reached
from .lattice import R, Seg, Shard, canon
from .node_args import weight_param

aten = torch.ops.aten
LINEAR = aten.linear.default
EMBEDDING = aten.embedding.default
ATTENTION = torch.ops.dcp.attention.default


@dataclass
class PlacementPlan:
    placements: dict[Node, object]              # every node: its placement (Partial: pending)
    params: dict[Node, Shard]                   # parameter placeholders that are sharded
    linears: dict[Node, str]                    # linear -> column | row | lm_head
    roles: dict[str, str] = field(default_factory=dict)   # linear/embedding name -> role
    embeddings: list[Node] = field(default_factory=list)
    kv_shard: Shard | None = None
    # attention node -> {"q"/"k"/"v": linears behind it, "o": its row-parallel O projection}
    attention: dict[Node, dict] = field(default_factory=dict)

    def of(self, n: Node):
        return self.placements.get(n)


def head_shards(config, num_kv_heads: int | None = None) -> tuple[Shard, Shard]:
    """What dcp.attention needs of q and of k/v ([B, S, H, D], heads at dim 2);
    ``num_kv_heads``: a layer's own (per-layer KV layouts), else the config's."""
    a = config.attention_shard
    hq = config.num_q_heads
    hkv = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    q = Shard(2, (Seg(hq, a),), "attn")
    kv = Shard(2, (Seg(hkv, min(hkv, a), max(1, a // hkv)),), "attn")
    return q, canon(kv)


def attention_projections(attn: list[Node], linears: dict[Node, str], decided: dict,
                          order: dict[Node, int]) -> dict[Node, dict]:
    """attention node -> {"q"/"k"/"v": the linears behind it, "o": its row-parallel O
    projection (None when there is no single one)}."""
    out = {}
    for at in attn:
        sites = {w: sorted(_linears_behind(at.args[i]), key=order.__getitem__)
                 for i, w in enumerate("qkv")}
        ahead = linears_ahead(at)
        o = ahead[0] if len(ahead) == 1 else None
        if o is not None and not (linears.get(o) == "row"
                                  and decided[weight_param(o.args[1])].axis == "attn"):
            o = None
        out[at] = {**sites, "o": o}
    return out


def linear_roles(attn: list[Node], linears: dict[Node, str], decided: dict,
                 embeddings: list[Node]) -> dict[str, str]:
    """linear/embedding name -> role (q_proj, kv_proj, o_proj, mlp_column, lm_head, ...)."""
    roles = {}
    feeds = {}
    for at in attn:
        for i, what in enumerate("qkv"):
            for lin in _linears_behind(at.args[i]):
                feeds.setdefault(lin, set()).add(what)
    for n, kind in linears.items():
        if kind == "lm_head":
            roles[n.name] = "lm_head"
        elif kind == "row":
            roles[n.name] = "o_proj" if decided[weight_param(n.args[1])].axis == "attn" else "mlp_row"
        elif n in feeds:
            roles[n.name] = "".join(w for w in "qkv" if w in feeds[n]) + "_proj"
        elif kind == "replicated":       # e.g. MLA's q_a_proj (low-rank q path)
            roles[n.name] = "replicated"
        else:
            roles[n.name] = "mlp_column" if decided[weight_param(n.args[1])].axis == "mlp" \
                else "attention_column"
    for e in embeddings:
        roles[e.name] = "embedding"
    return roles


def _linears_behind(start: Node) -> set[Node]:
    """Linears ``start`` is computed from, back to the nearest linear or attention."""
    return set(linears_reached([start], lambda n: n.all_input_nodes, stop={ATTENTION}))


def linears_ahead(start: Node) -> list[Node]:
    """Linears reached forward from ``start`` before any other linear or attention."""
    return linears_reached(list(start.users), lambda n: n.users, stop={ATTENTION})


def reaches_output_directly(start: Node) -> bool:
    """Does ``start`` reach the graph output without passing another linear or attention?"""
    seen, stack, reaches, other = set(), list(start.users), False, False
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output":
            reaches = True
        elif n.target in (LINEAR, ATTENTION):
            other = True
        else:
            stack.extend(n.users)
    return reaches and not other


def option_cuts(sink_shard, kv_shard) -> dict:
    """dcp.attention's tensor keywords -> (the placement each needs, the fix): sinks cut
    like q's heads (``sink_shard``), memory key/values like k's (``kv_shard``), ALiBi's
    slopes and a distance table whole (shard_tensor_parallel takes each rank's heads of
    them by rank arithmetic), DeepSeek Sparse Attention's indexer q and head weights whole."""
    whole = ("ALiBi's slopes and a distance table are per-head constants of the model; "
             "shard_tensor_parallel takes each rank's heads of them")
    return {"sinks": (sink_shard, "Sinks are one logit per q head: pass a [q_heads] "
                                  "parameter, cut like q's heads"),
            **{k: (kv_shard, "Memory key/values are cut by heads like k and v")
               for k in MEMORY_KWARGS},
            **{k: (R, whole) for k in POSITION_BIAS_KWARGS},
            **{k: (R, "The indexer runs whole on every rank (no head-sharded indexer)")
               for k in ("index_q", "index_weights")}}
