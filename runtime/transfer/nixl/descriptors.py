"""Descriptor arithmetic of the NIXL KV transfer: which bytes of which cache a READ covers.

Pure arithmetic over addresses and the transfer plan's chunks; nothing here imports nixl or
touches memory it is not given, so it is tested on ordinary tensors (tests/transfer/test_nixl_descriptors.py
carries out the descriptors with a memory copy and compares the caches).

Cache layout (both engines): per layer a key and a value tensor ``[num_blocks, block_size,
kv_heads_per_rank, head_dim]``; row ``physical_slot`` holds one token's heads. Whole cache rows
move as one descriptor per run of rows that is contiguous on both sides: the plan's runs (a
block, or less at the end) are merged wherever the next run starts where the last one ended
in both caches (:func:`merge_runs`; consecutive blocks, which the block allocator prefers).
Runs never merge across tensors: each cache is its own NIXL registration, and with the
garbage block last no run of layer ``i`` ends where layer ``i + 1`` begins. A head range of a row (splitting / merging) is strided across tokens, so it is either staged
(the remote runs read whole into a bounce buffer, merged wherever they are contiguous in the
remote cache, then copied into the head range: :func:`stage`, :func:`apply_staged`) or one
descriptor per token (``partial_rows="descriptors"``).

A descriptor array is NIXL's Nx3 ``(address, length, device id)`` (:func:`nx3`); one READ
reads ``remote[i]`` into ``local[i]`` for every row ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dcp_compile.runtime import layout
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransferError

__all__ = ["EPOCH_BYTES", "PARTIAL_ROWS", "CacheGeometry", "RemoteRead", "StagedCopy",
           "StagedRun", "apply_staged", "check_caches", "epoch_descriptors",
           "merge_runs", "nx3", "plan_reads", "probe_descriptor", "read_epochs", "stage",
           "stale_epochs"]

EPOCH_BYTES = 8                      # one int64 block epoch (see PrefillKVConnector.hold)
PARTIAL_ROWS = ("staged", "descriptors")  # how a head range of a cache row moves


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    element_size: int

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.element_size

    @property
    def row_bytes(self) -> int:
        return self.num_heads * self.head_bytes

    @property
    def block_len(self) -> int:
        return self.block_size * self.row_bytes


def check_caches(kv_caches, cfg: DCPConfig, rank: int, heads: list[int],
                  side: str) -> tuple[list[torch.Tensor], CacheGeometry]:
    caches = []
    for i, kv in enumerate(kv_caches):
        if len(kv) != 2:
            raise DCPTransferError(f"{side} rank {rank}: layer {i} must be a (key, value) pair: "
                                   f"got {len(kv)} tensors. Pass [(k_cache, v_cache), ...].")
        caches.extend(kv)
    if not caches:
        raise DCPTransferError(f"{side} rank {rank}: no KV caches given. Pass one (key, value) "
                               f"pair per layer.")
    t0 = caches[0]
    want = ("num_blocks", cfg.block_size, len(heads), "head_dim")
    for t in caches:
        bad = (t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 4
               or t.shape[1] != cfg.block_size or t.shape[2] != len(heads)
               or t.shape != t0.shape or t.dtype != t0.dtype or t.shape[0] < 2)
        if bad:
            raise DCPTransferError(
                f"{side} rank {rank}: KV caches must be contiguous CPU tensors of one shape "
                f"[num_blocks >= 2, block_size, kv_heads_per_rank, head_dim] = {list(want)}: got "
                f"{t.device.type} {t.dtype} {list(t.shape)} contiguous={t.is_contiguous()}. "
                f"Allocate them per the layout (last block = garbage block).")
    geo = CacheGeometry(num_layers=len(caches) // 2, num_blocks=t0.shape[0],
                         block_size=t0.shape[1], num_heads=t0.shape[2], head_dim=t0.shape[3],
                         dtype=t0.dtype, element_size=t0.element_size())
    return caches, geo



def nx3(bases: np.ndarray, offsets: torch.Tensor, sizes: torch.Tensor) -> np.ndarray:
    """NIXL's Nx3 descriptor array (address, length, device id) for every base x offset."""
    off = offsets.numpy().astype(np.uint64)
    addr = (bases[:, None] + off[None, :]).reshape(-1)
    out = np.zeros((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = np.tile(sizes.numpy().astype(np.uint64), len(bases))
    return out


def merge_runs(a: torch.Tensor, b: torch.Tensor,
               length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs ``(a[i], b[i], length[i])`` (first row on either side, rows) with the next run
    starting where this one ended on both sides become one run; order is kept."""
    if len(length) <= 1:
        return a, b, length
    joins = (a[:-1] + length[:-1] == a[1:]) & (b[:-1] + length[:-1] == b[1:])
    first = torch.cat([torch.ones(1, dtype=torch.bool), ~joins])
    group = torch.cumsum(first, 0) - 1
    merged = torch.zeros(int(first.sum()), dtype=length.dtype).index_add_(0, group, length)
    return a[first], b[first], merged


# ---------------------------------------------------------------------------------------
# Data READs
# ---------------------------------------------------------------------------------------


@dataclass
class RemoteRead:
    """Everything read from one remote rank for one request: NIXL descriptor arrays."""

    local: list = field(default_factory=list)   # Nx3 arrays, concatenated when posted
    remote: list = field(default_factory=list)
    bytes: int = 0
    kv_bytes: int = 0


@dataclass
class StagedCopy:
    """After the READs: staging rows -> the head range of local cache rows (one tensor)."""

    tensor: int
    staging_offset: int    # bytes into the staging buffer
    rows: torch.Tensor     # local cache rows, one per staged row
    remote_heads: int
    remote_head_offset: int
    local_head_offset: int
    num_heads: int


@dataclass(frozen=True)
class StagedRun:
    """Runs of one HeadRead that are read whole into the staging buffer (see :func:`stage`)."""

    read: object               # dcp_compile.runtime.transfer.plan.HeadRead
    target: RemoteRead         # the remote rank's read the staging descriptors join
    r_bases: np.ndarray        # the remote rank's cache tensors (k0, v0, k1, ...)
    r_row_bytes: int
    r_rows: torch.Tensor       # first remote cache row of each run
    l_rows: torch.Tensor       # first local cache row of each run
    length: torch.Tensor       # tokens per run

    @property
    def nbytes(self) -> int:
        return int(self.length.sum()) * self.r_row_bytes * len(self.r_bases)


def plan_reads(plan, rank: int, seq_len: int, prefill_block_table, decode_block_table,
               remotes: dict, geometry: CacheGeometry, local_bases: np.ndarray,
               partial_rows: str) -> tuple[dict, list[StagedRun]]:
    """The READs of one request on decode rank ``rank``.

    ``plan`` is the TransferPlan, ``remotes`` remote rank -> its NeuronNixlAgentMetadata,
    ``local_bases`` the addresses of this rank's cache tensors (k0, v0, k1, ...). Returns
    remote rank -> :class:`RemoteRead` (None when there is nothing to read from it), and the
    runs still to be staged (their descriptors need the staging buffer's address).
    """
    g = geometry
    out: dict = {p: None for p in plan.rank(rank).remote_ranks}
    staged = []
    for read in plan.rank(rank).reads:
        md = remotes[read.remote_rank]
        chunks = plan.chunks(rank, read.remote_cp_rank, seq_len, prefill_block_table,
                             decode_block_table)
        if len(chunks) == 0:
            continue
        rr = out[read.remote_rank] = out[read.remote_rank] or RemoteRead()
        r_row_bytes = len(md.kv_heads) * g.head_bytes
        r_bases = np.array([a for kv in md.kv_caches_base_addr for a in kv], dtype=np.uint64)
        r_rows = layout.physical_slot(chunks[:, 2], chunks[:, 1], block=plan.prefill.block_size)
        l_rows = layout.physical_slot(chunks[:, 4], chunks[:, 3], block=plan.decode.block_size)
        length = chunks[:, 5]
        rr.kv_bytes += int(length.sum()) * read.num_heads * g.head_bytes * len(r_bases)
        if read.num_heads == len(md.kv_heads) == g.num_heads:
            # Whole rows on both sides: one descriptor per run contiguous on both sides.
            m_r, m_l, m_len = merge_runs(r_rows, l_rows, length)
            size = m_len * g.row_bytes
            rr.local.append(nx3(local_bases, m_l * g.row_bytes, size))
            rr.remote.append(nx3(r_bases, m_r * r_row_bytes, size))
            rr.bytes += int(size.sum()) * len(r_bases)
        elif partial_rows == "descriptors":
            # One descriptor per token and head range.
            idx, step = _tokens_of_runs(length)
            r_off = (r_rows[idx] + step) * r_row_bytes + read.remote_head_offset * g.head_bytes
            l_off = (l_rows[idx] + step) * g.row_bytes + read.local_head_offset * g.head_bytes
            size = torch.full_like(r_off, read.num_heads * g.head_bytes)
            rr.local.append(nx3(local_bases, l_off, size))
            rr.remote.append(nx3(r_bases, r_off, size))
            rr.bytes += int(size.sum()) * len(r_bases)
        else:
            staged.append(StagedRun(read, rr, r_bases, r_row_bytes, r_rows, l_rows, length))
    return out, staged


def _tokens_of_runs(length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of the runs: the index of its run and its step inside that run."""
    first = torch.cumsum(length, 0) - length
    idx = torch.repeat_interleave(torch.arange(len(length)), length)
    return idx, torch.arange(len(idx)) - first[idx]


def stage(staged: list[StagedRun], geometry: CacheGeometry, base: int) -> list[StagedCopy]:
    """Whole remote runs -> one bounce buffer at address ``base`` (of at least
    ``sum(s.nbytes for s in staged)`` bytes); appends the descriptors to each run's
    RemoteRead and returns the copies :func:`apply_staged` makes once the READs are done."""
    g = geometry
    bases = np.array([base], dtype=np.uint64)
    copies, cursor = [], 0
    for s in staged:
        first = torch.cumsum(s.length, 0) - s.length
        idx, step = _tokens_of_runs(s.length)
        rows = s.l_rows[idx] + step
        # The staging side is one run: merge every run contiguous in the remote cache.
        m_r, m_first, m_len = merge_runs(s.r_rows, first, s.length)
        size = m_len * s.r_row_bytes
        n_bytes = int(size.sum())
        for t, r_base in enumerate(s.r_bases):
            s.target.local.append(nx3(bases, cursor + m_first * s.r_row_bytes, size))
            s.target.remote.append(nx3(np.array([r_base], dtype=np.uint64),
                                       m_r * s.r_row_bytes, size))
            copies.append(StagedCopy(
                tensor=t, staging_offset=cursor, rows=rows,
                remote_heads=s.r_row_bytes // g.head_bytes,
                remote_head_offset=s.read.remote_head_offset,
                local_head_offset=s.read.local_head_offset, num_heads=s.read.num_heads))
            cursor += n_bytes
        s.target.bytes += n_bytes * len(s.r_bases)
    return copies


def apply_staged(staging: torch.Tensor, copies: list[StagedCopy], caches: list[torch.Tensor],
                 geometry: CacheGeometry) -> None:
    """Copy staged rows (uint8 ``staging``) into their head ranges of the local ``caches``."""
    g = geometry
    for c in copies:
        n = len(c.rows)
        src = staging[c.staging_offset:c.staging_offset + n * c.remote_heads
                      * g.head_bytes].view(g.dtype).view(n, c.remote_heads, g.head_dim)
        src = src[:, c.remote_head_offset:c.remote_head_offset + c.num_heads]
        dst = caches[c.tensor].view(-1, g.num_heads, g.head_dim)
        heads = slice(c.local_head_offset, c.local_head_offset + c.num_heads)
        first = int(c.rows[0]) if n else 0
        if n and int(c.rows[-1]) - first == n - 1 and bool((c.rows.diff() == 1).all()):
            dst[first:first + n, heads] = src   # one run of rows: a strided copy, no gather
        else:
            dst[c.rows, heads] = src


# ---------------------------------------------------------------------------------------
# Epoch READs and the connection probe
# ---------------------------------------------------------------------------------------


def epoch_descriptors(local_base: int, slot: int, remote_base: int,
                      blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) descriptors reading the remote epochs of ``blocks`` into row ``slot``
    (the remote rank's index in the plan) of the ``[remotes, blocks]`` int64 landing array
    at ``local_base`` (read back with :func:`read_epochs`)."""
    n = len(blocks)
    size = torch.full((n,), EPOCH_BYTES, dtype=torch.int64)
    local = nx3(np.array([local_base], dtype=np.uint64),
                (slot * n + torch.arange(n)) * EPOCH_BYTES, size)
    remote = nx3(np.array([remote_base], dtype=np.uint64),
                 torch.from_numpy(blocks.astype(np.int64)) * EPOCH_BYTES, size)
    return local, remote


def read_epochs(landing: torch.Tensor, num_remotes: int, num_blocks: int) -> torch.Tensor:
    """The ``[remotes, blocks]`` int64 epochs that :func:`epoch_descriptors` READs landed."""
    got = landing[:num_remotes * num_blocks * EPOCH_BYTES].view(torch.int64)
    return got.view(num_remotes, num_blocks)


def stale_epochs(got: torch.Tensor, epoch: int) -> torch.Tensor:
    """(remote, block) indices of blocks not held since ``epoch``: a block is good only if
    ``0 < e <= epoch`` (held by this lease or an earlier one still alive, never freed)."""
    return ((got <= 0) | (got > epoch)).nonzero()


def probe_descriptor(md, scratch_bytes: int) -> tuple[int, int]:
    """(address, bytes) of the connection probe: the start of the remote garbage block of
    layer 0's key cache (never a live row), at most ``scratch_bytes``."""
    garbage_row = md.kv_caches_base_addr[0][0] + (md.num_blocks - 1) * md.block_len
    return garbage_row, min(scratch_bytes, md.block_len)
