"""Transfer planning (runtime/transfer/plan.py): the spec's worked examples, a brute-force
coverage check over many topologies, the spec formula's disagreements, errors and the CLI."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from dcp_compile.runtime import layout
from dcp_compile.cli import main as cli_main
from dcp_compile.runtime.errors import DCPTransferError
from dcp_compile.runtime.topology import topology
from dcp_compile.runtime.transfer.plan import (CHUNK_COLUMNS, engine_configs, plan_transfer,
                                   spec_remote_ranks)


def _plan(ptp, pdcp, dtp, ddcp, heads, block=16):
    return plan_transfer(*engine_configs(prefill_tp=ptp, prefill_dcp=pdcp, decode_tp=dtp,
                                         decode_dcp=ddcp, num_kv_heads=heads, block_size=block))


def _remote_ranks(plan):
    return [rp.remote_ranks for rp in plan.ranks]


# ---------------------------------------------------------------------------------------
# The specification's worked examples ("Transfer Topologies")
# ---------------------------------------------------------------------------------------


def test_example_dcp_prefill_to_standard_decode():
    # P:TP=4/DCP=2 -> D:TP=2: rank 0 (heads 0-3) <- [0, 2], rank 1 (heads 4-7) <- [1, 3].
    plan = _plan(4, 2, 2, 1, 8)
    assert _remote_ranks(plan) == [[0, 2], [1, 3]]
    assert [list(rp.kv_heads) for rp in plan.ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rp.remote_cp_ranks for rp in plan.ranks] == [[0, 1], [0, 1]]
    assert plan.kind == "match"
    # "Local blocks are interleaved across remote ranks by token group."
    r0, r2 = plan.ranks[0].reads
    assert plan.block_pattern(0, r0.remote_cp_rank)["text"] == "local 2m <- remote m"
    assert plan.block_pattern(0, r2.remote_cp_rank)["text"] == "local 2m+1 <- remote m"


@pytest.mark.parametrize("heads", [8, 4, 2, 1], ids=lambda h: f"kv{h}")
def test_example_dcp_prefill_to_dcp_decode_same_degree(heads):
    # P:TP=32/DCP=2 -> D:TP=16/DCP=2: decode rank 0 <- 0 (cp_rank 0), rank 1 <- 16 (cp_rank 1).
    plan = _plan(32, 2, 16, 2, heads)
    assert _remote_ranks(plan)[:2] == [[0], [16]]
    for rp in plan.ranks:  # 1:1 cp_rank mapping, block m -> block m
        assert rp.remote_cp_ranks == [rp.cp_rank]
        assert plan.block_pattern(rp.rank, rp.cp_rank)["text"] == "local m <- remote m"


@pytest.mark.parametrize("heads", [8, 4, 2, 1], ids=lambda h: f"kv{h}")
def test_example_dcp_prefill_to_dcp_decode_different_degree(heads):
    # P:TP=32/DCP=4 -> D:TP=16/DCP=2: rank 0 <- [0, 16] (cp_ranks 0, 2), rank 1 <- [8, 24].
    plan = _plan(32, 4, 16, 2, heads)
    assert _remote_ranks(plan)[:2] == [[0, 16], [8, 24]]
    for rp in plan.ranks:  # filter: decode dcp_rank r reads cp_ranks {r, r + D_DCP, ...}
        assert rp.remote_cp_ranks == [rp.cp_rank, rp.cp_rank + 2]


@pytest.mark.parametrize("heads", [8, 4, 2, 1], ids=lambda h: f"kv{h}")
def test_example_standard_prefill_to_dcp_decode(heads):
    # P:TP=16 -> D:TP=16/DCP=2: dcp_rank 0 keeps even remote blocks, dcp_rank 1 odd ones.
    plan = _plan(16, 1, 16, 2, heads)
    for rp in plan.ranks:
        assert len(rp.remote_ranks) == 1
        keep = "remote 2m" if rp.cp_rank == 0 else "remote 2m+1"
        assert plan.block_pattern(rp.rank, 0)["text"] == f"local m <- {keep}"
    ids = plan.chunks(1, 0, 16 * 5, list(range(5)), list(range(3)))[:, 1].tolist()
    assert ids == [1, 3]  # odd-indexed remote blocks


def test_split_and_merge_head_offsets():
    split = _plan(2, 1, 4, 1, 8)  # 4 heads per prefill rank, 2 per decode rank
    assert split.kind == "split"
    assert [(r.remote_rank, r.remote_head_offset, r.local_head_offset, r.num_heads)
            for rp in split.ranks for r in rp.reads] == [(0, 0, 0, 2), (0, 2, 0, 2),
                                                         (1, 0, 0, 2), (1, 2, 0, 2)]
    merge = _plan(8, 2, 2, 1, 8)  # 2 heads per prefill rank, 4 per decode rank
    assert merge.kind == "merge"
    assert _remote_ranks(merge) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [(r.remote_rank, r.remote_head_offset, r.local_head_offset)
            for r in merge.ranks[0].reads] == [(0, 0, 0), (1, 0, 2), (4, 0, 0), (5, 0, 2)]


def test_chunks_name_blocks_through_both_block_tables():
    plan = _plan(4, 2, 2, 1, 8, block=4)
    p_table, d_table = [7, 3], [5, 9, 2]  # non-identity: block-table entries are what move
    c0 = plan.chunks(0, 0, 10, p_table, d_table).tolist()
    c1 = plan.chunks(0, 1, 10, p_table, d_table).tolist()
    assert CHUNK_COLUMNS[1] == "remote_block"
    # cp_rank 0 holds positions 0-3 and 8-11; cp_rank 1 positions 4-7 (local block entry 0).
    assert c0 == [[0, 7, 0, 5, 0, 4], [8, 3, 0, 2, 0, 2]]
    assert c1 == [[4, 7, 0, 9, 0, 4]]
    assert plan.readers_of(0) == [0] and plan.readers_of(3) == [1]


# ---------------------------------------------------------------------------------------
# Where the spec's formula and its examples disagree (see the module docstring)
# ---------------------------------------------------------------------------------------


def _spec(ptp, pdcp, dtp, ddcp, heads, rank):
    p, d = engine_configs(prefill_tp=ptp, prefill_dcp=pdcp, decode_tp=dtp, decode_dcp=ddcp,
                          num_kv_heads=heads)
    return spec_remote_ranks(p, d, rank)


def test_spec_formula_agrees_on_example_1():
    assert [_spec(4, 2, 2, 1, 8, d) for d in range(2)] == [[0, 2], [1, 3]]


def test_spec_formula_picks_another_replica_in_example_2():
    assert [_spec(32, 2, 16, 2, 8, d) for d in range(2)] == [[0], [17]]  # example: [16]
    pt = topology(32, 2, "prefill", num_kv_heads=8)
    assert pt.kv_heads_of(17) == pt.kv_heads_of(16) == [0]  # same data: head 0, cp_rank 1
    assert pt.cp_rank(17) == pt.cp_rank(16) == 1


def test_spec_formula_is_wrong_in_example_3():
    assert [_spec(32, 4, 16, 2, 8, d) for d in range(2)] == [[0], [17]]  # example: [0,16] [8,24]
    pt = topology(32, 4, "prefill", num_kv_heads=8)
    assert (pt.cp_rank(17), pt.kv_heads_of(17)) == (2, [1])  # decode rank 1: head 0, cp 1 and 3


def test_spec_formula_drops_rank_1_in_example_4_and_fails_for_smaller_prefill_tp():
    assert [_spec(16, 1, 16, 2, 8, d) for d in range(2)] == [[0], []]
    assert _spec(2, 1, 4, 1, 8, 0) is None  # tp_ratio = 0 -> num_target_ranks = 0


# ---------------------------------------------------------------------------------------
# Brute force: every (position, KV head) a decode rank must hold is read exactly once,
# from a prefill rank that holds it — checked through the inverse map (global_position).
# ---------------------------------------------------------------------------------------

_BLOCK = 2


def _servable(ptp, pdcp, dtp, ddcp, h):
    sub = ptp // pdcp
    return ((h % sub == 0 or sub % h == 0) and (h % dtp == 0 or dtp % h == 0)
            and (ddcp == 1 or (dtp > h and (dtp // h) % ddcp == 0)))


def _topologies(heads):
    for ptp in (1, 2, 4, 8):
        for pdcp in (x for x in (1, 2, 4, 8) if ptp % x == 0):
            for dtp in (1, 2, 4, 8, 16):
                for ddcp in (x for x in (1, 2, 4, 8) if dtp % x == 0):
                    yield ptp, pdcp, dtp, ddcp, heads


def _check_coverage(plan, seq_len, rng):
    p, d = plan.prefill, plan.decode
    pt = topology(p.tp, p.dcp, "prefill", num_kv_heads=p.num_kv_heads)
    dt = topology(d.tp, d.dcp, "decode", num_kv_heads=d.num_kv_heads)
    p_table = rng.sample(range(64), -(-seq_len // p.vblock))
    d_table = rng.sample(range(64), -(-seq_len // d.vblock))
    p_inv = {b: i for i, b in enumerate(p_table)}
    d_inv = {b: i for i, b in enumerate(d_table)}
    seen = Counter()
    for rp in plan.ranks:
        for r in rp.reads:
            assert pt.cp_rank(r.remote_rank) == r.remote_cp_rank
            r_heads, l_heads = pt.kv_heads_of(r.remote_rank), dt.kv_heads_of(rp.rank)
            for pos, rb, ro, lb, lo, n in plan.chunks(rp.rank, r.remote_cp_rank, seq_len,
                                                      p_table, d_table).tolist():
                assert n >= 1 and ro + n <= p.block_size and lo + n <= d.block_size
                for t in range(n):
                    r_pos = layout.global_position(p_inv[rb] * p.block_size + ro + t,
                                                   r.remote_cp_rank, dcp=p.dcp,
                                                   interleave=p.interleave_size)
                    l_pos = layout.global_position(d_inv[lb] * d.block_size + lo + t,
                                                   rp.cp_rank, dcp=d.dcp,
                                                   interleave=d.interleave_size)
                    assert r_pos == l_pos == pos + t < seq_len
                    assert layout.owner(r_pos, **p.layout_kwargs()) == r.remote_cp_rank
                    for j in range(r.num_heads):
                        h = r_heads[r.remote_head_offset + j]
                        assert h == l_heads[r.local_head_offset + j]
                        seen[(rp.rank, l_pos, h)] += 1
    need = {(e, q, h) for e in range(d.tp) for q in range(seq_len)
            if layout.owner(q, **d.layout_kwargs()) == dt.cp_rank(e) for h in dt.kv_heads_of(e)}
    assert set(seen) == need, (need - set(seen), set(seen) - need)
    assert max(seen.values(), default=1) == 1


@pytest.mark.parametrize("heads", [1, 2, 4, 8], ids=lambda h: f"kv{h}")
def test_brute_force_coverage_over_topologies(heads):
    rng = random.Random(heads)
    served = rejected = smaller_prefill_dcp = 0
    for topo in _topologies(heads):
        try:
            plan = _plan(*topo, block=_BLOCK)
        except DCPTransferError:
            assert not _servable(*topo), f"rejected a servable topology {topo}"
            rejected += 1
            continue
        assert _servable(*topo), f"planned an unservable topology {topo}"
        period = max(plan.prefill.vblock, plan.decode.vblock)
        for n in (0, 1, _BLOCK + 1, 2 * period + 3):
            try:
                _check_coverage(plan, n, rng)
            except AssertionError as e:
                raise AssertionError(f"topology {topo}, seq_len={n}: {e}") from None
        served += 1
        smaller_prefill_dcp += 1 < topo[1] < topo[3]
    # The enumeration exercises both sides (one KV head: every pair is servable).
    assert served >= 40 and (rejected >= 10 or heads == 1)
    if heads <= 2:  # decode DCP 4 and 8 need tp // heads to be a multiple of dcp
        assert smaller_prefill_dcp >= 5  # 1 < P_DCP < D_DCP is planned and covered


# ---------------------------------------------------------------------------------------
# Configurations that cannot be served fail before any transfer, naming values and a fix
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes, words", [
    ((8, 4, 8, 3, 8), ["TP % DCP"]),
    ((2, 1, 2, 1, 3), ["num_kv_heads=3", "shard=2"]),
    # DCPConfig refuses the decode layout itself (KV-head rules need no query heads).
    ((4, 2, 4, 2, 4), ["decode engine's layout is invalid", "decode DCP needs tp > num_kv_heads",
                       "tp=4, num_kv_heads=4", "Use tp=8"]),
], ids=["tp-not-multiple-of-dcp", "heads-3-over-2", "decode-no-replica"])
def test_unservable_configurations(sizes, words):
    with pytest.raises(DCPTransferError) as e:
        _plan(*sizes)
    for w in words:
        assert w in str(e.value)


def test_mismatched_engines_and_bad_block_tables():
    p, _ = engine_configs(prefill_tp=4, prefill_dcp=2, decode_tp=2, decode_dcp=1,
                          num_kv_heads=8, block_size=16)
    _, d32 = engine_configs(prefill_tp=4, prefill_dcp=2, decode_tp=2, decode_dcp=1,
                            num_kv_heads=8, block_size=32)
    with pytest.raises(DCPTransferError, match="prefill block_size=16, decode block_size=32"):
        plan_transfer(p, d32)
    _, d4 = engine_configs(prefill_tp=4, prefill_dcp=2, decode_tp=2, decode_dcp=1,
                           num_kv_heads=4)
    with pytest.raises(DCPTransferError, match="prefill num_kv_heads=8, decode num_kv_heads=4"):
        plan_transfer(p, d4)
    with pytest.raises(DCPTransferError, match="mode='prefill'"):
        plan_transfer(d4.replace(num_kv_heads=8), d4.replace(num_kv_heads=8))
    plan = _plan(4, 2, 2, 1, 8)
    with pytest.raises(DCPTransferError, match="prefill block table too short.*seq_len=100, "
                                                "1 entries, 4 needed"):
        plan.chunks(0, 0, 100, [0], list(range(7)))
    with pytest.raises(DCPTransferError, match="negative entry"):
        plan.chunks(0, 0, 10, [-1], [0])


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def test_cli_json(capsys):
    assert cli_main(["plan-transfer", "--prefill-tp", "32", "--prefill-dcp", "4",
                     "--decode-tp", "16", "--decode-dcp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ranks = out["decode_ranks"]
    assert [r["rank"] for r in ranks] == list(range(16))
    assert ranks[0]["remote_ranks"] == [0, 16] and ranks[1]["remote_ranks"] == [8, 24]
    assert out["prefill"]["num_kv_heads"] == 8  # default: the largest servable count <= 8
    read = ranks[1]["reads"][1]
    assert (read["remote_rank"], read["remote_head_offset"], read["num_heads"]) == (24, 0, 1)
    assert read["block_pattern"]["local_block"] == [2, 1]
    assert ranks[1]["spec_formula_remote_ranks"] == [17]


def test_cli_table_and_error(capsys):
    assert cli_main(["plan-transfer", "--prefill-tp", "4", "--prefill-dcp", "2",
                     "--decode-tp", "2", "--num-kv-heads", "8"]) == 0
    text = capsys.readouterr().out
    assert "decode rank 1 (cp_rank 0, heads [4, 5, 6, 7]) <- prefill ranks [1, 3]" in text
    assert "local 2m+1 <- remote m" in text
    assert cli_main(["plan-transfer", "--prefill-tp", "2", "--decode-tp", "2",
                     "--num-kv-heads", "3"]) == 2
    assert "num_kv_heads=3, shard=2" in capsys.readouterr().err


@pytest.mark.parametrize("ptp,pdcp,dtp,ddcp,heads,patterns", [
    # P:TP2/DCP2 -> D:TP8/DCP4: decode cp_rank r reads prefill cp_rank r % 2, keeping its
    # remote blocks 2m + r // 2 (P_DCP < D_DCP, beyond the spec's cases).
    (2, 2, 8, 4, 2, {0: (0, "local m <- remote 2m"), 1: (1, "local m <- remote 2m"),
                     2: (0, "local m <- remote 2m+1"), 3: (1, "local m <- remote 2m+1")}),
    # P:TP1 -> D:TP8/DCP8: every decode rank reads the one prefill rank, block 8m + r.
    (1, 1, 8, 8, 1, {r: (0, f"local m <- remote 8m{'+' + str(r) if r else ''}")
                     for r in range(8)}),
    # P:TP4/DCP4 -> D:TP6/DCP3 (gcd 1: every decode cp_rank reads every prefill cp_rank).
    (4, 4, 6, 3, 2, {0: (0, "local 4m <- remote 3m"), 1: (1, "local 4m <- remote 3m"),
                     2: (1, "local 4m+1 <- remote 3m+1")}),
], ids=["tp2dcp2-to-tp8dcp4", "tp1-to-tp8dcp8", "tp4dcp4-to-tp6dcp3"])
def test_any_pair_of_dcp_degrees(capsys, ptp, pdcp, dtp, ddcp, heads, patterns):
    plan = _plan(ptp, pdcp, dtp, ddcp, heads)
    for cp_d, (cp_p, text) in patterns.items():
        assert plan.block_pattern(cp_d, cp_p)["text"] == text
    for n in (0, 1, 17, 200):
        _check_coverage(plan, n, random.Random(n))
    assert plan.decode_block_groups * ddcp % pdcp == 0
    assert cli_main(["plan-transfer", "--prefill-tp", str(ptp), "--prefill-dcp", str(pdcp),
                     "--decode-tp", str(dtp), "--decode-dcp", str(ddcp)]) == 0
    text = capsys.readouterr().out
    assert f"decode rank 1 (cp_rank 1" in text and patterns[1][1] in text
