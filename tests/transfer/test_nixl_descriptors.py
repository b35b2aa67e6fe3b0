"""Descriptor arithmetic of the NIXL KV transfer (runtime/transfer/nixl/descriptors.py), without NIXL.

The READs a decode rank would post are carried out here by a memory copy (descriptor by
descriptor, each checked to lie inside a buffer the test owns), the staged copies applied,
and the decode caches compared bit for bit with the reference scattered into the decode
layout -- the same end state the real transfer must reach (tests/transfer/test_nixl_connector.py).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dcp_compile.runtime.errors import DCPTransferError
from dcp_compile.runtime.topology import topology
from dcp_compile.runtime.transfer.nixl.descriptors import (EPOCH_BYTES, apply_staged, check_caches,
                                      epoch_descriptors, nx3, plan_reads, probe_descriptor,
                                      read_epochs, stage, stale_epochs)
from dcp_compile.runtime.transfer.nixl.handshake import NeuronNixlAgentMetadata, check_metadata
from nixl_loopback import SENTINEL, block_tables, engine_config, filled_caches, new_caches
from dcp_compile.runtime.transfer.plan import plan_transfer

from suite_path import ROOT  # noqa: E402  (the repository root)

SPEC = {"num_kv_heads": 4, "head_dim": 8, "layers": 2, "dtype": "bfloat16", "block_size": 4,
        "seed": 3, "requests": [{"id": "long", "seq_len": 61}, {"id": "vblock", "seq_len": 16},
                                {"id": "short", "seq_len": 3}, {"id": "empty", "seq_len": 0}]}

# (prefill tp, dcp) -> (decode tp, dcp), partial_rows, the plan's kind
CASES = {
    "dcp2-to-tp2-match": ((4, 2), (2, 1), "staged", "match"),
    "dcp2-to-tp4-split-staged": ((4, 2), (4, 1), "staged", "split"),
    "dcp2-to-tp4-split-desc": ((4, 2), (4, 1), "descriptors", "split"),
    "dcp2-to-tp1-merge-staged": ((4, 2), (1, 1), "staged", "merge"),
    "dcp2-to-tp1-merge-desc": ((4, 2), (1, 1), "descriptors", "merge"),
    "dcp2-to-dcp2-split": ((4, 2), (8, 2), "staged", "split"),
    "dcp4-to-dcp2-split": ((4, 4), (8, 2), "staged", "split"),
    "tp2-to-dcp2-split-desc": ((2, 1), (8, 2), "descriptors", "split"),
}


def _execute(desc_local: np.ndarray, desc_remote: np.ndarray, local_bufs, remote_bufs) -> int:
    """Do what one NIXL READ does: remote[i] -> local[i]; returns the bytes moved. Every
    range must lie inside one of the given tensors (a wrong offset fails, never corrupts)."""
    assert desc_local.shape == desc_remote.shape and desc_local.shape[1] == 3
    assert (desc_local[:, 1] == desc_remote[:, 1]).all()
    for (l_addr, n, _), (r_addr, _, _) in zip(desc_local.tolist(), desc_remote.tolist()):
        for addr, bufs, side in ((l_addr, local_bufs, "local"), (r_addr, remote_bufs, "remote")):
            assert any(t.data_ptr() <= addr and addr + n <= t.data_ptr() + t.nbytes
                       for t in bufs), f"{side} range [{addr}, +{n}) is outside every buffer"
        ctypes.memmove(l_addr, r_addr, n)
    return int(desc_local[:, 1].sum())


def _metadata(cfg, rank: int, caches, geometry) -> NeuronNixlAgentMetadata:
    heads = topology(cfg.tp, cfg.dcp, cfg.mode, config=cfg).kv_heads_of(rank)
    return NeuronNixlAgentMetadata(
        engine_id="p", agent_name=f"p-rank{rank}", agent_metadata=b"", tp_rank=rank,
        tp_size=cfg.tp, kv_caches_base_addr=tuple((k.data_ptr(), v.data_ptr()) for k, v in caches),
        num_blocks=geometry.num_blocks, block_size=geometry.block_size,
        block_len=geometry.block_len, kv_heads=tuple(heads), head_dim=geometry.head_dim,
        dtype="bfloat16", block_epochs_addr=0, dcp_size=cfg.dcp)


# Any pair of DCP degrees (P_DCP < D_DCP included), num_kv_heads of SPEC_ANY.
ANY_PAIR = {
    "tp2dcp2-to-tp8dcp4": ((2, 2), (8, 4), "staged", "match"),
    "tp1-to-tp8dcp8": ((1, 1), (8, 8), "staged", "match"),
    "tp4dcp4-to-tp6dcp3": ((4, 4), (6, 3), "staged", "match"),
}
SPEC_ANY = dict(SPEC, num_kv_heads=1)


def _contiguous(spec, plan) -> dict:
    """``spec`` with the engines' own allocator (BlockAllocator), grouped as the plan says."""
    return dict(spec, allocation="contiguous",
                block_groups={"p": plan.prefill_block_groups, "d": plan.decode_block_groups})


