"""Recurrent mixers of hybrid models as ``dcp`` ops: the token-mixing core of a layer whose
state is O(1) in the context (issue 38), with that state as an explicit cache.

A hybrid model's recurrent layer mixes tokens in order (a causal depthwise convolution, then
a recurrence), so it is neither token-wise nor attention. Its core becomes one op that the
rest of the pipeline sees as opaque and token-ordered: it takes a chunk of tokens per row and
the state the row's sequence left, and returns the outputs and the caches with the state the
chunk leaves. Everything around the core (input projections, gates, norms, the output
projection) stays the model's own token-wise ops.

The state cache, per layer (beside the paged KV cache, one entry per sequence slot):
  conv_state  [num_slots + 1, C, K - 1]   the last K - 1 inputs of the convolution
  rec_state   [num_slots + 1, Hv, dk, dv] the recurrence's matrix state
The last entry is the garbage slot (``garbage_state_slot``): a row whose ``state_slot`` is -1
(a padding row) or outside the cache writes there and reads zeros, so no row reads or writes
a slot it was not given. Rows are left-packed: row b's first ``lengths[b]`` tokens are real;
later tokens neither advance the state nor produce output (zeros). ``fresh[b]`` starts the
row's sequence: its state is read as zeros (a new sequence reuses a slot without a separate
clearing step). ``snapshot_slot[b, t]`` (optional; speculative width-K steps) also keeps the
state after token t in that slot (-1: none), so a rejected draft rolls back to a snapshot.

Ops:
  dcp.gated_delta_net  Gated DeltaNet (Qwen3-Next / Qwen3.5): conv1d + SiLU over
                       [q | k | v] channels, l2-normalised q and k, the gated delta rule
                       S_t = a_t S_{t-1} + k_t (beta_t (v_t - S_{t-1}^T k_t))^T,
                       o_t = S_t^T q_t / sqrt(dk) (a_t = exp(g_t)), grouped value heads
                       (each k head serves Hv/Hk v heads).
  dcp.kimi_delta_attention
                       Kimi Delta Attention (Kimi Linear): the same with a decay per key
                       channel (g [B, S, H, dk]) and one key head per value head.
  dcp.lightning_attention
                       MiniMax's lightning attention: a decayed linear attention, no
                       convolution (its layer has a recurrence cache only).
  dcp.mamba2_ssm       Mamba2 (Bamba, Granite-4-H): conv1d + SiLU over [x | B | C] channels,
                       then the selective scan S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,
                       y_t = S_t C_t + D x_t, dt_t = clamp(softplus(dt + dt_bias), limits),
                       B and C shared by the heads of a group.
  dcp.short_conv       LFM2's short convolution: the depthwise causal conv alone (no
                       activation), its state the last K-1 inputs; also Mamba-1's conv.
  dcp.mamba_ssm        Mamba-1 (Jamba, Zamba): the selective scan alone (its conv is
                       dcp.short_conv, the mixer's x_proj runs between the two),
                       S_t = exp(dt_t A) S_{t-1} + (dt_t x_t) B_t^T, y_t = S_t C_t + D x_t,
                       A [D, N] per channel, B and C shared by every channel.
  dcp.rg_lru           RecurrentGemma's RG-LRU (runtime/kernels/rg_lru.py; its conv is
                       dcp.short_conv): gated diagonal recurrence, state h [lru_width].

The reference is the recurrent form, a static loop over the chunk's tokens: exact, the
function transformers' one-token updates (``torch_recurrent_gated_delta_rule``,
``mamba2_selective_state_update``) compute; it is also the decomposition (static shapes, no
data-dependent control flow).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dcp_compile.runtime.kernels.op_defs import dcp_op
# Each row's slot, read and written (shared with runtime/kernels/rg_lru.py; re-exported here).
from dcp_compile.runtime.kernels.recurrent_slots import (  # noqa: F401
    _read_state, _write_states, garbage_state_slot, state_rows)

# The activations a recurrent mixer's convolution may apply (transformers' config names).
CONV_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "identity": lambda x: x}

# dcp.gated_delta_net's operands in schema order.
GDN_OPERANDS = ("mixed_qkv", "g", "beta", "conv_weight", "conv_state", "rec_state",
                "state_slot", "fresh", "lengths", "num_k_heads", "head_k_dim", "head_v_dim",
                "activation", "snapshot_slot")
GDN_ARG = {name: i for i, name in enumerate(GDN_OPERANDS)}


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """transformers' l2norm (FLA's convention): x * rsqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def sliding_windows(full: Tensor, size: int, count: int) -> Tensor:
    """``full.unfold(-1, size, 1)[..., :count, :]`` as ``size`` static slices stacked: the
    same values, and the form the StableHLO lowering takes (torch-mlir does not lower
    ``aten.unfold``; docs/lowering.md, "Hybrid models on XLA")."""
    return torch.stack([full[..., k:k + count] for k in range(size)], dim=-1)


