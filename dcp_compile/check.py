"""transform(check=...): run the emitted program once against the original model; refuse it
if the logits differ.

What runs, on the threaded world (every rank a thread, real collectives) and on the original
model through the same engine (dcp_compile.verify's machinery):

  decode mode:  the "context" prompt step, then decode steps until the longest row has
                crossed the largest sliding window of the program and a vblock boundary
                (``decode_steps``; at most ``MAX_DECODE_STEPS``, within the shapes). The
                masks are proven (passes/prove/masks.py); this is the backstop that runs a
                position past every window. The decoded tokens are seeded random ids, not
                the greedy ones, so that a near-tie in the argmax cannot make the two sides
                decode different tokens.
  prefill mode: a first prompt chunk, then a second chunk that attends to the first.

Inputs are seeded random token ids (``SEED``; the global RNG is not touched) in rows of mixed
lengths: the interleave period (``interleave_size * dcp``) + 1 and - 1, a single token, and
the longest prompt the shapes hold, as many rows as the batch and the cache blocks allow.
The garbage block is re-poisoned with NaN before every step, so a program that reads it
unmasked fails too. Neither the model nor the program is modified: the program runs on
per-rank copies of its graphs and freshly allocated caches.

Tolerance (``TOLERANCE``, by dtype): every real token's logits must satisfy
``|program - model| <= atol + rtol * max|model logits|``. The program reorders sums (sharded
matmuls, all-reduces, the LSE combine of partial attention). Measured on the demo model
(|logits| up to ~4; tp/dcp 8/4, 4/2, 2/1, both modes): fp32 errors <= 6e-6, bf16 <= 0.07,
fp16 <= 0.009; on the fuzz grammar's fp32 models <= 5e-6. A wrongly sharded projection is
off by 0.1 to 10 (the fuzz's silent mismatches: 0.15 to 5.7). Hence fp32 (1e-4, 1e-5), and
for bf16/fp16 about 2.5x and 4x their measured error.

``check=None`` (the default) checks unless ``skip_reasons`` names a reason. It needs: real
weights (not on the meta device, not fake tensors), at most ``MAX_PARAMETERS`` parameters,
tp at most ``MAX_TP``, prompt steps of at most ``MAX_STEP_TOKENS`` tokens (batch x
context_len), and transform() not called inside a running distributed job (a torchrun worker
would run the whole world in every process). Within that bound one step per mode takes
seconds on two CPU cores (demo model, tp=8/dcp=4: 1.4 to 2.0 s per mode, about twice the
transform itself).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from dcp_compile.runtime.program.dcp_program import DCPProgram
from dcp_compile.runtime.errors import DCPCheckError, DCPTransformError
from dcp_compile.runtime.names import Mode, StepKind

from .compare import token_errors

SEED = 0

# dtype -> (atol, rtol of the step's max |model logit|); see the module docstring.
TOLERANCE = {
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-8, 1e-10),
    torch.bfloat16: (0.1, 0.02),
    torch.float16: (0.02, 0.005),
}

MAX_PARAMETERS = 50_000_000
MAX_TP = 8
MAX_STEP_TOKENS = 4096
MAX_DECODE_STEPS = 64


@dataclass
class CheckReport:
    """What the check ran and how far the program's logits were from the model's."""

    mode: str
    steps: list[str]                    # step names, in order
    lengths: list[list[int]]            # per step: new tokens per row
    step_errors: list[float]            # per step: max over ranks and real tokens
    tolerance: float
    seconds: float = 0.0
    first_mismatch: dict | None = None  # {"step", "rank", "row", "position", "error"}
    ok: bool = True

    def to_json(self) -> dict:
        return asdict(self)


# -- when the check runs ----------------------------------------------------------------------


def _fake_or_meta(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return t.is_meta or isinstance(t, FakeTensor)


def skip_reasons(model: torch.nn.Module, tp: int, shapes) -> list[str]:
    """Why check=None leaves the check off for this model and config ([] = it runs)."""
    import torch.distributed as dist

    from dcp_compile.runtime.distributed.world import current_rank
    tensors = list(model.parameters()) + list(model.buffers())
    reasons = []
    if any(_fake_or_meta(t) for t in tensors):
        reasons.append("the model's weights are not real (meta device or fake tensors)")
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMETERS:
        reasons.append(f"{count} parameters > MAX_PARAMETERS={MAX_PARAMETERS}")
    if tp > MAX_TP:
        reasons.append(f"tp={tp} > MAX_TP={MAX_TP}")
    tokens = shapes.batch * shapes.context_len
    if tokens > MAX_STEP_TOKENS:
        reasons.append(f"a prompt step of batch x context_len = {tokens} tokens > "
                       f"MAX_STEP_TOKENS={MAX_STEP_TOKENS}")
    if current_rank() is not None or (dist.is_available() and dist.is_initialized()):
        reasons.append("transform() runs inside a distributed job (each process would run "
                       "the whole world)")
    return reasons


def resolve(check: bool | None, model: torch.nn.Module, tp: int, shapes) -> bool:
    """check=None -> on within the bound; check=True -> on, or a clear error if it cannot run."""
    if check is not None and not isinstance(check, bool):
        raise DCPTransformError(f"check must be True, False or None: check={check!r}. "
                                f"Pass a bool, or None for the default.")
    reasons = skip_reasons(model, tp, shapes)
    if check is None:
        return not reasons
    if check:
        hard = [r for r in reasons if "not real" in r or "distributed job" in r]
        if hard:
            raise DCPTransformError(
                f"transform(check=True) cannot run the model: {'; '.join(hard)}. Load real "
                f"weights and call transform() outside a distributed job, or pass "
                f"check=False.")
    return check


# -- inputs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckStep:
    name: str
    tokens: list[list[int]]             # one token list per row ([] leaves the row out)
    decode: bool = False                # engine.decode (one token per row) vs engine.prefill


def row_lengths(program: DCPProgram) -> list[tuple[int, int]]:
    """(first-step, second-step) new tokens per row that the program's shapes hold; in decode
    mode the second is the number of decode steps (the same for every row).

    Wanted rows, in order: the interleave period + 1 and - 1 (the rank boundary of the
    DCP layout), a single token, the longest prompt; each is cut to the shapes and a row is
    dropped when its blocks no longer fit. Decode steps are counted from the longest row
    kept (``decode_steps``).
    """
    c, s = program.config, program.shapes
    capacity = _capacity(program)
    first_max = max(1, min(s.context_len, capacity - 1))
    if c.mode != Mode.DECODE:
        return _fit_rows(program, first_max, None)
    steps = 1
    while True:   # fewer rows fit as steps grow; steps only grow (bounded): this settles
        rows = _fit_rows(program, first_max, steps)
        more = decode_steps(program, [a for a, _ in rows])
        if more <= steps:
            return rows
        steps = more


def _capacity(program: DCPProgram) -> int:
    """The longest row the program serves: what its block table addresses, and no longer
    than the model's max_model_len (a LongRoPE program is exact only below it)."""
    c, s = program.config, program.shapes
    addressed = s.max_blocks * c.block_size * c.dcp
    limit = program.facts.max_model_len if program.facts is not None else None
    return min(addressed, limit) if limit else addressed


