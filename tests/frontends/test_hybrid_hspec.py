"""Speculative (width-K) decode of hybrid programs (docs/hybrid.md, "Speculative decoding"):
a width-K decode step keeps the recurrent state after each draft position in the sequence's
spare state slots (``state_snapshot_slot``), and the engine continues from the accepted
draft's snapshot, so a rejected draft rolls the state back exactly.

Prefix caching: a decode program built with ``StepShapes(state_checkpoints=N)`` keeps the
state at each full vblock of a prompt, and a prefix-cache hit resumes from it. Program files
keep the state caches.

Tests: the accepted tokens equal greedy decode of the model's own forward, with drafts partly
wrong on purpose, every verified position's logits within 1e-4; a prefix-cache hit gives the
uncached run's tokens without recomputing the prefix; each with its mutation (no roll back,
no checkpoint: the logits leave the model's); a saved and reloaded program reproduces the
tokens; the slots, the checkpoints and the refusals. The slice (default run): Bamba at
tp=4/dcp=2, the speculative decode of Falcon-H1 and RecurrentGemma and Jamba's prefix caching;
``DCP_HYBRID_FULL=1``: Qwen3.5 and Bamba at tp=4/dcp=2 and tp=8/dcp=4, every other recurrent
family (``FAMILY_TYPES``) at tp=4/dcp=2 (speculative decode and prefix caching each, one cell
per family), the other mixers' speculative decode at tp=8/dcp=4 and an LFM2 decode program's
file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import dcp_compile  # noqa: E402
from dcp_compile import verify  # noqa: E402
from dcp_compile.frontends.ordinary import FullForwardReference  # noqa: E402
from dcp_compile.runtime.errors import DCPHybridError  # noqa: E402
from dcp_compile.runtime.names import STATE_SNAPSHOT_SLOT  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402
from dcp_compile.runtime.serving.state_cache import StateSlots  # noqa: E402
from full_runs import full  # noqa: E402
from hybrid_configs import build_hybrid  # noqa: E402

TOL = 1e-4
K = 3                                 # a row verifies up to 2 drafts
LENGTHS = (1, 5, 8)
STEPS = 7
SHAPES = StepShapes(batch=3, context_len=8, max_blocks=8, num_blocks=16, decode_len=K)
BLOCK = 2
FULL = full("DCP_HYBRID_FULL")
SPEC_TYPES = ("qwen3_5_text", "bamba")
LAYOUTS = ((4, 2), (8, 4))


# Speculative decode of the other mixers (each op keeps its snapshots) at tp=8/dcp=4 too:
# Falcon-H1's own Mamba2 forward, Jamba's conv + Mamba-1 scan, MiniMax's lightning, Kimi
# Linear's KDA, OLMo-hybrid's Gated DeltaNet (its own swap rule), RecurrentGemma's conv +
# RG-LRU.
SPEC_OTHER_TYPES = ("falcon_h1", "jamba", "minimax", "kimi_linear", "olmo_hybrid",
                    "recurrent_gemma")
# The default run's speculative cells (RecurrentGemma's is test_hybrid_rglru.py's only program).
SPEC_FAMILY_SLICE = {("falcon_h1", 4, 2), ("recurrent_gemma", 4, 2)}
SLICE = {("bamba", 4, 2)}             # the default run's case; DCP_HYBRID_FULL: all
# Every other recurrent family that matches in plain decode (docs/hybrid.md): speculative
# decode and prefix caching at tp=4/dcp=2, one cell per family and feature.
FAMILY_TYPES = ("qwen3_next", "qwen3_5_moe_text", "kimi_linear", "bailing_hybrid", "jamba",
                "zamba", "nemotron_h", "falcon_h1", "zamba2", "minimax", "lfm2", "lfm2_moe",
                "granitemoehybrid", "olmo_hybrid", "recurrent_gemma")
# The 2026 hybrids with swap rules (test_hybrid_newhyb.py): LFM3's short conv, LaRA-mini's GDN
FAMILY_TYPES += ("lfm3", "lara_mini")
FAMILY_SLICE = {("jamba", 4, 2)}      # the default run's family cell (prefix caching)


def _cases(types=SPEC_TYPES, slice_=SLICE, layouts=LAYOUTS):
    return [pytest.param(t, tp, dcp, id=f"{t}-tp{tp}-dcp{dcp}",
                         marks=() if (t, tp, dcp) in slice_ or FULL else
                         pytest.mark.skip(reason="DCP_HYBRID_FULL=1 runs it"))
            for t in types for tp, dcp in layouts]


def _prompts(vocab: int = 256):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


_PROGRAMS: dict = {}


def _program(model_type: str, tp: int, dcp: int):
    key = (model_type, tp, dcp)
    if key not in _PROGRAMS:
        model = build_hybrid(model_type)
        _PROGRAMS[key] = model, dcp_compile.transform(model, tp=tp, dcp=dcp, mode="decode",
                                                      block_size=BLOCK, shapes=SHAPES,
                                                      check=False)
    return _PROGRAMS[key]


class WrongOnPurpose:
    """Drafts from the model's own greedy continuation ``want``, with every draft whose
    generated index is 2 mod 3 made wrong (its token + 1): rows accept 0, 1 or 2 drafts, so
    a step's later positions are rejected and their state must be rolled back."""

    def __init__(self, prompts, want, vocab):
        self.prompts, self.want, self.vocab = prompts, want, vocab

    def propose(self, histories, counts):
        out = []
        for b, (h, c) in enumerate(zip(histories, counts)):
            g = len(h) - len(self.prompts[b])          # generated tokens so far
            drafts = self.want[b][g:g + c]
            out.append([(t + 1) % self.vocab if (g + i) % 3 == 2 else t
                        for i, t in enumerate(drafts)])
        return out

    def accepted(self, seq, length):
        pass


