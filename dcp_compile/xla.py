"""Run lowered programs on a real XLA compiler: PJRT CPU through jaxlib (the ``[xla]`` extra).

XLA is the compiler family whose HLO the Neuron compiler consumes, so this is the closest run
of the Neuron path we have on CPU. Each step's StableHLO module (``lowering.lower``) is
compiled once as it is, for ``num_replicas = tp`` host devices (replica r = device r = TP rank
r), and run SPMD: every replica gets its rank's weight shards and ``tp_rank``, the shared step
inputs, and its KV caches, which stay on the device between steps (the module's
``tf.aliasing_output`` donates each cache to the result that replaces it).

What XLA:CPU needs of the host:
  * ``--xla_force_host_platform_device_count=N`` in ``XLA_FLAGS`` before jax initialises its
    CPU backend (:func:`request_host_devices` sets it; too late is an error naming the flag);
  * 64-bit integers on (``jax_enable_x64``): otherwise the i64 ids / positions / block tables
    go in as i32 and execution fails.
What it cannot run (observed on jaxlib 0.10): ``ABORTING_FORMS``, refused before compiling by
:func:`check_xla_cpu_forms` (XLA would abort the whole process, not raise).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dcp_compile.runtime.errors import DCPTransformError, DCPXLAError
from dcp_compile.runtime.names import StepKind
from dcp_compile.runtime.serving.state_cache import state_rows

EXTRA = "xla"
_DEVICE_FLAG = "--xla_force_host_platform_device_count"

# How hard XLA:CPU's LLVM backend works on a module (rules as data: debug options by effort).
# Both run the same HLO passes -- the optimised HLO and its cost analysis, what a Neuron
# compiler would see of the module, are identical -- and differ only in the machine code:
# "fast" skips LLVM's expensive optimisations and compiles these small modules in about half
# the time (verification runs each step a few times); "optimized" is for timing steps.
COMPILE_EFFORT = {
    "fast": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True},
    "optimized": {},
}


# ------------------------------------------------------------------------------------------
# Collective forms XLA:CPU cannot run (rules as data)
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AbortingForm:
    op: str                         # StableHLO op name
    with_channel: bool | None       # True: only with a channel_handle; None: in any form
    what: str                       # what XLA:CPU does with it
    fix: str


ABORTING_FORMS = (
    AbortingForm("stablehlo.all_to_all", True, "aborts the process (cross-partition "
                 "all_to_all is unimplemented on CPU)",
                 "Lower all_to_all without a channel handle (cross-replica, as "
                 "lowering.emit_collectives does)"),
    AbortingForm("stablehlo.collective_permute", True, "aborts the process",
                 "Lower collective_permute without a channel handle, or express it as an "
                 "all_gather"),
    AbortingForm("stablehlo.collective_broadcast", None, "is unimplemented",
                 "Express the broadcast as an all_gather or all_reduce"),
)


def check_xla_cpu_forms(text: str, *, step: str = "module", path: str | None = None) -> None:
    """Raise DCPTransformError if ``text`` (a StableHLO module) contains a collective form
    XLA:CPU aborts on; the message names the op, its line and what to change."""
    where = f" ({path})" if path else ""
    for lineno, line in enumerate(text.splitlines(), start=1):
        for form in ABORTING_FORMS:
            m = re.search(r'"?' + re.escape(form.op) + r'\b"?', line)
            if m is None:
                continue
            has_channel = "channel_handle" in line[m.end():]
            if form.with_channel is None or has_channel == form.with_channel:
                shown = f"{form.op} with a channel_handle" if form.with_channel else form.op
                raise DCPTransformError(
                    f"step {step!r}{where} line {lineno} has {shown}, which XLA:CPU "
                    f"{form.what}: {line.strip()[:160]}. {form.fix}.")


# ------------------------------------------------------------------------------------------
# jax / jaxlib
# ------------------------------------------------------------------------------------------


def xla_available() -> tuple[bool, str]:
    """Whether jax (with jaxlib) imports here, and why not."""
    try:
        import jax  # noqa: F401
        import jaxlib  # noqa: F401
    except ImportError as e:
        return False, (f"jax/jaxlib are not installed ({e}); install the extra: "
                       f"pip install -e '.[{EXTRA}]'")
    return True, f"jax {jax.__version__}"


def request_host_devices(n: int) -> None:
    """Ask XLA:CPU for at least ``n`` host devices through XLA_FLAGS. Takes effect only if
    jax has not initialised its CPU backend yet (:func:`host_devices` checks)."""
    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(re.escape(_DEVICE_FLAG) + r"=(\d+)", flags)
    if m is not None and int(m.group(1)) >= n:
        return
    flags = re.sub(re.escape(_DEVICE_FLAG) + r"=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={n}".strip()


def _jax():
    ok, why = xla_available()
    if not ok:
        raise DCPXLAError(f"running lowered programs on XLA needs jax: {why}.")
    import jax
    jax.config.update("jax_enable_x64", True)      # i64 inputs stay i64
    return jax


def host_devices(n: int) -> list:
    """The first ``n`` XLA:CPU devices (replica r runs on device r)."""
    request_host_devices(n)
    jax = _jax()
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise DCPXLAError(
            f"XLA:CPU has {len(devices)} host device(s), the program needs {n} (one per TP "
            f"rank): jax initialised its CPU backend before {_DEVICE_FLAG} was set. Set "
            f"XLA_FLAGS={_DEVICE_FLAG}={n} before the first jax call (or run in a fresh "
            f"process).")
    return list(devices[:n])


def compile_module(source: str | bytes, devices: list, *, step: str,
                   path: str | None = None, effort: str = "optimized"):
    """Compile one StableHLO module for ``len(devices)`` replicas, one partition: ``source``
    is its text or its portable artifact (VHLO bytecode, read back to text for the check);
    ``effort`` is a key of COMPILE_EFFORT.

    jax has no public API for compiling an externally built module; this is the one place
    that uses jax.extend's backend client (``compile_and_load``), as jax's own pxla does."""
    if isinstance(source, (bytes, bytearray)):
        from .lowering import deserialize
        text = str(deserialize(bytes(source)))
    else:
        text = source
    check_xla_cpu_forms(text, step=step, path=path)
    if effort not in COMPILE_EFFORT:
        raise DCPXLAError(f"unknown compile effort {effort!r}. Use one of "
                          f"{sorted(COMPILE_EFFORT)}.")
    import numpy as np
    from jax.extend import backend as jb
    client = jb.get_backend("cpu")
    n = len(devices)
    options = jb.get_compile_options(num_replicas=n, num_partitions=1,
                                     device_assignment=np.array(devices).reshape(n, 1))
    for name, value in COMPILE_EFFORT[effort].items():
        setattr(options.executable_build_options.debug_options, name, value)
    try:
        return client.compile_and_load(source, devices, options)
    except Exception as e:        # jaxlib's XlaRuntimeError
        where = f" ({path})" if path else ""
        raise DCPXLAError(f"XLA rejected the lowered {step!r} module{where}: "
                          f"{str(e).strip()[:2000]}. Check the module with 'dcp-compile "
                          f"lower' and the lowering's contract.") from e


# ------------------------------------------------------------------------------------------
# Host <-> device
# ------------------------------------------------------------------------------------------


def _to_numpy(x: torch.Tensor):
    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        import ml_dtypes
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _to_torch(a) -> torch.Tensor:
    import ml_dtypes
    import numpy as np
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


class _Replicas:
    """Builds one jax.Array per module argument holding one buffer per replica.

    The array's sharding says "replicated", but it is only the container execute_sharded
    wants: buffer r (on device r) is what replica r reads, so the buffers may differ."""

    def __init__(self, devices: list):
        jax = _jax()
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        self.jax, self.devices = jax, devices
        self.sharding = NamedSharding(Mesh(devices, ("replica",)), PartitionSpec())

    def per_rank(self, values: list[torch.Tensor]):
        arrays = [self.jax.device_put(_to_numpy(v), d) for v, d in zip(values, self.devices)]
        return self.of_buffers(arrays)

    def same(self, value: torch.Tensor):
        return self.jax.device_put(_to_numpy(value), self.sharding)

    def of_buffers(self, buffers: list):
        return self.jax.make_array_from_single_device_arrays(
            tuple(buffers[0].shape), self.sharding, list(buffers))


# ------------------------------------------------------------------------------------------
# The executor
# ------------------------------------------------------------------------------------------


class XLAExecutor:
    """A dcp_compile.runtime.serving.engine executor running a program's lowered modules on XLA:CPU replicas.

    ``Engine(XLAExecutor(program, lower(program)), shapes, ...)`` serves requests with the
    compiled StableHLO. Every step's inputs are checked against the program's step contract
    (``StepContract.for_program``) before anything runs; ``step`` returns rank 0's logits
    after checking that every rank computed the same ones. The caches live on the devices;
    ``caches`` copies them to the host (one list per rank). ``compile_seconds[step]`` is
    each module's XLA compile time (by module name). A program with context buckets has one
    module per (step kind, bucket), each compiled once here; a step runs the module of its
    block table's width. ``source="artifact"`` compiles each module's portable
    artifact (.mlirbc bytes) instead of its text; ``fill`` is the caches' initial value;
    ``effort`` the compile effort (COMPILE_EFFORT: the verifiers below compile "fast").
    """

    SOURCES = ("text", "artifact")

    def __init__(self, program, lowered, *, fill: float = 0.0, source: str = "text",
                 effort: str = "optimized"):
        from dcp_compile.runtime.names import RANK_INPUT
        from dcp_compile.runtime.serving.step_contract import StepContract
        if source not in self.SOURCES:
            raise DCPXLAError(f"unknown module source {source!r}. Use one of {self.SOURCES}.")
        self.lowered = lowered
        self.tp = program.topology.tp
        for step, m in lowered.modules.items():      # refuse before compiling anything
            check_xla_cpu_forms(m.text, step=step, path=m.paths.get("text"))
        self.devices = host_devices(self.tp)
        self.replicas = _Replicas(self.devices)
        # (step kind, block-table width) -> executable: each (step, bucket) module compiled
        # once; a step runs the one of its table's width (the Engine picks the bucket).
        self.executables, self.compile_seconds, self.contracts = {}, {}, {}
        self.modules, self.step_seconds = {}, {}
        for name, m in lowered.modules.items():
            kind, view = m.kind or name, program.for_bucket(m.bucket or program.capacity)
            key = (kind, view.shapes.max_blocks)
            t = time.perf_counter()
            self.executables[key] = compile_module(getattr(m, source), self.devices,
                                                   step=name, path=m.paths.get(source),
                                                   effort=effort)
            self.compile_seconds[name] = time.perf_counter() - t
            self.contracts[key] = StepContract.for_program(view, kind)
            self.modules[key] = name
        states = [program.state_dict_for(rank) for rank in range(self.tp)]
        self.prefix = [self.replicas.per_rank([s[name] for s in states])
                       for name in list(program.weight_inputs) + [RANK_INPUT]]
        allocated = [program.cache_spec().allocate(fill=fill) for _ in range(self.tp)]
        self._caches = [self.replicas.per_rank([a[i] for a in allocated])
                        for i in range(len(allocated[0]))]
        # A hybrid program's recurrent-state caches (program.state_spec(): replicated over
        # the DCP group, whole on every rank), on the devices after the KV caches: the
        # modules take and return them in that order (lowering/recurrent.py).
        spec = program.state_spec()
        self.state_spec = spec
        self.num_kv_caches = len(self._caches)
        if spec is not None:
            states = [spec.allocate_inputs() for _ in range(self.tp)]
            self._caches += [self.replicas.per_rank([s[i] for s in states])
                             for i in range(len(states[0]))]

    @property
    def caches(self) -> list[list[torch.Tensor]]:
        per_cache = [[_to_torch(s.data) for s in sorted(c.addressable_shards,
                                                        key=lambda s: self.devices.index(
                                                            s.device))]
                     for c in self._caches[:self.num_kv_caches]]
        return [[c[r] for c in per_cache] for r in range(self.tp)]

    def rank_caches(self, rank: int) -> list[torch.Tensor]:
        return self.caches[rank]

    def copy_state(self, src: int, dst: int) -> None:
        """A prefix-cache hit of a hybrid program (a state checkpoint into the sequence's
        slot): not built on XLA."""
        raise DCPXLAError(
            f"prefix caching of a hybrid program on XLA is not built: a hit copies state "
            f"checkpoint slot {src} into slot {dst}, which XLAExecutor does not do. Serve "
            f"the hybrid on XLA without prefix caching, or on the eager runtime "
            f"(docs/lowering.md, Hybrid models on XLA).")

    @property
    def states(self) -> list[list[torch.Tensor]]:
        """A hybrid program's recurrent-state caches on the host, one list per rank
        (``program.state_spec().input_order()``); [] per rank for any other program."""
        per_cache = [[_to_torch(s.data) for s in sorted(c.addressable_shards,
                                                        key=lambda s: self.devices.index(
                                                            s.device))]
                     for c in self._caches[self.num_kv_caches:]]
        return [[c[r] for c in per_cache] for r in range(self.tp)]

    def executable_for(self, kind, block_table):
        """(executable, contract) of step ``kind`` in the bucket of ``block_table``'s width."""
        kinds = sorted({k for k, _ in self.executables})
        if kind not in kinds:
            raise DCPXLAError(f"no lowered {kind!r} module: lowered steps are {kinds}. Lower "
                              f"the program with that step.")
        width = block_table.shape[-1] if getattr(block_table, "dim", lambda: 0)() == 2 \
            else None
        widest = max(w for k, w in self.executables if k == kind)
        # An unknown width is checked against the widest contract, which names the shape.
        key = (kind, width) if (kind, width) in self.executables else (kind, widest)
        return self.executables[key], self.contracts[key]

    def step(self, kind, input_ids, positions, block_table, state_slot=None,
             snapshot_slot=None):
        """One step; a hybrid program's also takes each row's ``state_slot`` [B] (its
        ``state_fresh`` and ``state_lengths`` follow from the positions, as on the eager
        runtime) and, in a width-K decode step, ``snapshot_slot`` [B, K]: where the state
        after each draft is kept (the engine rolls a rejected draft back to it)."""
        executable, contract = self.executable_for(kind, block_table)
        step_inputs, state_inputs, snapshots = [input_ids, positions, block_table], [], []
        if self.state_spec is None:
            if state_slot is not None or snapshot_slot is not None:
                raise DCPXLAError("this program has no recurrent-state caches (no recurrent "
                                  "layer): run its steps without state_slot=.")
            contract.check(input_ids, positions, block_table)
        else:
            if state_slot is None:
                raise DCPXLAError(
                    f"{kind} step of a hybrid program on XLA: pass each row's state_slot= "
                    f"(the engine does, Engine(state_slots=N)).")
            fresh, lengths = state_rows(positions)
            contract.check(input_ids, positions, block_table, state_slot=state_slot,
                           fresh=fresh, snapshot_slot=snapshot_slot)
            state_inputs = [state_slot, fresh, lengths]
            # a width-K decode step's state_snapshot_slot [B, K] is its last input
            snapshots = [] if snapshot_slot is None else [snapshot_slot]
        started = time.perf_counter()
        shared = [self.replicas.same(x) for x in step_inputs]
        # graph(*weights, tp_rank, input_ids, positions, block_table, *kv_caches,
        #       [state_slot, state_fresh, state_lengths, *state_caches])
        kv, states = self._caches[:self.num_kv_caches], self._caches[self.num_kv_caches:]
        args = self.prefix + shared + kv + [self.replicas.same(x) for x in state_inputs] + \
            states + [self.replicas.same(x) for x in snapshots]
        results = executable.execute_sharded(args)
        outs = results.disassemble_into_single_device_arrays()   # [output][replica]
        by_device = [{b.device: b for b in out} for out in outs]
        outs = [[m[d] for d in self.devices] for m in by_device]
        self._caches = [self.replicas.of_buffers(o) for o in outs[1:]]
        logits = [_to_torch(b) for b in outs[0]]
        self.step_seconds.setdefault((kind, block_table.shape[-1]), []).append(
            time.perf_counter() - started)
        for rank, got in enumerate(logits[1:], start=1):
            if not torch.equal(got, logits[0]):
                raise DCPXLAError(f"{kind} step on XLA: rank {rank}'s logits differ from rank "
                                  f"0's (max {float((got - logits[0]).abs().max())}). The "
                                  f"module's final gather is not replicating its result.")
        return logits[0]


