"""The hybrid frontend: a Hugging Face model whose recurrent mixers a rule of
:mod:`.module_recurrent` names (Gated DeltaNet, Mamba2, short conv) beside its attention
layers (docs/hybrid.md).

The ordinary frontend's capture and prologue, with two differences:

  * the step runs each recurrent mixer as its ``dcp`` op (``recurrent_as_ops``), so the graph
    has one ``dcp.gated_delta_net`` / ``dcp.kimi_delta_attention`` / ``dcp.mamba2_ssm`` /
    ``dcp.short_conv`` per recurrent layer instead of the model's own scan and in-place cache writes;
  * the step's signature carries the state: ``state_slot [B]``, ``state_fresh [B]``,
    ``state_lengths [B]`` and one input per state cache (``state_caches_<i>``: every recurrent
    layer's conv cache, in layer order, then every recurrence cache), and returns the new
    state caches after the logits (and, once the cache insertion ran, after the KV caches):

        graph(*weights, tp_rank, input_ids, positions, block_table, *kv_caches,
              state_slot, state_fresh, state_lengths, *state_caches)
            -> (logits, *kv_caches', *state_caches')

A width-K decode step (``StepShapes.decode_len = K > 1``, speculative verification) also
takes ``state_snapshot_slot [B, K]`` after the state caches: where the state after each
draft position is kept, so the engine continues from the accepted draft's snapshot. With
``StepShapes.state_checkpoints = N``, the context step takes one too (``[B, context_len]``):
the engine keeps the state at a prompt's vblock boundaries there, for prefix caching.

What is not built is refused by name (:func:`refuse_unbuilt`): a decode program's chunk
step, state checkpoints in a prefill program, and prefill of the models ``PREFILL_REFUSED``
names (none at present); the engine refuses prefix caching of a program
without state checkpoints.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import Tensor, nn

from dcp_compile.runtime.errors import DCPHybridError
from dcp_compile.runtime.names import STATE_CACHES, Mode, StepKind

from ..capture import capture
from .module_experts import drop_replaced_weights
from .module_recurrent import (RecurrentStates, recurrent_as_ops, recurrent_layers,
                               refuse_hybrid, state_spec, state_tp)
from .ordinary import OrdinaryFrontend, OrdinaryStep, step_capture
from .protocol import StepCapture



def state_slots(shapes) -> int:
    """State slots of a program: one per row of its batch (the engine's sequences at once),
    times the decode width K: a width-K (speculative) step keeps the state after each of a
    row's first K-1 tokens in its sequence's K-1 spare slots (``state_snapshot_slot``), the
    state after its last token in its live slot (docs/hybrid.md); then the
    ``state_checkpoints`` slots prefix caching keeps the state at vblock boundaries in."""
    return shapes.batch * shapes.decode_len + getattr(shapes, "state_checkpoints", 0)


def keeps_snapshots(shapes, step: str) -> bool:
    """Whether ``step``'s graph takes ``state_snapshot_slot [B, tokens]``: a width-K decode
    step (speculative drafts) and, with ``state_checkpoints``, the context step (the state
    at a prompt's vblock boundaries, for prefix caching)."""
    if step == StepKind.DECODE:
        return shapes.decode_len > 1
    return step == StepKind.CONTEXT and getattr(shapes, "state_checkpoints", 0) > 0


def _recomposition_out_of_place(m: nn.Module):
    """Qwen3.5's MRoPE ``recomposition_frequencies``, its slice writes (``freqs_thw[..., idx] =
    freq[dim, ..., idx]``, an in-place ``copy_`` the token-wise check refuses) written as a
    ``where`` over the last dim's indices ``offset:length:3``: the same values, elementwise."""
    def recomposition_frequencies(freq):
        freqs_thw = freq[0]
        i = torch.arange(freq.shape[-1], device=freq.device)
        for dim, offset in enumerate((1, 2), start=1):
            length = m.mrope_section[dim] * 3
            picked = (i >= offset) & (i < length) & ((i - offset) % 3 == 0)
            freqs_thw = torch.where(picked, freq[dim], freqs_thw)
        return torch.cat((freqs_thw, freqs_thw), dim=-1)
    return recomposition_frequencies


_TF = "transformers.models"
# Methods of a hybrid's other modules that write a slice in place, run out of place during
# the capture: (module, class, method, its pinned source hash (transformers 5.25), the
# out-of-place twin). A changed source is refused by name.
OUT_OF_PLACE = (
    (f"{_TF}.qwen3_5.modeling_qwen3_5", "Qwen3_5TextRotaryEmbedding",
     "recomposition_frequencies", "cda427993fce", _recomposition_out_of_place),
    (f"{_TF}.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeTextRotaryEmbedding",
     "recomposition_frequencies", "cda427993fce", _recomposition_out_of_place),
)


@contextlib.contextmanager
def writes_out_of_place(model: nn.Module):
    """Within: each method of ``OUT_OF_PLACE`` on ``model``'s modules runs its out-of-place
    twin (set on the instance, undone on exit)."""
    from .module_experts import source_hash
    swapped = []
    try:
        for name, mod in model.named_modules():
            for module, cls, method, pinned, twin in OUT_OF_PLACE:
                if type(mod).__name__ != cls or type(mod).__module__ != module:
                    continue
                got = source_hash(getattr(type(mod), method))
                if got != pinned:
                    raise DCPHybridError(
                        f"{cls}.{method} at {name}: its source is not the code its out-of-"
                        f"place twin was written against (sha256 {got}, pinned {pinned}). "
                        f"Use the transformers version of requirements/corpus.txt, or "
                        f"update OUT_OF_PLACE in dcp_compile/frontends/hybrid.py.")
                setattr(mod, method, twin(mod))
                swapped.append((mod, method))
        yield
    finally:
        for mod, method in swapped:
            delattr(mod, method)


class HybridStep(nn.Module):
    """``forward(input_ids, position_ids, state_slot, state_fresh, state_lengths,
    state_caches) -> (logits, *state_caches')`` with every recurrent mixer as its op."""

    def __init__(self, model: nn.Module, conv_layers: list[int], rec_layers: list[int]):
        super().__init__()
        self.step = OrdinaryStep(model, library_modules=True)
        self.conv_layers, self.rec_layers = conv_layers, rec_layers

    def forward(self, input_ids: Tensor, position_ids: Tensor, state_slot: Tensor,
                state_fresh: Tensor, state_lengths: Tensor, state_caches: list[Tensor],
                state_snapshot_slot: Tensor | None = None):
        n = len(self.conv_layers)
        states = RecurrentStates(dict(zip(self.conv_layers, state_caches[:n])),
                                 dict(zip(self.rec_layers, state_caches[n:])),
                                 state_slot, state_fresh, state_lengths,
                                 snapshot_slot=state_snapshot_slot)
        with recurrent_as_ops(self.step.model, states), writes_out_of_place(self.step.model):
            logits = self.step(input_ids, position_ids)
        return (logits, *[states.conv[i] for i in self.conv_layers],
                *[states.rec[i] for i in self.rec_layers])


class HybridFrontend(OrdinaryFrontend):
    """The ordinary frontend with the recurrent mixers as ops and their state as step inputs
    and outputs (module doc)."""

    def __init__(self, model: nn.Module, shapes):
        refuse_unbuilt(model, shapes)
        super().__init__(model, shapes)
        spec = state_spec(model, state_slots(shapes))
        self.conv_layers = [la.layer for la in spec.layers if la.conv is not None]
        self.rec_layers = [la.layer for la in spec.layers if la.rec is not None]
        self.step_model = HybridStep(model, self.conv_layers, self.rec_layers)

    def state_cache(self, tp: int):
        """One rank's state caches: every layer's heads cut ``tp`` ways when its op runs cut
        by heads (passes/placement/recurrent.py; the same rule, ``module_recurrent.state_tp``),
        else whole on every rank (replicated weights)."""
        return state_spec(self.model, state_slots(self.shapes), tp=state_tp(self.model, tp))

    def capture(self, step: str, config) -> StepCapture:
        refuse_unbuilt(self.model, self.shapes, mode=config.mode)
        tokens = self.shapes.tokens(step)
        batch, device = self.shapes.batch, self.device
        start = time.perf_counter()
        # captured whole (tp=1): shard_tensor_parallel cuts the caches as the ops' layout says
        caches = self.state_cache(1).allocate_inputs(device)   # input order
        example = (torch.zeros(batch, tokens, dtype=torch.int64, device=device),
                   torch.arange(tokens, device=device).expand(batch, tokens).clone(),
                   torch.arange(batch, dtype=torch.int64, device=device),
                   torch.ones(batch, dtype=torch.bool, device=device),
                   torch.full((batch,), tokens, dtype=torch.int64, device=device),
                   caches)
        if keeps_snapshots(self.shapes, step):      # a state snapshot slot per token
            example += (torch.full((batch, tokens), -1, dtype=torch.int64, device=device),)
        captured = capture(self.step_model, example)
        drop_replaced_weights(captured, self.step_model.step, self.model)
        return step_capture(captured, self.step_model, self.model, start)

    def accept(self, config) -> None:
        refuse_unbuilt(self.model, self.shapes, mode=config.mode)


# Mixer classes whose models a prefill program cannot serve yet, and why (none now: Qwen's
# gated attention, once refused here, has its output gate computed again on the O
# projection's tokens by passes/dcp_prefill.py, LayerPlan.o_recomputed).
PREFILL_REFUSED: dict[str, str] = {}


def refuse_unbuilt(model: nn.Module, shapes, *, mode: str | None = None) -> None:
    """``DCPHybridError`` for what a hybrid program does not do yet (docs/hybrid.md):
    a decode program's chunk step (a prompt continued after prior context), or prefill of a
    model a rule cannot run under sequence parallelism. Speculative (width-K) decode is
    built: the decode step keeps a state snapshot per draft position."""
    if getattr(shapes, "chunk_len", 0):
        name, _, rule = recurrent_layers(model)[0]
        raise DCPHybridError(
            f"hybrid model ({rule.cls} at {name}): a decode program's chunk step "
            f"(StepShapes.chunk_len={shapes.chunk_len}) is not built for hybrids: the chunk "
            f"step's width-K rows are not wired to the state caches. Set chunk_len=0 (the "
            f"prompt runs through the context step).")
    if mode == Mode.PREFILL and getattr(shapes, "state_checkpoints", 0):
        name, _, rule = recurrent_layers(model)[0]
        raise DCPHybridError(
            f"hybrid model ({rule.cls} at {name}) in prefill mode with StepShapes."
            f"state_checkpoints={shapes.state_checkpoints}: the state checkpoints of prefix "
            f"caching are kept by a decode program's context step only (the prefill rewrite "
            f"does not pass snapshot slots). Build a decode program, or state_checkpoints=0.")
    if mode == Mode.PREFILL:
        for name, _, rule in recurrent_layers(model)[:1]:
            if rule.cls in PREFILL_REFUSED:
                raise DCPHybridError(
                    f"hybrid model ({rule.cls} at {name}) in prefill mode: "
                    f"{PREFILL_REFUSED[rule.cls]}. Serve it with a decode program (its "
                    f"context step runs the prompt), or prefill without DCP.")


__all__ = ["HybridFrontend", "HybridStep", "OUT_OF_PLACE", "PREFILL_REFUSED", "STATE_CACHES",
           "keeps_snapshots", "refuse_unbuilt", "state_slots", "writes_out_of_place"]
