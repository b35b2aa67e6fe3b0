"""The `dcp` custom ops: the primitives models call and DCP programs are built from.

Every op is functional (a cache write returns the new caches; KV caches are program inputs),
has a fake implementation (shapes only), and a reference implementation written in plain
ATen-composable torch, which doubles as its decomposition (``DECOMPOSITIONS``) so that any
backend can lower it. Index arithmetic comes from :mod:`dcp_compile.runtime.layout`, never re-derived.

Tensor conventions (one batch of sequences, padded to a static shape):
  q            [batch, q_len, q_heads, head_dim]
  k, v         [batch, kv_len, kv_heads, head_dim]
  positions    [batch, tokens] int64 global positions; -1 marks padding (writes nothing,
               attends to nothing, output 0)
  key_cache,
  value_cache  [num_blocks, block_size, kv_heads, head_dim]; one block is the reserved
               garbage block that slot -1 writes land in and no block table names: the last
               by default, the first with ``garbage_block=0`` (runtime/garbage_block.py)
  block_table  [batch, max_blocks] int64; -1 marks an unallocated entry
  rank         0-d int64 tensor: this rank's cp_rank (rank is data: one graph serves every rank)
"""

from __future__ import annotations

import torch
from torch import Tensor

from dcp_compile.runtime import layout
from dcp_compile.runtime.garbage_block import LAST
from dcp_compile.runtime.kernels.op_defs import dcp_op
from dcp_compile.runtime.kernels.live_attention import (alibi_bias, join_memory,  # noqa: F401
                                                        live_partial_attention, position_bias, readable_table,
                                                        same_chunk)
from dcp_compile.runtime.kernels.paged import prior_slots, write_rows
from dcp_compile.runtime.kernels.sparse_attention import dsa_keep_one_rank

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------
# Layout metadata computed inside the graph (same formulas as the host and the proofs).
# ----------------------------------------------------------------------------------------


def max_block_id(block: int) -> int:
    """Largest block id whose cache rows ``id * block + offset`` cannot wrap int64."""
    return (2 ** 63 - 1) // block - 1


def _slot_mapping_impl(positions: Tensor, block_table: Tensor, rank: Tensor, dcp: int,
                       interleave: int, block: int) -> Tensor:
    kw = dict(dcp=dcp, interleave=interleave, block=block)
    pos = positions.clamp(min=0)
    # Block-table entry covering this position (one entry per vblock, same table on all ranks).
    entry_index = layout.local_slot(pos, **kw) // block
    in_table = entry_index < block_table.shape[1]
    entry = torch.gather(block_table, 1, entry_index.clamp(max=block_table.shape[1] - 1))
    # Padding, unallocated (-1) entries and ids whose row arithmetic could wrap write nowhere
    # (-1); the step contract rejects the last two on the host, this holds without it.
    writable = (positions >= 0) & in_table & (entry >= 0) & (entry <= max_block_id(block))
    slots = layout.slot_mapping(pos, rank, torch.where(writable, entry, 0), **kw)
    return torch.where(writable, slots, torch.full_like(slots, -1))


@dcp_op("slot_mapping", mutates_args=())
def slot_mapping(positions: Tensor, block_table: Tensor, rank: Tensor, dcp: int,
                 interleave: int, block: int) -> Tensor:
    """Cache row each token is written to on ``rank``; -1 for padding or another rank's."""
    return _slot_mapping_impl(positions, block_table, rank, dcp, interleave, block)


@slot_mapping.register_fake
def _(positions, block_table, rank, dcp, interleave, block):
    return torch.empty_like(positions)


def _local_filled_impl(n: Tensor, rank: Tensor, dcp: int, interleave: int,
                       block: int) -> Tensor:
    return layout.local_filled(n.clamp(min=0), rank, dcp=dcp, interleave=interleave,
                               block=block)


@dcp_op("local_filled", mutates_args=())
def local_filled(n: Tensor, rank: Tensor, dcp: int, interleave: int, block: int) -> Tensor:
    """Prior tokens (of the first n) that live in ``rank``'s shard (spec: local_filled)."""
    return _local_filled_impl(n, rank, dcp, interleave, block)