def _speculative(model, program, prompts):
    ref, _ = verify.run_reference(FullForwardReference(model), program, prompts, STEPS)
    drafter = WrongOnPurpose(prompts, ref.tokens, model.config.vocab_size)
    return verify.verify_speculative(FullForwardReference(model), program, prompts, STEPS,
                                     lambda rank: drafter, atol=TOL)


@pytest.mark.parametrize("model_type,tp,dcp",
                         _cases() + _cases(FAMILY_TYPES, SPEC_FAMILY_SLICE, ((4, 2),))
                         + _cases(SPEC_OTHER_TYPES, set(), ((8, 4),)))
def test_speculative_decode_matches_greedy_with_drafts_partly_rejected(model_type, tp, dcp):
    """Width-3 verification steps with partly wrong drafts: the accepted tokens are the model's
    own greedy tokens and every verified position's logits are within 1e-4 of its own forward
    over the whole sequence, on every rank; some drafts were accepted and some rejected."""
    model, program = _program(model_type, tp, dcp)
    report = _speculative(model, program, _prompts())
    assert report.ok and report.tokens_agree, report
    spec = report.spec
    assert 0 < spec["accepted"] < spec["drafted"], spec
    # a step with a rejected draft after an accepted one: the state rolled back mid-row
    assert any(a == 1 for step in spec["accepted_per_step"] for a in step), spec
    print(f"{model_type} tp={tp} dcp={dcp} speculative K={K}: max |logit error| "
          f"{report.max_abs_error:.1e}, {spec['accepted']}/{spec['drafted']} drafts accepted")


def test_without_the_roll_back_the_tokens_differ(monkeypatch):
    """The mutation: the engine keeps the live slot (the state after the rejected drafts) as
    if the snapshot were taken. The logits then leave the model's own (the test above can
    fail)."""
    model, program = _program("bamba", 4, 2)

    def kept_live(self, seq, length):
        return length in self.snapshots.pop(seq, {})
    monkeypatch.setattr(StateSlots, "roll_back", kept_live)
    report = _speculative(model, program, _prompts())
    assert not report.ok and report.max_abs_error > 1e-2, report
    print(f"bamba without the roll back: max |logit error| {report.max_abs_error:.1e}")


def test_the_width_k_decode_step_takes_the_snapshot_slots():
    """Only the width-K decode graph has the ``state_snapshot_slot`` input (last), and the
    program's state slots are K per row of the batch."""
    _, program = _program("bamba", 4, 2)
    assert program.state_spec().num_slots == SHAPES.batch * K
    for kind, gm in program.graphs.items():
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        assert (names[-1] == STATE_SNAPSHOT_SLOT) == (kind == "decode"), (kind, names[-3:])


