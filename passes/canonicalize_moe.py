"""Canonicalize mixture-of-experts blocks: one ``dcp.moe`` node per MoE layer, its router named.

Accepted experts: ``dcp.moe`` (runtime/kernels/moe.py) — transformers' experts classes reach it
through dcp_compile.hf's ``"dcp"`` experts implementation, whatever implementation the model
was configured with (eager loop, grouped_mm, batched_mm: the same function of the same
weights); a plain model calls ``torch.ops.dcp.moe`` itself.

The router before it — linear, softmax or sigmoid, top-k, group-limited top-k with a
score-correction bias (DeepSeek-V3 ``noaux_tc``), ``norm_topk_prob``, a routed scaling factor,
PhiMoE's sparsemixer — stays the model's own ops. Its inputs are replicated on every rank, so
it computes the same choices on every rank (exact ties included: the same kernel on the same
values); this pass marks its linears ``router`` so that the placement runs them whole. A
shared expert is an ordinary MLP (tensor-parallel like any); a sigmoid gate in front of it (a
linear to one feature: Qwen2-MoE's ``shared_expert_gate``) is marked ``shared_expert_gate``
and also runs whole.

Every ``dcp.moe`` node is normalised to all its operands positional (``runtime.moe.ARG``
indexes them for the later passes). Refused, naming the node and its source line: expert
computations that did not become ``dcp.moe`` (``UNRECOGNISED``: grouped matmuls, batched_mm's
per-choice gather of a stacked [E, ...] weight), expert weights or biases that are not
parameters or whose shapes disagree with the layout, an unknown activation or layout, a
tp that divides neither the experts (expert parallel) nor the intermediate dim (TP), fewer
experts than ranks under expert parallelism, and experts narrower than the tokens (bf16
experts in an fp32 model: no program equals such a model at fp32 tolerance).

Where a routing score scales the experts' input rather than their output (Llama-4: one
dcp.moe per choice over ``score * x``, weight 1), the router is found behind that score too.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassResult

import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.program.facts import MixtureOfExperts, ModelFacts
from dcp_compile.runtime.kernels.moe import (ACTIVATIONS, LAYOUTS, OPERANDS, PARAMETERS,
                                             ExpertActivation, ExpertLayout, parameters_agree)
from dcp_compile.runtime.names import MOE_ROLE_META, MOE_ROUTER, MOE_SHARED_GATE

from .infra import DCPPass, Found, Property, ancestors, ensure, source_of, val
from .op_classes import CASTS, MULS, RESHAPES, SLICES, SPLITS, TOP_K

aten = torch.ops.aten
MOE = torch.ops.dcp.moe.default
LINEAR = aten.linear.default
KIND_MOE = "moe"

_FIX = ("Route the experts through dcp.moe: transform() and dcp_compile.hf.prepare do it for "
        "transformers models (experts implementation 'dcp'); a plain model calls "
        "torch.ops.dcp.moe(x, topk_ids, topk_weights, gate_up_proj, down_proj, rank0)")


def _grouped_mm_ops() -> dict:
    out = {}
    for packet in (getattr(aten, "_grouped_mm", None),
                   getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback",
                           None)):
        if packet is not None:
            for o in packet.overloads():
                out[getattr(packet, o)] = "a grouped matmul over experts (grouped_mm)"
    return out


# Expert computations in a form other than dcp.moe: op -> what it is.
UNRECOGNISED = {aten.nonzero.default: "a data-dependent expert loop (nonzero)",
                **_grouped_mm_ops()}


def _stacked_weight_gather(n: Node) -> bool:
    """batched_mm's ``gate_up_proj[expert_ids]``: a stacked [E, ...] parameter indexed by
    tokens' expert choices."""
    if n.target != aten.index.Tensor:
        return False
    w = n.args[0]
    return w.op == "placeholder" and val(w).dim() == 3


def _top_k_of(ids: Node) -> Node | None:
    """The top-k that chose ``ids`` (through getitem, slices, casts, views), or None."""
    n = ids
    while isinstance(n, Node) and n.op == "call_function" and n.target not in TOP_K:
        ins = n.all_input_nodes
        if n.target is not operator.getitem and n.target not in SLICES | SPLITS | CASTS | RESHAPES \
                or len(ins) != 1:
            return None
        n = ins[0]
    return n if isinstance(n, Node) and n.target in TOP_K else None


