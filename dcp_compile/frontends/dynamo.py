"""The Dynamo frontend (the torch.compile backend): a Dynamo graph -> an ATen graph in the
program's calling convention (the sibling of :mod:`dcp_compile.capture`, which captures an
nn.Module with torch.export). :class:`DynamoFrontend` hands it to the driver.

1. The Dynamo graph must be the whole step: a graph break raises :class:`DCPTransformError`
   naming the break (:func:`check_whole_step`), since the rest of the model would run
   eagerly and unsharded.
2. AOTAutograd (``aot_export_module``, pre-dispatch, forward only) gives the ATen graph;
   ``aten.linear`` and our ``dcp`` ops stay whole, like transform()'s torch.export capture.
   Dynamo lifts parameters and buffers to graph inputs: they become the program's weight
   inputs, named as transform() names them (``p_layers_0_self_attn_q_proj_weight``).
3. The placeholders are put in the program calling convention (weights, then input_ids,
   positions, block_table, kv_caches in layer order) and the step kind is picked from the
   attention's token dimension: decode mode captures "context" (S > 1) and "decode"
   (S == 1) graphs, prefill mode "prefill".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule

from dcp_compile.runtime.errors import DCPError, DCPTransformError
from dcp_compile.runtime.program.facts import ModelFacts
from dcp_compile.runtime.names import Mode, StepKind

from ..capture import refuse_mutation
from .protocol import PAGED_STEP, StepCapture

__all__ = ["DynamoCapture", "DynamoFrontend", "capture_dynamo", "check_whole_step"]


@dataclass
class DynamoCapture:
    gm: GraphModule
    weights: list[tuple[str, int]]       # (placeholder name, Dynamo argument index)
    user: list[tuple[str, int]]          # input_ids, positions, block_table, caches...
    step: str
    shapes: Any                          # dcp_compile.runtime.serving.engine.StepShapes
    num_layers: int
    block_size: int
    kv_heads: int                        # heads of the KV caches passed in
    dtype: torch.dtype


def check_whole_step(gm: GraphModule) -> None:
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and getattr(reason, "graph_break", False):
        where = reason.user_stack[-1] if reason.user_stack else None
        at = f" at {where.filename}:{where.lineno} ({where.line})" if where else ""
        lines = [ln.strip() for ln in str(reason.reason).splitlines() if ln.strip()]
        why = " - ".join(lines[:2]) or "graph break"
        raise DCPTransformError(
            f"graph break in the compiled model{at}: {why.rstrip('.')}. Backend 'dcp' "
            f"shards the whole step or nothing; a partial graph would leave the rest of the "
            f"model running eagerly, unsharded. Remove the break (no print, .item(), "
            f"data-dependent branch or unsupported call in forward), and compile with "
            f"fullgraph=True to see every break.")


def _source_name(node) -> str:
    """Dynamo's source of a graph input (``L['self']._modules['lm_head']._parameters[
    'weight']``), or, once Dynamo has dropped that meta, its flat placeholder name."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    return source.name if source is not None and hasattr(source, "name") else node.name


def _input_kind(source: str, example) -> str:
    if "._parameters[" in source or "_parameters_" in source \
            or isinstance(example, torch.nn.Parameter):
        return "param"
    if "._buffers[" in source or "_buffers_" in source:
        return "buffer"
    return "input"


def _readable_name(source: str, kind: str) -> str:
    """Dynamo source -> transform()'s placeholder names (p_<fqn>, b_<fqn>, input names)."""
    parts = [a or b for a, b in re.findall(r"\['([^']*)'\]|\[(\d+)\]", source)]
    parts = [p for p in parts if p not in ("self",)]
    if parts:
        name = "_".join(parts)
    else:  # a flat name: L_self_modules_lm_head_parameters_weight_ -> lm_head_weight
        name = re.sub(r"^[lL]_(self_)?", "", source).strip("_")
        name = re.sub(r"(^|_)(modules|parameters|buffers)_", r"\1", name)
    name = re.sub(r"\W", "_", name).strip("_") or "arg"
    if name[0].isdigit():
        name = f"arg_{name}"
    return {"param": f"p_{name}", "buffer": f"b_{name}"}.get(kind, name)


