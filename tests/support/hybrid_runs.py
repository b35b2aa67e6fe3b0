"""What the frontends' hybrid program tests share: the sizes, the
prompts, one transform per (model type, layout, mode), and the two checks against the
model's own forward (fp32, 1e-4, greedy tokens equal, on every rank)."""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile import verify
from dcp_compile.frontends.ordinary import FullForwardReference
from dcp_compile.runtime.serving.engine import StepShapes
from hybrid_configs import build_hybrid

TOL = 1e-4
LENGTHS = (1, 5, 8)                 # around the conv kernel K=4; a one-token prompt
STEPS = 6
SHAPES = StepShapes(batch=3, context_len=8, max_blocks=8, num_blocks=16)
BLOCK = 2
LAYOUTS = ((4, 2), (8, 4))


def cases(types, slice_, run_all: bool):
    """(model type, tp, dcp) of the full matrix, the slice's marked to always run (every
    case with ``run_all``: the module's full-run switch)."""
    return [pytest.param(t, tp, dcp, id=f"{t}-tp{tp}-dcp{dcp}",
                         marks=() if (t, tp, dcp) in slice_ or run_all else
                         pytest.mark.skip(reason="DCP_HYBRID_FULL=1 runs it"))
            for t in types for tp, dcp in LAYOUTS]


def prompts(vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


_MODELS: dict = {}
_PROGRAMS: dict = {}


def model_of(model_type: str):
    if model_type not in _MODELS:
        _MODELS[model_type] = build_hybrid(model_type)
    return _MODELS[model_type]


def program(model_type: str, tp: int, dcp: int, mode: str):
    """(the tiny model, its program for (tp, dcp, mode)), built once per session."""
    key = (model_type, tp, dcp, mode)
    if key not in _PROGRAMS:
        model = model_of(model_type)
        _PROGRAMS[key] = model, dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode,
                                                      block_size=BLOCK, shapes=SHAPES,
                                                      check=False)
    return _PROGRAMS[key]


def assert_decode_matches(model, prog, label: str):
    """The prompts through the context step, then STEPS greedy decode steps: every step's
    logits within TOL of the model's own forward over the whole sequence."""
    report = verify.verify(FullForwardReference(model), prog, prompts(), steps=STEPS,
                           atol=TOL)
    assert report.ok and report.tokens_agree, report
    print(f"{label} decode: max |logit error| {report.max_abs_error:.1e}")
    return report


def assert_prefill_matches(model, prog, chunks: int, label: str):
    """The chunk's tokens split over the ranks, every real token's logits within TOL; with
    two chunks the second continues each row's state (cut at unaligned places)."""
    ps = prompts()
    plan = [ps] if chunks == 1 else verify.chunk_plan_of(ps, chunks)
    report = verify.verify_prefill(FullForwardReference(model), prog, plan, atol=TOL,
                                   check_cache=False)   # the reference holds no KV cache
    assert report.ok and report.tokens_agree, report
    print(f"{label} prefill x{chunks}: max |logit error| {report.max_abs_error:.1e}")
    return report


def assert_swapped_rows_match(model, lengths=(1, 5, 8)) -> torch.Tensor:
    """The model with its mixers run as their ops (``recurrent_as_ops``, one fresh state slot
    per row) over a batch of rows of mixed ``lengths`` equals its own forward row by row
    (1e-4, greedy tokens); returns the batch of token ids."""
    from dcp_compile.frontends.module_recurrent import allocate_states, recurrent_as_ops
    ids = torch.randint(0, model.config.vocab_size, (len(lengths), max(lengths)),
                        generator=torch.Generator().manual_seed(1))
    states = allocate_states(model, num_slots=len(lengths))
    states.step(list(range(len(lengths))), [True] * len(lengths), list(lengths))
    with recurrent_as_ops(model, states):
        got = model(ids, use_cache=False).logits
    for b, n in enumerate(lengths):
        want = model(ids[b:b + 1, :n], use_cache=False).logits[0]
        err = (got[b, :n] - want).abs().max().item()
        assert err < TOL, f"row {b} (len={n}): max error {err}"
        assert torch.equal(got[b, :n].argmax(-1), want.argmax(-1))
    return ids


def collectives(nodes) -> list[str]:
    """``op@role`` of every collective among ``nodes``, sorted."""
    from dcp_compile.runtime.distributed.roles import role_of
    return sorted(f"{n.target._opname}@{role_of(n)}" for n in nodes
                  if n.op == "call_function" and role_of(n) is not None)