@pytest.mark.parametrize("allocation", ["shuffled", "contiguous"])
@pytest.mark.parametrize("case", list(CASES) + list(ANY_PAIR))
def test_descriptors_move_exactly_the_decode_layout(case, allocation):
    """Bit for bit, over fragmented (shuffled) block tables and the allocator's contiguous
    ones; with contiguous tables every (remote rank, head range) is one descriptor per
    cache tensor (staged or whole rows), the one-read floor's count."""
    (ptp, pdcp), (dtp, ddcp), partial_rows, kind = {**CASES, **ANY_PAIR}[case]
    spec = SPEC_ANY if case in ANY_PAIR else SPEC
    p_cfg = engine_config(spec, {"tp": ptp, "dcp": pdcp}, "prefill")
    d_cfg = engine_config(spec, {"tp": dtp, "dcp": ddcp}, "decode")
    plan = plan_transfer(p_cfg, d_cfg)
    assert plan.kind == kind
    if allocation == "contiguous":
        spec = _contiguous(spec, plan)
    _run_descriptors(spec, plan, partial_rows, floor_count=allocation == "contiguous"
                     and partial_rows == "staged")


def test_fragmented_allocator_tables_still_move_exactly():
    """The allocator falls back to scattered blocks when no run is free: still bit-exact,
    and more descriptors than the contiguous floor."""
    from dcp_compile.runtime.serving.kv_cache import BlockAllocator
    p_cfg = engine_config(SPEC, {"tp": 4, "dcp": 2}, "prefill")
    d_cfg = engine_config(SPEC, {"tp": 2, "dcp": 1}, "decode")
    plan = plan_transfer(p_cfg, d_cfg)
    alloc = BlockAllocator(40, d_cfg.vblock)
    for s in range(6):                       # six 3-block sequences, then every other freed
        alloc.ensure(100 + s, 3 * d_cfg.vblock)
    for s in range(0, 6, 2):
        alloc.free(100 + s)
    alloc.ensure(200, 23 * d_cfg.vblock)     # the 3-block holes and the tail: no run of 16
    table = alloc.table([200], 23)[0].tolist()
    assert any(b + 1 != c for b, c in zip(table, table[1:]))  # really fragmented
    reads = _run_descriptors(SPEC, plan, "staged", d_table={"long": table})
    floor = 2 * SPEC["layers"] * sum(len(rp.reads) for rp in plan.ranks)
    assert reads["long"] > floor


