"""torch.compile backend: ``torch.compile(model, backend="dcp", options={"tp": 4, "dcp": 2})``.

The backend is registered through the ``torch_dynamo_backends`` entry point (pyproject.toml),
so after ``pip install`` the name ``"dcp"`` works without importing dcp_compile first. For
backend names, torch.compile hands ``options`` to the backend as a keyword argument
(``torch._TorchCompileWrapper``: ``compiler_fn(gm, example_inputs, options=options)``); it
refuses ``mode=`` together with ``options=``, and torch.compile's ``mode`` means Inductor's
modes, so the DCP mode goes in ``options["mode"]``. The module is also callable, as a
factory, for code that prefers an explicit callable::

    from dcp_compile import backend
    compiled = torch.compile(model, backend=backend(tp=4, dcp=2, mode="decode"))

Options: ``tp`` (default: the world size at compile time), ``dcp`` (required), ``mode``
("decode" | "prefill", default "decode"), ``block_size`` (default: the KV caches' block
size), ``interleave_size``, ``kv_role``, ``dump_dir`` (else ``$DCP_COMPILE_DUMP/backend-<mode>``).

What happens per compile (Dynamo compiles once per input shape):

1. The Dynamo graph must be the whole step: a graph break (``fullgraph=False`` with a
   print, a data-dependent branch, an unsupported call) raises :class:`DCPTransformError`
   naming the break, since the rest of the model would run eagerly and unsharded.
2. AOTAutograd (``aot_export_module``, pre-dispatch, forward only) gives the ATen graph;
   ``aten.linear`` and our ``dcp`` ops stay whole, like transform()'s torch.export capture.
   Dynamo lifts parameters and buffers to graph inputs: they become the program's weight
   inputs, named as transform() names them (``p_layers_0_self_attn_q_proj_weight``).
3. The placeholders are put in the program calling convention (weights, then input_ids,
   positions, block_table, kv_caches in layer order) and the step kind is picked from the
   attention's token dimension: decode mode compiles "context" (S > 1) and "decode"
   (S == 1) graphs, prefill mode "prefill". Then the same passes as ``transform()`` run:
   the step kind's row of ``passes.pipeline.PIPELINE`` (``pipeline.transform_graph``).
4. The result is a :class:`DCPCompiledStep`: on its first call on a rank it binds the
   topology's process groups (``runtime.world.bind_roles``, once per world) and cuts this
   rank's weight shards from the weights Dynamo passes in; every call runs this rank's
   program. It needs an initialised torch.distributed world of ``tp`` ranks (torchrun +
   ``runtime.launch.init_distributed_from_env``, or a threaded world) and this rank's KV
   caches (:func:`kv_cache_spec`).
"""

from __future__ import annotations

import re
import sys
import threading
import types
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.fx import GraphModule

from runtime import ops  # noqa: F401  (registers torch.ops.dcp.*)
from runtime.config import DCPConfig
from runtime.errors import DCPConfigError, DCPError, DCPTransformError, DCPWorldError

__all__ = ["BackendOptions", "DCPCompiledStep", "build_program", "dcp_backend",
           "kv_cache_spec", "make_backend"]

BACKEND_NAME = "dcp"
_OPTION_KEYS = ("tp", "dcp", "mode", "block_size", "interleave_size", "kv_role", "dump_dir")


@dataclass(frozen=True)
class BackendOptions:
    """The backend's options; ``tp=None`` means the world size at compile time."""

    dcp: int
    tp: int | None = None
    mode: str = "decode"
    block_size: int | None = None
    interleave_size: int | None = None
    kv_role: str | None = None
    dump_dir: str | None = None

    @classmethod
    def from_dict(cls, options: dict | None) -> "BackendOptions":
        options = dict(options or {})
        unknown = sorted(set(options) - set(_OPTION_KEYS))
        if unknown:
            raise DCPConfigError(f"unknown torch.compile options for backend 'dcp': {unknown}. "
                                 f"Known options: {list(_OPTION_KEYS)}.")
        if "dcp" not in options:
            raise DCPConfigError("backend 'dcp' needs the DCP degree: options has no 'dcp'. "
                                 "Pass options={'tp': 4, 'dcp': 2} (dcp=1 is plain TP).")
        opts = cls(**options)
        if opts.tp is not None:  # validate what can be validated before the model is seen
            DCPConfig(tp=opts.tp, dcp=opts.dcp, mode=opts.mode,
                      block_size=opts.block_size or 16, interleave_size=opts.interleave_size,
                      kv_role=opts.kv_role)
        return opts

    def resolved_tp(self) -> int:
        if self.tp is not None:
            return self.tp
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        raise DCPConfigError("backend 'dcp' needs tp: options has no 'tp' and no "
                             "torch.distributed world is initialised to take it from. Pass "
                             "options={'tp': N, ...} or compile inside the world.")