# ------------------------------------------------------------------------------------------
# Verification against the single-device model (same signatures as dcp_compile.verify)
# ------------------------------------------------------------------------------------------

# The verifiers run each step a few times: compile time dominates, not the steps'.
VERIFY_EFFORT = "fast"


def lower_for_xla(program, out_dir: str | Path | None = None):
    """Lower ``program`` (every step) and check its collective forms run on XLA:CPU."""
    from .lowering import lower
    lowered = lower(program, out_dir=out_dir)
    check_lowered_for_xla(lowered)
    return lowered


def check_lowered_for_xla(lowered) -> None:
    """Check that every lowered step's collective forms run on XLA:CPU (a LoweringResult
    lowered elsewhere, e.g. reused)."""
    for step, m in lowered.modules.items():
        check_xla_cpu_forms(m.text, step=step, path=m.paths.get("text"))


def generate(program, prompts, steps: int, *, lowered=None, source: str = "text",
             executor=None):
    """Greedy-decode ``steps`` tokens with the lowered program on XLA (GenerateResult)."""
    from dcp_compile.runtime.serving.engine import Engine

    from dcp_compile.runtime.serving.rank_engine import prompt_kind
    if executor is None:
        executor = XLAExecutor(program, lowered or lower_for_xla(program), source=source,
                               effort=VERIFY_EFFORT)
    state = program.state_spec()        # a hybrid program's engine gives each row a slot
    engine = Engine(executor, program.shapes,
                    block_size=program.config.block_size, dcp=program.config.dcp,
                    prompt_kind=prompt_kind(program), buckets=program.buckets,
                    state_slots=None if state is None else state.num_slots)
    with torch.no_grad():
        return engine.generate(prompts, steps)


