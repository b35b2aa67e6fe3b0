"""The step-input contract (runtime/serving/step_contract.py): every fault is refused before any write.

Fault injection: one probe per rule, on a loaded program's direct entry (RankProgram.run, on
the threaded world: tp=2, dcp=2) and on the Engine. Each asserts the DCPInputError names the
rule, the field, the row and the value, and that no cache changed (snapshots before/after).

Property: hypothesis draws step inputs (prior histories, chunks, block tables, ids, padding)
and faults on top of them, runs them on the prefill-DCP program, and asserts: either a
contract DCPInputError with the caches untouched, or logits equal to the single-device model;
in both cases no cache block outside the blocks the step's own positions name (and the
garbage block) changed. A row that starts past its written history (a gap) is the caller's
responsibility on a direct entry (see RankProgram); for those rows only the block invariant
is asserted.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import dcp_compile
from dcp_compile.runtime.errors import DCPConfigError, DCPInputError
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes
from dcp_compile.runtime.serving.kv_cache import KVCacheSpec
from dcp_compile.runtime.serving.step_contract import RULE_NAMES, StepContract
from dcp_compile.runtime.distributed.world import bind_roles, run_threaded

from helpers import assert_close_report

CFG = DemoConfig(num_layers=1, hidden_size=32, num_q_heads=4, num_kv_heads=1, head_dim=8,
                 intermediate_size=32, vocab_size=64, seed=3)
TP, W, BLOCK = 2, 2, 4
VBLOCK = BLOCK * W
B, S, M, NB = 2, 8, 4, 10              # batch, chunk, table width, cache blocks per rank
GARBAGE = NB - 1
MAX_LEN = M * VBLOCK                   # 32
SHAPES = StepShapes(batch=B, context_len=S, max_blocks=M, num_blocks=NB)


@functools.lru_cache(maxsize=None)
def programs():
    model = demo_model(CFG)
    prefill = dcp_compile.transform(model, tp=TP, dcp=W, mode="prefill", shapes=SHAPES,
                                    block_size=BLOCK, interleave_size=BLOCK)
    decode = dcp_compile.transform(model, tp=TP, dcp=W, mode="decode", shapes=SHAPES,
                                   block_size=BLOCK, interleave_size=2)
    return model, prefill, decode


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """The single-device model's logits for every position of one sequence, from scratch."""
    n = len(tokens)
    blocks = -(-n // BLOCK)
    spec = KVCacheSpec(CFG.num_layers, blocks + 1, BLOCK, CFG.num_kv_heads, CFG.head_dim)
    with torch.no_grad():
        logits, _ = model(torch.tensor([tokens]), torch.arange(n)[None],
                          torch.arange(blocks)[None], spec.allocate())
    return logits[0]


def random_caches(program, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c.shape, generator=g) for c in program.cache_spec().allocate()]


def changed_blocks(before, after) -> set[int]:
    out = set()
    for a, b in zip(before, after):
        diff = (a != b) & ~(a.isnan() & b.isnan())
        out |= set(diff.reshape(a.shape[0], -1).any(1).nonzero().flatten().tolist())
    return out


# ----------------------------------------------------------------------------------------
# Fault injection on a loaded program's direct entry
# ----------------------------------------------------------------------------------------

def base_step():
    """A valid prefill step: row 0 one full vblock from 0, row 1 three tokens from 0."""
    ids = torch.arange(B * S, dtype=torch.int64).reshape(B, S) % CFG.vocab_size
    pos = torch.tensor([list(range(8)), [0, 1, 2] + [-1] * 5])
    table = torch.tensor([[3, -1, -1, -1], [5, -1, -1, -1]])
    return ids, pos, table


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def _row(values):
    return torch.tensor(values + [-1] * (S - len(values)))