# ------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------


def dcp_backend(gm: GraphModule, example_inputs: list, options: dict | None = None,
                mode: str | None = None):
    """The ``torch.compile(backend="dcp", options={...})`` entry (see the module doc)."""
    if mode not in (None, "default"):
        raise DCPConfigError(
            f"torch.compile(mode={mode!r}) selects Inductor's modes; backend 'dcp' has none. "
            f"Pass the DCP mode as an option: options={{'mode': 'decode'}} (or 'prefill').")
    return _compile_or_raise(gm, example_inputs, BackendOptions.from_dict(options))


def make_backend(**options):
    """An explicit backend callable: ``torch.compile(model, backend=make_backend(tp=4, dcp=2))``
    (also reachable as ``dcp_compile.backend(tp=4, dcp=2)``)."""
    opts = BackendOptions.from_dict(options)

    def dcp(gm, example_inputs):
        return _compile_or_raise(gm, example_inputs, opts)

    dcp.options = opts
    return dcp


class _CallableModule(types.ModuleType):
    """``dcp_compile.backend(tp=..., dcp=...)``: the module doubles as the backend factory."""

    def __call__(self, **options):
        return make_backend(**options)


sys.modules[__name__].__class__ = _CallableModule


def kv_cache_spec(model, *, tp: int, dcp: int, num_blocks: int, mode: str = "decode",
                  block_size: int = 16, dtype: torch.dtype | None = None):
    """This rank's KV caches for ``model`` compiled with backend "dcp" (``.allocate()`` them).

    A rank holds ``kv_heads_per_rank`` KV heads (KV heads sharded by TP, replicated when
    there are fewer than the attention shard) and ``num_blocks`` blocks of ``block_size``
    of its own positions; block ``num_blocks - 1`` is the garbage block.
    """
    from runtime.kv_cache import KVCacheSpec

    shape = model.kv_cache_shape(num_blocks, block_size)
    cfg = DCPConfig(tp=tp, dcp=dcp, mode=mode, block_size=block_size, num_kv_heads=shape[2],
                    head_dim=shape[3])
    if dtype is None:
        params = list(model.parameters())
        dtype = params[0].dtype if params else torch.float32
    return KVCacheSpec(model.num_layers, num_blocks, block_size, cfg.kv_heads_per_rank,
                       shape[3], dtype)


def _compile_or_raise(gm, example_inputs, opts: BackendOptions):
    try:
        return build_step(gm, example_inputs, opts)
    except DCPError as e:
        error = e
    except Exception as e:  # noqa: BLE001
        # Never let Dynamo treat our failure as "fall back to eager": some exception types
        # (fake-tensor ones) would make it run this graph unsharded.
        error = DCPTransformError(f"backend 'dcp' could not compile the graph: "
                                  f"{type(e).__name__}: {e}")
        error.__cause__ = e
    if torch._dynamo.config.suppress_errors:
        # Dynamo would swallow a compile error and run the model eagerly (unsharded):
        # hand back a graph that raises instead.
        return _Raiser(error)
    raise error


class _Raiser:
    def __init__(self, error: Exception):
        self.error = error

    def __call__(self, *args):
        raise self.error


# ------------------------------------------------------------------------------------------
# Compile: Dynamo graph -> ATen graph -> passes -> DCPProgram of one step kind
# ------------------------------------------------------------------------------------------

_certificates: dict[tuple[int, int, int], Any] = {}
_certificates_lock = threading.Lock()


@dataclass
class _Capture:
    gm: GraphModule
    weights: list[tuple[str, int]]       # (placeholder name, Dynamo argument index)
    user: list[tuple[str, int]]          # input_ids, positions, block_table, caches...
    step: str
    shapes: Any                          # runtime.engine.StepShapes
    num_layers: int
    block_size: int
    kv_heads: int                        # heads of the KV caches passed in
    dtype: torch.dtype


