"""The placement analysis driver: requirements from attention run backward to the weights,
placements run forward from them, until nothing changes; then a strict forward check. Any op
without a rule for its inputs, any conflict, is a DCPTransformError naming the op, the
placements and the source line (see :mod:`dcp_compile.passes.placement`).

The sweeps are worklists (:class:`Worklist`): a sweep visits only the nodes whose inputs'
placements, requirements or decisions changed since their last visit, in the order a full
sweep would, so the work is linear in the graph (one fixpoint per MLP down projection used to
re-walk the whole graph: quadratic in the layers). ``DCP_COMPILE_FULL_PLACEMENT_SWEEPS=1``
sweeps every node instead, with the same decisions and errors
(tests/passes/test_placement_worklist.py)."""

from __future__ import annotations

import operator
import os
from dataclasses import replace

import torch
from torch.fx import GraphModule, Node

from dcp_compile.runtime.errors import DCPTransformError

from ..infra import attention_nodes, source_of
from ..op_classes import RECURRENT_OPS, SPLITS
from dcp_compile.runtime.names import INPUT_IDS, MEMORY_KWARGS, RANK_INPUT
from .lattice import R, Partial, Refusal, Seg, Shard, show
from .node_args import (fake, node_arg, norm_dim, reads_input, shape_of, tensor_args,
                        weight_param)
from .plan import (ATTENTION, EMBEDDING, LINEAR, PlacementPlan, attention_projections,
                   head_shards, linear_roles, option_cuts, reaches_output_directly)
from .experts import carry_experts_sum, place_experts
from .recurrent import place_recurrent
from .whole import place_whole_linears
from .weights import (adopt_params, adopt_tied_kind, decide_weight, lora_up, plain_lm_head,
                      replicated_weight, weight_placement)
from .rules import POINTWISE, rule_for, slice_bounds, split_ranges
from .worklist import FULL_SWEEPS_ENV, Worklist  # noqa: F401  (the env switch's name)

aten = torch.ops.aten


def _replicated(p) -> bool:
    return all(_replicated(x) for x in p) if isinstance(p, tuple) else p == R


def _err(n: Node, what: str, fix: str) -> DCPTransformError:
    return DCPTransformError(f"{what}: node {n.name} ({n.target}) at {source_of(n)}. {fix}.")