def causal_conv_chunk(x: Tensor, conv_state: Tensor, weight: Tensor, lengths: Tensor,
                      activation: str, bias: Tensor | None = None, *,
                      per_token: bool = False):
    """Depthwise causal convolution of a chunk after its incoming state.

    x [B, S, C], conv_state [B, C, K-1], weight [C, K], bias [C] or None. Returns
    (out [B, S, C], the last K-1 inputs up to each row's last real token [B, C, K-1]) and,
    ``per_token``, the state after every token [B, S, C, K-1]."""
    B, S, C = x.shape
    K = weight.shape[-1]
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"recurrent op: conv activation {activation!r} is not one of "
                         f"{sorted(CONV_ACTIVATIONS)}")
    full = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)      # [B, C, K-1+S]
    windows = sliding_windows(full, K, S)                                      # [B, C, S, K]
    out = (windows * weight[None, :, None, :].to(x.dtype)).sum(-1).transpose(1, 2)
    if bias is not None:
        out = out + bias.to(x.dtype)
    out = CONV_ACTIVATIONS[activation](out)
    # Token j sits at full[..., K-1+j]: the K-1 inputs ending at token lengths-1 start at
    # full[..., lengths]; lengths = 0 keeps the incoming state.
    idx = lengths.long().view(B, 1, 1) + torch.arange(K - 1, device=x.device).view(1, 1, -1)
    new_state = full.gather(-1, idx.expand(B, C, K - 1))
    if per_token:   # the state after each token t: full[..., t+1 : t+K]   -> [B, S, C, K-1]
        each = sliding_windows(full[..., 1:], K - 1, S)                        # [B, C, S, K-1]
        return out, new_state, each.permute(0, 2, 1, 3)
    return out, new_state


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                     valid: Tensor, *, per_token: bool = False):
    """The gated delta rule, token by token (fp32).

    q, k [B, S, Hv, dk] (normalised, q scaled), v [B, S, Hv, dv], g [B, S, Hv] (or
    [B, S, Hv, dk]: a decay per key channel, Kimi Delta Attention), beta [B, S, Hv],
    state [B, Hv, dk, dv], valid [B, S] bool. Returns (o [B, S, Hv, dv], state') and,
    ``per_token``, the state after every token [B, S, Hv, dk, dv]."""
    outs, states = [], []
    for t in range(q.shape[1]):
        # g [B, S, Hv]: one decay per head; [B, S, Hv, dk] (KDA): one per key channel
        decay = g[:, t].exp()
        decayed = state * (decay[..., None, None] if g.dim() == 3 else decay[..., None])
        kv_mem = (decayed * k[:, t, :, :, None]).sum(dim=-2)                   # [B, Hv, dv]
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        new = decayed + k[:, t, :, :, None] * delta[:, :, None, :]
        keep = valid[:, t].view(-1, 1, 1, 1)
        state = torch.where(keep, new, state)
        o = (new * q[:, t, :, :, None]).sum(dim=-2)
        outs.append(torch.where(keep[..., 0], o, torch.zeros_like(o)))
        states.append(state)
    if per_token:
        return torch.stack(outs, dim=1), state, torch.stack(states, dim=1)
    return torch.stack(outs, dim=1), state