# id: (step kind, program, mutate(ids, pos, table, caches) -> same, rule, substrings)
PROBES = {
    "shared-block": ("prefill", "prefill",
                     lambda i, p, t, c: (i, p, _set(t, (1, 0), 3), c), "shared-block",
                     ["block_table[1, 0] = 3 is shared with row 0 and row 1 writes into it",
                      "read-only: no request writes another's KV",
                      "give row 1 its own block"]),
    "shared-block-same-row": ("prefill", "prefill",
                              lambda i, p, t, c: (i, p, _set(t, (0, 2), 3), c),
                              "shared-block", ["block_table[0, 2] = 3 is also "
                                               "block_table[0, 0]"]),
    "block-2**62": ("prefill", "prefill",
                    lambda i, p, t, c: (i, p, _set(t, (0, 1), 2 ** 62), c), "block-id-range",
                    [f"block_table[0, 1] = {2 ** 62} is outside the cache (num_blocks=10)",
                     "block id in [0, 8] or -1"]),
    "block-below-minus-one": ("prefill", "prefill",
                              lambda i, p, t, c: (i, p, _set(t, (1, 3), -2), c),
                              "block-id-range", ["block_table[1, 3] = -2 is below -1"]),
    "block-beyond-cache": ("prefill", "prefill",
                           lambda i, p, t, c: (i, p, _set(t, (1, 2), NB), c),
                           "block-id-range", ["block_table[1, 2] = 10 is outside the cache"]),
    "garbage-block": ("prefill", "prefill",
                      lambda i, p, t, c: (i, p, _set(t, (1, 1), GARBAGE), c), "garbage-block",
                      ["block_table[1, 1] = 9 is the garbage block"]),
    "pos-on-unallocated-entry": ("prefill", "prefill",
                                 lambda i, p, t, c: (i, _set(p, 1, _row([8, 9, 10])), t, c),
                                 "allocated-entry",
                                 ["positions[1, 0] = 8 (and 2 more) is beyond its block table",
                                  "block_table[1, 1] = -1 is unallocated"]),
    "pos-past-table-width": ("prefill", "prefill",
                             lambda i, p, t, c: (i, _set(p, 1, _row([31])),
                                                 _set(t, 1, torch.tensor([5, 6, 7, -1])), c),
                             "allocated-entry", ["positions[1, 0] = 31",
                                                 "block_table[1, 3] = -1 is unallocated"]),
    "unallocated-prior-entry": ("prefill", "prefill",
                                lambda i, p, t, c: (i, _set(p, 1, _row([8, 9, 10])),
                                                    _set(t, 1, torch.tensor([-1, 5, -1, -1])),
                                                    c),
                                "allocated-prefix",
                                ["block_table[1, 0] = -1 is unallocated below row 1's "
                                 "position 10"]),
    "left-padded": ("prefill", "prefill",
                    lambda i, p, t, c: (i, _set(p, 1, torch.tensor([-1, -1, 0, 1, 2, -1, -1,
                                                                    -1])), t, c),
                    "padding-at-end", ["positions[1, 2] = 0 follows padding "
                                       "(positions[1, 1] = -1)", "padding (-1) comes only at "
                                       "the end of a row"]),
    "mid-padded": ("prefill", "prefill",
                   lambda i, p, t, c: (i, _set(p, (0, 3), -1), t, c), "padding-at-end",
                   ["positions[0, 4] = 4 follows padding (positions[0, 3] = -1)"]),
    "duplicate-pos": ("prefill", "prefill",
                      lambda i, p, t, c: (i, _set(p, 1, _row([0, 1, 1])), t, c), "contiguous",
                      ["positions[1, 2] = 1 repeats positions[1, 1] = 1",
                       "consecutive"]),
    "decreasing-pos": ("prefill", "prefill",
                       lambda i, p, t, c: (i, _set(p, 1, _row([0, 1, 0])), t, c),
                       "contiguous", ["positions[1, 2] = 0 goes back from positions[1, 1] = 1"]),
    "gap-in-chunk": ("prefill", "prefill",
                     lambda i, p, t, c: (i, _set(p, 1, _row([0, 1, 3])), t, c), "contiguous",
                     ["positions[1, 2] = 3 skips from positions[1, 1] = 1"]),
    "pos-below-minus-one": ("prefill", "prefill",
                            lambda i, p, t, c: (i, _set(p, (1, 5), -7), t, c),
                            "position-range", ["positions[1, 5] = -7 is below -1"]),
    "pos-beyond-max-model-len": ("prefill", "prefill",
                                 lambda i, p, t, c: (i, _set(p, 1, _row([MAX_LEN])), t, c),
                                 "max-model-len", ["positions[1, 0] = 32 is >= max_model_len "
                                                   "32", "4 * 4 * 2"]),
    "token-out-of-vocab": ("prefill", "prefill",
                           lambda i, p, t, c: (_set(i, (0, 3), CFG.vocab_size), p, t, c),
                           "token-range", ["input_ids[0, 3] = 64 is outside the vocabulary "
                                           "[0, 64)"]),
    "token-negative": ("prefill", "prefill",
                       lambda i, p, t, c: (_set(i, (1, 0), -1), p, t, c), "token-range",
                       ["input_ids[1, 0] = -1"]),
    "padding-token-out-of-vocab": ("prefill", "prefill",
                                   lambda i, p, t, c: (_set(i, (1, 7), 1000), p, t, c),
                                   "token-range", ["input_ids[1, 7] = 1000",
                                                   "padding included"]),
    "int32-cache": ("prefill", "prefill",
                    lambda i, p, t, c: (i, p, t, [x.to(torch.int32) for x in c]),
                    "cache-spec", ["kv_caches[0] is torch.int32",
                                   "the program's cache is torch.float32"]),
    "fp16-cache": ("prefill", "prefill",
                   lambda i, p, t, c: (i, p, t, [c[0], c[1].half()]), "cache-spec",
                   ["kv_caches[1] is torch.float16"]),
    "cache-fewer-blocks": ("prefill", "prefill",
                           lambda i, p, t, c: (i, p, t, [x[:5] for x in c]), "cache-spec",
                           ["kv_caches[0] is torch.float32 [5, 4, 1, 8]", "[10, 4, 1, 8]"]),
    "cache-missing": ("prefill", "prefill", lambda i, p, t, c: (i, p, t, c[:1]),
                      "cache-count", ["kv_caches has 1 tensors, the program takes 2"]),
    "int32-positions": ("prefill", "prefill",
                        lambda i, p, t, c: (i, p.int(), t, c), "input-type",
                        ["positions is torch.int32", "int64 tensors"]),
    "table-as-list": ("prefill", "prefill",
                      lambda i, p, t, c: (i, p, t.tolist(), c), "input-type",
                      ["block_table is list"]),
    "table-too-narrow": ("prefill", "prefill",
                         lambda i, p, t, c: (i, p, t[:, :3], c), "input-shape",
                         ["block_table has shape (2, 3), the prefill step takes (2, 4)"]),
    "context-past-0": ("context", "decode",
                       lambda i, p, t, c: (i, _set(p, 1, _row([3, 4])), t, c), "first-chunk",
                       ["positions[1, 0] = 3 starts a context step past 0"]),
    "decode-two-tokens": ("decode", "decode",
                          lambda i, p, t, c: (i.repeat(1, 2), torch.tensor([[0, 1], [0, 1]]),
                                              t, c), "input-shape",
                          ["input_ids has shape (2, 2), the decode step takes (2, 1)"]),
}


