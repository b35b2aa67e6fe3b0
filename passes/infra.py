"""Pass infrastructure: the DCP pass base class, the transform context and graph helpers.

Built on torch's own ``PassBase`` (requires -> call -> ensures, returning a ``PassResult``).
A pass here is also a plain FX pass: it has a ``name`` and is callable on a GraphModule, so a
foreign pass manager (e.g. a Neuron plugin's) can run it.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.program.facts import ModelFacts
from dcp_compile.runtime.names import META_KIND, META_LAYER, META_PASS, StepKind

if TYPE_CHECKING:
    from .prove.certificate import Certificate

class Property(str, Enum):
    """What a graph is known to hold at a point of the pipeline. A capture gives some
    (``StepCapture.provides``); each pass states those it needs before it runs
    (``DCPPass.required``) and those it makes hold (``DCPPass.ensured``), and building a
    row of the pipeline checks the order (``pipeline.check_order``)."""

    ATEN_GRAPH = "aten_graph"                    # captured ATen graph, meta['val'] on nodes
    NO_EXPORT_ASSERTS = "no_export_asserts"      # no _assert_tensor_metadata left
    STATIC_SHAPES = "static_shapes"              # no symbolic size anywhere
    STATE_SNAPSHOTS_READ = "state_snapshots_read"  # a step with state_snapshot_slot: every
                                                 # recurrent op reads it
    CANONICAL_OPS = "canonical_ops"              # linears, slices and splits in one form
    LATENT_ABSORBED = "latent_absorbed"          # MLA attends in latent space (one KV head)
    PAGED_CACHE = "paged_cache"                  # step signature: caches are inputs,
                                                 # attention a dcp.paged_attention
    POSITIONS_LIFTED = "positions_lifted"        # positional values read the positions input
    CANONICAL_ATTENTION = "canonical_attention"  # one dcp.attention per layer
    CANONICAL_MOE = "canonical_moe"              # one dcp.moe per experts block, checked
    TOKEN_WISE = "token_wise"                    # no op outside attention mixes tokens or
                                                 # depends on the sequence length
    PROVEN = "proven"                            # config validated, layout certificate
    RANK_INPUT = "rank_input"                    # the tp_rank input
    TP_SHARDED = "tp_sharded"                    # weights and ops cut by tensor parallelism
    SEQUENCE_PARALLEL = "sequence_parallel"      # prefill tokens laid out per rank
    DCP_REWRITTEN = "dcp_rewritten"              # attention in its DCP form

    def __str__(self) -> str:
        return self.value


# What a captured step graph holds before any pass (a frontend's capture may give more).
CAPTURED: frozenset[Property] = frozenset({Property.ATEN_GRAPH})


# Kinds of inserted nodes (for history, structure tests and dump highlighting).
KIND_COLLECTIVE = "collective"
KIND_SLICE = "slice"
KIND_MASK = "mask"
KIND_CACHE_WRITE = "cache_write"
KIND_LSE = "lse_combine"
KIND_ATTENTION = "attention"
KIND_SHARD = "shard"
KIND_RANK = "rank"


@dataclass
class TransformContext:
    """What every pass may read: the layout, the step kind, and what is known so far.

    Passes do not write it: a pass returns what it found (:class:`Found`), and
    ``DCPPass.__call__`` merges that in (:meth:`take`) for the passes after it (whichever
    pass manager runs them).
    """

    config: DCPConfig
    step: StepKind | str                         # a StepKind (plain strings compare equal)
    facts: ModelFacts = field(default_factory=ModelFacts)
    # parameter placeholder name -> ShardSpec (found by shard_tensor_parallel).
    shards: dict[str, Any] = field(default_factory=dict)
    certificate: Certificate | None = None

    def take(self, found: "Found") -> None:
        """Merge what a pass found: later passes (and the driver) read it from here."""
        self.facts = self.facts.merged(found.facts)
        if found.config is not None:
            self.config = found.config
        if found.certificate is not None:
            self.certificate = found.certificate
        self.shards.update(found.shards)


class Found(PassResult):
    """A pass's result with what it found: model facts, the validated config and its
    certificate, weight shards; ``DCPPass.__call__`` hands it to the context."""

    def __new__(cls, graph_module: GraphModule, modified: bool, *,
                facts: ModelFacts | None = None, config: DCPConfig | None = None,
                certificate: Certificate | None = None, shards: dict | None = None):
        self = super().__new__(cls, graph_module, modified)
        self.facts, self.config, self.certificate = facts, config, certificate
        self.shards = dict(shards or {})
        return self


class DCPPass(PassBase):
    """A named rewrite with a context; records what it matched and what it inserted."""

    name: str = "dcp_pass"
    # What the graph must hold before the pass runs, and what holds after it (the pipeline
    # checks a row's order by them; ``requires``/``ensures`` check the graph itself).
    required: ClassVar[frozenset[Property]] = frozenset()
    ensured: ClassVar[frozenset[Property]] = frozenset()

    def __init__(self, ctx: TransformContext):
        super().__init__()
        self.ctx = ctx
        self.matched: dict[str, Any] = {}
        self.inserted: Counter = Counter()

    def __call__(self, gm: GraphModule) -> PassResult | None:
        """PassBase's requires -> call -> ensures; then what the pass found goes to the
        context, where the next pass and the driver read it."""
        result = super().__call__(gm)
        if isinstance(result, Found):
            self.ctx.take(result)
        return result

    def call(self, gm: GraphModule) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def record(self, **matched) -> None:
        self.matched.update(matched)

    def tag(self, node: Node, kind: str, layer: int | None = None) -> Node:
        """Mark an inserted node with its kind (and layer) and count it."""
        node.meta[META_KIND] = kind
        node.meta[META_PASS] = self.name
        if layer is not None:
            node.meta[META_LAYER] = layer
        self.inserted[kind] += 1
        return node


def ensure(ok: bool, pass_name: str, what: str, values) -> None:
    """A pass's post-condition (its ``ensures``): raise, never ``assert``, which ``python -O``
    strips. ``what`` says what is wrong, ``values`` names the offending nodes or values."""
    if not ok:
        raise DCPTransformError(
            f"pass {pass_name} broke its post-condition, {what}: {values}. This is a bug in "
            f"the pass; report it with the model that triggers it.")


# ------------------------------------------------------------------------------------------
# Graph helpers shared by passes
# ------------------------------------------------------------------------------------------


def attention_nodes(gm: GraphModule, target=None) -> list[Node]:
    target = target or torch.ops.dcp.attention.default
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def ancestors(n: Node) -> set[Node]:
    """Every node ``n`` reads, directly or through others (not ``n`` itself)."""
    seen, stack = set(), [n]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def linears_reached(starts: list[Node], onward, stop=frozenset()) -> list[Node]:
    """The ``aten.linear`` nodes reached from ``starts`` following ``onward`` (a node's inputs
    or its users), not going past a linear nor past a call of a target in ``stop``."""
    out, seen, stack = [], set(), list(starts)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target == torch.ops.aten.linear.default:
            out.append(n)
        elif n.op == "call_function" and n.target not in stop:
            stack.extend(onward(n))
    return out


def getitem_users(node: Node) -> dict[int, Node]:
    """index -> the getitem node that reads that output of a multi-output node."""
    out = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            out[user.args[1]] = user
    return out


def placeholder(gm: GraphModule, name: str) -> Node:
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name == name:
            return n
    raise DCPTransformError(f"graph has no input named {name!r}: inputs are "
                            f"{[n.name for n in gm.graph.nodes if n.op == 'placeholder']}.")


def val(node: Node):
    """The node's fake value (meta['val']), which the pass manager keeps accurate."""
    v = node.meta.get("val")
    if v is None:
        raise DCPTransformError(f"node {node.name} has no meta['val']; the pass manager "
                                f"re-propagates shapes after every pass.")
    return v


