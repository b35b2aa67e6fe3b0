"""The eager kernel of ``dcp.partial_attention``: the live span, scalar masks, no ``cat``.

``dcp.partial_attention``'s reference body (runtime/kernels/ops.py, also its decomposition for the
StableHLO lowering) builds one key set: ``cat([prior keys, current keys])``, the same for the
values, then zeroes invalid values with ``where(valid, values, zeros_like(values))``. Run
eagerly, each of those is a fresh copy of the whole prior span per layer (profiled at 8k
context, dcp=2: fill_/where/cat were 50% of the op, the gather itself 10%).

This kernel reads the same keys in two segments and never copies them again:

  prior    the block-table entries the longest row's prior uses (a host value: eager only),
           gathered once (``cache[table]`` is already a fresh tensor, so its stale/poisoned
           rows are zeroed in place by a scalar ``masked_fill_``, never by ``where``);
  current  this step's keys (a few rows).

Scores of each segment are masked in place with the scalar -inf, and the two softmax
segments are joined through their log-sum-exps (``logaddexp``), which is the softmax over the
concatenated keys. Shared K = V halves (MLA) are read as two matmuls on the halves, not a
``cat`` of them. Same arguments and results as ``partial_attention`` (tests compare them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dcp_compile.runtime import layout
from dcp_compile.runtime.garbage_block import LAST, garbage_block_id, usable_block
from dcp_compile.runtime.kernels.op_defs import dcp_op

NEG_INF = float("-inf")


def same_chunk(q_pos: Tensor, key_pos: Tensor, chunk: int) -> Tensor:
    """Chunked attention (Llama 4's ``attention_chunk_size``): a key is visible to a query
    only in the query's own chunk of ``chunk`` positions, ``k // chunk == q // chunk`` (with
    causality, ``q - q % chunk <= k <= q``). A predicate of the two global positions, so each
    rank applies it to the keys it holds and the LSE combine is unchanged. Positions are
    >= 0 where it matters (padding and unwritten keys are masked apart)."""
    return torch.div(q_pos, chunk, rounding_mode="floor") == \
        torch.div(key_pos, chunk, rounding_mode="floor")


def distance_bias(q_pos: Tensor, key_pos: Tensor, kv_heads: int, *,
                  slopes: Tensor | None = None, table: Tensor | None = None) -> Tensor:
    """The score bias of a key-query distance, [b, k, g, i, j] for scores [b, kv head,
    group, query, key] (q head h = k * groups + g): the one definition for ALiBi's slopes
    and for a distance table. The distance is ``q_pos - key_pos`` (>= 0 at every key a
    causal mask keeps); ALiBi adds ``-slopes[h] * distance``; a table ``[q_heads, L]``
    (T5's bucketed bias, an MLP of the distance: computed from the model's own module at
    transform time, frontends/module_position_bias.py) adds ``table[h, distance]``, the
    distance clamped into ``[0, L)`` (keys outside it are masked by causality, or lie past
    the program's max_model_len). A function of the two global positions and the head, so
    each rank adds it to the scores of the keys it holds and the LSE combine is unchanged.
    Bloom's ``slope * k_pos`` and MPT's ``slope * (k_pos - (S - 1))`` differ from ALiBi's by
    a per-query constant, which softmax ignores. ``key_pos`` [b or 1, j], ``q_pos`` [b, i]
    (int64)."""
    d = q_pos[:, None, None, :, None] - key_pos[:, None, None, None, :]     # [b, 1, 1, i, j]
    if slopes is not None:
        return -slopes.float().reshape(1, kv_heads, -1, 1, 1) * d.float()
    length = table.shape[-1]
    t = table.float().reshape(kv_heads, -1, length)                         # [k, g, L]
    at = d[:, 0, 0].clamp(0, length - 1)                                    # [b, i, j]
    return t[:, :, at].permute(2, 0, 1, 3, 4)


def alibi_bias(slopes: Tensor, q_pos: Tensor, key_pos: Tensor, kv_heads: int) -> Tensor:
    """ALiBi's score bias ``slopes[h] * (key_pos - q_pos)``: :func:`distance_bias`."""
    return distance_bias(q_pos, key_pos, kv_heads, slopes=slopes)


def position_bias(q_pos: Tensor, key_pos: Tensor, kv_heads: int, slopes: Tensor | None,
                  table: Tensor | None) -> Tensor | None:
    """The score bias an attention op's ``alibi_slopes`` / ``distance_table`` give (None:
    neither)."""
    if slopes is None and table is None:
        return None
    return distance_bias(q_pos, key_pos, kv_heads, slopes=slopes, table=table)


def join_memory(out: Tensor, lse: Tensor, q: Tensor, q_pos: Tensor, rank: Tensor | None,
                mem_k: Tensor, mem_v: Tensor, scale: float, softcap: float) -> tuple[Tensor, Tensor]:
    """Memory key/values (x-transformers' ``attn_num_mem_kv``): learned keys and values
    ``[1, M, kv_heads, D]`` every query attends at no position (no causality, no window,
    no bias), joined to a partial attention ``(out [b, i, q_heads, D], lse [b, i, q_heads])``
    through the two log-sum-exps, as one more segment of keys. Only cp rank 0 holds them
    (``rank`` is data): every rank's partial over its own keys is combined exactly by the
    LSE combine, so the memory enters each softmax once; ``rank`` None: this attention is
    not split over ranks (the decode engine's prompt step), it adds them. Padding queries
    (q_pos < 0) see none. Returns (out float32, lse)."""
    batch, q_len, q_heads, dim = q.shape
    kv_heads = mem_k.shape[2]
    qf = q.float().reshape(batch, q_len, kv_heads, q_heads // kv_heads, dim)
    s_mem = torch.einsum("bikgd,jkd->bkgij", qf, mem_k[0].float()) * scale
    if softcap > 0:
        s_mem = torch.tanh(s_mem / softcap) * softcap
    sees = (q_pos >= 0) if rank is None else (q_pos >= 0) & (rank == 0)        # [b, i]
    s_mem = s_mem.masked_fill(~sees[:, None, None, :, None], NEG_INF)
    lse_mem = torch.logsumexp(s_mem, dim=-1)                                   # [b, k, g, i]
    safe = torch.where(torch.isinf(lse_mem), torch.zeros_like(lse_mem), lse_mem)
    out_mem = torch.einsum("bkgij,jkd->bikgd", torch.exp(s_mem - safe[..., None]),
                           mem_v[0].float()).reshape(batch, q_len, q_heads, -1)
    lse_mem = lse_mem.permute(0, 3, 1, 2).reshape(batch, q_len, q_heads)
    both = torch.logaddexp(lse, lse_mem)
    finite = torch.isfinite(both)
    base = torch.where(finite, both, torch.zeros_like(both))
    w_seq = torch.where(finite & torch.isfinite(lse), torch.exp(lse - base),
                        torch.zeros_like(lse))
    w_mem = torch.where(finite & torch.isfinite(lse_mem), torch.exp(lse_mem - base),
                        torch.zeros_like(lse_mem))
    joined = out.float() * w_seq[..., None] + out_mem * w_mem[..., None]
    return joined, both


def readable_table(block_table: Tensor, num_blocks: int,
                   garbage_block: int = LAST) -> tuple[Tensor, Tensor]:
    """(usable, table): which block-table entries name a usable block, and the table with
    every other entry (-1 unallocated, the garbage block, ids beyond the cache) pointing at
    the garbage block, so a gather never reads a sequence's block for them; readers mask
    them out."""
    usable = usable_block(block_table, num_blocks, garbage_block)
    return usable, torch.where(usable, block_table, garbage_block_id(num_blocks, garbage_block))


def live_entries(prior_len: Tensor, block: int, max_blocks: int) -> int:
    """Block-table entries the longest row's prior slots [0, prior_len) span (host value)."""
    live = int(prior_len.clamp(min=0).max()) if prior_len.numel() else 0
    return min(max_blocks, -(-live // block))


def _scores(qf: Tensor, keys: list[Tensor], scale: float, softcap: float) -> Tensor:
    """[b, k, g, i, j] scores of q [b, i, k, g, d] against keys [b, j, k, d] given as
    feature-dim pieces (one piece, or the two halves of a shared K = V vector)."""
    out, start = None, 0
    for piece in keys:
        width = piece.shape[-1]
        part = torch.einsum("bikgd,bjkd->bkgij", qf[..., start:start + width], piece.float())
        out = part if out is None else out.add_(part)
        start += width
    out = out.mul_(scale)
    if softcap > 0:  # logit soft-capping (Gemma 2): on the scaled scores, before the mask
        out = torch.tanh(out.div_(softcap)).mul_(softcap)
    return out


def attended(pieces: list[Tensor], index_width: int) -> list[Tensor]:
    """The feature-dim pieces of a shared K = V vector without its last ``index_width``
    columns (DeepSeek Sparse Attention: the indexer's K stored beside the latent,
    runtime/kernels/sparse_attention.py ``index_columns``); the attention reads the rest."""
    if not index_width:
        return pieces
    keep, out = sum(p.shape[-1] for p in pieces) - index_width, []
    for p in pieces:
        if keep > 0:
            out.append(p[..., :keep])
        keep -= p.shape[-1]
    return out


def _weighted(probs: Tensor, values: list[Tensor]) -> Tensor:
    """probs [b, k, g, i, j] @ values [b, j, k, d] -> [b, i, k, g, d] (pieces side by side)."""
    parts = [torch.einsum("bkgij,bjkd->bikgd", probs, v.float()) for v in values]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def live_partial_attention(q: Tensor, q_pos: Tensor, k_cur: Tensor, v_cur: Tensor,
                           k_pos: Tensor, key_cache: Tensor, value_cache: Tensor,
                           block_table: Tensor, prior_len: Tensor, rank: Tensor, dcp: int,
                           interleave: int, scale: float, window: int = 0,
                           softcap: float = 0.0,
                           kv_shared: bool = False,
                           garbage_block: int = LAST,
                           alibi_slopes: Tensor | None = None,
                           attention_chunk: int = 0,
                           keep: Tensor | None = None,
                           index_width: int = 0,
                           distance_table: Tensor | None = None,
                           mem_k: Tensor | None = None,
                           mem_v: Tensor | None = None,
                           mem_split: bool = True) -> tuple[Tensor, Tensor]:
    """``partial_attention``'s result, reading only the live block-table span (module doc)."""
    batch, q_len, q_heads, _ = q.shape
    num_blocks, block, kv_heads, width = key_cache.shape
    entries = live_entries(prior_len, block, block_table.shape[1])
    table = block_table[:, :entries]
    usable, safe = readable_table(table, num_blocks, garbage_block)             # [b, e]
    span = entries * block
    local = torch.arange(span, device=q.device)
    # Prior slot bounds: one per row [b, 1, 1], or one per query of a width-K row [b, i, 1].
    bound = prior_len[:, :, None] if prior_len.dim() == 2 else prior_len[:, None, None]
    allocated = usable[:, local // block]                                       # [b, span]
    row_bound = bound.amax(dim=1)                                               # [b, 1]
    k_prior = key_cache[safe].view(batch, span, kv_heads, width).to(q.dtype)
    v_prior = value_cache[safe].view(batch, span, kv_heads, width).to(q.dtype)
    # Unwritten or poisoned rows must not leak through 0 * NaN: the gathers are fresh
    # tensors, so zero their invalid rows in place (a scalar fill, no copy).
    stale = ~((local[None, :] < row_bound) & allocated)[:, :, None, None]
    v_prior.masked_fill_(stale, 0.0)
    if kv_shared:
        k_prior.masked_fill_(stale, 0.0)
    q_ok = (q_pos >= 0)[:, :, None]                                             # [b, i, 1]
    prior_ok = (local[None, None, :] < bound) & allocated[:, None, :] & q_ok     # [b, i, span]
    prior_pos = layout.global_position(local, rank, dcp=dcp, interleave=interleave)
    if prior_len.dim() != 2:  # a row bound: causal on global positions too
        prior_ok &= prior_pos[None, None, :] <= q_pos[:, :, None]
    cur_ok = (k_pos >= 0)[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None]) & q_ok
    if window > 0:  # per position: each rank applies it to its own keys
        prior_ok &= q_pos[:, :, None] - prior_pos[None, None, :] < window
        cur_ok &= q_pos[:, :, None] - k_pos[:, None, :] < window
    if attention_chunk > 0:  # per position too: the query's own chunk
        prior_ok &= same_chunk(q_pos[:, :, None], prior_pos[None, None, :], attention_chunk)
        cur_ok &= same_chunk(q_pos[:, :, None], k_pos[:, None, :], attention_chunk)
    if keep is not None:  # DSA's selection on the key axis [all prior slots ; current keys]
        full = block_table.shape[1] * block
        prior_ok &= keep[:, :, :span]
        cur_ok &= keep[:, :, full:]
    current = (k_pos >= 0)[:, :, None, None]
    v_cur = torch.where(current, v_cur.to(q.dtype), 0.0)
    k_cur = torch.where(current, k_cur.to(q.dtype), 0.0) if kv_shared else k_cur.to(q.dtype)
    if kv_shared:  # keys = values = [k half ; v half], read as two pieces
        prior_pieces = attended([k_prior, v_prior], index_width)
        cur_pieces = attended([k_cur, v_cur], index_width)
    else:
        prior_pieces, cur_pieces = [k_prior], [k_cur]
    groups = q_heads // kv_heads
    qf = q.float().reshape(batch, q_len, kv_heads, groups, q.shape[-1])
    s_prior = _scores(qf, prior_pieces, scale, softcap)
    s_cur = _scores(qf, cur_pieces, scale, softcap)
    if alibi_slopes is not None or distance_table is not None:
        s_prior.add_(position_bias(q_pos, prior_pos[None, :], kv_heads, alibi_slopes,
                                   distance_table))
        s_cur.add_(position_bias(q_pos, k_pos, kv_heads, alibi_slopes, distance_table))
    s_prior.masked_fill_(~prior_ok[:, None, None], NEG_INF)
    s_cur.masked_fill_(~cur_ok[:, None, None], NEG_INF)
    lse = torch.logaddexp(torch.logsumexp(s_prior, dim=-1), torch.logsumexp(s_cur, dim=-1))
    # A query with no allowed key has lse = -inf: its probabilities are exactly 0, never NaN.
    safe_lse = torch.where(torch.isinf(lse), 0.0, lse)[..., None]
    p_prior = s_prior.sub_(safe_lse).exp_()
    p_cur = s_cur.sub_(safe_lse).exp_()
    out = _weighted(p_prior, prior_pieces if kv_shared else [v_prior])
    out = out.add_(_weighted(p_cur, cur_pieces if kv_shared else [v_cur]))
    out = out.reshape(batch, q_len, q_heads, out.shape[-1]).to(q.dtype)
    lse = lse.permute(0, 3, 1, 2).reshape(batch, q_len, q_heads)
    if mem_k is not None:
        out, lse = join_memory(out, lse, q, q_pos, rank if mem_split else None, mem_k, mem_v,
                               scale, softcap)
        out = out.to(q.dtype)
    return out, lse


# The op (its eager swap for dcp.partial_attention: runtime/kernels/eager.py).
@dcp_op("partial_attention_live", mutates_args=())
def partial_attention_live(q: Tensor, q_pos: Tensor, k_cur: Tensor, v_cur: Tensor,
                           k_pos: Tensor, key_cache: Tensor, value_cache: Tensor,
                           block_table: Tensor, prior_len: Tensor, rank: Tensor, dcp: int,
                           interleave: int, scale: float, window: int = 0,
                           softcap: float = 0.0,
                           kv_shared: bool = False,
                           garbage_block: int = LAST,
                           alibi_slopes: Tensor | None = None,
                           attention_chunk: int = 0,
                           keep: Tensor | None = None,
                           index_width: int = 0,
                           distance_table: Tensor | None = None,
                           mem_k: Tensor | None = None,
                           mem_v: Tensor | None = None,
                           mem_split: bool = True) -> tuple[Tensor, Tensor]:
    """partial_attention reading only the block-table entries some row's prior uses.

    Slots at or beyond prior_len are masked out by partial_attention anyway, so dropping the
    entries past the longest prior changes nothing but the work: a step costs its context,
    not the block table's (or the cache's) capacity. The width is data (a host sync), which
    is why only eager backends run this; static-shape backends keep the full span. The body
    masks with scalars and never concatenates the keys (runtime/kernels/live_attention.py).
    """
    return live_partial_attention(q, q_pos, k_cur, v_cur, k_pos, key_cache, value_cache,
                                  block_table, prior_len, rank, dcp, interleave, scale,
                                  window, softcap, kv_shared, garbage_block, alibi_slopes,
                                  attention_chunk, keep, index_width, distance_table, mem_k, mem_v,
                                  mem_split)


@partial_attention_live.register_fake
def _(q, q_pos, k_cur, v_cur, k_pos, key_cache, value_cache, block_table, prior_len, rank,
      dcp, interleave, scale, window=0, softcap=0.0, kv_shared=False, garbage_block=LAST,
      alibi_slopes=None, attention_chunk=0, keep=None, index_width=0, distance_table=None,
      mem_k=None, mem_v=None, mem_split=True):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