@local_filled.register_fake
def _(n, rank, dcp, interleave, block):
    return torch.empty_like(n)


def _query_bound_impl(positions: Tensor, rank: Tensor, dcp: int, interleave: int,
                      block: int) -> Tensor:
    # Row b's queries sit at positions[b, 0] + t; padding (-1) reads no slot.
    n = positions[:, :1].clamp(min=0)
    offset = torch.arange(positions.shape[1], device=positions.device).unsqueeze(0)
    bound = layout.query_local_bound(n, offset, rank, dcp=dcp, interleave=interleave,
                                     block=block)
    return torch.where(positions >= 0, bound, torch.zeros_like(bound))


@dcp_op("query_bound", mutates_args=())
def query_bound(positions: Tensor, rank: Tensor, dcp: int, interleave: int,
                block: int) -> Tensor:
    """[B, K]: local slots of ``rank`` each query of a width-K decode row reads (prior and
    this step's owned tokens at or below the query: layout.query_local_bound); 0 on padding."""
    return _query_bound_impl(positions, rank, dcp, interleave, block)


@query_bound.register_fake
def _(positions, rank, dcp, interleave, block):
    return torch.empty_like(positions)


def _active_mask_impl(n: Tensor, rank: Tensor, dcp: int, interleave: int,
                      block: int) -> Tensor:
    owned = layout.dcp_active_mask(n.clamp(min=0), rank, dcp=dcp, interleave=interleave,
                                   block=block)
    return owned * (n >= 0).to(owned.dtype)


@dcp_op("active_mask", mutates_args=())
def active_mask(n: Tensor, rank: Tensor, dcp: int, interleave: int, block: int) -> Tensor:
    """dcp_active_mask: 1 where this rank owns position n (and n is not padding), else 0."""
    return _active_mask_impl(n, rank, dcp, interleave, block)


@active_mask.register_fake
def _(n, rank, dcp, interleave, block):
    return torch.empty_like(n)


# ----------------------------------------------------------------------------------------
# KV cache write
# ----------------------------------------------------------------------------------------


