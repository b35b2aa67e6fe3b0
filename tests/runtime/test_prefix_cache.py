"""Prefix caching: shared full vblocks, refcounts, LRU eviction, the read-only rule, and
identical outputs with fewer prompt tokens computed (single device and DCP on threads)."""

from __future__ import annotations

import json

import pytest
import torch

from dcp_compile import cli
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.serving.kv_cache import BlockAllocator, KVCacheSpec
from dcp_compile.runtime.serving.speculative import NgramDrafter
from dcp_compile.runtime.serving.step_contract import StepContract

V = 4                                           # tokens per vblock (block 4, dcp 1)


def test_allocator_shares_whole_vblocks_counts_references_and_evicts_lru():
    a = BlockAllocator(6, V, prefix_caching=True)        # blocks 0..4 usable
    prompt = list(range(10))                              # 2 full vblocks + 2 tokens
    assert a.share_prefix(0, prompt) == 0                 # nothing cached yet
    a.ensure(0, 10)
    a.register_prefix(0, prompt)
    first = a.table([0], 4)[0, :2].tolist()
    # Same first 9 tokens: both full vblocks reused, the rest computed into its own block.
    assert a.share_prefix(1, prompt[:9] + [99]) == 8
    a.ensure(1, 10)
    t1 = a.table([1], 4)[0].tolist()
    assert t1[:2] == first and t1[2] not in first
    # A prompt of exactly 2 vblocks keeps its last token to compute: reuses one vblock.
    assert a.share_prefix(2, prompt[:8]) == 4
    a.free(0)
    a.free(1)
    a.free(2)
    # Cached blocks outlive their sequences; a new allocation evicts the least recently
    # used first (vblock 1's block, released before vblock 0's).
    a.ensure(3, 4 * V)                                    # 3 free blocks + 1 evicted
    assert a.share_prefix(4, prompt) == 4                 # vblock 0 is still cached
    a.free(4)
    a.ensure(3, 5 * V)                                    # every block: evicts the last
    assert a.share_prefix(5, prompt) == 0 and a.reused_tokens == 16


def _contract():
    return StepContract(kind="decode", batch=2, tokens=2, max_blocks=3, num_blocks=8,
                        block_size=V, dcp=1)


def test_a_shared_block_is_read_only():
    c = _contract()
    ids = torch.zeros(2, 2, dtype=torch.int64)
    table = torch.tensor([[0, 1, -1], [0, 2, -1]])        # block 0 shared by both rows
    c.check(ids, torch.tensor([[5, 6], [4, 5]]), table)  # both write entry 1: allowed
    with pytest.raises(DCPInputError, match=r"block_table\[1, 0\] = 0 is shared with row 0 "
                                            r"and row 1 writes into it") as e:
        c.check(ids, torch.tensor([[5, 6], [3, 4]]), table)   # row 1 writes position 3
    assert e.value.rule == "shared-block"
    with pytest.raises(DCPInputError, match="also block_table"):
        c.check(ids, torch.tensor([[5, 6], [4, 5]]), torch.tensor([[0, 1, -1], [2, 2, -1]]))


def _engine(model, *, kind="prefill", K=1, prefix_caching=False):
    shapes = StepShapes.fitting(4, 24, 40, block_size=V, dcp=1, decode_len=K)
    c = model.config
    spec = KVCacheSpec(c.num_layers, shapes.num_blocks, V, c.num_kv_heads, c.head_dim)
    # NaN-poisoned caches: a row read without being written would surface in the logits.
    return Engine(LocalExecutor(model, spec.allocate(fill=float("nan"))), shapes,
                  block_size=V, prompt_kind=kind, prefix_caching=prefix_caching)


