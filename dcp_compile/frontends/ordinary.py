"""The ordinary frontend: any causal LM ``forward(input_ids (, position_ids)) -> logits`` (or
an object with ``.logits``), Hugging Face models with ``attn_implementation`` "sdpa" or
"eager" included. Captured with :func:`capture_ordinary`; its prologue is the optional
passes of the pipeline's capture prologue (canonicalize_ops, absorb_latent_attention,
insert_paged_cache, which adds the KV cache, and lift_positions); its reference is the
model's own full forward, recomputed every step (:class:`FullForwardReference`).
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
from torch import Tensor, nn

from dcp_compile.runtime.errors import DCPOutputContractError, DCPTransformError
from dcp_compile.runtime.program.facts import ModelFacts

from ..capture import Captured, capture, checkpoint_names, constant_values
from .hf_checkpoint import checkpoint_sources
from .module_experts import drop_replaced_weights, module_experts_enabled, stacked_experts
from .module_position_bias import (Tables, bias_sites, module_position_bias_enabled,
                                   prepare_distance_tables)
from .module_compressed_attention import refuse_compressed_attention
from .module_sparse_attention import indexer_sites, module_indexers_enabled
from .module_windows import module_windows_enabled, window_sites
from .hf_config import attention_chunks
from .huggingface import attention_windows, check_hf_config, dcp_experts_enabled, is_hf
from .protocol import StepCapture, forward_params


class OrdinaryFrontend:
    source = "transform"
    dump_name = "transform"
    reference_has_cache = False      # the reference recomputes the whole sequence

    def __init__(self, model: nn.Module, shapes):
        if is_hf(model):
            check_hf_config(model)
        self.model, self.shapes = model, shapes
        self.step_model = OrdinaryStep(model, library_modules=True)
        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")

    def steps(self, mode: str) -> tuple[str, ...]:
        from dcp_compile.passes.pipeline import steps_of
        return steps_of(mode, self.shapes)

    def at_shapes(self, shapes) -> "OrdinaryFrontend":
        other = copy.copy(self)             # the same model, checks done, wrappers kept
        other.shapes = shapes
        return other

    def capture(self, step: str, config) -> StepCapture:
        tokens = self.shapes.tokens(step)
        start = time.perf_counter()
        # The positions a program's block table addresses: a distance table's length.
        step_model = self.step_model
        step_model.max_model_len = self.shapes.max_blocks * config.block_size * config.dcp
        prepare_distance_tables(step_model.library_biases, Tables(
            step_model.library_bias_tables, step_model.max_model_len))
        captured = capture_ordinary(self.step_model, self.shapes.batch, tokens,
                                    device=self.device)
        drop_replaced_weights(captured, self.step_model, self.model)
        return step_capture(captured, self.step_model, self.model, start)

    def prologue(self, ctx, captured: StepCapture) -> list:
        """The graph has no cache yet: the optional passes of the pipeline's capture
        prologue (canonical ops, MLA absorption, the cache insertion, positions lifted),
        built from the model."""
        from dcp_compile.passes.absorb_latent_attention import AbsorbLatentAttention
        from dcp_compile.passes.canonical_ops import CanonicalizeOps
        from dcp_compile.passes.insert_paged_cache import InsertPagedCache
        from dcp_compile.passes.positions import LiftPositions
        inputs = captured.user_inputs
        return [CanonicalizeOps(ctx, weights=set(captured.weight_inputs),
                                constants=captured.constants),
                AbsorbLatentAttention(ctx),
                InsertPagedCache(ctx, token_input=inputs[0],
                                 position_input=inputs[1] if len(inputs) > 1 else None,
                                 num_blocks=self.shapes.num_blocks,
                                 max_blocks=self.shapes.max_blocks,
                                 constants=captured.constants,
                                 windows=attention_windows(self.model),
                                 chunks=attention_chunks(self.model)),
                LiftPositions(ctx, inputs[0])]

    def facts(self) -> ModelFacts:
        return ModelFacts()          # the cache insertion finds them in the graph

    def reference(self) -> nn.Module:
        return FullForwardReference(self.model)

    def accept(self, config) -> None:
        pass

    def state_cache(self, tp: int):
        return None                  # no recurrent layers (frontends/hybrid.py has them)


def step_capture(captured, step_model: nn.Module, model: nn.Module,
                 start: float) -> StepCapture:
    """The StepCapture of ``captured`` (``step_model`` wrapping ``model``, capture begun at
    ``start``): its weights and buffers, their values and their checkpoint names read lazily
    from the model."""
    return StepCapture(captured.gm, captured.user_inputs,
                       list(captured.params) + list(captured.buffers),
                       time.perf_counter() - start,
                       constants=lambda: constant_values(step_model, captured),
                       weight_names=lambda: checkpoint_names(step_model, captured, model),
                       weight_sources=lambda: checkpoint_sources(model))


class OrdinaryStep(nn.Module):
    """``forward(input_ids (, position_ids)) -> logits`` around any causal LM."""

    def __init__(self, model: nn.Module, *, library_modules: bool = False):
        super().__init__()
        self.model = model
        # The model libraries' MoE blocks as dcp.moe (module_experts): for the capture only;
        # the reference runs the model's own blocks.
        self.library_experts = stacked_experts(model) if library_modules else nn.ModuleDict()
        # The model libraries' sliding windows written in place (litgpt's loop) as a formula
        # of positions (module_windows): for the capture only, with the MoE blocks.
        self.library_windows = window_sites(model) if library_modules else []
        # ... and their position biases cached in a buffer (x-transformers' ALiBi) recomputed
        # as a formula of positions at every call (module_position_bias).
        self.library_biases = bias_sites(model) if library_modules else []
        # ... of which those of the key-query distance (T5's, an MLP's) are read from a
        # table over the program's max_model_len, a buffer of this module (set by capture).
        self.library_bias_tables = nn.Module()
        self.max_model_len: int | None = None
        params = forward_params(model)
        self.hf = is_hf(model)
        # transformers' DSA indexers as one dcp.index_topk op each (module_sparse_attention):
        # for the capture only; the reference runs the model's own indexer.
        self.indexers = indexer_sites(model) if self.hf else []
        # DeepSeek-V4's compressed attention: refused by name before the capture meets it
        if self.hf:
            refuse_compressed_attention(model)
        self.takes_positions = "position_ids" in params
        first = next(iter(params), None)
        if first is None:
            raise DCPTransformError(
                f"{type(model).__name__}.forward takes no arguments. An ordinary causal LM "
                f"takes forward(input_ids (, position_ids)).")

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None):
        kwargs = {"position_ids": position_ids} if self.takes_positions else {}
        if self.hf:
            kwargs.update(use_cache=False, return_dict=True)
        experts = dcp_experts_enabled(self.model) if self.hf else contextlib.nullcontext()
        with experts, module_experts_enabled(self.model, self.library_experts), \
                module_windows_enabled(self.library_windows), \
                module_position_bias_enabled(self.library_biases, Tables(
                    self.library_bias_tables, self.max_model_len)), \
                module_indexers_enabled(self.indexers):
            out = self.model(input_ids, **kwargs)
        logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
        if not isinstance(logits, Tensor):
            raise DCPTransformError(
                f"{type(self.model).__name__}.forward returned {type(out).__name__}, not "
                f"logits: an ordinary causal LM returns the logits tensor [B, S, vocab] or "
                f"an object with .logits.")
        if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
            raise DCPOutputContractError(_output_contract(self.model, logits, input_ids))
        return logits


def _output_contract(model: nn.Module, logits: Tensor, input_ids: Tensor) -> str:
    """Why ``logits`` is not what a program returns, naming the form when it is the last
    position's logits only (nanoGPT's inference forward, ``lm_head(x[:, [-1], :])``)."""
    name, shape, ids = type(model).__name__, tuple(logits.shape), tuple(input_ids.shape)
    if logits.dim() in (2, 3) and shape[0] == ids[0] and ids[1] > 1 \
            and (logits.dim() == 2 or shape[1] == 1):
        return (f"{name} returns the logits of the last position only (shape {shape} for "
                f"input_ids {ids}: its LM head reads x[:, [-1], :] or x[:, -1, :], as "
                f"nanoGPT's inference forward does). A program returns every token's logits "
                f"[B, S, vocab], one per token of its step (in prefill the last real token of "
                f"a padded row is not at index -1), and does not change what the model "
                f"returns: apply the LM head to every position (nanoGPT: "
                f"logits = self.lm_head(x), its training branch) and take the last token's "
                f"logits from the program's output")
    return (f"{name} returned logits of shape {shape} for input_ids {ids}: expected "
            f"[B, S, vocab]. Return the logits of every token.")


def capture_ordinary(step: OrdinaryStep, batch: int, tokens: int, *,
                     device) -> Captured:
    """Capture one step kind of an ordinary model (positions 0..S-1 as the example)."""
    ids = torch.zeros(batch, tokens, dtype=torch.int64, device=device)
    example = (ids,)
    if step.takes_positions:
        example += (torch.arange(tokens, device=device).expand(batch, tokens).clone(),)
    try:
        with torch.no_grad():
            return capture(step, example)
    except DCPOutputContractError:
        raise                     # already names what the model returns and what to change
    except DCPTransformError as e:
        raise DCPTransformError(
            f"{e} ({type(step.model).__name__} was taken as an ordinary causal LM, "
            f"forward(input_ids [B, S] (, position_ids)) -> logits [B, S, vocab]: it has no "
            f"paged step signature; a model that manages its own paged KV cache describes it "
            f"with `num_layers` and `kv_cache_shape(num_blocks, block_size)`.)") from e


class FullForwardReference(nn.Module):
    """An ordinary model behind the paged step signature, for the engine's single-device
    reference: each step recomputes the model's own full forward over the sequence so far
    (no cache; the caches pass through untouched), so the reference is independent of the
    cache insertion. A sequence is known by its first block (stable while it lives)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.step = OrdinaryStep(model)
        self.history: dict[int, dict[int, int]] = {}     # first block -> position -> token

    @torch.no_grad()
    def forward(self, input_ids, positions, block_table, kv_caches):
        logits = None
        for b in range(input_ids.shape[0]):
            valid = positions[b] >= 0
            if not bool(valid.any()):
                continue
            seen = self.history.setdefault(int(block_table[b, 0]), {})
            for p, t in zip(positions[b][valid].tolist(), input_ids[b][valid].tolist()):
                seen[p] = t
            last = int(positions[b][valid].max())
            seq = torch.tensor([[seen[p] for p in range(last + 1)]], device=input_ids.device)
            args = (seq, torch.arange(last + 1, device=seq.device)[None]) \
                if self.step.takes_positions else (seq,)
            full = self.step(*args)[0]
            if logits is None:
                logits = full.new_zeros(*input_ids.shape, full.shape[-1])
            logits[b, valid] = full[positions[b][valid]]
        if logits is None:
            raise DCPTransformError("a reference step with no tokens: every position is -1.")
        return logits, list(kv_caches)