def _run_descriptors(spec, plan, partial_rows, floor_count=False, d_table=None) -> dict:
    """Carry out every decode rank's READs of every request of ``spec`` by memory copies;
    the decode caches must equal the direct scatter bit for bit. Returns request id ->
    descriptors over all ranks."""
    p_cfg, d_cfg = plan.prefill, plan.decode
    ptp, dtp = p_cfg.tp, d_cfg.tp
    _, p_tables = block_tables(spec, p_cfg, "p")
    num_blocks, d_tables = block_tables(spec, d_cfg, "d")
    if d_table:  # given decode tables (the fragmented allocation): room for their blocks
        d_tables = {**d_tables, **d_table}
        num_blocks = max(num_blocks, max(max(t) for t in d_table.values()) + 2)
    kind = plan.kind
    counts = {}
    remote_caches, remotes = {}, {}
    for p in range(ptp):
        caches = filled_caches(spec, p_cfg, "p", p)
        flat, geo = check_caches(caches, p_cfg, p, list(range(caches[0][0].shape[2])), "prefill")
        remote_caches[p], remotes[p] = flat, _metadata(p_cfg, p, caches, geo)
    for d in range(dtp):
        caches = new_caches(spec, d_cfg, d, num_blocks)
        heads = list(plan.rank(d).kv_heads)
        flat, geo = check_caches(caches, d_cfg, d, heads, "decode")
        local_bases = np.array([t.data_ptr() for t in flat], dtype=np.uint64)
        for p in plan.rank(d).remote_ranks:
            check_metadata(remotes[p], p, p_cfg, geo, decode_rank=d)
        for r in spec["requests"]:
            reads, staged = plan_reads(plan, d, r["seq_len"], p_tables[r["id"]],
                                       d_tables[r["id"]], remotes, geo, local_bases, partial_rows)
            assert set(reads) == set(plan.rank(d).remote_ranks)
            staging = torch.zeros(sum(s.nbytes for s in staged), dtype=torch.uint8)
            copies = stage(staged, geo, staging.data_ptr()) if staged else []
            for p, rr in reads.items():
                if rr is None:
                    continue
                n_desc = sum(len(x) for x in rr.local)
                counts[r["id"]] = counts.get(r["id"], 0) + n_desc
                if floor_count:  # one descriptor per cache tensor and head range
                    n_reads = sum(1 for x in plan.rank(d).reads if x.remote_rank == p)
                    assert n_desc == 2 * spec["layers"] * n_reads, (r["id"], d, p, n_desc)
                moved = _execute(np.concatenate(rr.local), np.concatenate(rr.remote),
                                 flat + [staging], remote_caches[p])
                assert moved == rr.bytes
                assert rr.kv_bytes <= rr.bytes
                if partial_rows == "descriptors" or kind != "split":
                    assert rr.kv_bytes == rr.bytes  # exact bytes unless staging splits rows
            apply_staged(staging, copies, flat, geo)
        want = filled_caches(spec, d_cfg, "d", d) if not d_table else \
            _scattered(spec, d_cfg, d, num_blocks, d_tables)
        for (k, v), (wk, wv) in zip(caches, want):
            for got, exp in ((k, wk), (v, wv)):  # bit for bit, garbage block included
                assert torch.equal(got.view(torch.int16), exp.view(torch.int16)), \
                    f"decode rank {d}: cache differs at {(got != exp).nonzero()[:4].tolist()}"
        assert (caches[0][0][-1] == SENTINEL).all()
    return counts


def _scattered(spec, cfg, rank, num_blocks, tables):
    from nixl_loopback import reference_kv, scatter_reference
    caches = new_caches(spec, cfg, rank, num_blocks)
    for i, r in enumerate(spec["requests"]):
        scatter_reference(reference_kv(spec, i, r["seq_len"]), cfg, rank, caches,
                          tables[r["id"]])
    return caches


def test_check_metadata_refuses_a_geometry_the_plan_does_not_expect():
    p_cfg = engine_config(SPEC, {"tp": 4, "dcp": 2}, "prefill")
    d_cfg = engine_config(SPEC, {"tp": 2, "dcp": 1}, "decode")
    caches = new_caches(SPEC, p_cfg, 1, 6)
    _, p_geo = check_caches(caches, p_cfg, 1, [0, 1], "prefill")
    _, d_geo = check_caches(new_caches(SPEC, d_cfg, 0, 6), d_cfg, 0, [0, 1], "decode")
    md = _metadata(p_cfg, 1, caches, p_geo)
    check_metadata(md, 1, p_cfg, d_geo, decode_rank=0)
    bad = NeuronNixlAgentMetadata(**{**md.__dict__, "block_len": md.block_len * 2})
    with pytest.raises(DCPTransferError, match=r"block_len advertised 256, plan expects 128"):
        check_metadata(bad, 1, p_cfg, d_geo, decode_rank=0)


