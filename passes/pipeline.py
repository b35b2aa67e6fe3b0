"""The pipeline as data: named stages of passes, and each step kind's row built from them.

``STAGES`` names the stages in the order they run (capture prologue, canonicalise, prove,
shard, DCP rewrite); ``DCP_REWRITE`` holds the one stage that differs by step kind, and
``PIPELINE`` is each step kind's row, built from the stages (:func:`row`). ``transform()``
and the torch.compile backend build their passes from it (:func:`passes_for`), the dump
records it in each step's ``manifest.json``, and a test checks the "Passes" list of
docs/architecture.md against it.

Each pass states the graph properties it requires and those it ensures
(:class:`~dcp_compile.passes.infra.Property`); :func:`check_order` walks a row from what the
capture gives and refuses a pass whose requirement no capture or earlier pass ensured, or
one that ensures again what already holds. Every row of the table is checked on import, and
each row built for a captured graph again, from what that capture gives.

Step kinds: ``context`` (the decode engine's prompt step), ``decode`` (one token per
sequence) and ``prefill`` (the prefill engine's chunk; ``sequence_parallel`` lays out the
tokens ``dcp_prefill`` rewrites). The passes in ``OPTIONAL`` (canonicalize_ops,
absorb_latent_attention, insert_paged_cache, lift_positions) run only on an ordinary model's
graph, which has no cache yet: the frontend that captured the graph builds them as its
prologue, because their arguments come from the model (``dcp_compile.frontends.ordinary``);
a paged model's capture gives what they ensure. The table still says where they run.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable, Sequence

from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.names import Mode, StepKind

from .absorb_latent_attention import AbsorbLatentAttention
from .canonical_ops import CanonicalizeOps
from .canonicalize_attention import CanonicalizeAttention
from .canonicalize_moe import CanonicalizeMoE
from .check_state_snapshots import CheckStateSnapshots
from .check_static_shapes import CheckStaticShapes
from .check_token_wise import CheckTokenWise
from .dcp_decode import DCPContext, DCPDecode
from .dcp_prefill import DCPPrefill
from .drop_export_asserts import DropExportAsserts
from .infra import CAPTURED, DCPPass, Property, TransformContext
from .insert_paged_cache import InsertPagedCache
from .insert_rank import InsertRank
from .positions import LiftPositions
from .sequence_parallel import SequenceParallel
from .shard_tensor_parallel import ShardTensorParallel
from .validate_and_prove import ValidateAndProve

# Mode -> the step kinds a program of that mode holds (transform() captures each).
STEPS_BY_MODE: dict[Mode, tuple[StepKind, ...]] = {
    Mode.DECODE: (StepKind.CONTEXT, StepKind.DECODE),
    Mode.PREFILL: (StepKind.PREFILL,),
}


def steps_of(mode: Mode, shapes) -> tuple[StepKind, ...]:
    """The step kinds a program of ``mode`` with ``shapes`` (StepShapes) holds: the mode's,
    and a decode program's chunk step when ``shapes.chunk_len`` > 0."""
    extra = (StepKind.CHUNK,) if mode == Mode.DECODE and getattr(shapes, "chunk_len", 0) \
        else ()
    return STEPS_BY_MODE[mode] + extra


class Stage(str, Enum):
    """The pipeline's stages, in the order they run (DESIGN "Data flow")."""

    CAPTURE_PROLOGUE = "capture prologue"   # a captured graph made into a paged step
    CANONICALIZE = "canonicalize"           # one dcp.attention / dcp.moe per layer, and
                                            # every other op token-wise (or refused)
    PROVE = "prove"                         # config validated, layout proven
    SHARD = "shard"                         # rank input, tensor-parallel weights and ops
    DCP_REWRITE = "dcp rewrite"             # attention in its DCP form, per step kind

    def __str__(self) -> str:
        return self.value


# Stage -> its passes in order (the DCP rewrite: per step kind, in DCP_REWRITE).
STAGES: dict[Stage, tuple[type[DCPPass], ...]] = {
    Stage.CAPTURE_PROLOGUE: (DropExportAsserts, CheckStaticShapes, CheckStateSnapshots,
                             CanonicalizeOps,
                             AbsorbLatentAttention, InsertPagedCache, LiftPositions),
    Stage.CANONICALIZE: (CanonicalizeAttention, CanonicalizeMoE, CheckTokenWise),
    Stage.PROVE: (ValidateAndProve,),
    Stage.SHARD: (InsertRank, ShardTensorParallel),
}

DCP_REWRITE: dict[StepKind, tuple[type[DCPPass], ...]] = {
    StepKind.CONTEXT: (DCPContext,),
    StepKind.DECODE: (DCPDecode,),
    StepKind.CHUNK: (DCPDecode,),       # a width-chunk_len decode step (every query bounded)
    StepKind.PREFILL: (SequenceParallel, DCPPrefill),
}