def build_step(gm: GraphModule, example_inputs: list, opts: BackendOptions
               ) -> "DCPCompiledStep":
    """Compile one Dynamo graph into this process's runnable step (all ranks share it)."""
    program, capture = build_program(gm, example_inputs, opts)
    return DCPCompiledStep(program, capture.step,
                           weight_args=[i for _, i in capture.weights],
                           user_args=[i for _, i in capture.user])


def build_program(gm: GraphModule, example_inputs: list, opts: BackendOptions):
    """The DCPProgram (one step kind) of a Dynamo graph, and how its inputs map to Dynamo's.

    Usable outside torch.compile on a graph a capturing backend kept (tests do this).
    """
    from passes.dump import dump_root_for, pass_dump

    from .pipeline import transform_graph
    from runtime.dcp_program import DCPProgram
    from runtime.topology import topology

    _check_whole_step(gm)
    capture = _capture_aten(gm, example_inputs, opts.mode)
    tp = opts.resolved_tp()
    block = opts.block_size or capture.block_size
    config = DCPConfig(tp=tp, dcp=opts.dcp, mode=opts.mode, block_size=block,
                       interleave_size=opts.interleave_size, kv_role=opts.kv_role)
    dump_root = dump_root_for("backend", config.mode, opts.dump_dir) if _writes_dump() \
        else None
    dump = pass_dump(dump_root, capture.step, source="torch.compile backend", config=config)
    ctx = None
    try:
        out, records, ctx = transform_graph(
            capture.gm, config, capture.step, first_user_input=capture.user[0][0],
            model_facts={"num_layers": capture.num_layers},
            certificate=_certificate_for(config), on_pass=dump)
    finally:  # a failed pass leaves the dump up to it
        if dump is not None:
            dump.close(getattr(ctx, "config", None), getattr(ctx, "certificate", None))
    cfg = ctx.config
    _remember_certificate(cfg, ctx.certificate)
    if capture.kv_heads != cfg.kv_heads_per_rank:
        raise DCPTransformError(
            f"the KV caches passed to the compiled model have {capture.kv_heads} KV heads, but "
            f"a rank of tp={cfg.tp}, dcp={cfg.dcp} ({cfg.mode}) holds {cfg.kv_heads_per_rank}: "
            f"the compiled model runs one rank's program on that rank's caches. Allocate them "
            f"with dcp_compile.backend.kv_cache_spec(model, tp={cfg.tp}, dcp={cfg.dcp}, "
            f"num_blocks=...).allocate().")
    program = DCPProgram(
        config=cfg, topology=topology(cfg.tp, cfg.dcp, cfg.mode, config=cfg),
        certificate=ctx.certificate, graphs={capture.step: out}, history=records,
        shapes=capture.shapes, constants={}, shards=dict(ctx.shards),
        weight_inputs=[name for name, _ in capture.weights], num_layers=capture.num_layers,
        dump_dir=str(dump_root) if dump_root is not None else None,
        facts={"dtype": capture.dtype, "source": "torch.compile"})
    return program, capture


def _check_whole_step(gm: GraphModule) -> None:
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


