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
size), ``interleave_size``, ``kv_role``, ``expert_parallel`` (a mixture-of-experts model's
experts partitioned over the tp ranks instead of cut by TP; as ``transform()``'s),
``dump_dir`` (else ``$DCP_COMPILE_DUMP/backend-<mode>``).

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
   (S == 1) graphs, prefill mode "prefill". Steps 1-3 are the Dynamo frontend
   (:mod:`dcp_compile.frontends.dynamo`). Then the one driver (``driver.compile_program``,
   as for ``transform()``) runs the step kind's row of
   ``dcp_compile.passes.pipeline.PIPELINE`` and builds the program.
4. The result is a :class:`DCPCompiledStep` (``dcp_compile.runtime.serving.compiled_step``): on its first call
   on a rank it binds the topology's process groups (``dcp_compile.runtime.distributed.world.bind_roles``, once per
   world) and cuts this rank's weight shards from the weights Dynamo passes in; every call
   runs this rank's program. It needs an initialised torch.distributed world of ``tp`` ranks
   (torchrun + ``dcp_compile.runtime.distributed.launch.init_distributed_from_env``, or a threaded world) and this
   rank's KV caches (:func:`kv_cache_spec`).
"""

from __future__ import annotations

import sys
import threading
import types
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.fx import GraphModule

from dcp_compile.runtime.kernels import ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime.serving.compiled_step import DCPCompiledStep
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPConfigError, DCPError, DCPTransformError
from dcp_compile.runtime.names import Mode, StepKind

from .frontends.dynamo import DynamoFrontend

__all__ = ["BackendOptions", "DCPCompiledStep", "build_program", "dcp_backend",
           "kv_cache_spec", "make_backend"]

_OPTION_KEYS = ("tp", "dcp", "mode", "block_size", "interleave_size", "kv_role",
                "expert_parallel", "dump_dir", "compile")


@dataclass(frozen=True)
class BackendOptions:
    """The backend's options; ``tp=None`` means the world size at compile time."""

    dcp: int
    tp: int | None = None
    mode: str = Mode.DECODE
    block_size: int | None = None
    interleave_size: int | None = None
    kv_role: str | None = None
    expert_parallel: bool = False  # MoE experts partitioned over tp (else TP-cut)
    dump_dir: str | None = None
    compile: str = "eager"        # how each rank runs its graph: "eager" | "inductor"

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
        if not isinstance(opts.expert_parallel, bool):
            raise DCPConfigError(f"backend 'dcp' option expert_parallel="
                                 f"{opts.expert_parallel!r} is not a bool. Pass True or False.")
        from dcp_compile.runtime.serving.rank_program import COMPILERS
        if opts.compile not in COMPILERS:
            raise DCPConfigError(f"unknown compile mode for backend 'dcp': "
                                 f"compile={opts.compile!r}. Pass one of {sorted(COMPILERS)}.")
        if opts.tp is not None:  # validate what can be validated before the model is seen
            DCPConfig(tp=opts.tp, dcp=opts.dcp, mode=opts.mode,
                      block_size=opts.block_size or 16, interleave_size=opts.interleave_size,
                      kv_role=opts.kv_role, expert_parallel=opts.expert_parallel)
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


def kv_cache_spec(model, *, tp: int, dcp: int, num_blocks: int, mode: str = Mode.DECODE,
                  block_size: int = 16, dtype: torch.dtype | None = None):
    """This rank's KV caches for ``model`` compiled with backend "dcp" (``.allocate()`` them).

    A rank holds ``kv_heads_per_rank`` KV heads (KV heads sharded by TP, replicated when
    there are fewer than the attention shard) and ``num_blocks`` blocks of ``block_size``
    of its own positions; block ``num_blocks - 1`` is the garbage block.
    """
    from dcp_compile.runtime.serving.kv_cache import KVCacheSpec

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


def build_step(gm: GraphModule, example_inputs: list, opts: BackendOptions
               ) -> DCPCompiledStep:
    """Compile one Dynamo graph into this process's runnable step (all ranks share it)."""
    program, capture = build_program(gm, example_inputs, opts)
    return DCPCompiledStep(program, capture.step,
                           weight_args=[i for _, i in capture.weights],
                           user_args=[i for _, i in capture.user], compile=opts.compile)


def build_program(gm: GraphModule, example_inputs: list, opts: BackendOptions):
    """The DCPProgram (one step kind) of a Dynamo graph, and how its inputs map to Dynamo's.

    The Dynamo frontend captures the graph; the one driver (``driver.compile_program``)
    runs the pipeline and builds the program. Usable outside torch.compile on a graph a
    capturing backend kept (tests do this).
    """
    from .driver import CompileOptions, compile_program

    frontend = DynamoFrontend(gm, example_inputs, opts.mode)
    capture = frontend.captured
    config = DCPConfig(tp=opts.resolved_tp(), dcp=opts.dcp, mode=opts.mode,
                       block_size=opts.block_size or capture.block_size,
                       interleave_size=opts.interleave_size, kv_role=opts.kv_role,
                       expert_parallel=opts.expert_parallel)
    program = compile_program(frontend, config, CompileOptions(
        dump_dir=opts.dump_dir, dump=_writes_dump(), certificate=_certificate_for(config),
        check=False))
    _remember_certificate(program.config, program.certificate)
    return program, capture


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

    from dcp_compile.runtime.distributed.world import current_rank
    if not (dist.is_available() and dist.is_initialized()) or current_rank() is not None:
        return True
    return dist.get_rank() == 0


# ------------------------------------------------------------------------------------------
# Several compiled steps as one program
# ------------------------------------------------------------------------------------------


def merge_programs(*programs):
    """One DCPProgram holding the graphs of several compiled steps (same config, weights);
    e.g. the "context" and "decode" programs of one model, for the threaded verifier."""
    first = programs[0]
    merged = replace(first, graphs=dict(first.graphs), shards=dict(first.shards),
                     report=replace(first.report, history=list(first.history)))
    for p in programs[1:]:
        if p.config != first.config or p.weight_inputs != first.weight_inputs:
            raise DCPTransformError("programs to merge differ in config or weight inputs.")
        merged.graphs.update(p.graphs)
        merged.report = merged.report.merged(p.report)
        merged.shards.update(p.shards)
        if StepKind.DECODE not in p.graphs:
            merged.shapes = p.shapes
    return merged