def test_state_slots_keep_a_snapshot_per_draft_and_roll_back_to_it():
    slots = StateSlots(6, width=3)
    assert slots.step_slots([0, 1, None], [2, 4, 0]).tolist() == [0, 3, -1]
    assert slots.spares == {0: [1, 2], 1: [4, 5]}
    snap = slots.snapshot_slots([0, 1, None], [5, 8, 0], [3, 1, 0], 3)
    assert snap.tolist() == [[1, 2, -1], [-1, -1, -1], [-1, -1, -1]]
    assert slots.snapshots == {0: {6: 1, 7: 2}, 1: {}}
    assert slots.roll_back(0, 7)              # the state after 7 tokens is slot 2's
    assert slots.of[0] == 2 and slots.spares[0] == [1, 0]
    assert not slots.roll_back(0, 6)          # the snapshots are spent
    assert not slots.roll_back(1, 8)
    with pytest.raises(Exception, match="keeps 3 state snapshots"):
        slots.snapshot_slots([0], [7], [4], 4)
    slots.free(0)
    assert slots.slot(2) == 0 and slots.spares[2] == [1, 2]


def test_the_engine_refuses_a_rewind_no_snapshot_covers():
    from dcp_compile.runtime.serving.engine import Engine, LocalExecutor
    engine = Engine(LocalExecutor(None, []), SHAPES, block_size=BLOCK, state_slots=9)
    engine.lengths = [5]
    engine.state_slots.slot(0)
    with pytest.raises(DCPHybridError, match=r"rewinding sequence 0 of a hybrid program from "
                                             r"5 to 3 tokens.*snapshots of lengths \[\]"):
        engine.rewind(0, 3)


# -- program files ---------------------------------------------------------------------------

@pytest.mark.parametrize("model_type,decode_len", [
    pytest.param("lfm2", 1, id="lfm2-decode", marks=() if FULL else
                 pytest.mark.skip(reason="DCP_HYBRID_FULL=1 runs it")),
    pytest.param("bamba", K, id="bamba-speculative"),
    pytest.param("recurrent_gemma", K, id="recurrent_gemma-speculative", marks=() if FULL else
                 pytest.mark.skip(reason="DCP_HYBRID_FULL=1 runs it"))])
def test_a_saved_and_reloaded_hybrid_program_reproduces_the_tokens(tmp_path, model_type,
                                                                    decode_len):
    """program.save / load_program keep the state caches (``state_spec()``, the file's
    ``state_cache`` field): the loaded program lists the same spec and its decode (LFM2) or
    speculative decode with partly wrong drafts (Bamba's width-K program, its snapshot
    input) gives the original program's tokens, the model's own greedy ones."""
    from dcp_compile.runtime.program.program_file import load_program
    if decode_len == 1:
        model = build_hybrid(model_type)
        program = dcp_compile.transform(model, tp=4, dcp=2, mode="decode", block_size=BLOCK,
                                        shapes=StepShapes(batch=3, context_len=8, max_blocks=8,
                                                          num_blocks=16), check=False)
    else:
        model, program = _program(model_type, 4, 2)
    program.save(tmp_path / "hybrid.dcp")
    loaded = load_program(tmp_path / "hybrid.dcp")
    assert loaded.state_spec() == program.state_spec() is not None
    prompts = _prompts()
    if decode_len == 1:
        before = verify.verify(FullForwardReference(model), program, prompts, steps=4, atol=TOL)
        report = verify.verify(FullForwardReference(model), loaded, prompts, steps=4, atol=TOL)
        assert before.ok and report.ok and report.tokens_agree, report
    else:
        report = _speculative(model, loaded, prompts)
        assert report.ok and report.tokens_agree and report.spec["accepted"] > 0, report
    print(f"{model_type} reloaded: max |logit error| {report.max_abs_error:.1e}")


# -- prefix caching --------------------------------------------------------------------------

CKPT_SHAPES = StepShapes(batch=2, context_len=12, max_blocks=8, num_blocks=24, decode_len=1,
                         state_checkpoints=4)
PREFIX = 10        # request A's prompt: full vblocks of V = 2 * dcp tokens, then the rest
CKPT_STEPS = 4


_CKPT_PROGRAMS: dict = {}


def _ckpt_program(model_type: str, tp: int, dcp: int):
    key = (model_type, tp, dcp)
    if key not in _CKPT_PROGRAMS:
        model = build_hybrid(model_type)
        _CKPT_PROGRAMS[key] = model, dcp_compile.transform(
            model, tp=tp, dcp=dcp, mode="decode", block_size=BLOCK, shapes=CKPT_SHAPES,
            check=False)
    return _CKPT_PROGRAMS[key]


def _greedy(model, prompt, steps):
    """The model's own greedy tokens and their logits (its full forward each step)."""
    seq, tokens, logits = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            out = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
            tokens.append(int(out.argmax()))
            logits.append(out)
            seq.append(tokens[-1])
    return tokens, logits


