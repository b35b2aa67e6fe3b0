"""Running lowered modules on CPU: the StableHLO reference interpreter (it ships in
torch-mlir's _stablehlo bindings), on one rank or every rank at once, and an engine executor
that serves requests with it (InterpreterExecutor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from dcp_compile.runtime.errors import DCPLoweringError

from .artifact import LoweredModule, LoweringResult, collectives_in
from .finalize import _ALLOWED_DIALECTS, _FORBIDDEN_OPS
from .stablehlo import FUNC_NAME, _walk, new_context


def interpreter_available() -> tuple[bool, str]:
    """Whether the StableHLO reference interpreter can be called here, and why not."""
    try:
        from torch_mlir._mlir_libs import _stablehlo
    except ImportError as e:
        return False, f"torch-mlir's StableHLO bindings do not import: {e}"
    if not hasattr(_stablehlo, "eval_module"):
        return False, "this torch-mlir build has no stablehlo eval_module"
    return True, "torch_mlir._mlir_libs._stablehlo.eval_module"


def run_interpreter(module: LoweredModule | str, inputs: Sequence[torch.Tensor]
                    ) -> list[torch.Tensor]:
    """Run a module without collectives (tp=1, or a standalone function) on CPU tensors with
    the StableHLO reference interpreter; see :func:`run_interpreter_spmd` for ranks."""
    return run_interpreter_spmd(module, [inputs])[0]


def run_interpreter_spmd(module: LoweredModule | str,
                         inputs_per_rank: Sequence[Sequence[torch.Tensor]], *,
                         isolate: bool | None = None) -> list[list[torch.Tensor]]:
    """Run one lowered module on every rank at once in the StableHLO reference interpreter.

    With several ranks, the module's function runs as the program of each of ``len(
    inputs_per_rank)`` replicas under ``interpreter.run_parallel`` (num_replicas = ranks,
    num_partitions = 1), so its collectives move real data between the replicas of their
    replica groups. Returns each rank's results. bf16/f16 results come back through an
    appended convert to f32 (the bindings cannot hand them to numpy) and are cast back.

    Limits of the interpreter (stablehlo/reference): run_parallel runs the replicas on a
    thread pool as large as this machine's CPUs, and a collective waits 3 s for its group,
    then aborts the process. So more ranks than CPUs is refused here, and with several ranks
    the run happens in a child process (``isolate``, default: ranks > 1) whose abort becomes
    a DCPLoweringError. A module with ops outside stablehlo/func, or with collectives but one
    rank, is refused too.
    """
    import os

    text = module.text if isinstance(module, LoweredModule) else module
    ranks = len(inputs_per_rank)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if ranks > (cpus or 1):
        raise DCPLoweringError(
            f"the StableHLO reference interpreter runs {ranks} ranks on a pool of {cpus} "
            f"threads (one per CPU here) and its collectives wait only 3 s for the group: "
            f"{ranks} ranks would deadlock. Run on a machine with >= {ranks} CPUs, or lower "
            f"a program with tp <= {cpus}.")
    if isolate if isolate is not None else ranks > 1:
        return _run_isolated(text, inputs_per_rank)
    return _run_in_process(text, inputs_per_rank)


def _run_isolated(text: str, inputs_per_rank) -> list[list[torch.Tensor]]:
    """run_interpreter_spmd in a child process (python -m dcp_compile.lowering)."""
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory(prefix="dcp_interp_") as tmp:
        job, out = Path(tmp) / "job.pt", Path(tmp) / "out.pt"
        torch.save({"text": text, "inputs": [list(x) for x in inputs_per_rank]}, job)
        proc = subprocess.run([sys.executable, "-m", "dcp_compile.lowering", "interpret",
                               str(job), str(out)], capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise DCPLoweringError(
                f"the StableHLO reference interpreter failed on {len(inputs_per_rank)} ranks "
                f"(exit {proc.returncode}): {tail}. 'rendezvous timed out' means a rank reached "
                f"a collective 3 s before another: a loaded machine, or too much work between "
                f"collectives (use smaller shapes).")
        return torch.load(out)


def _run_in_process(text: str, inputs_per_rank) -> list[list[torch.Tensor]]:
    import numpy as np
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo

    ranks = len(inputs_per_rank)
    ctx = new_context(stablehlo_only=True)
    _stablehlo.register_interpreter_dialect(ctx)
    with ctx, ir.Location.unknown():
        parsed = ir.Module.parse(text)
        ops = list(_walk(parsed.operation))
        bad = sorted({op.name for op in ops if op.name.split(".", 1)[0] not in _ALLOWED_DIALECTS
                      or op.name in _FORBIDDEN_OPS})
        if bad:
            raise DCPLoweringError(f"the StableHLO reference interpreter cannot run {bad}. "
                                   f"Run a module that lower() produced.")
        ids = sorted({i for c in collectives_in(parsed) for g in c["replica_groups"]
                      for i in g})
        if ids and (ranks == 1 or ids != list(range(ranks))):
            raise DCPLoweringError(
                f"the module's collectives span replicas {ids}, but {ranks} rank(s) of inputs "
                f"were given: the interpreter cannot run stablehlo.all_* collectives in one "
                f"process. Pass one input list per rank ({len(ids)}).")
        funcs = [op for op in ops if op.name == "func.func"]
        func = next(f for f in funcs if ir.StringAttr(f.attributes["sym_name"]).value
                    == FUNC_NAME)
        ftype = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
        for r, inputs in enumerate(inputs_per_rank):
            if len(inputs) != len(ftype.inputs):
                raise DCPLoweringError(f"module takes {len(ftype.inputs)} inputs, rank {r} "
                                       f"gave {len(inputs)}.")
        narrow = _widen_results(func, ftype)
        results_per_rank = len(ftype.results)
        if ranks > 1:
            _wrap_in_run_parallel(parsed, func, ranks)
        args = [_to_attribute(x, t) for inputs in inputs_per_rank
                for x, t in zip(inputs, ftype.inputs)]
        results = _stablehlo.eval_module(parsed, args)
        out = []
        for r in range(ranks):
            mine = []
            for i, a in enumerate(results[r * results_per_rank:(r + 1) * results_per_rank]):
                t = torch.from_numpy(np.array(a).copy())
                mine.append(t.to(narrow[i]) if i in narrow else t)
            out.append(mine)
        return out


def _to_attribute(x: torch.Tensor, expected):
    import numpy as np
    from torch_mlir import ir
    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        import ml_dtypes     # numpy's bfloat16
        attr = ir.DenseElementsAttr.get(x.float().numpy().astype(ml_dtypes.bfloat16),
                                        type=ir.BF16Type.get())
    else:
        attr = ir.DenseElementsAttr.get(np.array(x.numpy(), order="C"))
    if str(attr.type) != str(expected):
        raise DCPLoweringError(f"interpreter input: module expects {expected}, got "
                               f"{attr.type}.")
    return attr


def _wrap_in_run_parallel(module, func, ranks: int) -> None:
    """Rename ``main`` to the per-rank program; a new ``main`` runs it on ``ranks`` replicas
    (interpreter.run_parallel, the reference interpreter's process grid)."""
    from torch_mlir import ir
    program = "dcp_rank_program"
    func.attributes["sym_name"] = ir.StringAttr.get(program)
    ftype = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    inputs, results = list(ftype.inputs) * ranks, list(ftype.results) * ranks
    with ir.InsertionPoint(module.body):
        main = ir.Operation.create(
            "func.func", regions=1,
            attributes={"sym_name": ir.StringAttr.get(FUNC_NAME),
                        "function_type": ir.TypeAttr.get(ir.FunctionType.get(inputs, results))})
    block = main.regions[0].blocks.append(*inputs)
    with ir.InsertionPoint(block):
        grid = ir.ArrayAttr.get([ir.ArrayAttr.get([ir.FlatSymbolRefAttr.get(program)])
                                 for _ in range(ranks)])
        run = ir.Operation.create("interpreter.run_parallel", results=results,
                                  operands=list(block.arguments),
                                  attributes={"programs": grid})
        ir.Operation.create("func.return", operands=list(run.results))


class InterpreterExecutor:
    """A dcp_compile.runtime.serving.engine executor that runs a program's lowered modules in the StableHLO
    reference interpreter, every rank at once (:func:`run_interpreter_spmd`), each rank with
    its weight shards, ``tp_rank`` and KV caches. ``step`` returns rank 0's logits after
    checking that every rank computed the same ones.

    So ``Engine(InterpreterExecutor(program, lower(program)), ...)`` serves requests with
    the lowered StableHLO instead of the FX graphs — on CPU, slowly, and for at most as many
    ranks as this machine has CPUs (see run_interpreter_spmd).

    ``results`` (optional, shareable by several executors): run digest -> outputs. A step
    whose module text and every rank's inputs (dtype, shape, bytes) were run before takes
    that run's outputs instead of interpreting again; ``reused`` counts such steps. Exact:
    the interpreter is a deterministic function of the module and its inputs, and the
    digest covers both (e.g. two programs that differ only in their decode combine run
    byte-identical prompt steps on the same prompts).
    """

    def __init__(self, program, lowered: LoweringResult, *, isolate: bool = False,
                 results: dict | None = None):
        from dcp_compile.runtime.names import RANK_INPUT
        self.lowered, self.isolate = lowered, isolate
        self.results, self.reused = results, 0
        self.tp = program.topology.tp
        self.prefix = []
        for rank in range(self.tp):
            state = program.state_dict_for(rank)
            self.prefix.append([state[n] for n in program.weight_inputs] + [state[RANK_INPUT]])
        self.caches = [program.cache_spec().allocate() for _ in range(self.tp)]

    def step(self, kind, input_ids, positions, block_table):
        if kind not in self.lowered.modules:
            raise DCPLoweringError(f"no lowered {kind!r} module: lowered steps are "
                                   f"{list(self.lowered.modules)}.")
        inputs = [prefix + [input_ids, positions, block_table] + caches
                  for prefix, caches in zip(self.prefix, self.caches)]
        outs = self._run(self.lowered[kind], inputs)
        self.caches = [list(out[1:]) for out in outs]
        for rank, out in enumerate(outs[1:], start=1):
            if not torch.equal(out[0], outs[0][0]):
                raise DCPLoweringError(f"{kind} step: rank {rank}'s logits differ from rank "
                                       f"0's (max {float((out[0] - outs[0][0]).abs().max())}).")
        return outs[0][0]

    def _run(self, module: LoweredModule, inputs) -> list[list[torch.Tensor]]:
        if self.results is None:
            return run_interpreter_spmd(module, inputs, isolate=self.isolate)
        key = _run_digest(module.text, inputs)
        if key in self.results:
            self.reused += 1
        else:
            self.results[key] = run_interpreter_spmd(module, inputs, isolate=self.isolate)
        return [[t.clone() for t in out] for out in self.results[key]]


def _run_digest(text: str, inputs_per_rank) -> str:
    """sha256 of a module's text and every rank's inputs (dtype, shape and bytes)."""
    import hashlib
    h = hashlib.sha256(text.encode())
    for inputs in inputs_per_rank:
        h.update(b"|rank")
        for x in inputs:
            h.update(f"|{x.dtype}{tuple(x.shape)}|".encode())
            flat = x.detach().cpu().contiguous().reshape(-1)     # a 0-d tensor cannot view
            h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _widen_results(func, ftype) -> dict[int, torch.dtype]:
    """Append stablehlo.convert to f32 before the return for bf16/f16 results."""
    from torch_mlir import ir
    narrow_types = {"bf16": torch.bfloat16, "f16": torch.float16}
    block = func.regions[0].blocks[0]
    ret = list(block.operations)[-1]
    narrow, new_results = {}, []
    operands = list(ret.operands)
    for i, t in enumerate(ftype.results):
        rt = ir.RankedTensorType(t)
        name = str(rt.element_type)
        if name in narrow_types:
            wide = ir.RankedTensorType.get(list(rt.shape), ir.F32Type.get())
            conv = ir.Operation.create("stablehlo.convert", results=[wide],
                                       operands=[operands[i]], ip=ir.InsertionPoint(ret))
            ret.operands[i] = conv.result
            narrow[i] = narrow_types[name]
            new_results.append(wide)
        else:
            new_results.append(t)
    if narrow:
        func.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get(list(ftype.inputs), new_results))
    return narrow


def main(argv: list[str]) -> int:
    """``python -m dcp_compile.lowering interpret JOB OUT``: the child of _run_isolated."""
    if len(argv) != 3 or argv[0] != "interpret":
        print("usage: python -m dcp_compile.lowering interpret JOB.pt OUT.pt")
        return 2
    job = torch.load(argv[1])
    torch.save(_run_in_process(job["text"], job["inputs"]), argv[2])
    return 0