class Analysis:
    def __init__(self, gm: GraphModule, config, full_sweeps: bool | None = None):
        self.gm, self.cfg = gm, config
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        rank = [n for n in self.nodes if n.op == "placeholder" and n.name == RANK_INPUT]
        first_user = self.order[rank[0]] if rank else None
        self.params = {n for n in self.nodes if n.op == "placeholder" and (
            first_user is None and n.name.startswith(("p_", "b_", "c_"))
            or first_user is not None and self.order[n] < first_user)}
        self.attn = attention_nodes(gm)
        self.q_shard, self.kv_shard = head_shards(config)
        # Per-layer KV layouts (Gemma 4): each attention's K/V and caches cut by its own
        # KV heads.
        self.kv_shards = {at: head_shards(config, shape_of(at.args[1])[2])[1]
                          for at in self.attn}
        self.sink_shard = replace(self.q_shard, dim=0)
        self.known: dict[Node, object] = {}
        self.state_inputs: dict[Node, object] = {}   # recurrent state caches cut by heads
        self.req: dict[Node, object] = {}
        self.decided: dict[Node, object] = {}     # param -> placement
        self.linears: dict[Node, str] = {}
        self.linear_nodes = [n for n in self.nodes if n.target == LINEAR]
        # What each sweep must revisit: a state change marks the nodes that read it.
        full = full_sweeps if full_sweeps is not None else \
            os.environ.get(FULL_SWEEPS_ENV, "") not in ("", "0")
        self.fw = Worklist(self.nodes, self.order, full)
        self.bw = Worklist(self.nodes, {n: -i for n, i in self.order.items()}, full)
        self.rows = Worklist(self.linear_nodes, self.order, full)
        self.down_cursor = 0
        self.evaluations = 0                      # forward + backward rule evaluations

    # -- state changes: each marks the nodes whose evaluation reads it --------------------

    def _placed(self, n: Node) -> None:
        """P(n) changed (known or decided): its users' forward and backward read it."""
        self.bw.mark(n)
        for u in n.users:
            self.fw.mark(u)
            self.bw.mark(u)
            self.rows.mark(u)

    def _set_known(self, n: Node, p) -> None:
        self.known[n] = p
        self._placed(n)

    def _set_linear(self, n: Node, kind: str) -> None:
        self.linears[n] = kind
        self.fw.mark(n)
        self.bw.mark(n)
        self.rows.mark(n)

    def _required(self, n: Node) -> None:
        """req[n] changed: read by n's forward (a sideways requirement), n's backward, and
        the backward of its producers two steps up (a split's input reads the getitems)."""
        self.fw.mark(n)
        self.bw.mark(n)
        for a in n.all_input_nodes:
            self.bw.mark(a)
            for b in a.all_input_nodes:
                self.bw.mark(b)

    # -- pieces ----------------------------------------------------------------------------

    def P(self, n: Node):
        if n in self.params:
            return self.decided.get(n, R)
        return self.known.get(n)

    def decide(self, param: Node, p, why: Node) -> None:
        old = self.decided.get(param)
        if old is not None and old != p:
            raise _err(why, f"parameter {param.name} is needed as {show(old)} and as {show(p)}",
                       "Tied or shared weights must be cut the same way; untie them")
        if old is None:
            self.decided[param] = p
            self.fw.mark(param)
            self._placed(param)

    def require(self, n: Node, p, why: Node) -> bool:
        if p is None:
            return False
        old = self.req.get(n)
        if old is not None and old != p:
            raise _err(why, f"{n.name} is required to be {show(old)} and {show(p)}",
                       "The model mixes layouts that no single weight cut serves")
        if old is None:
            self.req[n] = p
            self._required(n)
        return old is None

    def _refuse(self, n: Node, ins, reason: str):
        placed = ", ".join(f"{a.name}={show(self.P(a))}" for a in ins)
        return _err(n, f"no placement rule for {n.target} with inputs [{placed}] ({reason})",
                    "Write this op as an elementwise/view/split/sum op over replicated or "
                    "head-sharded tensors, or add a rule to dcp_compile.passes.placement.RULES")

    # -- forward ---------------------------------------------------------------------------

    def forward(self, n: Node, strict: bool):
        """This node's placement from its inputs', or None when an input is still unknown."""
        self.evaluations += 1
        if n.op == "placeholder":
            if n in self.params:
                return self.decided.get(n, R)
            if n.name == RANK_INPUT:
                return "rank"
            return R
        if n.op == "output":
            return None
        ins = tensor_args(n)
        t = n.target
        if t == LINEAR:
            return self._linear_fw(n, strict)
        if t == EMBEDDING:   # a table cut along its features (_adopt_through_views): its rows too
            w = self.P(n.args[0])
            return None if self.P(n.args[1]) is None else \
                replace(w, dim=fake(n).ndim - 1) if isinstance(w, Shard) and w.dim == 1 else R
        if t == ATTENTION:
            return self._attention_fw(n, strict)
        ps = [self.P(a) for a in ins]
        if any(p == "rank" for p in ps):
            return R  # rank arithmetic (inserted masks) is per-rank by design
        if any(p is None for p in ps):
            if not strict and rule_for(t) is POINTWISE:
                self._sideways(n, ins)
            return None
        carried = carry_experts_sum(n, self.P)
        if carried is not None:
            return carried
        ps = [R if isinstance(p, Partial) else p for p in ps]  # reduced at once
        if all(_replicated(p) for p in ps):
            return R if not isinstance(fake(n), (tuple, list)) else tuple(R for _ in fake(n))
        rule = rule_for(t)
        if rule is None:
            raise self._refuse(n, ins, "no rule for this op")
        try:
            if rule is POINTWISE and not strict:
                adopt_params(self, n, ins)
            if rule.adopt is not None and not strict:
                self._adopt_through_views(n, rule.adopt(n, self._read))
            return rule.forward(n, lambda a: R if isinstance(self.P(a), Partial) else self.P(a))
        except Refusal as e:
            raise self._refuse(n, ins, str(e)) from None

    def _read(self, a: Node):
        return R if isinstance(self.P(a), Partial) else self.P(a)

    def _adopt_through_views(self, n, wants: dict) -> None:
        """A replicated operand that is a parameter seen through single-input ops (views,
        slices: MLA's W_UK = kv_b_proj.weight viewed [H, dn+dv, L][:, :dn]) and needs a cut
        (``wants``): the cut is mapped back through those ops (their backward rules) to the
        parameter, which takes it; the ops are placed again from it. A token table's rows
        (an embedding, scaled, viewed: Gemma 4's per-layer inputs) needed cut along their
        features: the table is cut along them, each rank looks up its own columns (left out
        of the vocab-parallel cut). Anything else is left to the rule, which refuses."""
        for a, want in wants.items():
            chain, x = [], a
            while x not in self.params and x.target != EMBEDDING:
                r = rule_for(x.target) if x.op == "call_function" else None
                inputs = [t for t in tensor_args(x) if fake(t).numel() > 1]   # scalars aside
                if r is None or r.backward is None or len(inputs) != 1:
                    return
                chain.append((x, inputs[0]))
                x = inputs[0]
            need = want
            try:
                for c, inner in chain:
                    need = rule_for(c.target).backward(c, need).get(inner)
                    if not isinstance(need, Shard):
                        return
            except Refusal:
                return
            table = None if x in self.params else x.args[0]     # an embedding's table
            if table is not None and (need.dim != fake(x).ndim - 1 or table in self.decided
                                      or table not in self.params):
                return
            self.decide(x if table is None else table,
                        need if table is None else replace(need, dim=1), n)
            for c in [x] * (table is not None) + [c for c, _ in reversed(chain)]:
                self.known[c] = self.forward(c, strict=False)

    def _sideways(self, n, ins):
        """Pointwise op with a known sharded operand and unknown ones: they must match it."""
        known = [a for a in ins if isinstance(self.P(a), Shard)]
        if not known:
            return
        out_nd = fake(n).ndim
        p = self.P(known[0])
        self.require(n, replace(p, dim=p.dim + out_nd - fake(known[0]).ndim), n)

    def _linear_fw(self, n, strict):
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else None
        px, pw = self.P(x), weight_placement(self, n, w, strict)
        if px is None or pw is None or (b is not None and self.P(b) is None):
            return None
        px = R if isinstance(px, Partial) else px
        kind = self.linears.get(n)
        last = len(shape_of(n)) - 1
        if px == R and pw == R and (kind == "replicated" or replicated_weight(self, w)):
            return R
        if px == R and isinstance(pw, Shard) and pw.dim == 0:
            if b is not None and self.P(b) != replace(pw, dim=0):
                raise _err(n, f"bias {b.name} is {show(self.P(b))}, weight {show(pw)}",
                           "A column-parallel bias must be cut like the weight's rows")
            if kind == "lm_head":
                return R   # all-gathered over the vocab
            return replace(pw, dim=last)
        if isinstance(px, Shard) and isinstance(pw, Shard) and pw.dim == 1 \
                and px.dim == len(shape_of(x)) - 1 and replace(px, dim=1) == pw:
            if b is not None and self.P(b) != R:
                raise _err(n, f"row-parallel bias {b.name} is {show(self.P(b))}",
                           "The bias is added once after the all-reduce; keep it replicated")
            return Partial(pw.axis)
        raise _err(n, f"linear with input {show(px)} and weight {show(pw)} has no "
                      f"tensor-parallel form",
                   "Column-parallel needs a replicated input, row-parallel an input sharded "
                   "like the weight's columns")

    def _attention_fw(self, n, strict):
        q, k, v, kc, vc = n.args[:5]
        ps = [self.P(a) for a in (q, k, v, kc, vc)]
        if any(p is None for p in ps):
            # Its output is sharded by q heads whatever comes in (checked in the strict pass):
            # known early, so that an output gate can learn its cut from it.
            return None if strict else (self.q_shard, self.kv_shards[n], self.kv_shards[n])
        want = [self.q_shard, *[self.kv_shards[n]] * 4]
        for what, a, p, w in zip(("q", "k", "v", "key_cache", "value_cache"),
                                 (q, k, v, kc, vc), ps, want):
            if p != w:
                raise _err(n, f"attention {what} ({a.name}) is {show(p)}, expected {show(w)}",
                           "q, k and v must each come from projections cut by heads; check "
                           "that nothing mixes heads between the projection and attention")
        for a in n.args[5:7]:
            if self.P(a) not in (R, None):
                raise _err(n, f"attention input {a.name} is {show(self.P(a))}",
                           "positions and block tables must be replicated")
        for key, (want, fix) in option_cuts(self.sink_shard, self.kv_shards[n]).items():
            x = n.kwargs.get(key)
            if x is not None and self.P(x) != want and not (want == R and self.P(x) is None):
                raise _err(n, f"attention {key} ({x.name}) is {show(self.P(x))}, expected "
                              f"{show(want)}", fix)
        return (self.q_shard, self.kv_shards[n], self.kv_shards[n])

    # -- backward --------------------------------------------------------------------------

    def backward_sweep(self) -> bool:
        changed = False
        for n in self.bw.sweep():
            self.evaluations += 1
            if n.op != "call_function" and n not in self.params:
                if n.op == "placeholder" and isinstance(self.req.get(n), Shard) \
                        and n.name not in {a.name for at in self.attn for a in at.args[3:5]} \
                        and n not in self.state_inputs:
                    raise _err(n, f"input {n.name} is replicated but needed as "
                                  f"{show(self.req[n])}", "Only weights can be cut")
                continue
            if n in self.params:
                if n in self.req and n not in self.decided:
                    self.decide(n, self.req[n], n)
                    changed = True
                continue
            if n in self.known or n.target == operator.getitem or n.target in SPLITS:
                continue   # split outputs: their input collects them (_from_range_users)
            req = self.req.get(n)
            if req is None:
                req = self._from_range_users(n)
                if req is not None:
                    changed |= self.require(n, req, n)
            if req is None:
                continue
            if n.target == LINEAR:
                changed |= self._decide_column(n, req)
                continue
            if n.target == EMBEDDING or n.target == ATTENTION:
                continue
            rule = rule_for(n.target)
            if req == R:   # replicated output from replicated inputs, for any op
                for a in tensor_args(n):
                    if self.P(a) is None or a in self.params:
                        changed |= self.require(a, R, n)
                continue
            if rule is None or rule.backward is None:
                raise self._refuse(n, tensor_args(n), f"required to be {show(req)}, and the "
                                                       f"op has no backward rule")
            try:
                need = rule.backward(n, req)
            except Refusal as e:
                raise self._refuse(n, tensor_args(n), f"required to be {show(req)}: {e}") \
                    from None
            for a, p in need.items():
                if p is not None and (self.P(a) is None or a in self.params):
                    changed |= self.require(a, p, n)
        return changed

    def _from_range_users(self, n: Node):
        """A tensor whose users split it (split/chunk/unbind via getitem, or slices) into runs
        along one dim, each run required sharded there: it is the concatenation (segmented)."""
        runs = []
        for u in n.users:
            if u.op != "call_function":
                return None
            if u.target == aten.unbind.int:
                return self._same_for_all(u, n)
            elif u.target in SPLITS:
                d, bounds = split_ranges(u)
                items = {g.args[1]: g for g in u.users}
                for i, (a, b) in enumerate(bounds):
                    g = items.get(i)
                    runs.append((a, b, self.req.get(g) if g is not None else None, d))
            elif u.target in (aten.slice.Tensor, aten.narrow.default):
                d, a, b, step = slice_bounds(u)
                runs.append((a, b, self.req.get(u) if step == 1 else None, d))
            else:
                return None
        if not runs:
            return None
        dims = {r[3] for r in runs}
        reqs = [r[2] for r in runs if r[2] is not None]
        if len(dims) != 1 or not reqs:
            return None
        d = dims.pop()
        if all(r == R for r in reqs):
            return R if len(reqs) == len(runs) else None
        if any(r != R and r.dim != d for r in reqs):
            same = set(reqs)   # split off the sharded dim: all pieces alike
            if len(same) == 1 and all(r[2] is not None for r in runs):
                return same.pop()
            return None
        if any(r[2] is None for r in runs):
            return None        # wait until every run is known
        axis = next(r.axis for r in reqs if isinstance(r, Shard))
        group = self.cfg.attention_shard if axis == "attn" else self.cfg.tp
        runs = [(a, b, Shard(d, (Seg(b - a, 1, group),), axis) if r == R else r, dd)
                for a, b, r, dd in runs]    # a replicated run: whole on every rank
        runs.sort()
        pos, segs = 0, []
        for a, b, r, _ in runs:
            if a != pos or r.full != b - a:
                return None    # overlapping or gapped runs: not a partition
            segs.extend(r.segs)
            pos = b
        if pos != shape_of(n)[d] or len({r.axis for _, _, r, _ in runs}) != 1:
            return None
        return Shard(d, tuple(segs), reqs[0].axis)

    def _same_for_all(self, u, n):
        reqs = [self.req.get(g) for g in u.users]
        if not reqs or any(r is None for r in reqs) or len(set(reqs)) != 1:
            return None
        r = reqs[0]
        d = norm_dim(node_arg(u, 1, "dim", 0), len(shape_of(n)))
        return replace(r, dim=r.dim + (d <= r.dim))

    def _decide_column(self, n: Node, req) -> bool:
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else None
        if n in self.linears:
            return False
        if self.P(x) is None and isinstance(req, Shard):
            # A column projection reads a replicated input: a low-rank path before it (MLA's
            # q_a_proj -> RMSNorm -> q_b_proj) is then replicated, not an MLP down projection.
            return self.require(x, R, n)
        if self.P(x) != R and not isinstance(self.P(x), Partial):
            return False
        last = len(shape_of(n)) - 1
        if req == R:   # an MQA KV projection: every rank computes the one head
            self._check_weight(n, w)
            decide_weight(self, n, w, R)
            if b is not None:
                self.decide(b, R, n)
            self._set_linear(n, "replicated")
            return True
        if not isinstance(req, Shard) or req.dim != last:
            raise _err(n, f"linear output is required to be {show(req)}",
                       "Only the output features of a projection can be cut")
        self._check_weight(n, w)
        decide_weight(self, n, w, replace(req, dim=0))
        if b is not None:
            self.decide(b, replace(req, dim=0), n)
        self._set_linear(n, "column")
        return True

    def _check_weight(self, n, w):
        if weight_param(w) not in self.params:
            raise _err(n, f"linear weight {w.name} is not a parameter",
                       "Use nn.Linear weights directly, or a cast or transpose of one (no "
                       "computed weights)")

    def _decide_row(self, n: Node, px: Shard) -> None:
        self._check_weight(n, n.args[1])
        decide_weight(self, n, n.args[1], replace(px, dim=1))
        self._set_linear(n, "row")

    def _decide_replicated(self, n: Node) -> None:
        """A linear read by nothing that decides it, whose input features do not split over
        tp (Gemma 3n's AltUp coefficients: 2 -> 4): it runs whole on every rank, like
        vLLM's ReplicatedLinear, on a replicated input."""
        self._check_weight(n, n.args[1])
        decide_weight(self, n, n.args[1], R)
        if len(n.args) > 2 and n.args[2] is not None:
            self.decide(n.args[2], R, n)
        self._set_linear(n, "replicated")
        self.require(n.args[0], R, n)

    def _decide_lm_head(self, n: Node) -> None:
        """The linear reaching the output: vocab-parallel, all-gathered. Its input is whole
        on every rank, so a linear before it that is none of the roles (OPT's project_out)
        runs whole too, like vLLM's ReplicatedLinear."""
        vocab = shape_of(n)[-1]
        if vocab % self.cfg.tp:
            raise _err(n, f"vocabulary of {vocab} does not split over tp={self.cfg.tp}",
                       "Pad the vocabulary to a multiple of tp")
        self._check_weight(n, n.args[1])
        spec = Shard(0, (Seg(vocab, self.cfg.tp),), "mlp")
        decide_weight(self, n, n.args[1], spec)
        if len(n.args) > 2 and n.args[2] is not None:
            self.decide(n.args[2], spec, n)
        self._set_linear(n, "lm_head")
        self.require(n.args[0], R, n)

    # -- driver ----------------------------------------------------------------------------

    def forward_sweep(self) -> bool:
        changed = False
        for n in self.fw.sweep():
            if n in self.known:
                continue
            p = self.forward(n, strict=False)
            if p is not None:
                self._set_known(n, p)
                changed = True
        for n in self.rows.sweep():  # a linear reading a sharded input is row-parallel
            if n not in self.linears and isinstance(self.P(n.args[0]), Shard):
                px = self.P(n.args[0])
                if px.dim != len(shape_of(n.args[0])) - 1:
                    raise _err(n, f"linear input is {show(px)}", "Only the input features "
                               "of a row-parallel projection can be cut")
                self._decide_row(n, px)
                changed = True
        return changed

    def _first_down(self) -> Node | None:
        """The first undecided linear whose input is still unknown. Linears only get decided
        and inputs only get known, so the first such one never moves back: a cursor."""
        for i in range(self.down_cursor, len(self.linear_nodes)):
            n = self.linear_nodes[i]
            if n not in self.linears and self.P(n.args[0]) is None \
                    and not plain_lm_head(n) and not lora_up(n):   # decided below / by W
                self.down_cursor = i
                return n
        self.down_cursor = len(self.linear_nodes)
        return None

    def run(self) -> PlacementPlan:
        if not self.attn:
            raise DCPTransformError("placement analysis found no dcp.attention node. Run "
                                    "canonicalize_attention first.")
        for at in self.attn:
            for i, want in ((0, self.q_shard), (1, self.kv_shards[at]),
                            (2, self.kv_shards[at])):
                self.require(at.args[i], want, at)
            for key, (want, _) in option_cuts(self.sink_shard, self.kv_shards[at]).items():
                x = at.kwargs.get(key)
                if x is not None and key in MEMORY_KWARGS:   # a parameter seen through views
                    self._adopt_through_views(at, {x: want})
                if x is not None:
                    self.require(x, want, at)
            for c in at.args[3:5]:
                self._set_known(c, self.kv_shards[at])
        place_experts(self)
        place_recurrent(self)
        place_whole_linears(self)
        while True:
            while self.forward_sweep() | self.backward_sweep():
                pass
            n = self._first_down()
            if n is not None:   # an MLP's down projection: row-parallel over full TP
                k = shape_of(n.args[0])[-1]
                px = Shard(len(shape_of(n.args[0])) - 1, (Seg(k, self.cfg.tp),), "mlp")
                if k % self.cfg.tp:
                    self._decide_replicated(n)
                    continue
                self._decide_row(n, px)
                self.require(n.args[0], px, n)
                continue
            break
        for n in self.linear_nodes:
            if n not in self.linears and reaches_output_directly(n):
                self._decide_lm_head(n)
        while self.forward_sweep() | self.backward_sweep():
            pass
        for n in self.linear_nodes:
            if n not in self.linears and not adopt_tied_kind(self, n):
                raise _err(n, "cannot tell how to shard this linear: it is not a q/k/v/o "
                              "projection, an MLP pair or the LM head",
                           "Refusing to leave it unsharded; restructure the model")
        # Token embeddings are vocab-parallel; a table looked up by positions (learned or
        # sinusoidal positions) is replicated: its rows are not a vocabulary.
        embeddings = [n for n in self.nodes if n.target == EMBEDDING
                      and reads_input(n.args[1], INPUT_IDS)
                      and not (isinstance(self.decided.get(n.args[0]), Shard)
                               and self.decided[n.args[0]].dim == 1)]
        for e in embeddings:
            vocab = shape_of(e.args[0])[0]
            if vocab % self.cfg.tp:
                raise _err(e, f"vocabulary of {vocab} does not split over tp={self.cfg.tp}",
                           "Pad the vocabulary to a multiple of tp")
            self.decide(e.args[0], Shard(0, (Seg(vocab, self.cfg.tp),), "mlp"), e)
        return self.check(embeddings)

    def check(self, embeddings) -> PlacementPlan:
        """Strict forward pass: every node placed by a rule, every requirement met."""
        self.known = {c: self.kv_shards[at] for at in self.attn for c in at.args[3:5]}
        self.known.update(self.state_inputs)
        for n in self.nodes:
            if n in self.known:
                continue
            p = self.forward(n, strict=True)
            if p is None and n.op != "output":
                raise _err(n, "no placement could be derived", "Report this model")
            self.known[n] = p
        out = next(n for n in self.nodes if n.op == "output")
        for a in tensor_args(out):
            p = self.known[a]
            if p != R and not (isinstance(p, Shard) and a.target == operator.getitem and (
                    p in self.kv_shards.values() and a.args[0].target == ATTENTION
                    or p in self.state_inputs.values() and a.args[0].target in RECURRENT_OPS)):
                raise _err(a, f"graph output {a.name} is {show(p)}",
                           "Outputs other than the KV and state caches must be replicated")
        params = {p: s for p, s in self.decided.items() if isinstance(s, Shard)}
        for p in params:
            self.known[p] = params[p]
        roles = linear_roles(self.attn, self.linears, self.decided, embeddings)
        return PlacementPlan(self.known, params, dict(self.linears), roles, embeddings,
                             self.kv_shard, attention_projections(self.attn, self.linears,
                                                                  self.decided, self.order))


def analyze(gm: GraphModule, config) -> PlacementPlan:
    """Every node's placement over the tensor-parallel ranks, or DCPTransformError."""
    return Analysis(gm, config).run()