def _two_requests(program, prompts, *, prefix_caching):
    """Every rank: request A, finish it, request B (a prefix of A's vblocks, then its own
    tokens) on the same engine; B's tokens, logits, the positions its steps computed and the
    engine's counts."""
    from dcp_compile.runtime.distributed.world import run_threaded
    from dcp_compile.runtime.serving.rank_engine import rank_engine

    def rank_main(rank):
        engine = rank_engine(program, rank, shared_names=True, record=True,
                             prefix_caching=prefix_caching)
        with torch.no_grad():
            engine.generate([prompts[0]], CKPT_STEPS)
            engine.finish(0)
            seen = len(engine.executor.positions)
            result = engine.generate([prompts[1]], CKPT_STEPS)
        computed = sorted({p for pos in engine.executor.positions[seen:]
                           for p in pos[0].tolist() if p >= 0})
        ck = engine.checkpoints
        return (result.tokens[0], torch.stack(result.logits)[:, 0], computed,
                engine.allocator.reused_tokens, (ck.taken, ck.used) if ck else None)

    return run_threaded(program.config.tp, rank_main)


def _prefix_prompts():
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 256, (PREFIX,), generator=g).tolist()
    b = a[:8] + torch.randint(0, 256, (3,), generator=g).tolist()    # shares 2 vblocks
    return [a, b]


@pytest.mark.parametrize("model_type,tp,dcp",
                         _cases() + _cases(FAMILY_TYPES, FAMILY_SLICE, ((4, 2),)))