def _base_for(kind):
    ids, pos, table = base_step()
    if kind == "decode":
        return ids[:, :1], pos[:, :1], table
    return ids, pos, table


def _run_probes(program_name: str, probe_ids: list[str]) -> dict:
    model, prefill, decode = programs()
    program = prefill if program_name == "prefill" else decode

    def rank_main(rank):
        loaded = program.load(rank, bind_roles(program.topology, rank))
        out = {}
        for pid in probe_ids:
            kind, _, mutate, _, _ = PROBES[pid]
            caches = random_caches(program, seed=rank)
            ids, pos, table, given_caches = mutate(*_base_for(kind), caches)
            snapshot = [c.clone() for c in caches]
            try:
                loaded.run(kind, ids, pos, table, given_caches)
                err = None
            except DCPInputError as e:
                err = e
            out[pid] = (err, all(torch.equal(a, b) for a, b in zip(caches, snapshot)))
        # Control: the unmutated step runs and matches the single-device model.
        if program_name == "prefill":
            ids, pos, table = base_step()
            logits, _ = loaded.run("prefill", ids, pos, table, random_caches(program, rank))
            out["valid"] = logits
        return out

    return run_threaded(TP, rank_main, timeout=120)


@pytest.fixture(scope="module")
def probe_outcomes():
    outcomes = {}
    for name in ("prefill", "decode"):
        ids = [p for p, v in PROBES.items() if v[1] == name]
        runs = _run_probes(name, ids)
        outcomes.update({pid: [r[pid] for r in runs] for pid in runs[0]})
    return outcomes