def test_nx3_is_every_base_times_every_offset():
    out = nx3(np.array([1000, 5000], dtype=np.uint64), torch.tensor([0, 16, 48]),
              torch.tensor([16, 32, 8]))
    assert out.tolist() == [[1000, 16, 0], [1016, 32, 0], [1048, 8, 0],
                            [5000, 16, 0], [5016, 32, 0], [5048, 8, 0]]


def test_epoch_reads_land_per_remote_and_stale_blocks_are_found():
    blocks = np.array([3, 0, 2], dtype=np.uint64)
    remote_epochs = [torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([20, 21, 22, 23, 24, 25])]
    landing = torch.zeros(len(remote_epochs) * len(blocks) * EPOCH_BYTES, dtype=torch.uint8)
    for slot, epochs in enumerate(remote_epochs):
        local, remote = epoch_descriptors(landing.data_ptr(), slot, epochs.data_ptr(), blocks)
        assert _execute(local, remote, [landing], [epochs]) == len(blocks) * EPOCH_BYTES
    got = read_epochs(landing, len(remote_epochs), len(blocks))
    assert got.tolist() == [[13, 10, 12], [23, 20, 22]]
    # good: 0 < e <= epoch; 0 never held, < 0 freed, > epoch held again by a later lease
    got = torch.tensor([[1, 5, 0], [-3, 5, 6]])
    assert stale_epochs(got, 5).tolist() == [[0, 2], [1, 0], [1, 2]]


def test_probe_reads_the_start_of_the_remote_garbage_block():
    md = SimpleNamespace(kv_caches_base_addr=((1000, 9000), (2000, 3000)), num_blocks=6,
                         block_len=256)
    assert probe_descriptor(md, 64) == (1000 + 5 * 256, 64)
    md.block_len = 32
    assert probe_descriptor(md, 64) == (1000 + 5 * 32, 32)


def test_descriptor_and_handshake_modules_do_not_import_nixl():
    code = ("import sys, dcp_compile.runtime.transfer.nixl.descriptors, dcp_compile.runtime.transfer.nixl.handshake; "
            "assert 'nixl' not in sys.modules, sorted(m for m in sys.modules if 'nixl' in m)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_allocator_prefers_contiguous_runs_and_groups_entries():
    from dcp_compile.runtime.errors import DCPInputError
    from dcp_compile.runtime.serving.kv_cache import BlockAllocator
    alloc = BlockAllocator(21, 4)                        # blocks 0..19, 20 is garbage
    assert alloc.ensure(0, 12) == [0, 1, 2]
    assert alloc.ensure(1, 16, groups=2) == [3, 5, 4, 6]  # entries 0, 2 | 1, 3: one run each
    assert alloc.ensure(0, 13) == [0, 1, 2, 7]           # 3 is taken: the lowest free block
    assert alloc.ensure(0, 17) == [0, 1, 2, 7, 8]        # grows in place
    alloc.free(1)                                        # hole 3..6 (4 blocks)
    assert alloc.ensure(2, 20) == [9, 10, 11, 12, 13]    # 5 do not fit the hole: next run
    assert alloc.ensure(3, 12, groups=3) == [3, 4, 5]    # fits the hole
    assert alloc.ensure(4, 28) == [6, 14, 15, 16, 17, 18, 19]  # no run of 7: scattered
    with pytest.raises(DCPInputError, match="groups must be an int >= 1"):
        alloc.ensure(5, 4, groups=0)
    with pytest.raises(DCPInputError, match="out of KV cache blocks"):
        alloc.ensure(5, 4)
