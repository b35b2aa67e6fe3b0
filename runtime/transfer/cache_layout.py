"""Move KV between the single-device paged layout and per-rank DCP layouts (host side).

``scatter_cache`` gives each rank exactly the positions it owns, at the slots the slot
mapping gives; ``gather_cache`` puts them back. Both use the layout formulas, so they are a
second, independent consumer of what the proofs prove.
"""

from __future__ import annotations

import torch

from dcp_compile.runtime import layout


def _rows(positions: torch.Tensor, table_row: torch.Tensor, *, block: int, dcp: int,
          interleave: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions this cp_rank owns, their cache rows) for one sequence."""
    kw = dict(dcp=dcp, interleave=interleave, block=block)
    own = layout.owner(positions, **kw) == rank
    pos = positions[own]
    slot = layout.local_slot(pos, **kw)
    rows = layout.physical_slot(slot, table_row[slot // block], block=block)
    return pos, rows


def scatter_cache(ref_caches: list[torch.Tensor], ref_table: torch.Tensor,
                  lengths: list[int], dst_caches: list[torch.Tensor], dst_table: torch.Tensor,
                  *, cp_rank: int, dcp: int, interleave: int, kv_heads: list[int]) -> None:
    """Copy the first ``lengths[b]`` tokens of each sequence from the single-device caches
    (block table ``ref_table``, dcp=1) into one rank's DCP caches (``dst_table``), keeping
    only the positions ``cp_rank`` owns and only its ``kv_heads``."""
    block = ref_caches[0].shape[1]
    heads = torch.tensor(kv_heads)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        pos, dst_rows = _rows(torch.arange(n), dst_table[b], block=block, dcp=dcp,
                              interleave=interleave, rank=cp_rank)
        _, src_rows = _rows(pos, ref_table[b], block=block, dcp=1, interleave=block, rank=0)
        for src, dst in zip(ref_caches, dst_caches):
            flat_src = src.reshape(-1, *src.shape[2:])
            flat_dst = dst.view(-1, *dst.shape[2:])
            flat_dst[dst_rows] = flat_src[src_rows][:, heads]


def gather_cache(rank_caches: dict[int, list[torch.Tensor]], rank_table: torch.Tensor,
                 lengths: list[int], out_caches: list[torch.Tensor], out_table: torch.Tensor,
                 *, cp_rank_of, dcp: int, interleave: int, kv_heads_of) -> None:
    """Inverse of ``scatter_cache``: rebuild single-device caches from every rank's shard."""
    block = out_caches[0].shape[1]
    for rank, caches in rank_caches.items():
        heads = torch.tensor(kv_heads_of(rank))
        for b, n in enumerate(lengths):
            if n == 0:
                continue
            pos, src_rows = _rows(torch.arange(n), rank_table[b], block=block, dcp=dcp,
                                  interleave=interleave, rank=cp_rank_of(rank))
            _, dst_rows = _rows(pos, out_table[b], block=block, dcp=1, interleave=block,
                                rank=0)
            for src, dst in zip(caches, out_caches):
                flat_src = src.reshape(-1, *src.shape[2:])
                flat_dst = dst.view(-1, *dst.shape[2:])
                part = flat_dst[dst_rows]
                part[:, heads] = flat_src[src_rows]
                flat_dst[dst_rows] = part
