"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) over a DCP-sharded context, exact.

The model: a *lightning indexer* scores every prior token ``t`` for each query ``i``,
``score[i, t] = sum_h w[i, h] * relu(scale * q_idx[i, h] . k_idx[t])``, keeps the
``index_topk`` best (``torch.topk``) and the attention reads only those keys. Under DCP a
rank holds only its shard of the keys (and of the indexer's K), so the selection is made in
three steps that every rank runs on the same data:

  index_scores      the indexer's scores of each query over this rank's keys (its local
                    prior slots, read with the same proven slot maps as the attention, and
                    the step's current keys it owns), with their global positions;
  index_candidates  this rank's first ``min(index_topk, keys)`` keys in DSA_ORDER;
  all_gather        the candidates' (score, position) over the DCP group;
  index_threshold   the ``index_topk``-th of the merged candidates in DSA_ORDER: a
                    (score, position) pair per query, identical on every rank;
  keep              ``selected(score, position, threshold)`` on each rank's own keys, then
                    ``partial_attention(..., keep=keep)`` and the usual LSE combine.

**The rule (DSA_ORDER).** A query's selected set is the first ``index_topk`` of its
selectable keys (written, at or before the query, a real query) in the order *score
descending, then global position ascending*; all of them when there are fewer. It is a
total order (positions are distinct), so the selected set is a function of the scores and
positions alone, whatever the shard layout: the global first-k is contained in the union of
every rank's local first-k (a key with fewer than k keys before it globally has fewer than
k before it locally), and ``selected`` with the k-th pair as threshold picks exactly the
global first-k. Where the model's ``torch.topk`` meets no tie at its cut, this is the set
torch.topk returns; at a tie torch.topk's choice is not a rule of positions (its choice
depends on the vector's length and layout: docs/moe-mla.md, DeepSeek Sparse Attention), so
the reference is this rule on one device (``dsa_select``: the same functions with one
rank), and the model's own forward where its cut has no tie.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dcp_compile.runtime.garbage_block import LAST
from dcp_compile.runtime.kernels.op_defs import dcp_op
from dcp_compile.runtime.kernels.paged import prior_slots, write_rows

NEG_INF = float("-inf")
LAST_POSITION = torch.iinfo(torch.int64).max   # a threshold position above every key's


# DSA_ORDER as one integer per key (``dsa_key``): positions and key indices below 2**31.
_POSITION_BOUND = 2**31
_LOW = 2**32            # the position's share of the key: [0, 2**32)


def dsa_key(scores: Tensor, positions: Tensor) -> Tensor:
    """One int64 per key whose descending order is DSA_ORDER, and no two alike: the float32
    score mapped to an int32 of the same order (its bits, the negative ones' magnitude
    reversed; -0.0 taken as 0.0, as the scores compare), times 2**32, plus the position
    reversed (earlier first); a non-selectable key (position < 0) scores -inf and ranks
    after every selectable one, by its index. Distinct keys leave a sort nothing to break
    ties on, so any sort or top-k gives the same order: it lowers to ``stablehlo.sort``
    (``torch.topk``), where a stable sort (``aten.sort.stable``) does not."""
    ok = positions >= 0
    s = torch.where(ok, scores.float(), NEG_INF)
    s = torch.where(s == 0, torch.zeros_like(s), s)
    bits = s.view(torch.int32).to(torch.int64)
    by_score = torch.where(bits < 0, -_POSITION_BOUND - 1 - bits, bits)
    index = torch.arange(scores.shape[-1], device=scores.device).expand_as(positions)
    tie = torch.where(ok, positions, _POSITION_BOUND + index)
    return by_score * _LOW + (_LOW - 1 - tie)


def dsa_first(scores: Tensor, positions: Tensor, k: int) -> Tensor:
    """The indices of the first ``k`` keys of the last axis in DSA_ORDER: selectable keys
    (``positions >= 0``) by score descending, then position ascending; the rest last."""
    return torch.topk(dsa_key(scores, positions), k, dim=-1).indices


def selected(scores: Tensor, positions: Tensor, thr_score: Tensor, thr_pos: Tensor) -> Tensor:
    """Keys at or before the threshold pair in DSA_ORDER (``thr_*`` [..., 1] broadcast over
    the keys); non-selectable keys (position -1) never."""
    before = (scores > thr_score) | ((scores == thr_score) & (positions <= thr_pos))
    return (positions >= 0) & before


def _selectable(key_pos: Tensor, q_pos: Tensor) -> Tensor:
    """[b, i, T]: a key the query may select: written (position >= 0), causal, real query."""
    kp = key_pos[:, None, :] if key_pos.dim() == 2 else key_pos
    return (kp >= 0) & (kp <= q_pos[:, :, None]) & (q_pos[:, :, None] >= 0)


# ----------------------------------------------------------------------------------------
# The indexer's K cache and its scores over a rank's keys
# ----------------------------------------------------------------------------------------


def _index_cache_write_impl(index_cache: Tensor, k: Tensor, slots: Tensor,
                            garbage_block: int = LAST) -> Tensor:
    num_blocks, block, heads, dim = index_cache.shape
    rows = write_rows(index_cache, slots, garbage_block)
    return index_cache.index_put((rows // block, rows % block),
                                 k.reshape(-1, heads, dim).to(index_cache.dtype))


@dcp_op("index_cache_write", mutates_args=())
def index_cache_write(index_cache: Tensor, k: Tensor, slots: Tensor,
                      garbage_block: int = LAST) -> Tensor:
    """The indexer's K cache [num_blocks, block, 1, index_head_dim] with ``k`` [b, s, 1, d]
    written at ``slots`` (the attention's slot mapping: the same owner, the same local
    slot; slot -1 goes to the garbage block)."""
    return _index_cache_write_impl(index_cache, k, slots, garbage_block)


@index_cache_write.register_fake
def _(index_cache, k, slots, garbage_block=LAST):
    return torch.empty_like(index_cache)


def _index_scores_impl(index_q: Tensor, index_weights: Tensor, k_cur: Tensor, k_pos: Tensor,
                       index_cache: Tensor, block_table: Tensor, prior_len: Tensor,
                       q_pos: Tensor, rank: Tensor, dcp: int, interleave: int, scale: float,
                       garbage_block: int = LAST) -> tuple[Tensor, Tensor]:
    batch = index_q.shape[0]
    num_blocks, block, _, dim = index_cache.shape
    max_blocks = block_table.shape[1]
    _, table, prior_pos = prior_slots(block_table, num_blocks, block, prior_len, rank, dcp,
                                      interleave, garbage_block)
    k_prior = index_cache[table].reshape(batch, max_blocks * block, dim)
    keys = torch.cat([k_prior.float(), k_cur.reshape(batch, -1, dim).float()], dim=1)
    key_pos = torch.cat([prior_pos, k_pos], dim=1)                              # [b, T]
    keys = torch.where((key_pos >= 0)[:, :, None], keys, torch.zeros_like(keys))
    # The model's own arithmetic (DeepseekV32Indexer.forward): per-head dot products, relu,
    # then the weighted sum over heads as one matmul.
    per_head = torch.matmul(index_q.float(), keys.transpose(-1, -2).unsqueeze(1)) * scale
    scores = torch.matmul(index_weights.float().unsqueeze(-2),
                          torch.relu(per_head)).squeeze(-2)                      # [b, i, T]
    ok = _selectable(key_pos, q_pos)
    return torch.where(ok, scores, NEG_INF), torch.where(ok, key_pos[:, None, :], -1)


@dcp_op("index_scores", mutates_args=())
def index_scores(index_q: Tensor, index_weights: Tensor, k_cur: Tensor, k_pos: Tensor,
                 index_cache: Tensor, block_table: Tensor, prior_len: Tensor, q_pos: Tensor,
                 rank: Tensor, dcp: int, interleave: int, scale: float,
                 garbage_block: int = LAST) -> tuple[Tensor, Tensor]:
    """The indexer's scores of each query over this rank's keys: (scores [b, i, T] float32,
    positions [b, i, T] int64), on partial_attention's key axis [local prior slots
    [0, max_blocks * block) ; current keys], T = max_blocks * block + k_cur's length.
    ``index_q`` [b, i, H, d] (the indexer's roped queries), ``index_weights`` [b, i, H] (the
    model's head weights, already scaled), ``k_cur`` [b, s, 1, d] with ``k_pos`` [b, s] as
    partial_attention's current keys. A key a query may not select (unwritten, after the
    query, or a padding query) has score -inf and position -1."""
    return _index_scores_impl(index_q, index_weights, k_cur, k_pos, index_cache, block_table,
                              prior_len, q_pos, rank, dcp, interleave, scale, garbage_block)


@index_scores.register_fake
def _(index_q, index_weights, k_cur, k_pos, index_cache, block_table, prior_len, q_pos, rank,
      dcp, interleave, scale, garbage_block=LAST):
    b, i = index_q.shape[:2]
    t = block_table.shape[1] * index_cache.shape[1] + k_cur.shape[1]
    return (index_q.new_empty((b, i, t), dtype=torch.float32),
            index_q.new_empty((b, i, t), dtype=torch.int64))


# ----------------------------------------------------------------------------------------
# The selection: local candidates, the global threshold, identical on every rank
# ----------------------------------------------------------------------------------------


def candidates_per_rank(keys: int, topk: int) -> int:
    """How many candidates a rank sends: its first ``min(topk, keys)`` (static)."""
    return min(topk, keys)


def _index_candidates_impl(scores: Tensor, positions: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    first = dsa_first(scores, positions, candidates_per_rank(scores.shape[-1], topk))
    return scores.gather(-1, first), positions.gather(-1, first)


@dcp_op("index_candidates", mutates_args=())
def index_candidates(scores: Tensor, positions: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """This rank's first ``min(topk, T)`` keys per query in DSA_ORDER: (scores, positions)
    [b, i, c]; a slot with no selectable key left is (-inf, -1)."""
    return _index_candidates_impl(scores, positions, topk)


@index_candidates.register_fake
def _(scores, positions, topk):
    shape = (*scores.shape[:-1], candidates_per_rank(scores.shape[-1], topk))
    return scores.new_empty(shape), positions.new_empty(shape)


def _index_threshold_impl(cand_scores: Tensor, cand_pos: Tensor,
                          topk: int) -> tuple[Tensor, Tensor]:
    w, b, i, c = cand_scores.shape
    s = cand_scores.permute(1, 2, 0, 3).reshape(b, i, w * c)
    p = cand_pos.permute(1, 2, 0, 3).reshape(b, i, w * c)
    if w * c < topk:     # fewer candidates than index_topk: every selectable key is kept
        return (torch.full((b, i, 1), NEG_INF, dtype=s.dtype, device=s.device),
                torch.full((b, i, 1), LAST_POSITION, dtype=p.dtype, device=p.device))
    kth = dsa_first(s, p, topk)[..., topk - 1:topk]
    thr_s, thr_p = s.gather(-1, kth), p.gather(-1, kth)
    # The k-th is not selectable: there are fewer selectable keys than topk, keep them all.
    short = thr_p < 0
    return (torch.where(short, NEG_INF, thr_s),
            torch.where(short, torch.full_like(thr_p, LAST_POSITION), thr_p))


@dcp_op("index_threshold", mutates_args=())
def index_threshold(cand_scores: Tensor, cand_pos: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """The ``topk``-th key of the DCP group's merged candidates ([W, b, i, c], every rank's
    index_candidates gathered) in DSA_ORDER, as (score, position) [b, i, 1]; (-inf, the
    last position) when fewer than ``topk`` keys are selectable (all are kept). The same
    gathered input gives the same pair on every rank."""
    return _index_threshold_impl(cand_scores, cand_pos, topk)


@index_threshold.register_fake
def _(cand_scores, cand_pos, topk):
    w, b, i, c = cand_scores.shape
    return cand_scores.new_empty((b, i, 1)), cand_pos.new_empty((b, i, 1))



# ----------------------------------------------------------------------------------------
# The indexer of a captured model on one device (what the module swap emits)
# ----------------------------------------------------------------------------------------


def _index_topk_impl(index_q: Tensor, index_weights: Tensor, index_k: Tensor, bias: Tensor,
                     scale: float, topk: int) -> Tensor:
    per_head = torch.matmul(index_q.float(), index_k.float().transpose(-1, -2).unsqueeze(1))
    scores = torch.matmul(index_weights.float().unsqueeze(-2),
                          torch.relu(per_head * scale)).squeeze(-2) + bias      # [b, s, t]
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
    first = dsa_first(scores, positions, min(topk, scores.shape[-1]))
    return first.to(torch.int32)


@dcp_op("index_topk", mutates_args=())
def index_topk(index_q: Tensor, index_weights: Tensor, index_k: Tensor, bias: Tensor,
               scale: float, topk: int) -> Tensor:
    """The lightning indexer on one device, as the model computes it
    (``DeepseekV32Indexer.forward``: per-head dot products times ``scale``, relu, the
    weighted sum over heads, plus the additive mask ``bias`` [b, s, t]), then the first
    ``min(topk, t)`` keys in DSA_ORDER as int32 indices [b, s, k] (the model's
    ``torch.topk(...).indices``: the same set wherever its cut has no tie). ``index_q``
    [b, s, H, d] roped, ``index_weights`` [b, s, H] already scaled, ``index_k`` [b, t, d]."""
    return _index_topk_impl(index_q, index_weights, index_k, bias, scale, topk)


@index_topk.register_fake
def _(index_q, index_weights, index_k, bias, scale, topk):
    b, s = index_q.shape[:2]
    return index_q.new_empty((b, s, min(topk, index_k.shape[1])), dtype=torch.int32)


def index_columns(key_half: Tensor, value_half: Tensor, width: int) -> Tensor:
    """The indexer's K [..., width] stored beside the MLA latent: the last ``width`` columns
    of the shared K = V vector whose two halves are ``key_half`` and ``value_half`` (a cache
    pair [num_blocks, block, 1, D/2], or a step's current k / v [b, s, 1, D/2]). One cache
    per layer holds [latent ; k_pe ; index K], written once by the position's owner
    (passes/insert_paged_cache.py)."""
    return torch.cat([key_half, value_half], dim=-1)[..., -width:]


def dsa_keep_one_rank(index_q: Tensor, index_weights: Tensor, k: Tensor, v: Tensor,
                      positions: Tensor, key_cache: Tensor, value_cache: Tensor,
                      block_table: Tensor, prior_len: Tensor, scale: float, topk: int,
                      width: int) -> Tensor:
    """The selection of ``dcp.paged_attention`` on one device (every key on rank 0 of 1):
    the DCP ops with one rank, on partial_attention's key axis."""
    if not width:
        raise ValueError(
            "dcp.paged_attention with index_topk and index_width=0 reuses another layer's "
            "selection (GLM-5 indexer_types 'shared'): it runs in its DCP form only, where "
            "that layer's keep is reused (passes/dcp_decode.py dsa_keep)")
    block = key_cache.shape[1]
    rank0 = torch.zeros((), dtype=torch.int64, device=index_q.device)
    scores, pos = _index_scores_impl(index_q, index_weights, index_columns(k, v, width),
                                     positions, index_columns(key_cache, value_cache, width),
                                     block_table, prior_len, positions, rank0, 1, block,
                                     scale)
    cs, cp = _index_candidates_impl(scores, pos, topk)
    thr_s, thr_p = _index_threshold_impl(cs[None], cp[None], topk)
    return selected(scores, pos, thr_s, thr_p)


def dsa_select(scores: Tensor, positions: Tensor, topk: int) -> Tensor:
    """The single-device reference: the keys [b, i, T] a query selects by DSA_ORDER over all
    of them (one rank: its candidates are the whole group's)."""
    cs, cp = _index_candidates_impl(scores, positions, topk)
    thr_s, thr_p = _index_threshold_impl(cs[None], cp[None], topk)
    return selected(scores, positions, thr_s, thr_p)


DECOMPOSITIONS = {
    torch.ops.dcp.index_cache_write.default: _index_cache_write_impl,
    torch.ops.dcp.index_scores.default: _index_scores_impl,
    torch.ops.dcp.index_candidates.default: _index_candidates_impl,
    torch.ops.dcp.index_threshold.default: _index_threshold_impl,
    torch.ops.dcp.index_topk.default: _index_topk_impl,
}