def source_of(node: Node) -> str:
    """'File "...", line N, in fn' of the user code a node came from, for error messages."""
    trace = node.meta.get("stack_trace") or ""
    frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    if frames:
        return frames[-1]
    stack = node.meta.get("nn_module_stack")
    if stack:
        return f"module {list(stack.values())[-1][0]}"
    return "source unknown"


# -- graph edits shared by the canonicalizing rewrites (attention_forms, heads_in_batch,
# canonical_ops, regroup_fused_qkv, untile_kv_heads) ----------------------------------

def replace_node(gm: GraphModule, n: Node, target, args) -> Node:
    """``n`` replaced by ``target(*args)``, same value and source (meta kept)."""
    with gm.graph.inserting_before(n):
        new = gm.graph.call_function(target, tuple(args))
    new.meta.update(n.meta)
    n.replace_all_uses_with(new)
    gm.graph.erase_node(n)
    return new


def call_like(gm: GraphModule, at: Node, target, args) -> Node:
    """``target(*args)`` inserted before ``at``, with ``at``'s source and its own fake value
    (a rewrite that chains several steps reads the values of the nodes it made)."""
    with gm.graph.inserting_before(at):
        new = gm.graph.call_function(target, tuple(args))
    new.meta.update({k: v for k, v in at.meta.items() if k != "val"})
    fakes = torch.fx.node.map_arg(new.args, lambda x: val(x))
    with detect_fake_mode([v for v in fakes if isinstance(v, torch.Tensor)]):
        new.meta["val"] = target(*fakes)
    return new