def _scaled_tokens(moe: Node) -> tuple[Node, list[Node]]:
    """(the block's tokens, routing factors applied to them): dcp.moe's input itself, or,
    where the experts' input is the tokens times their routing score (Llama-4 scales inputs,
    not outputs), the tokens and that score (a factor descending from the ids' top-k)."""
    x = moe.args[0]
    if x.target not in MULS or len(x.all_input_nodes) != 2:
        return x, []
    topks = {_top_k_of(moe.args[1])} - {None}
    a, b = x.args[:2]
    for tokens, factor in ((a, b), (b, a)):
        if isinstance(factor, Node) and topks & (ancestors(factor) | {factor}) \
                and not topks & ancestors(tokens):
            return tokens, [factor]
    return x, []


def _router(moe: Node) -> set[Node]:
    """The ops computing the routing (ids, weights, a score scaling the input) from the
    block's input: the backward slice of the routing stopped where it meets the tokens' own
    history."""
    x, factors = _scaled_tokens(moe)
    stop = ancestors(x) | {x}
    seen, stack = set(), [moe.args[1], moe.args[2], *factors]
    while stack:
        n = stack.pop()
        if n in seen or n in stop or n.op != "call_function":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _functional_twin(target):
    """aten.div_.Tensor -> aten.div.Tensor (None: not an in-place aten op)."""
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    if target.namespace != "aten" or not name.endswith("_") or name.startswith("_"):
        return None
    twin = getattr(getattr(aten, name[:-1], None), target._overloadname, None)
    return twin


def _sort_top_k(router: set[Node]) -> int:
    """``topk(sorted=False)`` returns its k in an unspecified order (the router only scatters
    or gathers by them, and dcp.moe sums over k); the static lowering has only the sorted
    form, which is one of those orders."""
    done = 0
    for n in router:
        if n.target == aten.topk.default and not (n.args[4] if len(n.args) > 4
                                                  else n.kwargs.get("sorted", True)):
            args = list(n.args) + [n.kwargs.get(k, d) for k, d in
                                   (("dim", -1), ("largest", True))][len(n.args) - 2:]
            n.args, n.kwargs = tuple(args[:4]) + (True,), {}
            done += 1
    return done


def _functionalize(gm, router: set[Node]) -> int:
    """Routers update their own temporaries in place (``weights /= weights.sum()``,
    ``mask.scatter_(...)``); the static lowering needs values: ``a.op_(b)`` becomes
    ``a' = op(a, b)`` and every later reader of ``a`` reads ``a'``. Only a temporary of the
    router (not an input, not a view of another tensor) is rewritten."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = 0
    for n in sorted(router, key=order.__getitem__):
        twin = _functional_twin(n.target) if n.op == "call_function" and hasattr(
            n.target, "namespace") else None
        if twin is None:
            continue
        a = n.args[0]
        if a not in router or getattr(a.target, "is_view", False) or \
                torch.Tag.inplace_view in getattr(a.target, "tags", ()):
            raise DCPTransformError(
                f"the router updates {a.name} in place ({n.target}) at node {n.name} "
                f"({source_of(n)}), and {a.name} is not a temporary of the router: "
                f"rewriting it as a value could change what another reader sees. Write the "
                f"router without in-place updates of shared tensors.")
        n.target = twin
        for u in list(a.users):
            if u is not n and order[u] > order[n]:
                u.replace_input_with(a, n)
        done += 1
    return done




def _same_tokens(x: Node) -> list[Node]:
    """The experts' input and the tensors it is a view of (a shared-expert gate reads one)."""
    out = [x]
    while out[-1].op == "call_function" and out[-1].target in RESHAPES:
        out.append(out[-1].args[0])
    return out


def positional(n: Node) -> tuple:
    """dcp.moe's operands, all positional (schema defaults filled in)."""
    out = []
    for i, arg in enumerate(MOE._schema.arguments):
        if i < len(n.args):
            out.append(n.args[i])
        elif arg.name in n.kwargs:
            out.append(n.kwargs[arg.name])
        else:
            out.append(arg.default_value)
    return tuple(out)