def _capture_aten(gm: GraphModule, example_inputs: list, mode: str) -> _Capture:
    from torch._functorch.aot_autograd import aot_export_module
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from passes.manager import repropagate
    from runtime.engine import StepShapes

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
    if sig.user_inputs_to_mutate or sig.buffers_to_mutate:
        raise DCPTransformError(
            f"the model mutates its inputs or buffers in place "
            f"({list(sig.user_inputs_to_mutate) + list(sig.buffers_to_mutate)}): KV caches "
            f"must be written functionally (return the new caches, as dcp.paged_attention "
            f"does).")

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
        return _Capture(aten, weights, user, "decode" if mode == "decode" else "prefill",
                        StepShapes(), 0, 16, 0, torch.float32)
    user = _step_inputs(attention, inputs)
    _reorder_placeholders(aten, [by_index[i][0] for _, i in weights]
                          + [by_index[i][0] for _, i in user])

    q, kc = attention[0].args[0].meta["val"], attention[0].args[3].meta["val"]
    batch, tokens = q.shape[0], q.shape[1]
    if mode == "prefill":
        step = "prefill"
    else:
        step = "decode" if tokens == 1 else "context"
    table = attention[0].args[6].meta["val"]
    shapes = StepShapes(batch=batch, context_len=tokens, max_blocks=table.shape[1],
                        num_blocks=kc.shape[0])
    return _Capture(aten, weights, user, step, shapes, len(attention), kc.shape[1],
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


def _certificate_for(config: DCPConfig):
    with _certificates_lock:
        return _certificates.get((config.dcp, config.interleave_size, config.block_size))


def _remember_certificate(config: DCPConfig, certificate) -> None:
    if certificate is not None and getattr(certificate, "ok", False):
        with _certificates_lock:
            _certificates[(config.dcp, config.interleave_size, config.block_size)] = \
                certificate


def _writes_dump() -> bool:
    """Rank 0 writes the dump (every rank compiles the same SPMD graph); in a threaded world
    the one compiling thread does."""
    import torch.distributed as dist

    from runtime.world import current_rank
    if not (dist.is_available() and dist.is_initialized()) or current_rank() is not None:
        return True
    return dist.get_rank() == 0


# ------------------------------------------------------------------------------------------
# Run: this rank's program inside the initialised world
# ------------------------------------------------------------------------------------------

# (id of the default group, topology key) -> (default group, role -> group name): bind once
# per world. The group object is kept so that its id cannot be reused by a later world.
_bound: dict[tuple, tuple[Any, dict[str, str]]] = {}
_bound_lock = threading.Lock()


def _group_names(topo, rank: int) -> dict[str, str]:
    import torch.distributed as dist

    from runtime.world import bind_roles
    world = dist.group.WORLD
    key = (id(world), rank, topo.tp, topo.dcp, topo.mode,
           tuple((r, tuple(map(tuple, g))) for r, g in topo.groups.items()))
    with _bound_lock:
        hit = _bound.get(key)
    if hit is not None and hit[0] is world:
        return hit[1]
    names = bind_roles(topo, rank)  # collective: every rank reaches it on its first call
    with _bound_lock:
        _bound[key] = (world, names)
    return names


class DCPCompiledStep:
    """What backend "dcp" hands Dynamo for one graph: runs this rank's program of one step.

    ``program`` is the DCPProgram (one graph, ``step``), with history, certificate and
    weight shard specs. Weights are cut per rank on that rank's first call, from the
    weights Dynamo passes in; later weight updates are not seen (recompile instead).
    """

    def __init__(self, program, step: str, *, weight_args: list[int], user_args: list[int]):
        self.program = program
        self.step = step
        self.weight_args = weight_args
        self.user_args = user_args
        self._loaded: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, *args):
        rank = self._rank()
        loaded = self._loaded.get((id(_world()), rank))
        if loaded is None:
            loaded = self._load(rank, args)
        ids, positions, table, *caches = (args[i] for i in self.user_args)
        logits, new_caches = loaded.run(self.step, ids, positions, table, caches)
        return (logits, *new_caches)

    def _rank(self) -> int:
        import torch.distributed as dist
        tp = self.program.config.tp
        if not (dist.is_available() and dist.is_initialized()):
            raise DCPWorldError(
                f"a model compiled with backend 'dcp' (tp={tp}) runs one rank of a "
                f"torch.distributed world, and none is initialised. Launch {tp} ranks with "
                f"torchrun and call runtime.launch.init_distributed_from_env() first (or run "
                f"inside runtime.world.run_threaded).")
        if dist.get_world_size() != tp:
            raise DCPWorldError(f"world size does not match the compiled program: "
                                f"world_size={dist.get_world_size()}, tp={tp}. Launch {tp} "
                                f"ranks, or compile with options={{'tp': "
                                f"{dist.get_world_size()}}}.")
        return dist.get_rank()

    def _load(self, rank: int, args):
        program = self.program
        with self._lock:
            if not program.constants:
                program.constants = {name: args[i] for name, i in
                                     zip(program.weight_inputs, self.weight_args)}
        names = _group_names(program.topology, rank)
        loaded = program.load(rank, names)
        with self._lock:
            self._loaded[(id(_world()), rank)] = loaded
        return loaded


def _world():
    import torch.distributed as dist
    return dist.group.WORLD


def merge_programs(*programs):
    """One DCPProgram holding the graphs of several compiled steps (same config, weights);
    e.g. the "context" and "decode" programs of one model, for the threaded verifier."""
    first = programs[0]
    merged = replace(first, graphs=dict(first.graphs), history=list(first.history),
                     shards=dict(first.shards))
    for p in programs[1:]:
        if p.config != first.config or p.weight_inputs != first.weight_inputs:
            raise DCPTransformError("programs to merge differ in config or weight inputs.")
        merged.graphs.update(p.graphs)
        merged.history += p.history
        merged.shards.update(p.shards)
        if "decode" not in p.graphs:
            merged.shapes = p.shapes
    return merged