def capture_dynamo(gm: GraphModule, example_inputs: list, mode: str) -> DynamoCapture:
    from torch._functorch.aot_autograd import aot_export_module
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from dcp_compile.passes.propagation import repropagate
    from dcp_compile.runtime.serving.engine import StepShapes

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = []
    for node, example in zip(placeholders, example_inputs):
        source = _source_name(node)
        if not isinstance(example, torch.Tensor):
            raise DCPTransformError(
                f"graph input {source} is a {type(example).__name__}, not a tensor: the "
                f"graph has dynamic shapes or non-tensor inputs. DCP programs have static "
                f"shapes: compile with torch.compile(..., dynamic=False).")
        kinds.append(_input_kind(source, example))
    if next(gm.parameters(), None) is not None:
        raise DCPTransformError(
            "the Dynamo graph holds parameters as attributes (torch._dynamo.config."
            "inline_inbuilt_nn_modules is off): backend 'dcp' needs them as graph inputs. "
            "Leave inline_inbuilt_nn_modules at its default (True).")

    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
    fakes = [x if isinstance(x, FakeTensor) else fake_mode.from_tensor(x, static_shapes=True)
             for x in example_inputs]
    for x in fakes:
        if any(not isinstance(s, int) for s in x.shape):
            raise DCPTransformError(
                f"graph input of shape {tuple(x.shape)} is dynamic: DCP programs have static "
                f"shapes (one graph per step kind). Compile with "
                f"torch.compile(..., dynamic=False).")
    try:
        with torch.no_grad(), fake_mode:
            aten, sig = aot_export_module(gm, fakes, trace_joint=False, pre_dispatch=True)
    except DCPError:
        raise
    except Exception as e:
        raise DCPTransformError(f"AOTAutograd could not lower the Dynamo graph to ATen: "
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                                f". The model must trace with static shapes and no "
                                f"data-dependent control flow.") from e
    refuse_mutation(list(sig.user_inputs_to_mutate) + list(sig.buffers_to_mutate))

    new = [n for n in aten.graph.nodes if n.op == "placeholder"]
    if len(new) != len(placeholders):
        raise DCPTransformError(f"AOTAutograd changed the number of graph inputs "
                                f"({len(placeholders)} -> {len(new)}); cannot map them back.")
    taken: set[str] = set()
    by_index = {}
    for i, (node, old, kind, fake) in enumerate(zip(new, placeholders, kinds, fakes)):
        name = _readable_name(_source_name(old), kind)
        base, k = name, 1
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        node.target = name
        node._rename(name)
        node.meta["val"] = fake
        by_index[i] = (node, kind)
    aten.recompile()
    repropagate(aten)

    attention = [n for n in aten.graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.dcp.paged_attention.default, torch.ops.dcp.attention.default)]
    weights = [(node.name, i) for i, (node, kind) in by_index.items() if kind != "input"]
    inputs = {node: i for i, (node, kind) in by_index.items() if kind == "input"}
    if not attention:
        # The pipeline's canonicalization names the problem (no or unrecognised attention).
        user = [(n.name, i) for n, i in inputs.items()] or [(new[0].name, 0)]
        return DynamoCapture(aten, weights, user,
                             StepKind.DECODE if mode == Mode.DECODE else StepKind.PREFILL,
                             StepShapes(), 0, 16, 0, torch.float32)
    user = _step_inputs(attention, inputs)
    _reorder_placeholders(aten, [by_index[i][0] for _, i in weights]
                          + [by_index[i][0] for _, i in user])

    q, kc = attention[0].args[0].meta["val"], attention[0].args[3].meta["val"]
    batch, tokens = q.shape[0], q.shape[1]
    if mode == Mode.PREFILL:
        step = StepKind.PREFILL
    else:
        step = StepKind.DECODE if tokens == 1 else StepKind.CONTEXT
    table = attention[0].args[6].meta["val"]
    shapes = StepShapes(batch=batch, context_len=tokens, max_blocks=table.shape[1],
                        num_blocks=kc.shape[0])
    return DynamoCapture(aten, weights, user, step, shapes, len(attention), kc.shape[1],
                         kc.shape[2], kc.dtype)