def verify(model, program, prompts, steps: int, *, atol: float = 1e-4, lowered=None,
           source: str = "text"):
    """dcp_compile.verify.verify with the program lowered and run on XLA:CPU replicas."""
    from . import verify as V
    start = time.perf_counter()
    from .memory_floor import bucket_table
    ref, _ = V.run_reference(model, program, prompts, steps)
    executor = XLAExecutor(program, lowered or lower_for_xla(program), source=source,
                           effort=VERIFY_EFFORT)
    got = generate(program, prompts, steps, executor=executor)
    errors, first = [], None
    for t, (g, e) in enumerate(zip(got.logits, ref.logits)):
        err = float((g.float() - e.float()).abs().max()) if torch.isfinite(g).all() \
            else float("inf")
        errors.append(err)
        if err > atol and first is None:
            first = {"rank": 0, "step": t, "error": err}
    c = program.config
    agree = got.tokens == ref.tokens
    return V.VerifyReport(ok=agree and first is None, max_abs_error=max(errors, default=0.0),
                          tokens_agree=agree, tp=c.tp, dcp=c.dcp, mode=c.mode, steps=steps,
                          lengths=[len(p) for p in prompts], step_errors=errors,
                          first_mismatch=first, seconds=time.perf_counter() - start,
                          buckets=bucket_table(executor, program))


