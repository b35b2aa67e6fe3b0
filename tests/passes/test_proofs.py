"""The layout prover: proves the real formulas, refutes broken ones with real counterexamples."""

from __future__ import annotations

import json

import pytest

from dcp_compile import cli
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPConfigError, DCPProofError
from dcp_compile.runtime import layout
from dcp_compile.passes.prove.theorems import Certificate, layout_with, prove, prove_config, theorem_names

from full_runs import full

REQUIRED = {
    "exactly_one_owner", "local_filled_sum", "local_filled_empty", "local_filled_step",
    "local_slot_dense", "global_position_inverts_local_slot",
    "local_slot_inverts_global_position", "interleave_slice_owned_in_order",
    "interleave_slice_within_chunk", "q_unshuffle_inverts_slice", "slot_mapping_owner_writes",
}


@pytest.mark.parametrize("dcp,interleave,block", [
    pytest.param(1, 16, 16, id="dcp1"),
    pytest.param(2, 16, 16, id="dcp2-I=B"),
    pytest.param(3, 4, 16, id="dcp3-odd-I<B"),
    pytest.param(4, 16, 16, id="dcp4-I=B=16"),
    pytest.param(4, 1, 8, id="dcp4-I1"),
    pytest.param(8, 16, 16, id="dcp8"),
    pytest.param(2, 2, 2, id="tiny-block"),
])
def test_real_layout_is_proven(dcp, interleave, block):
    cert = prove(dcp, interleave, block)
    assert cert.ok, cert.format_table()
    assert REQUIRED <= {t.name for t in cert.theorems}
    assert all(t.status == "proven" and t.counterexample is None for t in cert.theorems)
    assert (cert.dcp, cert.interleave_size, cert.block_size) == (dcp, interleave, block)


# The proof's pieces depend on dcp, not on block or interleave size (benchmarks/bench_prove.py
# prints the times); every big configuration must prove. The slice: per dcp, each block size
# once and each interleave form once (a Latin square of the 27); all 27 with DCP_PROOF_FULL=1.
BIG = [(dcp, interleave, block) for dcp in (2, 8, 16) for block in (64, 256, 1024)
       for interleave in (1, 16, block)]
_SLICE = {(dcp, interleave, block) for dcp in (2, 8, 16)
          for (interleave, block) in ((1, 64), (16, 256), (1024, 1024))}


@pytest.mark.parametrize("dcp,interleave,block", [
    pytest.param(d, i, b, id=f"dcp{d}-I{i}-B{b}", marks=() if (d, i, b) in _SLICE else
                 pytest.mark.skipif(not full("DCP_PROOF_FULL"),
                                    reason="the full run: DCP_PROOF_FULL=1"))
    for d, i, b in BIG])
def test_big_configs_are_proven(dcp, interleave, block):
    cert = prove(dcp, interleave, block)
    assert cert.ok, cert.format_table()
    pieces = {t.name: t.cases for t in cert.theorems}
    assert all(n >= 1 for n in pieces.values())


def test_pieces_do_not_grow_with_block_size():
    """Enumerating offsets would multiply the pieces by 64 from block 64 to 4096."""
    def pieces(block):
        return sum(t.cases for t in prove(8, 16, block).theorems)
    # (Offsets of a width-K decode step cross stride rows: the pieces settle once a block
    # holds more stride rows than an offset can cross, and stay there.)
    assert pieces(4096) <= 1.6 * pieces(64)
    assert pieces(4096) == pieces(1024) == pieces(256)


def test_prove_config_and_cache():
    cfg = DCPConfig(tp=8, dcp=4, block_size=16)
    cert = prove_config(cfg)
    assert cert.ok and cert.interleave_size == 16
    assert prove(4, 16, 16) is cert  # proven once per process for the real layout
    assert cert.raise_if_failed() is cert