def _step_inputs(attention, inputs: dict) -> list[tuple[str, int]]:
    """Dynamo indices of (input_ids, positions, block_table, k_0, v_0, k_1, ...)."""
    def placeholder_arg(node, idx, what):
        arg = node.args[idx]
        if getattr(arg, "op", None) != "placeholder" or arg not in inputs:
            raise DCPTransformError(
                f"attention node {node.name} reads its {what} from {getattr(arg, 'name', arg)}"
                f", not from a step input: backend 'dcp' needs the step signature "
                f"forward(input_ids, positions, block_table, kv_caches) with positions, the "
                f"block table and the caches passed to the attention op as they come in.")
        return arg

    positions = {placeholder_arg(n, 5, "positions") for n in attention}
    tables = {placeholder_arg(n, 6, "block table") for n in attention}
    if len(positions) != 1 or len(tables) != 1:
        raise DCPTransformError("attention layers read different positions or block tables: "
                                "every layer must attend with the step's own.")
    caches = []
    for n in attention:
        caches += [placeholder_arg(n, 3, "key cache"), placeholder_arg(n, 4, "value cache")]
    known = positions | tables | set(caches)
    rest = [n for n in inputs if n not in known]
    if len(rest) != 1:
        raise DCPTransformError(
            f"the compiled step has inputs {[n.name for n in inputs]}; backend 'dcp' needs "
            f"exactly input_ids besides positions, block_table and the KV caches (found "
            f"{[n.name for n in rest]}). Use the step signature forward(input_ids, positions, "
            f"block_table, kv_caches) (Hugging Face models: dcp_compile.hf.prepare).")
    order = rest + [positions.pop(), tables.pop()] + caches
    return [(n.name, inputs[n]) for n in order]


def _reorder_placeholders(gm: GraphModule, order: list) -> None:
    anchor = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for node in order:
        anchor.prepend(node)
    gm.recompile()



class DynamoFrontend:
    """One Dynamo graph, captured on construction (its attention decides the step kind and
    the shapes); no prologue, no reference (the backend does not check)."""

    source = "torch.compile backend"
    dump_name = "backend"

    def __init__(self, gm: GraphModule, example_inputs: list, mode: str):
        import time
        check_whole_step(gm)
        start = time.perf_counter()
        self.captured = capture_dynamo(gm, example_inputs, mode)
        self.seconds = time.perf_counter() - start
        self.shapes = self.captured.shapes

    def steps(self, mode: str) -> tuple[str, ...]:
        return (self.captured.step,)

    def at_shapes(self, shapes) -> "DynamoFrontend":
        raise DCPTransformError(
            "context buckets need transform(model, buckets=...): the torch.compile backend "
            "gets one graph from Dynamo, at the shapes it was called with.")

    def capture(self, step: str, config) -> StepCapture:
        c = self.captured
        return StepCapture(c.gm, [name for name, _ in c.user],
                           [name for name, _ in c.weights], self.seconds, provides=PAGED_STEP)

    def prologue(self, ctx, captured: StepCapture) -> list:
        return []

    def facts(self) -> ModelFacts:
        return ModelFacts(num_layers=self.captured.num_layers, cache_dtype=self.captured.dtype)

    def reference(self) -> None:
        return None

    def state_cache(self, tp: int):
        return None                  # hybrids are transformed, not compiled (docs/hybrid.md)

    def accept(self, config) -> None:
        """The compiled model runs one rank's program on the caches it is given."""
        c = self.captured
        if c.kv_heads != config.kv_heads_per_rank:
            raise DCPTransformError(
                f"the KV caches passed to the compiled model have {c.kv_heads} KV heads, but "
                f"a rank of tp={config.tp}, dcp={config.dcp} ({config.mode}) holds "
                f"{config.kv_heads_per_rank}: the compiled model runs one rank's program on "
                f"that rank's caches. Allocate them with dcp_compile.backend.kv_cache_spec("
                f"model, tp={config.tp}, dcp={config.dcp}, num_blocks=...).allocate().")