def _ordered(form, experts, out_features, in_features) -> tuple:
    """A stacked expert weight's shape: [E, out, in], or [E, in, out] transposed."""
    return (experts, in_features, out_features) if form.transposed \
        else (experts, out_features, in_features)


class CanonicalizeMoE(DCPPass):
    name = "canonicalize_moe"
    required = frozenset({Property.PAGED_CACHE})
    ensured = frozenset({Property.CANONICAL_MOE})

    def call(self, gm):
        cfg = self.ctx.config
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            what = UNRECOGNISED.get(n.target) or (
                "batched_mm's gather of a stacked expert weight" if _stacked_weight_gather(n)
                else None)
            if what is not None:
                raise DCPTransformError(
                    f"unrecognised experts form, {what}: node {n.name} ({n.target}) at "
                    f"{source_of(n)}. {_FIX}.")
        blocks = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == MOE]
        facts = {"moe_layers": len(blocks)}
        if not blocks:
            self.record(**facts)
            return PassResult(gm, False)
        experts, top_ks, functionalized = set(), set(), 0
        for layer, n in enumerate(blocks):
            self._check(n, cfg)
            self.tag(n, KIND_MOE, layer)
            experts.add(val(n.args[3]).shape[0])
            top_ks.add(val(n.args[1]).shape[-1])
            router = _router(n)
            functionalized += _functionalize(gm, router) + _sort_top_k(router)
            for lin in (r for r in router if r.target == LINEAR):
                lin.meta[MOE_ROLE_META] = MOE_ROUTER
            for lin in (u for a in _same_tokens(n.args[0]) for u in a.users
                        if u.target == LINEAR):
                if val(lin).shape[-1] == 1 and MOE_ROLE_META not in lin.meta:
                    lin.meta[MOE_ROLE_META] = MOE_SHARED_GATE
        facts.update(experts=sorted(experts), top_k=sorted(top_ks),
                     router_rewrites=functionalized,
                     expert_parallel=cfg.expert_parallel,
                     router_linears=sum(m.meta.get(MOE_ROLE_META) == MOE_ROUTER
                                        for m in gm.graph.nodes),
                     shared_expert_gates=sum(m.meta.get(MOE_ROLE_META) == MOE_SHARED_GATE
                                             for m in gm.graph.nodes))
        self.record(**facts)
        return Found(gm, True, facts=ModelFacts(moe=MixtureOfExperts(
            len(blocks), tuple(sorted(experts)), tuple(sorted(top_ks)),
            cfg.expert_parallel)))

    def _check(self, n: Node, cfg) -> None:
        n.args, n.kwargs = positional(n), {}
        a = dict(zip(OPERANDS, n.args))
        where = f"node {n.name} at {source_of(n)}"
        for what, enum in (("activation", ExpertActivation), ("layout", ExpertLayout)):
            if a[what] not in set(enum):
                raise DCPTransformError(
                    f"dcp.moe {what} {a[what]!r} is unknown: {where}. Use one of "
                    f"{[e.value for e in enum]}.")
        if not parameters_agree(a["activation"], a["alpha"], a["limit"]):
            raise DCPTransformError(
                f"dcp.moe activation {a['activation']} with alpha={a['alpha']}, "
                f"limit={a['limit']}: {where}. Pass the parameters it reads, no others: "
                f"{ {k.value: v for k, v in PARAMETERS.items()} }, none for the others.")
        for what in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
            w = a[what]
            if w is not None and w.op != "placeholder":
                raise DCPTransformError(
                    f"expert {what} ({w.name}) is computed, not a parameter: {where}. Pass the "
                    f"stacked expert parameters to dcp.moe directly.")
        form = LAYOUTS[ExpertLayout(a["layout"])]
        x, ids, weights, gate_up = (val(a[k]).shape for k in OPERANDS[:4])
        if not form.gated and a["activation"] not in ACTIVATIONS:
            raise DCPTransformError(
                f"dcp.moe activation {a['activation']} is a gate, and layout {a['layout']} has "
                f"no gate projection: {where}. Pass an elementwise activation "
                f"({[x.value for x in ACTIVATIONS]}) with an ungated layout.")
        num_experts, width = gate_up[0], gate_up[form.gate_up_inner_dim]
        inner = width // form.projections
        t, k = ids
        hidden = x[-1] if len(x) == 2 else None
        expected = {"gate_up_proj": _ordered(form, num_experts, width, hidden),
                    "down_proj": _ordered(form, num_experts, hidden, inner),
                    "gate_up_bias": (num_experts, width), "down_bias": (num_experts, hidden)}
        wrong = {w: tuple(val(a[w]).shape) for w in expected
                 if a[w] is not None and tuple(val(a[w]).shape) != expected[w]}
        if tuple(weights) != (t, k) or tuple(x) != (t, hidden) or width % form.projections \
                or wrong:
            raise DCPTransformError(
                f"dcp.moe shapes do not agree ({a['layout']} layout): x {tuple(x)}, ids "
                f"{tuple(ids)}, weights {tuple(weights)}, gate_up {tuple(gate_up)}, wrong "
                f"{wrong or 'none'} (expected {expected}): {where}. Pass x [T, H], routing "
                f"[T, k] and expert weights laid out as the layout says (runtime/kernels/moe.py).")
        _check_dtype(val(a["gate_up_proj"]).dtype, val(a["x"]).dtype, where)
        _check_cut(cfg, num_experts, inner, where)

    def ensures(self, gm):
        left = [n.name for n in gm.graph.nodes if n.op == "call_function"
                and n.target in UNRECOGNISED]
        ensure(not left, self.name, "unrecognised expert computations left", left)