# Passes that run only when the frontend built one (their arguments come from the model).
OPTIONAL: frozenset[type[DCPPass]] = frozenset({
    CanonicalizeOps, AbsorbLatentAttention, InsertPagedCache, LiftPositions})

# Passes built from more than the context: pass -> its extra constructor arguments, from the
# name of the graph's first step input (the rank input goes before it).
_EXTRA_ARGS = {InsertRank: lambda first_user_input: (first_user_input,),
               CheckTokenWise: lambda first_user_input: (first_user_input,)}


def _all_passes() -> set[type[DCPPass]]:
    return {c for passes in (*STAGES.values(), *DCP_REWRITE.values()) for c in passes}


def check_order(passes: Iterable, given: frozenset[Property] = CAPTURED,
                where: str = "") -> frozenset[Property]:
    """Walk ``passes`` (classes or instances) from the properties ``given`` (what the capture
    holds): raise DCPTransformError naming the first pass that requires a property no
    earlier pass ensured, or that ensures one already held. Returns what holds at the end."""
    held = frozenset(given)
    seen: list[str] = []
    for p in passes:
        missing = sorted(str(x) for x in p.required - held)
        if missing:
            makers = sorted({c.name for c in _all_passes() if set(c.ensured) & set(
                p.required - held)})
            raise DCPTransformError(
                f"pass {p.name} requires {missing}{where}, which neither the capture nor a "
                f"pass before it ensures (before it: {seen or 'nothing'}; capture gives "
                f"{sorted(map(str, given))}). Run {makers or 'a pass that ensures it'} "
                f"before {p.name} (dcp_compile.passes.pipeline).")
        again = sorted(str(x) for x in p.ensured & held)
        if again:
            raise DCPTransformError(
                f"pass {p.name} ensures {again}{where}, which already holds there (the "
                f"capture or an earlier pass of {seen or 'nothing'} ensured it): it would "
                f"rewrite the graph a second time. Drop it from the row, or from the "
                f"frontend's prologue.")
        held |= p.ensured
        seen.append(p.name)
    return held


def row(step: StepKind) -> tuple[type[DCPPass], ...]:
    """``step``'s passes: every stage's, in order, with ``step``'s DCP rewrite last."""
    out: tuple[type[DCPPass], ...] = ()
    for stage in Stage:
        out += DCP_REWRITE[step] if stage is Stage.DCP_REWRITE else STAGES[stage]
    check_order(out, where=f" in the {step} row")
    return out


# Step kind -> its passes, in order.
PIPELINE: dict[StepKind, tuple[type[DCPPass], ...]] = {step: row(step) for step in DCP_REWRITE}


def pass_names(step: str) -> list[str]:
    """``step``'s pass names in order, the optional ones included."""
    return [cls.name for cls in _passes_of(step)]


def passes_for(ctx: TransformContext, first_user_input: str, *,
               prologue: Sequence[DCPPass] = (),
               given: frozenset[Property] = CAPTURED) -> list[DCPPass]:
    """``ctx.step``'s passes, built in ``PIPELINE`` order. ``prologue``: the optional passes
    the frontend built for this graph (an ordinary model's cache insertion), each run in
    its row's place; an optional pass it did not build does not run. ``given``: what the
    captured graph holds (``StepCapture.provides``); the built row's order is checked from
    it (:func:`check_order`)."""
    given_passes = {type(p): p for p in prologue}
    unknown = sorted(p.name for cls, p in given_passes.items() if cls not in OPTIONAL)
    if unknown:
        raise DCPTransformError(
            f"prologue passes {unknown} are not optional passes of the table: the optional "
            f"ones are {sorted(c.name for c in OPTIONAL)}. Add the pass to PIPELINE and "
            f"OPTIONAL (dcp_compile.passes.pipeline).")
    built = []
    for cls in _passes_of(ctx.step):
        if cls in OPTIONAL:
            if cls in given_passes:
                built.append(given_passes[cls])
            continue
        extra = _EXTRA_ARGS.get(cls)
        built.append(cls(ctx, *extra(first_user_input)) if extra else cls(ctx))
    check_order(built, given, where=f" for step {ctx.step!s}")
    return built


def _passes_of(step: str) -> tuple[type[DCPPass], ...]:
    try:
        return PIPELINE[step]
    except KeyError:
        raise DCPTransformError(
            f"no pipeline for step kind {step!r}: the step kinds are {sorted(PIPELINE)}. "
            f"Name one of them (dcp_compile.passes.pipeline.PIPELINE).") from None