@pytest.mark.parametrize("sizes", [(0, 16, 16), (4, 3, 16), (4, 32, 16), (-2, 1, 1),
                                   (4, 16.0, 16)],
                         ids=["dcp=0", "I-not-dividing-B", "I>B", "negative", "float"])
def test_invalid_sizes_raise_config_error(sizes):
    with pytest.raises(DCPConfigError):
        prove(*sizes)


# ----------------------------------------------------------------------------------------
# Broken formulas. Each must fail with a counterexample that is one when checked with ints.
# ----------------------------------------------------------------------------------------


def local_filled_clamp_off_by_one(n, rank, *, dcp, interleave, block):
    vblock, stride = block * dcp, interleave * dcp
    full = n // vblock
    remaining = n - full * vblock
    filled = full * block + (remaining // stride) * interleave
    leftover = remaining - (remaining // stride) * stride
    return filled + layout.clamp(leftover - rank * interleave, lo=0, hi=interleave - 1)


def owner_by_block_not_interleave(pos, *, dcp, interleave, block):
    return (pos // block) % dcp  # right only when interleave_size == block_size


def owner_shifted(pos, *, dcp, interleave, block):
    return (pos // interleave + 1) % dcp


def global_position_without_rank(slot, rank, *, dcp, interleave):
    return (slot // interleave) * (dcp * interleave) + slot % interleave


def q_unshuffle_swapped(p, chunk_len, *, dcp, interleave):
    stride = dcp * interleave
    r = (p % stride) // interleave
    j = (p // stride) * interleave + p % interleave
    return j * dcp + r  # treats the gather as position-major


def local_filled_wrong_from_third_vblock(n, rank, *, dcp, interleave, block):
    """Correct for N < 3*vblock, one too many afterwards: the search must reach k = 3."""
    good = layout.local_filled(n, rank, dcp=dcp, interleave=interleave, block=block)
    return good + layout.clamp(n // (3 * block * dcp), hi=1)


def query_bound_off_by_one(n, offset, rank, *, dcp, interleave, block):
    """Misses the query's own position when the rank owns it."""
    return layout.local_filled(n + offset, rank, dcp=dcp, interleave=interleave, block=block)


def query_bound_from_row_end(n, offset, rank, *, dcp, interleave, block):
    """local(G - k) taken as local(G) - k: counts back from the row's end (K = 4)."""
    K = 4
    return layout.local_filled(n + K, rank, dcp=dcp, interleave=interleave,
                               block=block) - (K - 1 - offset)


BROKEN = {
    "local_filled-clamp-off-by-one": (dict(local_filled=local_filled_clamp_off_by_one),
                                      (4, 4, 16), "local_filled_sum"),
    "owner-by-block": (dict(owner=owner_by_block_not_interleave), (4, 4, 16),
                       "local_filled_step"),
    "owner-shifted": (dict(owner=owner_shifted), (4, 16, 16), "local_filled_step"),
    "owner-shifted-dcp3": (dict(owner=owner_shifted), (3, 2, 4), "local_slot_dense"),
    "global_position-no-rank": (dict(global_position=global_position_without_rank),
                                (2, 16, 16), "global_position_inverts_local_slot"),
    "q_unshuffle-swapped": (dict(q_unshuffle_index=q_unshuffle_swapped), (4, 2, 4),
                            "q_unshuffle_inverts_slice"),
    "local_filled-late-bug": (dict(local_filled=local_filled_wrong_from_third_vblock),
                              (2, 4, 8), "local_filled_sum"),
    "query_bound-off-by-one": (dict(query_local_bound=query_bound_off_by_one), (4, 1, 16),
                               "query_local_bound_is_causal"),
    "query_bound-off-by-one-dcp1": (dict(query_local_bound=query_bound_off_by_one),
                                    (1, 16, 16), "query_local_bound_is_causal"),
    "query_bound-from-row-end": (dict(query_local_bound=query_bound_from_row_end),
                                 (2, 2, 8), "query_local_bound_is_causal"),
}


def _recheck(f, name, cex, W, I, B):
    """Recompute the failed claim of theorem ``name`` at the counterexample, with ints.

    Returns the (lhs, rhs) pair the theorem asserts equal (or value, (lo, hi)).
    """
    kw = dict(dcp=W, interleave=I, block=B)
    ks = dict(dcp=W, interleave=I)
    N, r = cex.get("N"), cex.get("rank")
    if name == "exactly_one_owner":
        return sum(f.dcp_active_mask(N, q, **kw) for q in range(W)), 1
    if name == "active_mask_is_owner":
        return f.dcp_active_mask(N, r, **kw), int(f.owner(N, **kw) == r)
    if name == "owner_stride_periodic":
        return f.owner(N + W * I, **kw), f.owner(N, **kw)
    if name == "local_filled_sum":
        return sum(f.local_filled(N, q, **kw) for q in range(W)), N
    if name == "local_filled_empty":
        return f.local_filled(0, r, **kw), 0
    if name == "local_filled_step":
        return (f.local_filled(N + 1, r, **kw),
                f.local_filled(N, r, **kw) + f.dcp_active_mask(N, r, **kw))
    if name == "local_slot_dense":
        m = f.dcp_active_mask(N, r, **kw)
        return m * f.local_slot(N, **kw), m * f.local_filled(N, r, **kw)
    if name == "global_position_inverts_local_slot":
        m = f.dcp_active_mask(N, r, **kw)
        return m * f.global_position(f.local_slot(N, **kw), r, **ks), m * N
    if name == "local_slot_inverts_global_position":
        p = f.global_position(cex["slot"], r, **ks)
        if cex["claim"].startswith("owner"):
            return f.owner(p, **kw), r
        return f.local_slot(p, **kw), cex["slot"]
    if name == "interleave_slice_owned_in_order":
        p = f.interleave_slice_index(cex["j"], r, **ks)
        if cex["claim"].startswith("owner"):
            return f.owner(p, **kw), r
        return f.local_slot(p, **kw), cex["j"]
    if name == "interleave_slice_within_chunk":
        S = cex["S"]
        expected = r * I if cex["end"] == "first" else S - 1 - (W - 1 - r) * I
        return f.interleave_slice_index(cex["j"], r, **ks), expected
    if name == "q_unshuffle_inverts_slice":
        S, j = cex["S"], cex["j"]
        return (f.q_unshuffle_index(f.interleave_slice_index(j, r, **ks), S, **ks),
                r * (S // W) + j)
    if name == "slot_mapping_owner_writes":
        e = cex["block_table_entry"]
        v = f.slot_mapping(N, r, e, **kw)
        if f.dcp_active_mask(N, r, **kw) == 1:
            return v, (e * B, (e + 1) * B)
        return v, -1
    if name == "query_local_bound_is_causal":
        t = cex["offset"]
        below = (f.local_filled(N, r, **kw) if t == 0
                 else f.query_local_bound(N, t - 1, r, **kw))
        return f.query_local_bound(N, t, r, **kw), below + f.dcp_active_mask(N + t, r, **kw)
    raise AssertionError(f"no int re-check for theorem {name}")


@pytest.mark.parametrize("overrides,sizes,must_fail", BROKEN.values(), ids=BROKEN.keys())
def test_broken_formula_fails_with_real_counterexample(overrides, sizes, must_fail):
    W, I, B = sizes
    f = layout_with(**overrides)
    cert = prove(W, I, B, formulas=f)
    assert not cert.ok
    assert not cert[must_fail].proven, cert.format_table()
    for t in cert.failed:
        cex = t.counterexample
        assert t.status == "failed" and cex and not cex.get("could_not_prove"), t
        lhs, rhs = _recheck(f, t.name, cex, W, I, B)
        assert cex["lhs"] == lhs
        if isinstance(rhs, tuple):
            assert not rhs[0] <= lhs < rhs[1], (t.name, cex)
        else:
            assert lhs != rhs and cex["rhs"] == rhs, (t.name, cex)
    with pytest.raises(DCPProofError, match=must_fail):
        cert.raise_if_failed()


def test_late_bug_counterexample_is_found_beyond_the_first_vblock():
    W, I, B = 2, 4, 8
    cert = prove(W, I, B, formulas=layout_with(local_filled=local_filled_wrong_from_third_vblock))
    assert cert["local_filled_sum"].counterexample["N"] == 3 * B * W
    assert cert["local_filled_step"].counterexample["N"] == 3 * B * W - 1


def test_broken_owner_does_not_touch_the_real_layout():
    prove(4, 4, 16, formulas=layout_with(owner=owner_shifted))
    assert layout.owner(4, dcp=4, interleave=4, block=16) == 1
    assert prove(4, 4, 16).ok


def test_unprovable_but_correct_formula_is_not_reported_proven():
    def owner_via_int(pos, *, dcp, interleave, block):
        pos = int(pos)  # fine on ints, a TypeError on a sympy symbol
        return layout.owner(pos, dcp=dcp, interleave=interleave, block=block)

    cert = prove(2, 2, 4, formulas=layout_with(owner=owner_via_int))
    assert not cert.ok
    cex = cert["exactly_one_owner"].counterexample
    assert cert["exactly_one_owner"].status == "failed"
    assert cex["could_not_prove"] is True and "residual" in cex


def test_formulas_object_must_provide_every_function():
    class Partial:
        owner = staticmethod(layout.owner)

    with pytest.raises(TypeError, match="local_filled"):
        prove(2, 2, 4, formulas=Partial())


# ----------------------------------------------------------------------------------------
# Certificate output and the CLI
# ----------------------------------------------------------------------------------------


def test_certificate_json_shape():
    cert = prove(4, 16, 16)
    data = json.loads(json.dumps(cert.to_json()))
    assert data["ok"] is True
    assert [t["name"] for t in data["theorems"]] == theorem_names()
    for t in data["theorems"]:
        assert {"name", "statement", "status", "counterexample", "method"} <= set(t)
        assert t["status"] == "proven" and t["counterexample"] is None
    assert isinstance(cert, Certificate) and "4" in cert.describe()


def test_failed_certificate_json_and_table():
    cert = prove(4, 4, 16, formulas=layout_with(owner=owner_shifted))
    data = json.loads(json.dumps(cert.to_json()))
    assert data["ok"] is False
    failed = [t for t in data["theorems"] if t["status"] == "failed"]
    assert failed and all({"N", "lhs", "rhs"} <= set(t["counterexample"])
                          or {"rank", "lhs", "rhs"} <= set(t["counterexample"])
                          for t in failed)
    table = cert.format_table()
    assert "PROOF FAILED" in table and "counterexample" in table


def test_cli_prove_exit_0_and_table(capsys):
    assert cli.main(["prove", "--dcp", "4", "--interleave-size", "16",
                     "--block-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "exactly_one_owner" in out and "all theorems proven" in out


def test_cli_prove_json(capsys):
    assert cli.main(["prove", "--dcp", "3", "--interleave-size", "4", "--block-size", "8",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["dcp"] == 3


def test_cli_prove_exit_1_on_broken_layout(monkeypatch, capsys):
    monkeypatch.setattr(layout, "owner", owner_shifted)  # real dcp_active_mask now uses it
    assert cli.main(["prove", "--dcp", "2", "--interleave-size", "2",
                     "--block-size", "4"]) == 1
    assert "PROOF FAILED" in capsys.readouterr().out


def test_cli_prove_invalid_sizes_exit_2(capsys):
    assert cli.main(["prove", "--dcp", "4", "--interleave-size", "3",
                     "--block-size", "16"]) == 2
    assert "interleave_size" in capsys.readouterr().err


def test_cli_prove_subprocess():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "dcp_compile.cli", "prove", "--dcp", "2",
                           "--block-size", "4", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] is True