@pytest.mark.parametrize("probe", PROBES, ids=list(PROBES))
def test_fault_is_refused_before_any_write(probe, probe_outcomes):
    _, _, _, rule, words = PROBES[probe]
    for rank, (err, unchanged) in enumerate(probe_outcomes[probe]):
        assert err is not None, f"rank {rank}: {probe} was accepted"
        msg = str(err)
        assert err.rule == rule, f"rank {rank}: rule {err.rule!r}, expected {rule!r}: {msg}"
        for w in words:
            assert w in msg, f"{w!r} not in {msg!r}"
        assert msg.rstrip().endswith("."), msg     # <what>: <rule>. <fix>.
        assert unchanged, f"rank {rank}: {probe} changed a cache"


def test_every_rule_has_a_probe():
    probed = {v[3] for v in PROBES.values()} | {"continues-sequence"}   # engine, below
    # the recurrent-state rules: tests/runtime/test_step_contract_state.py
    probed |= {name for name in RULE_NAMES if name.startswith("state-")}
    assert probed == set(RULE_NAMES) - {"input-device"}   # one device on this machine


def test_valid_step_matches_the_single_device_model(probe_outcomes):
    model = programs()[0]
    ids, pos, _ = base_step()
    for logits in probe_outcomes["valid"]:
        for b in range(B):
            n = int((pos[b] >= 0).sum())
            ref = reference_logits(model, ids[b, :n].tolist())
            assert_close_report(logits[b, :n], ref, atol=1e-4, what=f"row {b}")


def test_unknown_step_kind_is_refused():
    _, _, decode = programs()

    def rank_main(rank):
        loaded = decode.load(rank, bind_roles(decode.topology, rank))
        with pytest.raises(DCPInputError, match="no 'prefill' step: it has"):
            loaded.run("prefill", *base_step(), random_caches(decode, 0))
    run_threaded(TP, rank_main)


# ----------------------------------------------------------------------------------------
# The Engine: shapes against the caches, the sequence gap, StepShapes validation
# ----------------------------------------------------------------------------------------

def _single_device_engine(shapes, cache_blocks, block=BLOCK):
    model = programs()[0]
    spec = KVCacheSpec(CFG.num_layers, cache_blocks, block, CFG.num_kv_heads, CFG.head_dim)
    return Engine(LocalExecutor(model, spec.allocate()), shapes, block_size=BLOCK,
                  vocab_size=CFG.vocab_size)


# id: (build the engine -> caches it was given, words of the message)
ENGINE_PROBES = {
    "engine-shapes-exceed-caches": (
        lambda caches: Engine(LocalExecutor(programs()[0], caches), SHAPES, block_size=BLOCK),
        lambda: KVCacheSpec(1, 6, BLOCK, 1, 8).allocate(),
        ["StepShapes.num_blocks=10", "kv_caches[0] has 6 blocks of 4", "num_blocks <= 6"]),
    "engine-block-size-mismatch": (
        lambda caches: Engine(LocalExecutor(programs()[0], caches), SHAPES, block_size=BLOCK),
        lambda: KVCacheSpec(1, NB, 8, 1, 8).allocate(),
        ["block_size=4", "has 10 blocks of 8"]),
    "engine-over-program-exceeds-caches": (
        lambda caches: Engine(LocalExecutor({}, caches), StepShapes(B, S, M, NB + 3),
                              block_size=BLOCK, dcp=W),
        lambda: programs()[1].cache_spec().allocate(),
        ["StepShapes.num_blocks=13", "has 10 blocks"]),
}


@pytest.mark.parametrize("probe", ENGINE_PROBES, ids=list(ENGINE_PROBES))
def test_engine_shapes_must_fit_its_caches(probe):
    build, allocate, words = ENGINE_PROBES[probe]
    caches = allocate()
    snapshot = [c.clone() for c in caches]
    with pytest.raises(DCPInputError) as info:
        build(caches)
    assert info.value.rule == "engine-shapes" and info.value.field == "shapes"
    for w in words:
        assert w in str(info.value), str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, caches))


