"""Tensor-parallel sharding (spec: "Weight Loading").

Analysis finds each projection's role from the graph's structure (not from names):
  * q/k/v projections: the linears feeding a `dcp.attention` node -> column-parallel by heads
    over the attention shard (decode: full TP; prefill: dcp_tp_group). When there are fewer
    KV heads than shards, each KV head is replicated across consecutive ranks.
  * o projection: the linear reading the attention output -> row-parallel + all-reduce.
  * MLP: a linear whose input is computed only from other linears (SwiGLU's down) is
    row-parallel + all-reduce, and those linears (gate, up) are column-parallel.
  * embedding -> vocab-parallel (masked lookup + all-reduce); LM head -> vocab-column +
    all-gather.
Any other linear is an error: nothing is silently left unsharded. Weight placeholders get
their shard's shape; ``ctx.shards`` records how to cut each rank's shard on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from dcp_compile.errors import DCPTransformError

from . import collectives as C
from .infra import KIND_COLLECTIVE, KIND_MASK, KIND_SHARD, DCPPass, attention_nodes, \
    getitem_users, source_of, val
from .insert_rank import RANK_INPUT

LINEAR = torch.ops.aten.linear.default
EMBEDDING = torch.ops.aten.embedding.default


@dataclass(frozen=True)
class ShardSpec:
    """How rank r's shard of a weight is cut: piece (r % group) // replicas of ``pieces``."""

    dim: int
    pieces: int
    group: int
    replicas: int = 1

    def index(self, rank: int) -> int:
        return (rank % self.group) // self.replicas

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        size = full.shape[self.dim] // self.pieces
        return full.narrow(self.dim, self.index(rank) * size, size).contiguous()

    def shape(self, full_shape) -> tuple[int, ...]:
        s = list(full_shape)
        s[self.dim] //= self.pieces
        return tuple(s)


@dataclass
class ShardPlan:
    column: dict[Node, ShardSpec]       # linear node -> spec of its weight (dim 0)
    row: dict[Node, tuple[ShardSpec, str]]   # linear node -> (spec (dim 1), all-reduce role)
    vocab_embedding: list[Node]
    vocab_head: list[Node]
    roles: dict[str, str]               # linear name -> what it was found to be


def _is_linear(n: Node) -> bool:
    return n.op == "call_function" and n.target == LINEAR and n.args[1].op == "placeholder"


def _backward_sources(start: Node) -> tuple[set[Node], set[Node]]:
    """(linears, other sources) reached walking back from ``start``, stopping at linears."""
    linears, others, seen, stack = set(), set(), set(), [start]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_linear(n):
            linears.add(n)
        elif n.op == "placeholder" or (n.op == "call_function"
                                       and n.target == torch.ops.dcp.attention.default):
            others.add(n)
        else:
            stack.extend(n.all_input_nodes)
    return linears, others


def _forward_linears(start: Node) -> tuple[set[Node], bool]:
    """(linears reached walking forward, stopping at linears; whether output is reached)."""
    linears, seen, stack, reaches_output = set(), set(), list(start.users), False
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_linear(n):
            linears.add(n)
        elif n.op == "output":
            reaches_output = True
        else:
            stack.extend(n.users)
    return linears, reaches_output