def verify_speculative(model, program, prompts, steps: int, drafter, *, atol: float = 1e-4,
                       lowered=None, source: str = "text", prefix_caching: bool = False):
    """dcp_compile.verify.verify_speculative with the program lowered and run on XLA:CPU
    (one SPMD engine, so one ``drafter``; None: plain greedy)."""
    from dcp_compile.runtime.serving.engine import Engine
    from dcp_compile.runtime.serving.rank_engine import prompt_kind

    from . import verify as V
    start = time.perf_counter()
    ref, _ = V.run_reference(model, program, prompts, steps)
    lowered = lowered or lower_for_xla(program)
    state = program.state_spec()        # a hybrid program's engine gives each row its slots
    engine = Engine(XLAExecutor(program, lowered, source=source, effort=VERIFY_EFFORT),
                    program.shapes,
                    block_size=program.config.block_size, dcp=program.config.dcp,
                    prompt_kind=prompt_kind(program), prefix_caching=prefix_caching,
                    state_slots=None if state is None else state.num_slots)
    got, reused = V.generate_per_token(engine, prompts, steps, drafter)
    return V.speculative_report(program, ref, [got], start, atol=atol,
                                lengths=[len(p) for p in prompts], reused_tokens=reused)


def draft_drafter(draft):
    """A ModelDrafter over a draft program lowered and run on the same XLA:CPU devices."""
    from dcp_compile.runtime.serving.engine import Engine
    from dcp_compile.runtime.serving.speculative import ModelDrafter

    from dcp_compile.runtime.serving.rank_engine import prompt_kind
    return ModelDrafter(Engine(XLAExecutor(draft, lower_for_xla(draft), effort=VERIFY_EFFORT),
                               draft.shapes,
                               block_size=draft.config.block_size, dcp=draft.config.dcp,
                               prompt_kind=prompt_kind(draft)))