def test_engine_refuses_a_position_gap_before_any_write():
    engine = _single_device_engine(StepShapes(batch=2, context_len=8, max_blocks=8,
                                              num_blocks=12), cache_blocks=12)
    engine.prefill([[1, 2, 3], [4, 5]])
    snapshot = [c.clone() for c in engine.executor.caches]
    ids = torch.tensor([[7], [8]])
    # Row 1 holds 2 tokens: position 3 skips slot 2, which would attend to whatever a
    # reused block held there.
    pos = torch.tensor([[3], [3]])
    with pytest.raises(DCPInputError) as info:
        engine._run("decode", ids, pos, [1, 1])
    assert info.value.rule == "continues-sequence"
    assert "positions[1, 0] = 3 does not continue row 1's sequence of 2 tokens" \
        in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, engine.executor.caches))
    assert engine.lengths == [3, 2]


def test_engine_refuses_out_of_vocabulary_tokens_before_any_write():
    engine = _single_device_engine(StepShapes(batch=2, context_len=8, max_blocks=8,
                                              num_blocks=12), cache_blocks=12)
    snapshot = [c.clone() for c in engine.executor.caches]
    with pytest.raises(DCPInputError, match=r"input_ids\[1, 1\] = 64 is outside"):
        engine.prefill([[1, 2, 3], [4, 64]])
    assert all(torch.equal(a, b) for a, b in zip(snapshot, engine.executor.caches))


SHAPE_FAULTS = {
    "StepShapes(batch=-1)": (dict(batch=-1), "batch=-1"),
    "StepShapes(batch=0)": (dict(batch=0), "batch=0"),
    "StepShapes(num_blocks=1)": (dict(num_blocks=1), "num_blocks=1"),
    "StepShapes(context_len=0)": (dict(context_len=0), "context_len=0"),
    "StepShapes(max_blocks=2.5)": (dict(max_blocks=2.5), "max_blocks=2.5"),
    "StepShapes(batch=True)": (dict(batch=True), "batch=True"),
    "StepShapes(num_blocks='8')": (dict(num_blocks="8"), "num_blocks='8'"),
}


@pytest.mark.parametrize("change,named", SHAPE_FAULTS.values(), ids=list(SHAPE_FAULTS))
def test_step_shapes_are_validated_at_construction(change, named):
    with pytest.raises(DCPConfigError) as info:
        StepShapes(**change)
    assert named in str(info.value) and str(info.value).endswith(".")


def test_contract_wrap_bound_is_checked_once_at_construction():
    with pytest.raises(DCPConfigError, match="reaches 2\\*\\*62"):
        StepContract(num_blocks=2 ** 60, block_size=16)
    with pytest.raises(DCPConfigError, match="max_model_len exceeds"):
        StepContract(max_blocks=2, block_size=4, dcp=2, max_model_len=17)
    with pytest.raises(DCPConfigError, match="rules=\\['no-such-rule'\\]"):
        StepContract(rules=("shared-block", "no-such-rule"))


# ----------------------------------------------------------------------------------------
# Property: random step inputs and faults on the prefill-DCP program
# ----------------------------------------------------------------------------------------

TABLE_VALUES = (-2, -1, GARBAGE, NB, 2 ** 62, "shared")
CACHE_FAULTS = ("int32", "fp16", "bf16", "drop", "fewer-blocks")


@st.composite
def steps(draw):
    prior = [draw(st.integers(0, 2 * S)) for _ in range(B)]
    chunk = [draw(st.integers(0, S)) for _ in range(B)]
    perm = draw(st.permutations(range(NB - 1)))
    seed = draw(st.integers(0, 2 ** 16))
    faults = draw(st.lists(st.one_of(
        st.tuples(st.just("table"), st.integers(0, B - 1), st.integers(0, M - 1),
                  st.sampled_from(TABLE_VALUES)),
        st.tuples(st.just("pos"), st.integers(0, B - 1), st.integers(0, S - 1),
                  st.integers(-3, MAX_LEN + 1)),
        st.tuples(st.just("id"), st.integers(0, B - 1), st.integers(0, S - 1),
                  st.integers(-2, CFG.vocab_size + 1)),
        st.tuples(st.just("cache"), st.sampled_from(CACHE_FAULTS))),
        min_size=(n := draw(st.integers(0, 3))), max_size=n))
    return prior, chunk, perm, seed, faults