class ShardTensorParallel(DCPPass):
    name = "shard_tensor_parallel"

    # -- analysis --------------------------------------------------------------------------

    def plan(self, gm: GraphModule) -> ShardPlan:
        cfg = self.ctx.config
        shard = cfg.attention_shard
        q_spec = ShardSpec(0, shard, shard)
        if cfg.num_kv_heads >= shard:
            kv_spec = ShardSpec(0, shard, shard)
        else:  # fewer KV heads than shards: consecutive ranks hold the same head
            kv_spec = ShardSpec(0, cfg.num_kv_heads, shard, shard // cfg.num_kv_heads)
        o_spec = ShardSpec(1, shard, shard)
        o_role = "tp" if cfg.mode == "decode" else "dcp_tp"
        full = ShardSpec(0, cfg.tp, cfg.tp)
        tp_role = "tp" if cfg.mode == "decode" else "world"

        column, row, roles = {}, {}, {}
        for attn in attention_nodes(gm):
            found = []
            for idx, what in ((0, "q"), (1, "k"), (2, "v")):
                lin, _ = _backward_sources(attn.args[idx])
                if len(lin) != 1:
                    raise DCPTransformError(
                        f"{what} of attention node {attn.name} ({source_of(attn)}) comes from "
                        f"{len(lin)} projections ({sorted(x.name for x in lin)}); expected one "
                        f"linear per q, k and v. Fused or mixed projections are not sharded.")
                found.append(lin.pop())
            if len(set(found)) != 3:
                raise DCPTransformError(
                    f"attention node {attn.name} ({source_of(attn)}) reads q, k and v from a "
                    f"fused projection {found[0].name}: a head-wise shard of a fused weight "
                    f"would be wrong. Split the projection into q_proj, k_proj and v_proj.")
            for lin, spec, what in zip(found, (q_spec, kv_spec, kv_spec), "qkv"):
                column[lin] = spec
                roles[lin.name] = f"{what}_proj"
            out = getitem_users(attn).get(0)
            o_lin, _ = _forward_linears(out) if out is not None else (set(), False)
            if len(o_lin) != 1:
                raise DCPTransformError(
                    f"the output of attention node {attn.name} ({source_of(attn)}) reaches "
                    f"{len(o_lin)} linears; expected exactly one output projection.")
            o = o_lin.pop()
            row[o] = (o_spec, o_role)
            roles[o.name] = "o_proj"

        linears = [n for n in gm.graph.nodes if _is_linear(n)]
        for n in linears:
            if n in column or n in row:
                continue
            srcs, others = _backward_sources(n.args[0])
            if srcs and not others:
                row[n] = (ShardSpec(1, cfg.tp, cfg.tp), tp_role)
                roles[n.name] = "mlp_row"
                for s in srcs:
                    if s in row or (s in column and column[s] != full):
                        raise DCPTransformError(f"linear {s.name} ({source_of(s)}) is both an "
                                                f"attention and an MLP projection.")
                    column[s] = full
                    roles[s.name] = "mlp_column"
        head, emb = [], []
        for n in linears:
            if n in column or n in row:
                continue
            fwd, reaches_output = _forward_linears(n)
            if reaches_output and not fwd:
                head.append(n)
                roles[n.name] = "lm_head"
            else:
                raise DCPTransformError(
                    f"cannot tell how to shard linear {n.name} ({source_of(n)}): it is not a "
                    f"q/k/v/o projection, an MLP pair or the LM head. Refusing to leave it "
                    f"unsharded.")
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target == EMBEDDING:
                emb.append(n)
                roles[n.name] = "embedding"
        return ShardPlan(column, row, emb, head, roles)

    # -- rewrite ---------------------------------------------------------------------------

    def call(self, gm):
        cfg = self.ctx.config
        plan = self.plan(gm)
        tp_role = "tp" if cfg.mode == "decode" else "world"
        mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes
                                 if n.op == "placeholder"])
        g = gm.graph
        rank = next(n for n in g.nodes if n.op == "placeholder" and n.name == RANK_INPUT)

        # Each rank's KV caches hold only its KV heads: the cache inputs take that shape.
        for attn in attention_nodes(gm):
            for cache in attn.args[3:5]:
                full = cache.meta["val"]
                if full.shape[2] != cfg.kv_heads_per_rank:
                    with mode:
                        cache.meta["val"] = torch.empty(
                            (*full.shape[:2], cfg.kv_heads_per_rank, *full.shape[3:]),
                            dtype=full.dtype, device=full.device)
                    cache.meta["dcp_full_shape"] = tuple(full.shape)

        for lin, spec in plan.column.items():
            self._shard_param(lin.args[1], spec, mode)
            if len(lin.args) > 2 and lin.args[2] is not None:
                self._shard_param(lin.args[2], ShardSpec(0, spec.pieces, spec.group,
                                                         spec.replicas), mode)
        for lin, (spec, role) in plan.row.items():
            self._shard_param(lin.args[1], spec, mode)
            bias = lin.args[2] if len(lin.args) > 2 else None
            with g.inserting_before(lin.next):
                if bias is not None:  # add the bias once, after the reduction
                    lin.args = (lin.args[0], lin.args[1])
                c, w = C.all_reduce(g, lin, role)
                self.tag(c, KIND_COLLECTIVE)
                result = w
                if bias is not None:
                    with g.inserting_before(w.next):
                        result = g.call_function(torch.ops.aten.add.Tensor, (w, bias))
            lin.replace_all_uses_with(result, delete_user_cb=lambda u: u is not c)

        for lin in plan.vocab_head:
            vocab = val(lin).shape[-1]
            self._check_vocab(vocab, lin)
            self._shard_param(lin.args[1], ShardSpec(0, cfg.tp, cfg.tp), mode)
            if len(lin.args) > 2 and lin.args[2] is not None:
                self._shard_param(lin.args[2], ShardSpec(0, cfg.tp, cfg.tp), mode)
            with g.inserting_before(lin.next):
                c, w = C.all_gather(g, lin, tp_role, cfg.tp)         # [tp*B, S, V/tp]
                self.tag(c, KIND_COLLECTIVE)
                c.meta["dcp_scope"] = "model"
                b, s = val(lin).shape[0], val(lin).shape[1]
                v = g.call_function(torch.ops.aten.view.default,
                                    (w, [cfg.tp, b, s, vocab // cfg.tp]))
                p = g.call_function(torch.ops.aten.permute.default, (v, [1, 2, 0, 3]))
                full = g.call_function(torch.ops.aten.reshape.default, (p, [b, s, vocab]))
            lin.replace_all_uses_with(full, delete_user_cb=lambda u: u is not c)

        for emb in plan.vocab_embedding:
            weight, ids = emb.args[0], emb.args[1]
            # A weight tied to the LM head may already carry its shard's shape.
            vocab = weight.meta.get("dcp_full_shape", val(weight).shape)[0]
            self._check_vocab(vocab, emb)
            per = vocab // cfg.tp
            self._shard_param(weight, ShardSpec(0, cfg.tp, cfg.tp), mode)
            with g.inserting_before(emb):
                start = g.call_function(torch.ops.aten.mul.Tensor, (rank, per))
                local = g.call_function(torch.ops.aten.sub.Tensor, (ids, start))
                ge = g.call_function(torch.ops.aten.ge.Scalar, (local, 0))
                lt = g.call_function(torch.ops.aten.lt.Scalar, (local, per))
                inside = self.tag(g.call_function(torch.ops.aten.logical_and.default,
                                                  (ge, lt)), KIND_MASK)
                safe = g.call_function(torch.ops.aten.where.ScalarOther, (inside, local, 0))
            emb.args = (weight, safe) + tuple(emb.args[2:])
            with g.inserting_before(emb.next):
                keep = g.call_function(torch.ops.aten.unsqueeze.default, (inside, -1))
                masked = g.call_function(torch.ops.aten.mul.Tensor, (emb, keep))
                c, w = C.all_reduce(g, masked, tp_role)
                self.tag(c, KIND_COLLECTIVE)
                c.meta["dcp_scope"] = "model"
            emb.replace_all_uses_with(w, delete_user_cb=lambda u: u is not masked)

        self.record(**{k: v for k, v in sorted(plan.roles.items())})
        self.matched = {"projections": dict(sorted(plan.roles.items()))}
        return PassResult(gm, True)

    def _shard_param(self, p: Node, spec: ShardSpec, mode) -> None:
        if p.op != "placeholder":
            raise DCPTransformError(f"weight {p.name} is not a parameter input; cannot shard.")
        prev = self.ctx.shards.get(p.name)
        if prev is not None:
            if prev != spec:
                raise DCPTransformError(f"weight {p.name} is used with two different shards "
                                        f"({prev} and {spec}); tied weights are not "
                                        f"supported. Untie them.")
            return
        full = p.meta["val"]
        if full.shape[spec.dim] % spec.pieces:
            raise DCPTransformError(f"weight {p.name} of shape {tuple(full.shape)} does not "
                                    f"split into {spec.pieces} pieces along dim {spec.dim}. "
                                    f"Pick a tp that divides it.")
        with mode:
            p.meta["val"] = torch.empty(spec.shape(full.shape), dtype=full.dtype,
                                        device=full.device)
        p.meta["dcp_full_shape"] = tuple(full.shape)
        self.ctx.shards[p.name] = spec
        self.tag(p, KIND_SHARD)

    def _check_vocab(self, vocab: int, node: Node) -> None:
        if vocab % self.ctx.config.tp:
            raise DCPTransformError(f"vocabulary of {vocab} does not split over tp="
                                    f"{self.ctx.config.tp} ({node.name}, {source_of(node)}). "
                                    f"Pad the vocabulary to a multiple of tp.")

    def ensures(self, gm):
        for n in gm.graph.nodes:
            if _is_linear(n) and n.args[1].name not in self.ctx.shards:
                raise DCPTransformError(f"linear {n.name} was left unsharded.")


__all__ = ["ShardTensorParallel", "ShardSpec", "ShardPlan"]