def _cache_write_impl(key_cache: Tensor, value_cache: Tensor, k: Tensor, v: Tensor,
                      slots: Tensor, garbage_block: int = LAST) -> tuple[Tensor, Tensor]:
    num_blocks, block, heads, dim = key_cache.shape
    rows = write_rows(key_cache, slots, garbage_block)
    # (block, offset) indices on the cache itself, not rows of a flattened view: a reshaped
    # cache is laid out apart from the cache by XLA, which then copies it whole every step.
    where = (rows // block, rows % block)
    new_k = key_cache.index_put(where, k.reshape(-1, heads, dim).to(key_cache.dtype))
    new_v = value_cache.index_put(where, v.reshape(-1, heads, dim).to(value_cache.dtype))
    return new_k, new_v


@dcp_op("cache_write", mutates_args=())
def cache_write(key_cache: Tensor, value_cache: Tensor, k: Tensor, v: Tensor,
                slots: Tensor, garbage_block: int = LAST) -> tuple[Tensor, Tensor]:
    """Return the caches with k/v written at ``slots`` (slot -1 goes to the garbage block)."""
    return _cache_write_impl(key_cache, value_cache, k, v, slots, garbage_block)


@cache_write.register_fake
def _(key_cache, value_cache, k, v, slots, garbage_block=LAST):
    return torch.empty_like(key_cache), torch.empty_like(value_cache)


# ----------------------------------------------------------------------------------------
# Attention over (local prior cache shard) + (current keys), with LSE
# ----------------------------------------------------------------------------------------


def _partial_attention_impl(q: Tensor, q_pos: Tensor, k_cur: Tensor, v_cur: Tensor,
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
    batch, q_len, q_heads, dim = q.shape
    num_blocks, block, kv_heads, _ = key_cache.shape
    max_blocks = block_table.shape[1]
    local, table, prior_pos = prior_slots(block_table, num_blocks, block, prior_len, rank,
                                          dcp, interleave, garbage_block)
    # Whole blocks, one per block-table entry (a gather of batch * max_blocks blocks, not of
    # every slot): [batch, max_blocks, block, heads, dim] -> [batch, max_blocks * block, ...].
    k_prior = key_cache[table].reshape(batch, max_blocks * block, kv_heads,
                                       key_cache.shape[-1])
    v_prior = value_cache[table].reshape(batch, max_blocks * block, kv_heads,
                                         value_cache.shape[-1])
    if kv_shared:
        # The (key, value) caches hold the two halves of one vector that is both the key and
        # the value (MLA's [latent ; k_pe], stored once: passes/absorb_latent_attention.py).
        k_prior = v_prior = torch.cat([k_prior, v_prior], dim=-1)
        k_cur = v_cur = torch.cat([k_cur, v_cur], dim=-1)
        if index_width:   # DSA: the indexer's K columns beside the latent are not attended
            k_prior = v_prior = k_prior[..., :k_prior.shape[-1] - index_width]
            k_cur = v_cur = k_cur[..., :k_cur.shape[-1] - index_width]
    # prior_len [b]: one bound per row; [b, i]: one per query (a width-K decode step reads
    # its own owned tokens from the cache, query i up to query_bound[b, i]).
    per_query = prior_len.dim() == 2

    keys = torch.cat([k_prior.to(q.dtype), k_cur.to(q.dtype)], dim=1)
    # Shared: the values are the keys (one tensor), not a second copy of the same rows.
    values = keys if kv_shared else torch.cat([v_prior.to(q.dtype), v_cur.to(q.dtype)], dim=1)
    key_pos = torch.cat([prior_pos, k_pos], dim=1)
    key_valid = key_pos >= 0
    # Unwritten or poisoned rows must not leak through 0 * NaN: zero invalid values.
    values = torch.where(key_valid[:, :, None, None], values, torch.zeros_like(values))

    # Causal on global positions; padding queries attend to nothing.
    causal = key_pos[:, None, :] <= q_pos[:, :, None]
    if per_query:  # prior keys: the proven local bound alone decides (no global check)
        prior_causal = local[None, None, :] < prior_len[:, :, None]
        causal = torch.cat([prior_causal, causal[:, :, local.shape[0]:]], dim=2)
    allowed = key_valid[:, None, :] & causal & (q_pos[:, :, None] >= 0)     # [b, i, j]
    if window > 0:
        # Sliding window on global positions: a per-position mask, so each rank applies it
        # to its own keys and the LSE combine is unchanged.
        allowed = allowed & (q_pos[:, :, None] - key_pos[:, None, :] < window)
    if attention_chunk > 0:
        allowed = allowed & same_chunk(q_pos[:, :, None], key_pos[:, None, :], attention_chunk)
    if keep is not None:  # DeepSeek Sparse Attention: the indexer's selection (sparse_attention)
        allowed = allowed & keep
    groups = q_heads // kv_heads
    qf = q.float().reshape(batch, q_len, kv_heads, groups, dim)
    scores = torch.einsum("bikgd,bjkd->bkgij", qf, keys.float()) * scale
    if softcap > 0:  # logit soft-capping (Gemma 2): on the scaled scores, before the mask
        scores = torch.tanh(scores / softcap) * softcap
    bias = position_bias(q_pos, key_pos, kv_heads, alibi_slopes, distance_table)
    if bias is not None:   # ALiBi's slopes or a distance table (live_attention.distance_bias)
        scores = scores + bias
    scores = scores.masked_fill(~allowed[:, None, None], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)                                  # [b, k, g, i]
    # A row with no allowed key has lse = -inf: its probabilities are exactly 0, never NaN.
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe_lse[..., None])
    out = torch.einsum("bkgij,bjkd->bikgd", probs, values.float())
    out = out.reshape(batch, q_len, q_heads, dim).to(q.dtype)
    lse = lse.permute(0, 3, 1, 2).reshape(batch, q_len, q_heads)
    if mem_k is not None:   # memory key/values: one more segment of keys, on rank 0 only
        out, lse = join_memory(out, lse, q, q_pos, rank if mem_split else None, mem_k, mem_v,
                               scale, softcap)
        out = out.to(q.dtype)
    return out, lse


@dcp_op("partial_attention", mutates_args=())
def partial_attention(q: Tensor, q_pos: Tensor, k_cur: Tensor, v_cur: Tensor, k_pos: Tensor,
                      key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                      prior_len: Tensor, rank: Tensor, dcp: int, interleave: int,
                      scale: float, window: int = 0,
                      softcap: float = 0.0, kv_shared: bool = False,
                      garbage_block: int = LAST,
                      alibi_slopes: Tensor | None = None,
                      attention_chunk: int = 0,
                      keep: Tensor | None = None,
                      index_width: int = 0,
                      distance_table: Tensor | None = None,
                      mem_k: Tensor | None = None,
                      mem_v: Tensor | None = None,
                      mem_split: bool = True) -> tuple[Tensor, Tensor]:
    """Attention of q over this rank's keys only; returns (out, lse float32, base e).

    Keys are the local prior slots [0, prior_len) (global positions by the slot map of
    ``rank``) plus the current keys whose ``k_pos >= 0``; causal on global positions.
    ``prior_len`` [batch, q_len] bounds each query's prior slots instead (query_bound).
    ``window > 0``: only keys with ``q_pos - k_pos < window``; ``softcap > 0``: scores
    ``tanh(s / softcap) * softcap``; ``kv_shared``: keys and values are both
    ``cat(k, v, dim=-1)`` (one vector stored once, in halves, in the two caches).
    ``garbage_block``: which block is never read (runtime/garbage_block.py).
    ``alibi_slopes`` [q_heads of q]: ALiBi, ``alibi_bias`` added to each score.
    ``attention_chunk > 0`` (Llama 4's chunked layers): only keys of the query's own chunk
    of that many positions (``same_chunk``).
    ``keep`` [batch, q_len, max_blocks * block + k_cur's length] bool (DeepSeek Sparse
    Attention): only the keys the indexer selected (runtime/kernels/sparse_attention.py),
    on the key axis [local prior slots ; current keys].
    ``index_width`` (with ``kv_shared``): the shared vector's last that many columns are the
    indexer's K stored beside the latent (sparse_attention.index_columns), not attended.
    ``distance_table`` [q_heads of q, L]: a bias of the key-query distance (T5's bucketed
    one, an MLP of the distance), ``table[h, q_pos - k_pos]`` added to each score
    (``live_attention.distance_bias``, the one definition it shares with ALiBi).
    ``mem_k``, ``mem_v`` [1, M, kv_heads of k, D]: memory key/values every query attends at
    no position, added by ``rank`` 0 only (``live_attention.join_memory``); ``mem_split``
    False: the keys are not split over ranks (the decode engine's prompt step), every rank
    adds them.
    """
    return _partial_attention_impl(q, q_pos, k_cur, v_cur, k_pos, key_cache, value_cache,
                                   block_table, prior_len, rank, dcp, interleave, scale,
                                   window, softcap, kv_shared, garbage_block, alibi_slopes,
                                   attention_chunk, keep, index_width, distance_table, mem_k,
                                   mem_v, mem_split)


@partial_attention.register_fake
def _(q, q_pos, k_cur, v_cur, k_pos, key_cache, value_cache, block_table, prior_len, rank,
      dcp, interleave, scale, window=0, softcap=0.0, kv_shared=False, garbage_block=LAST,
      alibi_slopes=None, attention_chunk=0, keep=None, index_width=0, distance_table=None,
      mem_k=None, mem_v=None, mem_split=True):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _lse_correct_impl(out: Tensor, lse: Tensor, lse_all: Tensor) -> Tensor:
    # global_lse over the DCP group; a rank whose shard had no key (lse = -inf) gets weight 0,
    # and a query no rank could see (global = -inf) gets 0, not exp(-inf + inf) = NaN.
    global_lse = torch.logsumexp(lse_all, dim=0)
    finite = torch.isfinite(global_lse) & torch.isfinite(lse)
    weight = torch.where(finite, torch.exp(lse - torch.where(finite, global_lse,
                                                             torch.zeros_like(global_lse))),
                         torch.zeros_like(lse))
    return out.float() * weight[..., None]


@dcp_op("lse_correct", mutates_args=())
def lse_correct(out: Tensor, lse: Tensor, lse_all: Tensor) -> Tensor:
    """Scale a partial output by exp(local_lse - global_lse); ``lse_all`` is [W, *lse.shape]."""
    return _lse_correct_impl(out, lse, lse_all)


@lse_correct.register_fake
def _(out, lse, lse_all):
    return out.new_empty(out.shape, dtype=torch.float32)


def _sink_correct_impl(out: Tensor, global_lse: Tensor, sinks: Tensor) -> Tensor:
    # softmax over [scores ; sink] = softmax(scores) * e^G / (e^G + e^sink), G the logsumexp
    # of the scores over ALL keys: the sink enters the denominator once, after the combine.
    # G = -inf (no key) gives weight 0 and out is 0 already.
    return out.float() * torch.sigmoid(global_lse - sinks.float())[..., None]


@dcp_op("sink_correct", mutates_args=())
def sink_correct(out: Tensor, global_lse: Tensor, sinks: Tensor) -> Tensor:
    """Attention sinks: scale ``out`` [..., H, D] (already normalised over every key of every
    rank) by sigmoid(global_lse - sink) per head, i.e. add exp(sink) to the softmax
    denominator exactly once. ``global_lse`` must be the combined LSE, never a rank's own
    (a per-rank sink would be counted dcp times). Returns float32."""
    return _sink_correct_impl(out, global_lse, sinks)


@sink_correct.register_fake
def _(out, global_lse, sinks):
    return out.new_empty(out.shape, dtype=torch.float32)


# ----------------------------------------------------------------------------------------
# The model-facing op and the compiler's canonical attention node
# ----------------------------------------------------------------------------------------


def _paged_attention_impl(q: Tensor, k: Tensor, v: Tensor, key_cache: Tensor,
                          value_cache: Tensor, positions: Tensor, block_table: Tensor,
                          scale: float, window: int = 0,
                          softcap: float = 0.0,
                          kv_shared: bool = False,
                          sinks: Tensor | None = None,
                          alibi_slopes: Tensor | None = None,
                          attention_chunk: int = 0,
                          index_q: Tensor | None = None,
                          index_weights: Tensor | None = None,
                          index_scale: float = 0.0, index_topk: int = 0,
                          index_width: int = 0,
                          distance_table: Tensor | None = None,
                          mem_k: Tensor | None = None,
                          mem_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    block = key_cache.shape[1]
    rank0 = torch.zeros((), dtype=torch.int64, device=q.device)
    slots = _slot_mapping_impl(positions, block_table, rank0, 1, block, block)
    new_kc, new_vc = _cache_write_impl(key_cache, value_cache, k, v, slots)
    # A chunk is contiguous: its first position is the number of prior tokens.
    prior_len = positions[:, 0].clamp(min=0)
    keep = None
    if index_topk:   # DeepSeek Sparse Attention: the indexer's selection, one rank
        keep = dsa_keep_one_rank(index_q, index_weights, k, v, positions, new_kc, new_vc,
                                 block_table, prior_len, index_scale, index_topk,
                                 index_width)
    out, lse = _partial_attention_impl(q, positions, k, v, positions, new_kc, new_vc,
                                       block_table, prior_len, rank0, 1, block, scale,
                                       window, softcap, kv_shared,
                                       alibi_slopes=alibi_slopes,
                                       attention_chunk=attention_chunk, keep=keep,
                                       index_width=index_width, distance_table=distance_table,
                                       mem_k=mem_k, mem_v=mem_v)
    if sinks is not None:   # one device: the local LSE is the global one
        out = _sink_correct_impl(out, lse, sinks).to(q.dtype)
    return out, new_kc, new_vc


@dcp_op("paged_attention", mutates_args=())
def paged_attention(q: Tensor, k: Tensor, v: Tensor, key_cache: Tensor, value_cache: Tensor,
                    positions: Tensor, block_table: Tensor,
                    scale: float, window: int = 0,
                    softcap: float = 0.0,
                    kv_shared: bool = False,
                    sinks: Tensor | None = None,
                    alibi_slopes: Tensor | None = None,
                    attention_chunk: int = 0,
                    index_q: Tensor | None = None,
                    index_weights: Tensor | None = None,
                    index_scale: float = 0.0, index_topk: int = 0,
                    index_width: int = 0,
                    distance_table: Tensor | None = None,
                    mem_k: Tensor | None = None,
                    mem_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Single-device paged attention: write k/v at the positions' slots, then causal
    attention of each query over its sequence's cached tokens. Returns (out, caches).

    ``sinks`` [q_heads] (gpt-oss): a learned logit per head that joins each softmax's
    denominator and attends to no value (see ``sink_correct``). ``alibi_slopes`` [q_heads]
    (ALiBi: Bloom, MPT, Falcon): each score gets ``alibi_bias``, slope_h * (k_pos - q_pos).
    ``index_topk > 0`` (DeepSeek Sparse Attention, with ``kv_shared``): the last
    ``index_width`` columns of the shared K = V vector are the lightning indexer's K; each
    query attends only the first ``index_topk`` keys in DSA_ORDER of the indexer's scores
    (``index_q`` [b, s, H, d] roped, ``index_weights`` [b, s, H] scaled, ``index_scale``:
    runtime/kernels/sparse_attention.py).
    ``distance_table`` [q_heads, L] (T5's relative bias, an MLP of the distance): each score
    gets ``table[h, q_pos - k_pos]`` (``live_attention.distance_bias``). ``mem_k``,
    ``mem_v`` [1, M, kv_heads, D] (x-transformers' memory key/values): keys every query
    attends at no position (``live_attention.join_memory``)."""
    return _paged_attention_impl(q, k, v, key_cache, value_cache, positions, block_table,
                                 scale, window, softcap, kv_shared, sinks, alibi_slopes,
                                 attention_chunk, index_q, index_weights, index_scale,
                                 index_topk, index_width, distance_table, mem_k, mem_v)


@paged_attention.register_fake
def _(q, k, v, key_cache, value_cache, positions, block_table, scale, window=0, softcap=0.0,
      kv_shared=False, sinks=None, alibi_slopes=None, attention_chunk=0, index_q=None,
      index_weights=None, index_scale=0.0, index_topk=0, index_width=0, distance_table=None,
      mem_k=None, mem_v=None):
    return torch.empty_like(q), torch.empty_like(key_cache), torch.empty_like(value_cache)


@dcp_op("attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, key_cache: Tensor, value_cache: Tensor,
              positions: Tensor, block_table: Tensor,
              scale: float, window: int = 0,
              softcap: float = 0.0, kv_shared: bool = False,
              sinks: Tensor | None = None,
              alibi_slopes: Tensor | None = None,
              attention_chunk: int = 0,
              index_q: Tensor | None = None,
              index_weights: Tensor | None = None,
              index_scale: float = 0.0, index_topk: int = 0,
              index_width: int = 0,
              distance_table: Tensor | None = None,
              mem_k: Tensor | None = None,
              mem_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The canonical attention node every accepted attention form becomes (one per layer).

    Same semantics as ``paged_attention``; later passes target only this op.
    """
    return _paged_attention_impl(q, k, v, key_cache, value_cache, positions, block_table,
                                 scale, window, softcap, kv_shared, sinks, alibi_slopes,
                                 attention_chunk, index_q, index_weights, index_scale, index_topk,
                                 index_width, distance_table, mem_k, mem_v)


@attention.register_fake
def _(q, k, v, key_cache, value_cache, positions, block_table, scale, window=0, softcap=0.0,
      kv_shared=False, sinks=None, alibi_slopes=None, attention_chunk=0, index_q=None,
      index_weights=None, index_scale=0.0, index_topk=0, index_width=0, distance_table=None,
      mem_k=None, mem_v=None):
    return torch.empty_like(q), torch.empty_like(key_cache), torch.empty_like(value_cache)


# Decompositions to ATen: the reference implementations are plain torch code.
DECOMPOSITIONS = {
    torch.ops.dcp.slot_mapping.default: _slot_mapping_impl,
    torch.ops.dcp.local_filled.default: _local_filled_impl,
    torch.ops.dcp.active_mask.default: _active_mask_impl,
    torch.ops.dcp.query_bound.default: _query_bound_impl,
    torch.ops.dcp.cache_write.default: _cache_write_impl,
    torch.ops.dcp.partial_attention.default: _partial_attention_impl,
    torch.ops.dcp.lse_correct.default: _lse_correct_impl,
    torch.ops.dcp.sink_correct.default: _sink_correct_impl,
    torch.ops.dcp.paged_attention.default: _paged_attention_impl,
    torch.ops.dcp.attention.default: _paged_attention_impl,
}


# ----------------------------------------------------------------------------------------
# Prefill DCP: the interleave slice and Q unshuffle (runtime/kernels/prefill_slices.py)
# ----------------------------------------------------------------------------------------

from dcp_compile.runtime.kernels.prefill_slices import (  # noqa: E402,F401
    DECOMPOSITIONS as _PREFILL_DECOMPOSITIONS, interleave_slice_index, owned_capacity,
    q_unshuffle_index)

DECOMPOSITIONS.update(_PREFILL_DECOMPOSITIONS)


# ----------------------------------------------------------------------------------------
# Combining partial outputs locally (decode combine="all_to_all")
# ----------------------------------------------------------------------------------------


def _lse_merge_impl(out_parts: Tensor, lse_parts: Tensor) -> Tensor:
    # The same correction as lse_correct, each part against the logsumexp of all W parts.
    return _lse_correct_impl(out_parts, lse_parts, lse_parts.unsqueeze(1)).sum(0)


@dcp_op("lse_merge", mutates_args=())
def lse_merge(out_parts: Tensor, lse_parts: Tensor) -> Tensor:
    """Sum over dim 0 of W partial outputs [W, ..., D], each weighted by
    exp(lse - logsumexp(lse_parts, 0)); ``lse_parts`` is [W, ...]. Returns float32."""
    return _lse_merge_impl(out_parts, lse_parts)


@lse_merge.register_fake
def _(out_parts, lse_parts):
    return out_parts.new_empty(out_parts.shape[1:], dtype=torch.float32)


DECOMPOSITIONS[torch.ops.dcp.lse_merge.default] = _lse_merge_impl


# ----------------------------------------------------------------------------------------
# Eager kernels: what a program loaded on an eager backend (threads, torchrun) runs instead
# of the functional ops above (dcp_compile.runtime.kernels.eager). Program graphs and StableHLO never hold them.
# ----------------------------------------------------------------------------------------


@dcp_op("cache_write_", mutates_args=("key_cache", "value_cache"))
def cache_write_(key_cache: Tensor, value_cache: Tensor, k: Tensor, v: Tensor,
                 slots: Tensor, garbage_block: int = LAST) -> None:
    """cache_write in place: only the written rows are touched, nothing is copied."""
    num_blocks, block, heads, dim = key_cache.shape
    rows = write_rows(key_cache, slots, garbage_block)
    # view, never reshape: a reshape of a non-contiguous cache would copy and lose the write.
    key_cache.view(num_blocks * block, heads, dim).index_copy_(
        0, rows, k.reshape(-1, heads, dim).to(key_cache.dtype))
    value_cache.view(num_blocks * block, heads, dim).index_copy_(
        0, rows, v.reshape(-1, heads, dim).to(value_cache.dtype))


@cache_write_.register_fake
def _(key_cache, value_cache, k, v, slots, garbage_block=LAST):
    return None


# ----------------------------------------------------------------------------------------
# Mixture of experts (runtime/kernels/moe.py: dcp.moe and its eager kernel dcp.moe_grouped)
# ----------------------------------------------------------------------------------------

from dcp_compile.runtime.kernels.moe import DECOMPOSITIONS as _MOE_DECOMPOSITIONS  # noqa: E402

DECOMPOSITIONS.update(_MOE_DECOMPOSITIONS)

# ----------------------------------------------------------------------------------------
# DeepSeek Sparse Attention's indexer (runtime/kernels/sparse_attention.py)
# ----------------------------------------------------------------------------------------

from dcp_compile.runtime.kernels.sparse_attention import (  # noqa: E402
    DECOMPOSITIONS as _DSA_DECOMPOSITIONS)

DECOMPOSITIONS.update(_DSA_DECOMPOSITIONS)