def _apply(fault, ids, pos, table, caches):
    kind = fault[0]
    if kind == "table":
        _, b, j, v = fault
        if v == "shared":
            others = table[torch.arange(B) != b].flatten()
            others = others[others >= 0]
            if not len(others):
                return ids, pos, table, caches
            v = int(others[0])
        return ids, pos, _set(table, (b, j), v), caches
    if kind == "pos":
        return ids, _set(pos, fault[1:3], fault[3]), table, caches
    if kind == "id":
        return _set(ids, fault[1:3], fault[3]), pos, table, caches
    how = fault[1]
    if how == "drop":
        return ids, pos, table, caches[:-1]
    if how == "fewer-blocks":
        return ids, pos, table, [c[:-1] for c in caches]
    dtype = {"int32": torch.int32, "fp16": torch.float16, "bf16": torch.bfloat16}[how]
    return ids, pos, table, [c.to(dtype) for c in caches]


@settings(max_examples=60, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(steps())
def test_random_steps_are_refused_or_exact_and_never_touch_other_blocks(drawn):
    prior, chunk, perm, seed, faults = drawn
    model, program, _ = programs()
    g = torch.Generator().manual_seed(seed)
    history = [torch.randint(0, CFG.vocab_size, (prior[b] + S,), generator=g).tolist()
               for b in range(B)]
    # A valid table: each row's blocks for its history and its chunk, distinct across rows.
    table = torch.full((B, M), -1, dtype=torch.int64)
    used = 0
    for b in range(B):
        need = -(-(prior[b] + chunk[b]) // VBLOCK)
        table[b, :need] = torch.tensor(perm[used:used + need], dtype=torch.int64)
        used += need
    # The step: row b continues its history with chunk[b] tokens; then the faults.
    ids = torch.zeros(B, S, dtype=torch.int64)
    pos = torch.full((B, S), -1, dtype=torch.int64)
    for b in range(B):
        ids[b, :chunk[b]] = torch.tensor(history[b][prior[b]:prior[b] + chunk[b]],
                                         dtype=torch.int64)
        pos[b, :chunk[b]] = torch.arange(prior[b], prior[b] + chunk[b])

    def rank_main(rank):
        loaded = program.load(rank, bind_roles(program.topology, rank))
        caches = program.cache_spec().allocate(fill=float("nan"))
        # Write each row's history with valid chunks of the same program.
        for start in range(0, max(prior), S):
            h_ids = torch.zeros(B, S, dtype=torch.int64)
            h_pos = torch.full((B, S), -1, dtype=torch.int64)
            for b in range(B):
                n = max(0, min(S, prior[b] - start))
                h_ids[b, :n] = torch.tensor(history[b][start:start + n], dtype=torch.int64)
                h_pos[b, :n] = torch.arange(start, start + n)
            _, caches = loaded.run("prefill", h_ids, h_pos, table, caches)
        step = (ids, pos, table, caches)
        for fault in faults:
            step = _apply(fault, *step)
        snapshot = [c.clone() for c in caches]
        try:
            logits, new = loaded.run("prefill", *step)
        except DCPInputError as e:
            return step, e, snapshot, caches, None
        return step, None, snapshot, new, logits

    runs = run_threaded(TP, rank_main)
    event(f"refused: {runs[0][1].rule}" if runs[0][1] is not None else "accepted")
    for rank, (step, err, before, after, logits) in enumerate(runs):
        s_ids, s_pos, s_table = step[:3]
        if err is not None:
            assert err.rule in RULE_NAMES, err
            assert changed_blocks(before, after) == set(), f"rank {rank}: {err.rule} wrote"
            continue
        # Accepted: only the blocks the step's positions name (and the garbage block) change.
        valid = s_pos >= 0
        own = {int(s_table[b, int(s_pos[b, t]) // VBLOCK]) for b, t in valid.nonzero().tolist()}
        assert changed_blocks(before, after) <= own | {GARBAGE}, \
            f"rank {rank}: wrote blocks {changed_blocks(before, after) - own - {GARBAGE}}"
        # ... and every row that continues its written history matches the single device.
        for b in range(B):
            n = int(valid[b].sum())
            if n == 0:
                continue
            start = int(s_pos[b, 0])
            if start > prior[b]:
                event("accepted row with a gap (not compared)")
                continue            # a gap: the direct caller owns the cache history
            tokens = history[b][:start] + s_ids[b, :n].tolist()
            ref = reference_logits(model, tokens)[start:]
            assert_close_report(logits[b, :n], ref, atol=1e-4,
                                what=f"rank {rank} row {b} (faults {faults})")