def verify_prefill(model, program, chunk_plan, chunks: int | None = None, *,
                   atol: float = 1e-4, check_cache: bool = True, lowered=None,
                   source: str = "text"):
    """dcp_compile.verify.verify_prefill with the program lowered and run on XLA:CPU
    replicas: every chunk's logits, and each rank's cache (allocated NaN) holding exactly
    its owned positions."""
    from dcp_compile.runtime.serving.engine import Engine
    from dcp_compile.runtime.serving.rank_engine import RecordingExecutor

    from . import verify as V
    start = time.perf_counter()
    if chunks is not None:
        chunk_plan = V.chunk_plan_of(chunk_plan, chunks, max_chunk=program.shapes.context_len)
    lowered = lowered or lower_for_xla(program)
    ref = V.run_prefill_reference(model, program, chunk_plan)
    from .memory_floor import bucket_table
    executor = XLAExecutor(program, lowered, fill=float("nan") if check_cache else 0.0,
                           source=source, effort=VERIFY_EFFORT)
    recorder = RecordingExecutor(executor)
    state = program.state_spec()        # a hybrid program's engine gives each row a slot
    engine = Engine(recorder, program.shapes, block_size=program.config.block_size,
                    dcp=program.config.dcp, prompt_kind=StepKind.PREFILL, buckets=program.buckets,
                    state_slots=None if state is None else state.num_slots)
    with torch.no_grad():
        for chunk in chunk_plan:
            engine.prefill(chunk)
    n = len(chunk_plan[0])
    table = engine.allocator.table(list(range(n)), program.shapes.max_blocks)
    caches = executor.caches
    runs = [V.PrefillRun(rank, recorder.logits, recorder.positions, caches[rank], table,
                         list(engine.lengths)) for rank in range(executor.tp)]
    last, every, first, agree = V.compare_prefill_logits(runs[0], ref, atol=atol)
    if first is None and check_cache:
        problem = V.check_prefill_caches(program, runs, ref, atol=atol)
        if problem is not None:
            first = {"cache": problem}
    c = program.config
    return V.VerifyReport(ok=agree and first is None, max_abs_error=max(every, default=0.0),
                          tokens_agree=agree, tp=c.tp, dcp=c.dcp, mode=c.mode,
                          steps=len(chunk_plan), lengths=list(ref.lengths), step_errors=last,
                          first_mismatch=first, seconds=time.perf_counter() - start,
                          buckets=bucket_table(executor, program))