@pytest.mark.parametrize("kind,K", [("prefill", 1), ("context", 3)])
def test_shared_prefix_gives_identical_outputs_with_fewer_prompt_tokens(kind, K):
    model = demo_model(DemoConfig(vocab_size=64, hidden_size=64, num_layers=2,
                                  num_q_heads=8, num_kv_heads=2, head_dim=8,
                                  intermediate_size=96))
    shared = list(range(1, 20))                           # 4 full vblocks + 3 tokens
    prompts = [shared + [30, 31], shared + [40], shared + [50, 51, 52], [7, 8]]
    with torch.no_grad():
        plain = _engine(model).generate(prompts, 6)
        engine = _engine(model, kind=kind, K=K, prefix_caching=True)
        drafter = NgramDrafter() if K > 1 else None
        got = engine.generate(prompts, 6, drafter=drafter)
    assert got.tokens == plain.tokens
    assert engine.allocator.reused_tokens == 2 * 16       # two followers, 4 vblocks each
    if drafter is None:
        for a, b in zip(got.logits, plain.logits):
            assert float((a - b).abs().max()) <= 1e-4


def test_cli_verify_speculative_shared_prefix_json(capsys):
    """DCP on threads: n-gram speculation over a shared prefix, against the single-device
    model's plain greedy (tokens, every verified position's logits)."""
    code = cli.main(["verify", "--tp", "4", "--dcp", "2", "--block-size", "4",
                     "--interleave-size", "1", "--steps", "6", "--speculative", "ngram:3",
                     "--shared-prefix", "9", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] and report["tokens_agree"]
    assert report["max_abs_error"] <= 1e-4
    assert report["mean_accepted"] >= 1.0
    assert report["reused_tokens"] == 3 * 8               # 3 followers x 1 vblock of 8


@pytest.mark.parametrize("spec", ["ngram:1", "ngram:9", "draft:x:4", "beam:4"])
def test_cli_speculative_spec_is_checked(spec, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", "--tp", "4", "--dcp", "2", "--speculative", spec])
    assert e.value.code == 2
    assert "must be ngram:K or draft:PKG.MODULE:FACTORY:K" in capsys.readouterr().err


@pytest.mark.parametrize("kind,K", [("prefill", 1), ("context", 3)])
def test_generated_tokens_are_shared_by_a_later_request(kind, K):
    """A conversation's next turn (its prompt = the last prompt + the tokens generated for it
    + more) starts on the vblocks the generated tokens filled, not only the prompt's; with
    speculative drafts, only accepted tokens' vblocks are registered."""
    model = demo_model(DemoConfig(vocab_size=64, hidden_size=64, num_layers=2,
                                  num_q_heads=8, num_kv_heads=2, head_dim=8,
                                  intermediate_size=96))
    first = list(range(1, 7))                            # 6 tokens: no full vblock alone
    with torch.no_grad():
        engine = _engine(model, kind=kind, K=K, prefix_caching=True)
        drafter = NgramDrafter() if K > 1 else None
        turn1 = engine.generate([first], 12, drafter=drafter).tokens[0][:12]
        engine.allocator.free(0)
        engine.lengths = []
        second = first + turn1 + [9, 10]                 # 20 tokens: 4 full vblocks
        before = engine.allocator.reused_tokens
        got = engine.generate([second], 4, drafter=NgramDrafter() if K > 1 else None)
        plain = _engine(model).generate([second], 4)
    assert got.tokens[0][:4] == plain.tokens[0][:4]
    # prompt + 12 generated = 18 tokens, 17 written (the last generated is not fed yet): the
    # first 4 vblocks (16 tokens) are in the cache, 2 of them beyond the first prompt
    assert engine.allocator.reused_tokens - before == 16
    assert not engine.allocator.invariant_violations()


def test_a_rewind_inside_a_registered_vblock_unregisters_it():
    """A sequence rewound into a full, registered vblock writes it again: its hash must not
    serve another request with the old tokens."""
    a = BlockAllocator(6, V, prefix_caching=True)
    a.ensure(0, 2 * V)
    a.register_prefix(0, list(range(2 * V)))
    a.shrink(0, V + 1)                                   # keeps block 2 (positions V..2V-1)
    assert a.share_prefix(1, list(range(2 * V)) + [99]) == V   # only the first vblock
    assert not a.invariant_violations()
