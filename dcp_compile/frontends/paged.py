"""The paged frontend: a model that already takes the step signature
``forward(input_ids, positions, block_table, kv_caches)`` and states its cache
(``num_layers``, ``kv_cache_shape(num_blocks, block_size)``): the demo model,
``hf.prepare``'s wrapper. Captured with torch.export; no prologue; the model is its own
reference."""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.program.facts import ModelFacts

from ..capture import capture, checkpoint_names, constant_values, example_step_inputs
from .hf_checkpoint import checkpoint_sources
from .module_experts import drop_replaced_weights
from .protocol import PAGED_STEP, StepCapture


class PagedFrontend:
    source = "transform"
    dump_name = "transform"
    reference_has_cache = True       # the reference keeps its own KV cache between steps

    def __init__(self, model: nn.Module, shapes):
        if not hasattr(model, "kv_cache_shape") or not hasattr(model, "num_layers"):
            raise DCPTransformError(
                f"{type(model).__name__} does not describe its KV cache: it needs "
                f"`num_layers` and `kv_cache_shape(num_blocks, block_size)` (the built-in "
                f"demo model has them; wrap Hugging Face models with dcp_compile.hf.prepare).")
        self.model, self.shapes = model, shapes
        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self.dtype = params[0].dtype if params else torch.float32
        self._constants = None

    def steps(self, mode: str) -> tuple[str, ...]:
        from dcp_compile.passes.pipeline import steps_of
        return steps_of(mode, self.shapes)

    def at_shapes(self, shapes) -> "PagedFrontend":
        other = copy.copy(self)             # the same model, checks done, wrappers kept
        other.shapes = shapes
        return other

    def capture(self, step: str, config) -> StepCapture:
        s = self.shapes
        tokens = s.tokens(step)
        cache_shape = self.model.kv_cache_shape(s.num_blocks, config.block_size)
        start = time.perf_counter()
        captured = capture(self.model, example_step_inputs(
            s.batch, tokens, s.max_blocks, cache_shape, self.model.num_layers,
            device=self.device, dtype=self.dtype))
        drop_replaced_weights(captured, self.model, self.checkpoint_module)
        return StepCapture(captured.gm, captured.user_inputs,
                           list(captured.params) + list(captured.buffers),
                           time.perf_counter() - start,
                           constants=lambda: constant_values(self.model, captured),
                           provides=PAGED_STEP,
                           weight_names=lambda: checkpoint_names(self.model, captured,
                                                                 self.checkpoint_module),
                           weight_sources=lambda: checkpoint_sources(self.checkpoint_module))

    @property
    def checkpoint_module(self) -> nn.Module:
        """The model a checkpoint is of: a wrapper (hf.prepare's) names the model it wraps
        as ``checkpoint_module``; else the model itself."""
        return getattr(self.model, "checkpoint_module", self.model)

    def prologue(self, ctx, captured: StepCapture) -> list:
        """The graph takes its caches already; only the canonical forms the model names
        (``canonical_forms``: hf.prepare's wrapper names transformers' Conv1D and OPT's
        flattened MLP) are left to make."""
        forms = tuple(getattr(self.model, "canonical_forms", ()))
        if not forms:
            return []
        from dcp_compile.passes.canonical_ops import CanonicalizeOps
        return [CanonicalizeOps(ctx, weights=set(captured.weight_inputs),
                                constants=captured.constants, forms=forms)]

    def facts(self) -> ModelFacts:
        return ModelFacts(num_layers=self.model.num_layers, cache_dtype=self.dtype,
                          max_model_len=getattr(self.model, "max_model_len", None),
                          rope_type=getattr(self.model, "rope_type", None))

    def reference(self) -> nn.Module:
        return self.model

    def accept(self, config) -> None:
        pass

    def state_cache(self, tp: int):
        return None                  # no recurrent layers (frontends/hybrid.py has them)
