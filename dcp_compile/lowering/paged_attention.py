"""The lowering's decomposition of ``dcp.partial_attention`` for decode-width queries.

The reference implementation (runtime/kernels/ops.py) is what eager backends run; lowered as is,
XLA's cost analysis counts, per layer and step (``memory_floor.bytes_by_op``):

  * a per-slot gather of the block table ([batch, slots] int64) to mask the keys, and the
    mask materialised at [batch, heads, slots] next to the scores;
  * the current keys concatenated onto the read blocks: a second copy of K and V;
  * ``logsumexp`` then ``exp(s - lse)``: the scores written and read three more times.

This kernel is the same function without those: the blocks are read whole by the block
table (one index per entry); which keys a query sees is comparisons of positions at
[batch, queries, entries, block] (whether an entry is allocated is decided per entry, not
per slot); prior and current keys are scored apart (no concatenated copy); the softmax is
the row max, then one product of ``exp(s - max)`` with ``[values ; 1]``, which gives the
weighted sum and the denominator together. Keys and values of slots no query sees are
zeroed as they are read: unwritten or poisoned rows must not reach a score (the mask is
added, and NaN + -inf is NaN) nor leak through 0 * NaN.

What it cannot remove on XLA:CPU (docs/lowering.md: the memory floor): XLA materialises the read
blocks (a dot never fuses its producer, and a gather fused into a reduction would be
recomputed for each query head of a GQA group), and costs that fusion as reading its whole
cache operand (a gather fused with an elementwise op), whatever the bucket.

Numerics: ``exp(s - m) / l`` instead of ``exp(s - lse)``, the same value up to rounding
(tests/lowering/test_lowered_attention.py against the reference; tests/lowering/test_xla.py and
tests/runtime/test_buckets.py against the model's forward). Queries wider than ``MAX_QUERIES``
(prompt steps) keep the reference kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dcp_compile.runtime import layout
from dcp_compile.runtime.kernels.ops import NEG_INF, _partial_attention_impl, readable_table

# Queries per row up to which the fused form is used (decode, speculative decode widths).
MAX_QUERIES = 8


def _fused_decode_attention(q: Tensor, q_pos: Tensor, k_cur: Tensor, v_cur: Tensor,
                            k_pos: Tensor, key_cache: Tensor, value_cache: Tensor,
                            block_table: Tensor, prior_len: Tensor, rank: Tensor, dcp: int,
                            interleave: int, scale: float, window: int = 0,
                            softcap: float = 0.0,
                            kv_shared: bool = False,
                            garbage_block: int = -1,
                            alibi_slopes: Tensor | None = None,
                            attention_chunk: int = 0,
                            keep: Tensor | None = None,
                            index_width: int = 0,
                            distance_table: Tensor | None = None,
                            mem_k: Tensor | None = None,
                            mem_v: Tensor | None = None,
                            mem_split: bool = True) -> tuple[Tensor, Tensor]:
    # Prompt-width queries, and the options this form does not compute (ALiBi, a distance
    # table, memory key/values, chunked attention, DeepSeek Sparse Attention's keep and its
    # indexer columns): the reference kernel.
    if q.shape[1] > MAX_QUERIES or attention_chunk or index_width or any(
            x is not None for x in (alibi_slopes, keep, distance_table, mem_k)):
        return _partial_attention_impl(q, q_pos, k_cur, v_cur, k_pos, key_cache, value_cache,
                                       block_table, prior_len, rank, dcp, interleave, scale,
                                       window, softcap, kv_shared, garbage_block, alibi_slopes,
                                       attention_chunk, keep, index_width, distance_table,
                                       mem_k, mem_v, mem_split)
    batch, q_len, q_heads, dim = q.shape
    num_blocks, block, kv_heads, _ = key_cache.shape
    max_blocks = block_table.shape[1]
    slots = max_blocks * block
    # Whole blocks by the block table; unallocated (-1), garbage and out-of-range entries read
    # the garbage block and are masked out (as the reference does).
    allocated, table = readable_table(block_table, num_blocks, garbage_block)  # [b, W]
    k_prior, v_prior = key_cache[table], value_cache[table]     # [b, W, block, k, d]
    if kv_shared:   # MLA: one vector stored in halves is both the key and the value
        k_prior = v_prior = torch.cat([k_prior, v_prior], dim=-1)
        k_cur = v_cur = torch.cat([k_cur, v_cur], dim=-1)
    # Which keys each query sees: [b, i, W, block] for the prior slots, [b, i, K] for the
    # current keys, from positions only (comparisons; no per-slot gather of the table).
    local = torch.arange(slots, device=q.device).reshape(max_blocks, block)
    prior_global = layout.global_position(local, rank, dcp=dcp, interleave=interleave)
    per_query = prior_len.dim() == 2
    row_len = prior_len.amax(dim=1) if per_query else prior_len
    prior_valid = (local[None] < row_len[:, None, None]) & allocated[:, :, None]   # [b, W, n]
    if per_query:  # prior keys: the proven local bound alone decides (no global check)
        prior_allowed = prior_valid[:, None] & (local[None, None] < prior_len[:, :, None, None])
    else:
        prior_allowed = prior_valid[:, None] & \
            (prior_global[None, None] <= q_pos[:, :, None, None])
    cur_allowed = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])
    q_valid = q_pos >= 0
    prior_allowed = prior_allowed & q_valid[:, :, None, None]
    cur_allowed = cur_allowed & q_valid[:, :, None]
    if window > 0:
        prior_allowed = prior_allowed & \
            (q_pos[:, :, None, None] - prior_global[None, None] < window)
        cur_allowed = cur_allowed & (q_pos[:, :, None] - k_pos[:, None, :] < window)

    groups = q_heads // kv_heads
    d = k_prior.shape[-1]
    # [b, k, g, i, d], the scale folded into the (small) queries.
    qs = (q.float() * scale).reshape(batch, q_len, kv_heads, groups, d).permute(0, 2, 3, 1, 4)
    # Scores, prior [b, k, g, i, W, n] and current [b, k, g, i, K] apart (no concatenated
    # copy of the keys), as dots: a multiply + sum counts fewer bytes (2.60x instead of
    # 2.98x the floor at bucket 512) but ran 2.3x slower at bucket 4096 on XLA:CPU (docs/lowering.md).
    # Keys of slots no query sees are zeroed with the read (unwritten or poisoned rows must
    # not reach a score: the mask below is added, and NaN + -inf is NaN).
    zero = torch.zeros((), dtype=torch.float32, device=q.device)
    kp = torch.where(prior_valid[:, :, :, None, None], k_prior.float(), zero)
    kp = kp.permute(0, 3, 1, 2, 4)                                             # [b, k, W, n, d]
    s_prior = torch.einsum("bkgid,bkwnd->bkgiwn", qs, kp)
    s_cur = torch.einsum("bkgid,bkjd->bkgij", qs, k_cur.float().permute(0, 2, 1, 3))
    if softcap > 0:  # logit soft-capping (Gemma 2): on the scaled scores, before the mask
        s_prior = torch.tanh(s_prior / softcap) * softcap
        s_cur = torch.tanh(s_cur / softcap) * softcap
    # The mask as an added 0 / -inf, made at [b, i, W, n] and broadcast over the heads.
    s_prior = s_prior + torch.where(prior_allowed, zero, NEG_INF)[:, None, None]
    s_cur = s_cur.masked_fill(~cur_allowed[:, None, None], NEG_INF)
    row_max = torch.maximum(s_prior.amax(dim=(-2, -1)), s_cur.amax(dim=-1))   # [b, k, g, i]
    safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    # [values ; 1]: one reduction gives the weighted sum and the denominator. Values of keys
    # no query sees are zeroed: unwritten or poisoned rows must not leak through 0 * NaN.
    vp = torch.where(prior_valid[:, :, :, None, None], v_prior.float(), zero)
    vp = torch.cat([vp, torch.ones_like(vp[..., :1])], dim=-1).permute(0, 3, 1, 2, 4)
    vc = torch.where((k_pos >= 0)[:, :, None, None], v_cur.float(), zero)
    vc = torch.cat([vc, torch.ones_like(vc[..., :1])], dim=-1).permute(0, 2, 1, 3)
    p_prior = torch.exp(s_prior - safe_max[..., None, None])   # 0 where masked, never NaN
    p_cur = torch.exp(s_cur - safe_max[..., None])
    summed = torch.einsum("bkgiwn,bkwne->bkgie", p_prior, vp) + \
        torch.einsum("bkgij,bkje->bkgie", p_cur, vc)                          # [b,k,g,i,d+1]
    dv = summed.shape[-1] - 1
    denom = summed[..., dv]
    out = torch.where(denom[..., None] > 0,
                      summed[..., :dv] / torch.where(denom > 0, denom, 1.0)[..., None],
                      zero)
    lse = safe_max + torch.log(denom)      # -inf where no key is allowed (denom = 0)
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, q_len, q_heads, dv).to(q.dtype)
    lse = lse.permute(0, 3, 1, 2).reshape(batch, q_len, q_heads)
    return out, lse


# op -> the lowering's decomposition (decompose.decomposition_table puts these last).
LOWERING_KERNELS = {
    torch.ops.dcp.partial_attention.default: _fused_decode_attention,
}