def _fit_rows(program: DCPProgram, first_max: int, steps: int | None):
    c, s = program.config, program.shapes
    period, vblock = c.interleave_size * c.dcp, c.block_size * c.dcp
    capacity = _capacity(program)
    wanted = [period + 1, period - 1, 1, first_max]
    rows, free = [], s.num_blocks - 1
    for i, want in enumerate(wanted):
        if len(rows) == s.batch:
            break
        first = max(1, min(want, first_max, capacity - (steps or 1)))
        second = steps if steps is not None else min(s.context_len, capacity - first,
                                                     wanted[(i + 1) % len(wanted)])
        blocks = -(-(first + second) // vblock)
        if blocks <= free and (first, second) not in rows:
            rows.append((first, second))
            free -= blocks
    return rows


def decode_steps(program: DCPProgram, prompts: list[int]) -> int:
    """Decode steps after prompts of these lengths: until some row has written the first
    position of a new vblock in a decode step, and the longest row holds position W (the
    first one a window W hides key 0 from) for the largest window W; at least 1, within
    the longest row's capacity and MAX_DECODE_STEPS."""
    c, s = program.config, program.shapes
    if not prompts:
        return 1
    vblock = c.block_size * c.dcp
    longest = max(prompts)
    # A row of n tokens writes position p at decode step p - n + 1.
    boundary = min((n // vblock + 1) * vblock - n + 1 for n in prompts)
    window = max(program_windows(program), default=0)
    past_window = window - longest + 1 if window else 0
    room = _capacity(program) - longest
    return max(1, min(max(boundary, past_window), room, MAX_DECODE_STEPS))


def steps_for(program: DCPProgram, vocab: int, seed: int = SEED) -> list[CheckStep]:
    gen = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    rows = row_lengths(program)
    first = [ids(a) for a, _ in rows]
    second = [ids(b) for _, b in rows]
    if program.config.mode == Mode.DECODE:
        steps = rows[0][1] if rows else 1
        return [CheckStep(StepKind.CONTEXT, first)] + [
            CheckStep(StepKind.DECODE if steps == 1 else f"decode {t + 1}", [[r[t]] for r in second],
                      decode=True) for t in range(steps)]
    return [CheckStep("prefill chunk 1", first),
            CheckStep("prefill chunk 2 (after chunk 1)", second)]


def vocab_size(program: DCPProgram) -> int:
    """Rows of the embedding table the first graph looks token ids up in."""
    emb = torch.ops.aten.embedding.default
    gm = next(iter(program.graphs.values()))
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == emb:
            weight = program.constants.get(node.args[0].name)
            if weight is not None:
                return int(weight.shape[0])
    raise DCPTransformError(
        "transform(check=True) found no embedding lookup (aten.embedding of a weight) in the "
        "program, so it cannot draw valid token ids. Pass check=False and compare the program "
        "with dcp_compile.verify on your own inputs.")


# -- running both sides -----------------------------------------------------------------------


def _run_steps(engine, steps: list[CheckStep]) -> None:
    with torch.no_grad():
        for step in steps:
            if step.decode:
                engine.decode_rows(step.tokens)
            else:
                engine.prefill(step.tokens)


def run_model(model, program: DCPProgram, steps: list[CheckStep]):
    from dcp_compile.runtime.serving.engine import LocalExecutor
    from dcp_compile.runtime.serving.rank_engine import RecordingExecutor

    from .verify import reference_engine
    engine = reference_engine(program, lambda c: RecordingExecutor(LocalExecutor(model, c)))
    _run_steps(engine, steps)
    return engine.executor


def run_program(program: DCPProgram, steps: list[CheckStep]) -> list:
    from dcp_compile.runtime.serving.rank_engine import rank_engine
    from dcp_compile.runtime.distributed.world import run_threaded

    def rank_main(rank):
        # One program on this world: its ranks share one bound graph per step kind.
        engine = rank_engine(program, rank, shared_names=True, poison=True, record=True)
        _run_steps(engine, steps)
        return engine.executor

    return run_threaded(program.config.tp, rank_main)


def compare(ref, runs, steps: list[CheckStep], dtype: torch.dtype
            ) -> tuple[list[float], float, dict | None]:
    """(per-step max error, tolerance, first mismatch or None)."""
    atol, rtol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    scale = max(float(exp.float()[pos >= 0].abs().max()) if (pos >= 0).any() else 0.0
                for exp, pos in zip(ref.logits, ref.positions))
    tol = atol + rtol * scale
    errors, first = [0.0] * len(steps), None
    for t, step in enumerate(steps):
        exp, pos = ref.logits[t], ref.positions[t]
        for rank, run in enumerate(runs):
            diff = token_errors(run.logits[t], exp, pos)
            errors[t] = max(errors[t], float(diff.max()))
            bad = diff > tol
            if bad.any() and first is None:
                row, i = (int(x) for x in bad.nonzero()[0])
                first = {"step": step.name, "rank": rank, "row": row,
                         "position": int(pos[row, i]), "error": float(diff[row, i])}
    return errors, tol, first


def check_program(model, program: DCPProgram) -> CheckReport:
    """Run one step of each emitted graph both ways; raise DCPCheckError if they differ."""
    from dcp_compile.runtime.errors import DCPWorldError
    start = time.perf_counter()
    steps = steps_for(program, vocab_size(program))
    report = CheckReport(mode=program.config.mode, steps=[s.name for s in steps],
                         lengths=[[len(r) for r in s.tokens] for s in steps],
                         step_errors=[], tolerance=0.0)
    try:
        ref = run_model(model, program, steps)
    except Exception as e:  # noqa: BLE001 - the model's own failure, reported as such
        raise DCPTransformError(
            f"transform(check=...) could not run the original model on its check inputs "
            f"(rows of {report.lengths[0]} tokens): {type(e).__name__}: {e}. Fix the model, "
            f"or pass check=False.") from e
    try:
        runs = run_program(program, steps)
    except DCPWorldError as e:
        report.ok = False
        report.seconds = time.perf_counter() - start
        raise DCPCheckError(
            f"transformed program failed to run on the threaded world (tp={program.config.tp}"
            f", dcp={program.config.dcp}, mode={program.config.mode}): {e}. The rewrite "
            f"produced a program that does not execute; transform() refuses it. Report the "
            f"model; check=False returns the unchecked program for inspection.",
            report) from e
    report.step_errors, report.tolerance, report.first_mismatch = compare(
        ref, runs, steps, program.facts.cache_dtype)
    report.ok = report.first_mismatch is None
    report.seconds = time.perf_counter() - start
    if not report.ok:
        raise DCPCheckError(_mismatch_message(program, report), report)
    return report


def _mismatch_message(program: DCPProgram, report: CheckReport) -> str:
    m, c = report.first_mismatch, program.config
    t = report.steps.index(m["step"])
    dtype = program.facts.cache_dtype
    return (f"transformed program differs from the model in the {m['step']!r} step: max abs "
            f"logit error {report.step_errors[t]:.3g} > tolerance {report.tolerance:.3g} "
            f"({str(dtype).replace('torch.', '')}), first at row {m['row']}, position "
            f"{m['position']} (rank {m['rank']}: error {m['error']:.3g}); tp={c.tp}, "
            f"dcp={c.dcp}, mode={c.mode}, rows of {report.lengths[t]} tokens (seed {SEED}). "
            f"transform() refuses a program that computes something else than the model: "
            f"report the model (its sharding is not understood correctly); check=False "
            f"returns the unchecked program for inspection with dcp_compile.verify.")


def program_windows(program: DCPProgram) -> list[int]:
    """Each attention layer's sliding window (0: none), read from the program's first graph
    (every attention op of a DCP graph carries its window)."""
    gm = next(iter(program.graphs.values()))
    return [int(n.kwargs.get("window", 0)) for n in gm.graph.nodes
            if n.op == "call_function" and "window" in getattr(
                getattr(n.target, "_schema", None), "__str__", lambda: "")()]