def _check_dtype(narrow: torch.dtype, tokens: torch.dtype, where: str) -> None:
    """Experts narrower than the tokens (torchtitan's bf16 GroupedExperts in an fp32 model)
    cannot be matched at the tokens' tolerance: refused, naming why."""
    if narrow.itemsize < tokens.itemsize:
        raise DCPTransformError(
            f"the experts compute in {narrow} inside a {tokens} model (torchtitan's "
            f"GroupedExperts casts its tokens and weights to bfloat16): {narrow} matmuls round "
            f"by the shape of the batch they are given, so no program equals the model at "
            f"{tokens} tolerance (its own forward differs from itself by 4.7e-4 when only the "
            f"batch changes: torchtitan's DeepSeek-V3; tensor-parallel experts add each rank's "
            f"rounded partial down projection) ({where}). Transform the model in {narrow} "
            f"(model.to({narrow})), whose programs are compared at {narrow} tolerance, or make "
            f"its experts compute in the model's dtype.")


def _check_cut(cfg, num_experts: int, intermediate: int, where: str) -> None:
    """The experts' cut over the tp ranks exists: whole experts per rank (expert parallel)
    or a slice of every expert's intermediate dim (tensor parallel)."""
    if cfg.expert_parallel and num_experts < cfg.tp:
        raise DCPTransformError(
            f"expert parallelism gives each of the tp ranks whole experts, and there are "
            f"fewer experts than ranks: experts={num_experts}, tp={cfg.tp} ({where}). Serving "
            f"it would cut each expert over tp/experts ranks by its intermediate dim as well "
            f"(experts x intermediate on one weight), a cut the placement's one-dim shards do "
            f"not express. Use expert_parallel=False (tensor-parallel experts: every rank "
            f"holds 1/tp of every expert, the same bytes per rank), or a tp of at most "
            f"{num_experts} that divides it.")
    if cfg.expert_parallel and num_experts % cfg.tp:
        raise DCPTransformError(
            f"expert parallelism partitions the experts over the tp ranks, which needs tp to "
            f"divide them: experts={num_experts}, tp={cfg.tp} ({where}). Use a tp that divides "
            f"{num_experts}, or expert_parallel=False (tensor-parallel experts).")
    if not cfg.expert_parallel and intermediate % cfg.tp:
        raise DCPTransformError(
            f"tensor-parallel experts cut each expert's intermediate dim over tp, which needs "
            f"tp to divide it: intermediate={intermediate}, tp={cfg.tp} ({where}). Use a tp "
            f"that divides it, or expert_parallel=True.")
