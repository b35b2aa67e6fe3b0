"""The pipeline as data: each step kind's passes, in the order they run.

``PIPELINE`` is the one place the order is written. ``transform()`` and the torch.compile
backend build their passes from it (:func:`passes_for`), the dump records it in each step's
``manifest.json``, and a test checks the "Passes" list of docs/architecture.md against it.

Step kinds: ``context`` (the decode engine's prompt step), ``decode`` (one token per
sequence) and ``prefill`` (the prefill engine's chunk; ``sequence_parallel`` lays out the
tokens ``dcp_prefill`` rewrites). ``insert_paged_cache`` (in ``OPTIONAL``) runs only on an
ordinary model's graph, which has no cache yet: the frontend that captured the graph builds
it as its prologue, because its arguments come from the model
(``dcp_compile.frontends.ordinary``); the table still says where it runs.
"""

from __future__ import annotations

from typing import Sequence

from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.names import Mode, StepKind

from .canonicalize_attention import CanonicalizeAttention
from .canonicalize_moe import CanonicalizeMoE
from .check_static_shapes import CheckStaticShapes
from .check_token_wise import CheckTokenWise
from .dcp_decode import DCPContext, DCPDecode
from .dcp_prefill import DCPPrefill
from .drop_export_asserts import DropExportAsserts
from .infra import DCPPass, TransformContext
from .insert_paged_cache import InsertPagedCache
from .insert_rank import InsertRank
from .sequence_parallel import SequenceParallel
from .shard_tensor_parallel import ShardTensorParallel
from .validate_and_prove import ValidateAndProve

# Mode -> the step kinds a program of that mode holds (transform() captures each).
STEPS_BY_MODE: dict[Mode, tuple[StepKind, ...]] = {
    Mode.DECODE: (StepKind.CONTEXT, StepKind.DECODE),
    Mode.PREFILL: (StepKind.PREFILL,),
}

# Step kind -> its passes, in order.
PIPELINE: dict[StepKind, tuple[type[DCPPass], ...]] = {
    StepKind.CONTEXT: (InsertPagedCache, DropExportAsserts, CheckStaticShapes,
                       CanonicalizeAttention, CanonicalizeMoE, CheckTokenWise,
                       ValidateAndProve, InsertRank, ShardTensorParallel, DCPContext),
    StepKind.DECODE: (InsertPagedCache, DropExportAsserts, CheckStaticShapes,
                      CanonicalizeAttention, CanonicalizeMoE, CheckTokenWise,
                      ValidateAndProve, InsertRank, ShardTensorParallel, DCPDecode),
    StepKind.PREFILL: (InsertPagedCache, DropExportAsserts, CheckStaticShapes,
                       CanonicalizeAttention, CanonicalizeMoE, CheckTokenWise,
                       ValidateAndProve, InsertRank, ShardTensorParallel, SequenceParallel,
                       DCPPrefill),
}

# Passes that run only when the frontend built one (their arguments come from the model).
OPTIONAL: frozenset[type[DCPPass]] = frozenset({InsertPagedCache})

# Passes built from more than the context: pass -> its extra constructor arguments, from the
# name of the graph's first step input (the rank input goes before it).
_EXTRA_ARGS = {InsertRank: lambda first_user_input: (first_user_input,),
               CheckTokenWise: lambda first_user_input: (first_user_input,)}


def pass_names(step: str) -> list[str]:
    """``step``'s pass names in order, the optional ones included."""
    return [cls.name for cls in _passes_of(step)]


def passes_for(ctx: TransformContext, first_user_input: str, *,
               prologue: Sequence[DCPPass] = ()) -> list[DCPPass]:
    """``ctx.step``'s passes, built in ``PIPELINE`` order. ``prologue``: the optional passes
    the frontend built for this graph (an ordinary model's InsertPagedCache), each run in
    its row's place; an optional pass it did not build does not run."""
    given = {type(p): p for p in prologue}
    unknown = sorted(p.name for cls, p in given.items() if cls not in OPTIONAL)
    if unknown:
        raise DCPTransformError(
            f"prologue passes {unknown} are not optional passes of the table: the optional "
            f"ones are {sorted(c.name for c in OPTIONAL)}. Add the pass to PIPELINE and "
            f"OPTIONAL (dcp_compile.passes.pipeline).")
    built = []
    for cls in _passes_of(ctx.step):
        if cls in OPTIONAL:
            if cls in given:
                built.append(given[cls])
            continue
        extra = _EXTRA_ARGS.get(cls)
        built.append(cls(ctx, *extra(first_user_input)) if extra else cls(ctx))
    return built


def _passes_of(step: str) -> tuple[type[DCPPass], ...]:
    try:
        return PIPELINE[step]
    except KeyError:
        raise DCPTransformError(
            f"no pipeline for step kind {step!r}: the step kinds are {sorted(PIPELINE)}. "
            f"Name one of them (dcp_compile.passes.pipeline.PIPELINE).") from None