def test_prefix_cache_hit_resumes_from_the_state_checkpoint(model_type, tp, dcp):
    """Request B shares request A's first two vblocks: its prompt starts on A's cached KV and
    on the state checkpoint A's context step kept at token 8 (copied into B's slot), and
    computes only its 3 own tokens (positions 8..10 and the decode steps: nothing before 8
    is recomputed). B's tokens and logits equal the uncached run's and the model's own
    greedy decode (1e-4) on every rank."""
    model, program = _ckpt_program(model_type, tp, dcp)
    prompts = _prefix_prompts()
    want, want_logits = _greedy(model, prompts[1], CKPT_STEPS)
    cached = _two_requests(program, prompts, prefix_caching=True)
    uncached = _two_requests(program, prompts, prefix_caching=False)
    worst = 0.0
    for (tokens, logits, computed, reused, counts), (u_tokens, *_rest) in zip(cached, uncached):
        assert tokens == u_tokens == want, (tokens, u_tokens, want)
        worst = max(worst, float((logits - torch.stack(want_logits)).abs().max()))
        # A kept one checkpoint per full vblock of its prompt, B resumed from one
        assert reused == 8 and counts == ((PREFIX - 1) // (BLOCK * dcp), 1), (reused, counts)
        assert computed[0] == 8, computed                            # nothing before 8
    assert uncached[0][2][0] == 0                                    # uncached: from 0
    assert worst < TOL, worst
    print(f"{model_type} tp={tp} dcp={dcp} prefix cache: 8 of 11 prompt tokens reused from "
          f"the checkpoint, max |logit error| {worst:.1e}")


def test_without_the_checkpoint_the_tokens_differ(monkeypatch):
    """The mutation: the hit reuses the KV but not the checkpoint (B's slot keeps what A
    left in it). B's logits then leave the model's own: the checkpoint is what B resumes
    from."""
    from dcp_compile.runtime.serving.engine import LocalExecutor
    model, program = _ckpt_program("bamba", 4, 2)
    prompts = _prefix_prompts()
    _, want_logits = _greedy(model, prompts[1], CKPT_STEPS)
    monkeypatch.setattr(LocalExecutor, "copy_state", lambda self, src, dst: None)
    logits = _two_requests(program, prompts, prefix_caching=True)[0][1]
    error = float((logits - torch.stack(want_logits)).abs().max())
    assert error > 1e-2, error
    print(f"bamba without the checkpoint: max |logit error| {error:.1e}")


def test_prefix_caching_without_checkpoints_and_checkpoints_in_prefill_are_refused():
    from dcp_compile.runtime.serving.engine import Engine, LocalExecutor
    with pytest.raises(DCPHybridError, match=r"prefix caching with a hybrid program.*"
                                             r"StepShapes\(state_checkpoints=N\)"):
        Engine(LocalExecutor(None, []), SHAPES, block_size=BLOCK, prefix_caching=True,
               state_slots=9)
    with pytest.raises(DCPHybridError, match=r"in prefill mode with StepShapes."
                                             r"state_checkpoints=4"):
        dcp_compile.transform(build_hybrid("bamba"), tp=4, dcp=2, mode="prefill",
                              block_size=BLOCK, shapes=CKPT_SHAPES)


def test_checkpoints_are_planned_per_vblock_once_and_freed_with_the_cached_blocks():
    from dcp_compile.runtime.serving.state_cache import StateCheckpoints
    ck = StateCheckpoints(first=3, count=2)
    snap, new = ck.plan([[11, 12, 13], [11]], vblock=4, width=12)
    assert new == {11: 3, 12: 4}                 # two slots: the third vblock gets none
    assert snap[0].tolist() == [-1, -1, -1, 3, -1, -1, -1, 4, -1, -1, -1, -1]
    assert (snap[1] == -1).all()                 # hash 11 is kept once
    ck.keep(new)
    assert ck.longest([11, 12, 13], {11, 12, 13}) == 2 and ck.longest([99], {99}) == 0
    assert ck.longest([11, 12], {12}) == 0       # vblock 11 left the cache: no prefix
    ck.sync({12})                                # vblock 11 left the prefix cache
    assert ck.of_hash == {12: 4}


def test_a_loaded_program_refuses_a_snapshot_slot_of_another_sequence():
    """The step contract's state-snapshot-slot rule on the loaded width-K program: a draft's
    snapshot in another row's live slot is refused before anything runs (every state cache
    keeps its bytes); a snapshot given to a step that keeps none is refused too."""
    from dcp_compile.runtime.distributed.world import run_threaded
    from dcp_compile.runtime.errors import DCPInputError
    from dcp_compile.runtime.serving.rank_engine import load_rank
    _, program = _program("bamba", 4, 2)
    B = SHAPES.batch

    def rank_main(rank):
        loaded = load_rank(program, rank, shared_names=True)
        caches = program.cache_spec().allocate()
        states = [s.normal_() for s in program.state_spec().allocate_inputs()]
        before = [s.clone() for s in states]
        ids = torch.zeros(B, K, dtype=torch.int64)
        pos = torch.tensor([[5, 6, 7]] * B)
        table = torch.full((B, SHAPES.max_blocks), -1, dtype=torch.int64)
        table[:, :2] = torch.arange(2 * B).view(B, 2)                # two vblocks each
        slot = torch.tensor([0, 3, 6])
        snap = torch.tensor([[1, 2, -1], [3, 5, -1], [7, 8, -1]])     # row 1 names its own
        errors = []
        for kind, extra in (("decode", {"snapshot_slot": snap}),
                            ("context", {"snapshot_slot": snap})):
            try:
                loaded.run(kind, ids, pos, table, caches, state_slot=slot, states=states,
                           **extra)
            except DCPInputError as e:
                errors.append(str(e))
        return errors, all(torch.equal(a, b) for a, b in zip(before, states))

    for errors, kept in run_threaded(4, rank_main):
        assert len(errors) == 2 and kept, errors
        assert "state_snapshot_slot[1, 0] = 3 is named twice" in errors[0], errors[0]
        assert "'context' step keeps no state snapshots" in errors[1], errors[1]


# -- every swap rule passes the snapshot slots ------------------------------------------------

@pytest.mark.parametrize("model_type", FAMILY_TYPES + ("qwen3_5_text", "bamba"))
def test_every_swap_rule_keeps_a_snapshot_per_token(model_type):
    """Eager, no transform: each family's swapped model run with snapshot slots writes the
    state after each of a row's tokens into its snapshot slot, in every state cache (a swap
    that forgets ``*states.snap()`` leaves those slots zero; transform() refuses such a swap
    too: tests/passes/test_before_expected_check_state_snapshots.py)."""
    from dcp_compile.frontends.module_recurrent import allocate_states, recurrent_as_ops
    model = build_hybrid(model_type)
    states = allocate_states(model, num_slots=6).step([0, 1], [True, True], [3, 2])
    states.snapshot_slot = torch.tensor([[2, 3, -1], [4, -1, -1]])   # row 1 has 2 tokens
    ids = torch.randint(0, model.config.vocab_size, (2, 3), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad(), recurrent_as_ops(model, states):
        model(ids, use_cache=False)
    caches = {**{f"conv {k}": v for k, v in states.conv.items()},
              **{f"rec {k}": v for k, v in states.rec.items()}}
    assert caches
    for name, cache in caches.items():
        kept = [bool(cache[s].abs().sum() > 0) for s in (2, 3, 4)]
        assert all(kept), (model_type, name, kept)
        assert cache[5].abs().sum() == 0, (model_type, name)   # no snapshot named it