def _gated_delta_net_impl(mixed_qkv: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor,
                          conv_state: Tensor, rec_state: Tensor, state_slot: Tensor,
                          fresh: Tensor, lengths: Tensor, num_k_heads: int, head_k_dim: int,
                          head_v_dim: int, activation: str,
                          snapshot_slot: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    B, S, C = mixed_qkv.shape
    snap = snapshot_slot is not None
    num_v_heads = beta.shape[-1]
    key_dim = num_k_heads * head_k_dim
    rows = state_rows(rec_state, state_slot)
    usable = rows != garbage_state_slot(rec_state)
    valid = torch.arange(S, device=mixed_qkv.device)[None, :] < lengths.view(-1, 1)
    conv_in = _read_state(conv_state, rows, fresh, usable)
    conv_out, conv_new, *conv_each = causal_conv_chunk(mixed_qkv, conv_in, conv_weight, lengths,
                                                       activation, per_token=snap)
    q, k, v = torch.split(conv_out, [key_dim, key_dim, C - 2 * key_dim], dim=-1)
    q = q.reshape(B, S, num_k_heads, head_k_dim).float()
    k = k.reshape(B, S, num_k_heads, head_k_dim).float()
    v = v.reshape(B, S, num_v_heads, head_v_dim).float()
    group = num_v_heads // num_k_heads
    if group != 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    q = _l2norm(q) * head_k_dim ** -0.5
    k = _l2norm(k)
    state = _read_state(rec_state, rows, fresh, usable).float()
    out, state, *rec_each = gated_delta_rule(q, k, v, g.float(), beta.float(), state, valid,
                                             per_token=snap)
    new_conv = _write_states(conv_state, rows, conv_new, snapshot_slot, *conv_each or [None])
    new_rec = _write_states(rec_state, rows, state, snapshot_slot, *rec_each or [None])
    return out.to(mixed_qkv.dtype), new_conv, new_rec


@dcp_op("gated_delta_net", mutates_args=())
def gated_delta_net(mixed_qkv: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor,
                    conv_state: Tensor, rec_state: Tensor, state_slot: Tensor, fresh: Tensor,
                    lengths: Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                    activation: str = "silu", snapshot_slot: Tensor | None = None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Gated DeltaNet's core over a chunk (module doc): mixed_qkv [B, S, C] (the projected
    [q | k | v] before the convolution), g, beta [B, S, Hv], conv_weight [C, K]; the state
    caches, each row's state slot [B] int64 (-1: padding row), fresh [B] bool, lengths [B].
    ``snapshot_slot [B, S]`` (speculative steps): where the state after each token is kept.
    Returns (core output [B, S, Hv, dv], conv_state', rec_state')."""
    return _gated_delta_net_impl(mixed_qkv, g, beta, conv_weight, conv_state, rec_state,
                                 state_slot, fresh, lengths, num_k_heads, head_k_dim,
                                 head_v_dim, activation, snapshot_slot)


@gated_delta_net.register_fake
def _(mixed_qkv, g, beta, conv_weight, conv_state, rec_state, state_slot, fresh, lengths,
      num_k_heads, head_k_dim, head_v_dim, activation="silu", snapshot_slot=None):
    B, S, _ = mixed_qkv.shape
    return (mixed_qkv.new_empty(B, S, g.shape[-1], head_v_dim), torch.empty_like(conv_state),
            torch.empty_like(rec_state))


@dcp_op("kimi_delta_attention", mutates_args=())
def kimi_delta_attention(mixed_qkv: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor,
                         conv_state: Tensor, rec_state: Tensor, state_slot: Tensor,
                         fresh: Tensor, lengths: Tensor, num_heads: int, head_dim: int,
                         activation: str = "silu", snapshot_slot: Tensor | None = None
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """Kimi Delta Attention's core over a chunk (Kimi Linear): ``dcp.gated_delta_net`` with
    a decay per key channel, g [B, S, H, dk] (log of the decay), and as many key as value
    heads (H of ``head_dim``): conv + activation over [q | k | v], l2-normalised q and k,
    S_t = diag(exp(g_t)) S_{t-1} + k_t (beta_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t))^T,
    o_t = S_t^T q_t / sqrt(dk). Returns (core output [B, S, H, dv], conv_state',
    rec_state')."""
    return _gated_delta_net_impl(mixed_qkv, g, beta, conv_weight, conv_state, rec_state,
                                 state_slot, fresh, lengths, num_heads, head_dim, head_dim,
                                 activation, snapshot_slot)


@kimi_delta_attention.register_fake
def _(mixed_qkv, g, beta, conv_weight, conv_state, rec_state, state_slot, fresh, lengths,
      num_heads, head_dim, activation="silu", snapshot_slot=None):
    B, S, _ = mixed_qkv.shape
    return (mixed_qkv.new_empty(B, S, num_heads, head_dim), torch.empty_like(conv_state),
            torch.empty_like(rec_state))


def _lightning_attention_impl(q: Tensor, k: Tensor, v: Tensor, slope: Tensor,
                               rec_state: Tensor, state_slot: Tensor, fresh: Tensor,
                               lengths: Tensor, snapshot_slot: Tensor | None = None):
    B, S = q.shape[:2]
    rows = state_rows(rec_state, state_slot)
    usable = rows != garbage_state_slot(rec_state)
    valid = torch.arange(S, device=q.device)[None, :] < lengths.view(-1, 1)
    state = _read_state(rec_state, rows, fresh, usable).float()
    decay = torch.exp(-slope.float()).view(1, -1, 1, 1)                       # [1, H, 1, 1]
    q, k, v = q.float(), k.float(), v.float()
    outs, states = [], []
    for t in range(S):
        new = decay * state + k[:, t, :, :, None] * v[:, t, :, None, :]         # [B, H, d, d]
        keep = valid[:, t].view(-1, 1, 1, 1)
        state = torch.where(keep, new, state)
        o = (q[:, t, :, :, None] * new).sum(dim=-2)                            # [B, H, d]
        outs.append(torch.where(keep[..., 0], o, torch.zeros_like(o)))
        states.append(state)
    new_rec = _write_states(rec_state, rows, state, snapshot_slot,
                            torch.stack(states, dim=1) if snapshot_slot is not None else None)
    return torch.stack(outs, dim=1).to(v.dtype), new_rec


@dcp_op("lightning_attention", mutates_args=())
def lightning_attention(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, rec_state: Tensor,
                        state_slot: Tensor, fresh: Tensor, lengths: Tensor,
                        snapshot_slot: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """MiniMax's lightning attention over a chunk: a linear attention with a decay per head,
    S_t = exp(-slope_h) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t (no convolution, no
    normalisation, no scale). q, k, v [B, S, H, d], slope [H]; the recurrence cache
    [slots + 1, H, d, d] and the rows as the other ops'. Returns (o [B, S, H, d],
    rec_state'). The model's own block form (intra-block decayed scores, inter-block state)
    computes the same function."""
    return _lightning_attention_impl(q, k, v, slope, rec_state, state_slot, fresh, lengths,
                                     snapshot_slot)


@lightning_attention.register_fake
def _(q, k, v, slope, rec_state, state_slot, fresh, lengths, snapshot_slot=None):
    return torch.empty_like(v), torch.empty_like(rec_state)


def gated_delta_net_head_shard(num_k_heads: int, num_v_heads: int, head_k_dim: int,
                               head_v_dim: int, tp: int, rank: int) -> tuple[Tensor, slice]:
    """Tensor parallelism by heads: rank ``rank`` of ``tp`` holds k heads
    ``[rank * Hk/tp, (rank+1) * Hk/tp)`` and the v heads they serve. Returns (the channels of
    ``mixed_qkv`` / ``conv_weight`` / ``conv_state`` it holds, the v-head slice of g, beta,
    ``rec_state`` and the output). The op on those slices is exactly those slices of the
    op (every channel and head is computed on its own); tp must divide Hk."""
    if num_k_heads % tp:
        raise ValueError(f"gated_delta_net head shard: tp={tp} does not divide "
                         f"num_k_heads={num_k_heads}")
    key_dim = num_k_heads * head_k_dim
    k_local, v_local = num_k_heads // tp, num_v_heads // tp
    qk = torch.arange(rank * k_local * head_k_dim, (rank + 1) * k_local * head_k_dim)
    v = torch.arange(rank * v_local * head_v_dim, (rank + 1) * v_local * head_v_dim)
    channels = torch.cat([qk, key_dim + qk, 2 * key_dim + v])
    return channels, slice(rank * v_local, (rank + 1) * v_local)


NO_HEAD_CUT = "its op has no head cut"  # the layout reason of the other recurrent ops


def cut_by(count: int, what: str, tp: int) -> str | None:
    """The one rule of a head (channel) cut: None when tp > 1 divides the ``count`` heads or
    channels a rank holds whole, else why the op runs with replicated weights."""
    if tp == 1:
        return "tp=1"
    if count % tp:
        return f"tp={tp} does not divide the {count} {what}"
    return None


def gated_delta_net_cut(num_k_heads: int, tp: int) -> str | None:
    """Whether ``dcp.gated_delta_net`` runs cut by heads over ``tp`` ranks (None) or with
    replicated weights (the reason): the cut needs tp > 1 dividing the key heads (a rank holds
    whole key heads and the value heads they serve, ``gated_delta_net_head_shard``). The one
    rule the placement analysis (passes/placement/recurrent.py) and the program's state cache
    (frontends/hybrid.py) both read."""
    return cut_by(num_k_heads, "key heads", tp)


def mamba2_cut(n_groups: int, num_heads: int, tp: int) -> str | None:
    """Whether ``dcp.mamba2_ssm`` runs cut by heads over ``tp`` ranks (None) or with
    replicated weights (the reason). Either tp > 1 divides the groups: a rank holds whole
    groups (their heads, their B and C: ``mamba2_head_shard``) and the gated RMSNorm, taken
    per group, stays on the rank; or there is one group and tp divides the heads (vLLM's
    layout, ``mamba_mixer2.py``): every rank holds B and C whole and its heads, and the
    norm over all heads has its sum of squares all-reduced (one ``[tokens, 1]`` scalar). A
    group cut across some ranks only (1 < groups, tp not dividing them) is not built."""
    if tp == 1:
        return "tp=1"
    if n_groups == 1 and num_heads % tp:
        return (f"tp={tp} does not divide the {num_heads} heads (one group: B and C whole on "
                f"every rank, the heads cut)")
    if n_groups % tp and n_groups != 1:
        return (f"tp={tp} does not divide the {n_groups} groups (B, C and the gated norm "
                f"are per group)")
    return None


def kimi_delta_attention_cut(num_heads: int, tp: int) -> str | None:
    """Whether ``dcp.kimi_delta_attention`` runs cut by heads over ``tp`` ranks (None) or
    with replicated weights (the reason): KDA has one key head per value head, so a rank
    holds whole heads (their ``[q | k | v]`` channels, g's rows, beta, the state) when tp > 1
    divides the heads."""
    return cut_by(num_heads, "heads", tp)


def short_conv_cut(channels: int, tp: int) -> str | None:
    """Whether ``dcp.short_conv`` (LFM2's) runs cut by channels over ``tp`` ranks (None) or
    with replicated weights (the reason): a depthwise convolution keeps every channel apart,
    so the cut needs tp > 1 dividing the channels."""
    return cut_by(channels, "channels", tp)


def lightning_attention_cut(num_heads: int, tp: int) -> str | None:
    """Whether ``dcp.lightning_attention`` runs cut by heads over ``tp`` ranks (None) or with
    replicated weights (the reason): every head's recurrence is its own (its slope, its
    ``d x d`` state), so the cut needs tp > 1 dividing the heads. The model's norm over all
    heads then has its mean of squares all-reduced, as a one-group Mamba2's."""
    return cut_by(num_heads, "heads", tp)


def mamba2_whole_bc(n_groups: int, tp: int) -> bool:
    """Under the head cut, B and C are whole on every rank (one group, tp > 1)."""
    return tp > 1 and n_groups % tp != 0


def _short_conv_impl(x: Tensor, conv_weight: Tensor, conv_bias: Tensor | None,
                     conv_state: Tensor, state_slot: Tensor, fresh: Tensor,
                     lengths: Tensor, snapshot_slot: Tensor | None = None
                     ) -> tuple[Tensor, Tensor]:
    rows = state_rows(conv_state, state_slot)
    usable = rows != garbage_state_slot(conv_state)
    valid = torch.arange(x.shape[1], device=x.device)[None, :] < lengths.view(-1, 1)
    conv_in = _read_state(conv_state, rows, fresh, usable)
    out, new, *each = causal_conv_chunk(x, conv_in, conv_weight, lengths, "identity", conv_bias,
                                        per_token=snapshot_slot is not None)
    out = torch.where(valid[..., None], out, torch.zeros_like(out))
    return out, _write_states(conv_state, rows, new, snapshot_slot, *each or [None])


@dcp_op("short_conv", mutates_args=())
def short_conv(x: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, conv_state: Tensor,
               state_slot: Tensor, fresh: Tensor, lengths: Tensor,
               snapshot_slot: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A depthwise causal convolution over a chunk (module doc): x [B, S, C], conv_weight
    [C, K], conv_bias [C] or None, conv_state [slots + 1, C, K-1] and the rows as in
    dcp.gated_delta_net. Returns (out [B, S, C], conv_state')."""
    return _short_conv_impl(x, conv_weight, conv_bias, conv_state, state_slot, fresh, lengths,
                            snapshot_slot)


@short_conv.register_fake
def _(x, conv_weight, conv_bias, conv_state, state_slot, fresh, lengths, snapshot_slot=None):
    return torch.empty_like(x), torch.empty_like(conv_state)


# dcp.mamba2_ssm's operands in schema order.
MAMBA2_OPERANDS = ("hidden_b_c", "dt", "conv_weight", "conv_bias", "A_log", "D", "dt_bias",
                   "conv_state", "ssm_state", "state_slot", "fresh", "lengths", "n_groups",
                   "head_dim", "state_size", "activation", "dt_min", "dt_max", "snapshot_slot")


def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                   state: Tensor, valid: Tensor, *, per_token: bool = False):
    """Mamba2's scan, token by token (fp32): x [B, S, H, P], dt [B, S, H] (discretised),
    A, D [H], B, C [B, S, H, N] (per head), state [B, H, P, N], valid [B, S]. Returns
    (y, state') and, ``per_token``, the state after every token [B, S, H, P, N]."""
    outs, states = [], []
    for t in range(x.shape[1]):
        dA = torch.exp(dt[:, t] * A)                                           # [B, H]
        new = state * dA[..., None, None] + \
            (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        keep = valid[:, t].view(-1, 1, 1, 1)
        state = torch.where(keep, new, state)
        y = (new * C[:, t, :, None, :]).sum(-1) + D[:, None] * x[:, t]         # [B, H, P]
        outs.append(torch.where(keep[..., 0], y, torch.zeros_like(y)))
        states.append(state)
    if per_token:
        return torch.stack(outs, dim=1), state, torch.stack(states, dim=1)
    return torch.stack(outs, dim=1), state


def _mamba2_ssm_impl(hidden_b_c: Tensor, dt: Tensor, conv_weight: Tensor,
                     conv_bias: Tensor | None, A_log: Tensor, D: Tensor, dt_bias: Tensor,
                     conv_state: Tensor, ssm_state: Tensor, state_slot: Tensor, fresh: Tensor,
                     lengths: Tensor, n_groups: int, head_dim: int, state_size: int,
                     activation: str, dt_min: float, dt_max: float,
                     snapshot_slot: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    Bsz, S, _ = hidden_b_c.shape
    snap = snapshot_slot is not None
    H = dt.shape[-1]
    rows = state_rows(ssm_state, state_slot)
    usable = rows != garbage_state_slot(ssm_state)
    valid = torch.arange(S, device=dt.device)[None, :] < lengths.view(-1, 1)
    conv_in = _read_state(conv_state, rows, fresh, usable)
    conv_out, conv_new, *conv_each = causal_conv_chunk(hidden_b_c, conv_in, conv_weight, lengths,
                                                       activation, conv_bias, per_token=snap)
    x, B, C = torch.split(conv_out, [H * head_dim, n_groups * state_size,
                                     n_groups * state_size], dim=-1)
    x = x.reshape(Bsz, S, H, head_dim).float()
    B = B.reshape(Bsz, S, n_groups, state_size).float().repeat_interleave(H // n_groups, dim=2)
    C = C.reshape(Bsz, S, n_groups, state_size).float().repeat_interleave(H // n_groups, dim=2)
    step = F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_min, max=dt_max)
    A = -torch.exp(A_log.float())
    state = _read_state(ssm_state, rows, fresh, usable).float()
    y, state, *ssm_each = selective_scan(x, step, A, B, C, D.float(), state, valid,
                                         per_token=snap)
    new_conv = _write_states(conv_state, rows, conv_new, snapshot_slot, *conv_each or [None])
    new_ssm = _write_states(ssm_state, rows, state, snapshot_slot, *ssm_each or [None])
    return y.to(hidden_b_c.dtype), new_conv, new_ssm


@dcp_op("mamba2_ssm", mutates_args=())
def mamba2_ssm(hidden_b_c: Tensor, dt: Tensor, conv_weight: Tensor, conv_bias: Tensor | None,
               A_log: Tensor, D: Tensor, dt_bias: Tensor, conv_state: Tensor,
               ssm_state: Tensor, state_slot: Tensor, fresh: Tensor, lengths: Tensor,
               n_groups: int, head_dim: int, state_size: int, activation: str, dt_min: float,
               dt_max: float, snapshot_slot: Tensor | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
    """Mamba2's core over a chunk (module doc): hidden_b_c [B, S, C] (the projected
    [x | B | C] before the convolution), dt [B, S, H] (before dt_bias and softplus), the
    conv weight [C, K] and bias, A_log, D, dt_bias [H]; the state caches (conv
    [slots + 1, C, K-1], ssm [slots + 1, H, head_dim, state_size]) and the rows as in
    dcp.gated_delta_net. Returns (y [B, S, H, head_dim] with the D skip, conv', ssm')."""
    return _mamba2_ssm_impl(hidden_b_c, dt, conv_weight, conv_bias, A_log, D, dt_bias,
                            conv_state, ssm_state, state_slot, fresh, lengths, n_groups,
                            head_dim, state_size, activation, dt_min, dt_max, snapshot_slot)


@mamba2_ssm.register_fake
def _(hidden_b_c, dt, conv_weight, conv_bias, A_log, D, dt_bias, conv_state, ssm_state,
      state_slot, fresh, lengths, n_groups, head_dim, state_size, activation, dt_min, dt_max,
      snapshot_slot=None):
    B, S, _ = hidden_b_c.shape
    return (hidden_b_c.new_empty(B, S, dt.shape[-1], head_dim), torch.empty_like(conv_state),
            torch.empty_like(ssm_state))


def mamba2_head_shard(n_groups: int, num_heads: int, head_dim: int, state_size: int, tp: int,
                      rank: int) -> tuple[Tensor, slice]:
    """Tensor parallelism by groups: rank ``rank`` of ``tp`` holds groups
    ``[rank * G/tp, (rank+1) * G/tp)``, their heads and their B, C columns; with one group
    (``mamba2_whole_bc``), its heads and B, C whole. Returns (its channels of
    ``hidden_b_c`` / conv weight, bias and state; its head slice of dt, A_log, D, dt_bias,
    ``ssm_state`` and the output). ``mamba2_cut`` must allow the cut."""
    why = mamba2_cut(n_groups, num_heads, tp)
    if why is not None and tp > 1:
        raise ValueError(f"mamba2_ssm head shard: {why}")
    h_local = num_heads // tp
    inner = num_heads * head_dim
    x = torch.arange(rank * h_local * head_dim, (rank + 1) * h_local * head_dim)
    if mamba2_whole_bc(n_groups, tp):
        bc = torch.arange(n_groups * state_size)
    else:
        g_local = n_groups // tp
        bc = torch.arange(rank * g_local * state_size, (rank + 1) * g_local * state_size)
    channels = torch.cat([x, inner + bc, inner + n_groups * state_size + bc])
    return channels, slice(rank * h_local, (rank + 1) * h_local)


# dcp.mamba_ssm's operands in schema order (Mamba-1: Jamba, Zamba).
MAMBA_OPERANDS = ("x", "dt", "A_log", "B", "C", "D", "dt_bias", "ssm_state", "state_slot",
                  "fresh", "lengths", "snapshot_slot")


def mamba_selective_scan_ref(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                             D: Tensor, state: Tensor, valid: Tensor, *,
                             per_token: bool = False):
    """Mamba-1's selective scan, token by token (fp32): x, dt [B, S, D] (dt discretised),
    A [D, N], B, C [B, S, D, N] (per channel), D [D], state [B, D, N], valid [B, S].
    ``S_t = exp(dt_t A) S_{t-1} + (dt_t x_t) B_t^T``, ``y_t = S_t C_t + D x_t``. Returns
    (y [B, S, D], state') and, ``per_token``, the state after every token [B, S, D, N]."""
    outs, states = [], []
    for t in range(x.shape[1]):
        dA = torch.exp(dt[:, t, :, None] * A)                                   # [B, D, N]
        new = state * dA + (dt[:, t] * x[:, t])[..., None] * B[:, t]
        keep = valid[:, t].view(-1, 1, 1)
        state = torch.where(keep, new, state)
        y = (new * C[:, t]).sum(-1) + D * x[:, t]                                # [B, D]
        outs.append(torch.where(keep[..., 0], y, torch.zeros_like(y)))
        states.append(state)
    if per_token:
        return torch.stack(outs, dim=1), state, torch.stack(states, dim=1)
    return torch.stack(outs, dim=1), state


def _per_channel(t: Tensor, channels: int) -> Tensor:
    """B or C of dcp.mamba_ssm per channel [B, S, D, N]: from [B, S, N] (shared by every
    channel: Jamba) or [B, S, G, N] (one per group of D/G consecutive channels: Zamba's
    heads)."""
    if t.dim() == 3:
        return t[:, :, None, :].expand(t.shape[0], t.shape[1], channels, t.shape[-1])
    return t.repeat_interleave(channels // t.shape[2], dim=2)


def _mamba_ssm_impl(x: Tensor, dt: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor,
                    dt_bias: Tensor | None, ssm_state: Tensor, state_slot: Tensor,
                    fresh: Tensor, lengths: Tensor, snapshot_slot: Tensor | None = None
                    ) -> tuple[Tensor, Tensor]:
    S = x.shape[1]
    rows = state_rows(ssm_state, state_slot)
    usable = rows != garbage_state_slot(ssm_state)
    valid = torch.arange(S, device=x.device)[None, :] < lengths.view(-1, 1)
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    step = F.softplus(dt)
    A = -torch.exp(A_log.float())
    state = _read_state(ssm_state, rows, fresh, usable).float()
    B, C = (_per_channel(t.float(), x.shape[-1]) for t in (B, C))
    y, state, *each = mamba_selective_scan_ref(x.float(), step, A, B, C,
                                               D.float(), state, valid,
                                               per_token=snapshot_slot is not None)
    return y.to(x.dtype), _write_states(ssm_state, rows, state, snapshot_slot, *each or [None])


@dcp_op("mamba_ssm", mutates_args=())
def mamba_ssm(x: Tensor, dt: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor,
              dt_bias: Tensor | None, ssm_state: Tensor, state_slot: Tensor, fresh: Tensor,
              lengths: Tensor, snapshot_slot: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Mamba-1's selective scan over a chunk (module doc): x [B, S, D] (after the conv and
    its activation), dt [B, S, D] (before dt_bias and softplus), A_log [D, N], B, C
    [B, S, N] (shared by every channel) or [B, S, G, N] (per group of D/G consecutive
    channels: Zamba's heads), D [D], dt_bias [D] or None; the state cache ssm
    [slots + 1, D, N] and the rows as in dcp.gated_delta_net. Returns (y [B, S, D] with the D skip, ssm'). The
    convolution before it is dcp.short_conv (the mixer's x_proj runs between the two)."""
    return _mamba_ssm_impl(x, dt, A_log, B, C, D, dt_bias, ssm_state, state_slot, fresh,
                           lengths, snapshot_slot)


@mamba_ssm.register_fake
def _(x, dt, A_log, B, C, D, dt_bias, ssm_state, state_slot, fresh, lengths,
      snapshot_slot=None):
    return torch.empty_like(x), torch.empty_like(ssm_state)


# RecurrentGemma's RG-LRU lives in its own module (it reads this one's slot helpers);
# importing this module registers it too.
from dcp_compile.runtime.kernels.rg_lru import _rg_lru_impl  # noqa: E402

DECOMPOSITIONS = {torch.ops.dcp.rg_lru.default: _rg_lru_impl,
                  torch.ops.dcp.mamba_ssm.default: _mamba_ssm_impl,
                  torch.ops.dcp.gated_delta_net.default: _gated_delta_net_impl,
                  torch.ops.dcp.mamba2_ssm.default: _mamba2_ssm_impl,
                  torch.ops.dcp.short_conv.default: _short_conv_impl}
