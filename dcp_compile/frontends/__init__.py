"""Frontends: how a model's steps are captured (the ``Frontend`` protocol, and which
frontend a model gets).

A frontend is all that differs between model kinds; the driver (:mod:`dcp_compile.driver`)
runs every one the same way. It provides:

  * ``capture(step)``: stage 0, the step's ATen graph (:class:`StepCapture`);
  * ``prologue(ctx, captured)``: the optional passes of the pipeline table this graph needs
    (an ordinary model's cache insertion), built from the model;
  * ``facts()``: the typed :class:`~dcp_compile.runtime.program.facts.ModelFacts` it knows before
    the passes run;
  * ``reference()``: the forward ``check=`` compares the program with (None: no check).

Three frontends: :mod:`.paged` (the demo model, ``hf.prepare``), :mod:`.ordinary` (plain
and Hugging Face sdpa/eager models; the cache is inserted from the graph) and :mod:`.dynamo`
(the torch.compile backend). :func:`frontend_for` picks one for an ``nn.Module`` by the rules
of ``FRONTEND_RULES``, tried in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from torch import nn

from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.names import BLOCK_TABLE, KV_CACHES

from .hf_config import is_hf     # not .huggingface: transformers loads when an HF model needs it
from .protocol import Frontend, StepCapture, forward_params

if TYPE_CHECKING:
    from dcp_compile.runtime.serving.engine import StepShapes

__all__ = ["Frontend", "StepCapture", "frontend_for", "forward_params", "is_hf"]


# -- which frontend an nn.Module gets ------------------------------------------------------

def _paged(model, shapes):
    from .paged import PagedFrontend
    return PagedFrontend(model, shapes)


def _hf_prepared(model, shapes):
    from .huggingface import prepare   # attention already "dcp_paged": the fast path
    return _paged(prepare(model), shapes)


def _ordinary(model, shapes):
    from .ordinary import OrdinaryFrontend
    return OrdinaryFrontend(model, shapes)


def _refuse_hf_attention(model, shapes):
    impl = getattr(model.config, "_attn_implementation", None)
    raise DCPTransformError(
        f"{type(model).__name__} uses attn_implementation={impl!r}, which the compiler "
        f"does not read. Build it with attn_implementation='sdpa' or 'eager' (the KV "
        f"cache is inserted from the graph), or wrap it with dcp_compile.hf.prepare.")


def _has_recurrent_layers(model) -> bool:
    from .module_recurrent import recurrent_layers
    return bool(recurrent_layers(model))


def _unruled_hybrid(model) -> bool:
    """A Hugging Face hybrid (by its config) none of whose mixers a swap rule names."""
    from .module_recurrent import unruled_mixers
    return is_hf(model) and bool(unruled_mixers(model))


def _refuse_unruled_hybrid(model, shapes):
    from .module_recurrent import refuse_unruled_hybrid   # raises DCPHybridError by name
    refuse_unruled_hybrid(model)
    raise AssertionError("refuse_unruled_hybrid returned")  # pragma: no cover


def _has_not_built_part(model) -> bool:
    """A model with a part known by name that no dcp op computes (module_recurrent.NOT_BUILT)."""
    from .module_recurrent import not_built_parts
    return bool(not_built_parts(model))


def _refuse_not_built(model, shapes):
    from .module_recurrent import refuse_not_built   # raises DCPHybridError by name
    refuse_not_built(model)
    raise AssertionError("refuse_not_built returned")  # pragma: no cover


def _hybrid(model, shapes):
    from .hybrid import HybridFrontend      # refuses by name what is not built
    return HybridFrontend(model, shapes)


def _hf_attention(model) -> str | None:
    return getattr(model.config, "_attn_implementation", None) if is_hf(model) else None


def has_paged_hooks(model) -> bool:
    return hasattr(model, "kv_cache_shape") and hasattr(model, "num_layers")


def takes_paged_args(model) -> bool:
    return any(name in forward_params(model) for name in PAGED_ARGS)


PAGED_ARGS = (BLOCK_TABLE, KV_CACHES)          # a forward with these is a paged step
HF_ORDINARY_ATTENTION = ("sdpa", "eager")
HF_PAGED_ATTENTION = "dcp_paged"

# (test, frontend factory), tried in order: the first test that holds picks the frontend.
FRONTEND_RULES: tuple[tuple[Callable[[nn.Module], bool], Callable], ...] = (
    (_has_not_built_part, _refuse_not_built),  # a part no dcp op computes: by name
    (_has_recurrent_layers, _hybrid),       # hybrid (docs/hybrid.md): mixers as dcp ops
    (_unruled_hybrid, _refuse_unruled_hybrid),  # a hybrid without a swap rule: by name
    (has_paged_hooks, _paged),              # states its cache: num_layers, kv_cache_shape
    (lambda m: _hf_attention(m) == HF_PAGED_ATTENTION, _hf_prepared),
    (lambda m: _hf_attention(m) in HF_ORDINARY_ATTENTION, _ordinary),
    (is_hf, _refuse_hf_attention),          # HF, any other attention
    (takes_paged_args, _paged),             # a paged step without the hooks: refused there
    (lambda m: True, _ordinary),            # any other causal LM
)


def frontend_for(model: nn.Module, shapes: "StepShapes | None" = None) -> Frontend:
    """The frontend for ``model``: the first of ``FRONTEND_RULES`` whose test holds."""
    from dcp_compile.runtime.serving.engine import StepShapes
    shapes = shapes or StepShapes()
    for applies, make in FRONTEND_RULES:
        if applies(model):
            return make(model, shapes)
    raise AssertionError("the last rule always applies")  # pragma: no cover
