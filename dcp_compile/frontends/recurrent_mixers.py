"""Each recurrent mixer family's swapped forward and per-sequence state shape (the rules of
``module_recurrent.RULES`` point here): the model's own projections, gates, norms and output
projection verbatim around the ``dcp`` recurrence ops (runtime/kernels/recurrent.py), reading
and writing a ``RecurrentStates``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dcp_compile.runtime.kernels.recurrent  # noqa: F401  (registers the dcp recurrence ops)

@dataclass(frozen=True)
class StateShape:
    """One recurrent layer's state, per sequence: conv ``[C, K-1]``, recurrence ``[Hv, dk, dv]``."""

    conv: tuple[int, int] | None          # None: no convolution (lightning attention)
    rec: tuple[int, int, int] | None      # None: a convolution only (LFM2)


@dataclass
class RecurrentStates:
    """The state caches of every recurrent layer (``[num_slots + 1, ...]``, the last entry the
    garbage slot) and the current step's rows: ``state_slot [B]`` (-1: padding row),
    ``fresh [B]`` (the row starts its sequence), ``lengths [B]`` (real tokens, left-packed)."""

    conv: dict[int, Tensor] = field(default_factory=dict)
    rec: dict[int, Tensor] = field(default_factory=dict)
    state_slot: Tensor | None = None
    fresh: Tensor | None = None
    lengths: Tensor | None = None
    # [B, S] int64 of a width-K (speculative) step: where the state after each token is
    # also kept (-1: none); None for every other step
    snapshot_slot: Tensor | None = None

    def snap(self) -> tuple:
        """The ops' trailing ``snapshot_slot`` argument: () when the step keeps none."""
        return () if self.snapshot_slot is None else (self.snapshot_slot,)

    def step(self, state_slot, fresh, lengths) -> "RecurrentStates":
        """Set the rows of the next step (lists or tensors)."""
        self.state_slot = torch.as_tensor(state_slot, dtype=torch.int64)
        self.fresh = torch.as_tensor(fresh, dtype=torch.bool)
        self.lengths = torch.as_tensor(lengths, dtype=torch.int64)
        return self


def _gdn_shape(m: nn.Module) -> StateShape:
    return StateShape(conv=(m.conv_dim, m.conv_kernel_size - 1),
                      rec=(m.num_v_heads, m.head_k_dim, m.head_v_dim))


def _qwen3_next_head(m: nn.Module, h: Tensor):
    """Qwen3-Next's projections, verbatim: (mixed_qkv [B, S, C], z, b, a)."""
    qkvz, ba = m.in_proj_qkvz(h), m.in_proj_ba(h)
    query, key, value, z, b, a = m.fix_query_key_value_ordering(qkvz, ba)
    query, key, value = (x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value))
    return torch.cat((query, key, value), dim=-1), z, b, a


def _qwen3_5_head(m: nn.Module, h: Tensor):
    """Qwen3.5's projections, verbatim: (mixed_qkv [B, S, C], z, b, a)."""
    batch_size, seq_len, _ = h.shape
    z = m.in_proj_z(h).reshape(batch_size, seq_len, -1, m.head_v_dim)
    return m.in_proj_qkv(h), z, m.in_proj_b(h), m.in_proj_a(h)


def _olmo_hybrid_head(m: nn.Module, h: Tensor):
    """OLMo-hybrid's projections, verbatim: separate q, k, v concatenated (``[q | k | v]``,
    the conv's channel order), its own output gate ``g_proj`` as z, b, a."""
    mixed_qkv = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
    return mixed_qkv, m.g_proj(h), m.b_proj(h), m.a_proj(h)


def _qwen_beta(m: nn.Module, b: Tensor) -> Tensor:
    return b.sigmoid()


def _olmo_hybrid_beta(m: nn.Module, b: Tensor) -> Tensor:
    """OLMo-hybrid's ``allow_neg_eigval``: beta in [0, 2] (the state's eigenvalues
    ``1 - beta`` may go negative), the model's own lines; the delta rule takes any beta."""
    beta = b.sigmoid()
    if m.allow_neg_eigval:
        beta = beta * 2.0
    return beta


def _gdn_forward(m: nn.Module, states: RecurrentStates, head: Callable,
                 beta_of: Callable = _qwen_beta, norm: str = "norm",
                 out: str = "out_proj") -> Callable:
    """The mixer's forward with its conv + gated delta rule as ``dcp.gated_delta_net`` over
    ``states``; the model's own lines before and after it: its projections (``head``), its
    beta (``beta_of``), its gated norm and output projection (the attributes ``norm``,
    ``out``: Qwen's ``norm`` / ``out_proj``, OLMo-hybrid's ``o_norm`` / ``o_proj``)."""
    module = sys.modules[type(m).__module__]
    norm_fn, out_fn = getattr(m, norm), getattr(m, out)

    def forward(hidden_states: Tensor, cache=None, attention_mask=None, **kwargs) -> Tensor:
        hidden_states = module.apply_mask_to_padding_states(hidden_states, attention_mask)
        mixed_qkv, z, b, a = head(m, hidden_states)
        beta = beta_of(m, b)
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        core_attn_out, states.conv[m.layer_idx], states.rec[m.layer_idx] = \
            torch.ops.dcp.gated_delta_net(
                mixed_qkv, g, beta, m.conv1d.weight.squeeze(1), states.conv[m.layer_idx],
                states.rec[m.layer_idx], states.state_slot, states.fresh, states.lengths,
                m.num_k_heads, m.head_k_dim, m.head_v_dim, m.activation, *states.snap())
        # The model flattens [B, S, Hv, dv] to [B*S*Hv, dv] around its gated norm; the norm
        # works over the last dim alone (its forward is pinned), so it runs on the unflattened
        # tensor: the same values, and every view keeps the token dim (check_token_wise).
        core_attn_out = norm_fn(core_attn_out, z.reshape(core_attn_out.shape))
        core_attn_out = core_attn_out.reshape(core_attn_out.shape[0], core_attn_out.shape[1], -1)
        return out_fn(core_attn_out)
    return forward


def _kda_shape(m: nn.Module) -> StateShape:
    return StateShape(conv=(m.conv_dim, m.conv_kernel_size - 1),
                      rec=(m.num_heads, m.head_dim, m.head_dim))


def _kimi_gate(m: nn.Module, h: Tensor) -> Tensor:
    return m.g_b_proj(m.g_a_proj(h))        # Kimi Linear's low-rank output gate


def _bailing_gate(m: nn.Module, h: Tensor) -> Tensor:
    return m.g_proj(h)                      # Bailing-hybrid's


def _kda_forward(m: nn.Module, states: RecurrentStates, out_gate=_kimi_gate) -> Callable:
    """Kimi Linear's (Bailing-hybrid's) delta attention forward with its conv + KDA
    recurrence as ``dcp.kimi_delta_attention`` over ``states``; the model's own projections,
    forget gate, output gate (``out_gate``), gated norm and output projection, verbatim."""
    module = sys.modules[type(m).__module__]

    def forward(hidden_states: Tensor, cache=None, attention_mask=None, **kwargs) -> Tensor:
        hidden_states = module.apply_mask_to_padding_states(hidden_states, attention_mask)
        batch_size, seq_len = hidden_states.shape[:2]
        hidden_shape = (batch_size, seq_len, -1, m.head_dim)
        mixed_qkv = torch.cat([m.q_proj(hidden_states), m.k_proj(hidden_states),
                               m.v_proj(hidden_states)], dim=-1)
        g = m.forget_gate(hidden_states)
        beta = torch.sigmoid(m.b_proj(hidden_states))
        core_attn_out, states.conv[m.layer_idx], states.rec[m.layer_idx] = \
            torch.ops.dcp.kimi_delta_attention(
                mixed_qkv, g, beta, m.conv1d.weight.squeeze(1), states.conv[m.layer_idx],
                states.rec[m.layer_idx], states.state_slot, states.fresh, states.lengths,
                m.num_heads, m.head_dim, m.activation, *states.snap())
        gate = out_gate(m, hidden_states).view(hidden_shape)
        output = m.o_norm(core_attn_out, gate).reshape(batch_size, seq_len, -1)
        return m.o_proj(output)
    return forward


def _lightning_shape(m: nn.Module) -> StateShape:
    return StateShape(conv=None, rec=(m.num_attention_heads, m.head_dim, m.head_dim))


def _lightning_forward(m: nn.Module, states: RecurrentStates) -> Callable:
    """MiniMax's lightning attention forward with its recurrence (the block form for a prompt,
    the one-token form after it) as ``dcp.lightning_attention`` over ``states``; the model's
    own projection, activation, norm, output gate and output projection, verbatim."""
    module = sys.modules[type(m).__module__]

    def forward(hidden_states: Tensor, position_embeddings=None, attention_mask=None,
                cache=None, **kwargs):
        batch_size, seq_len, _ = hidden_states.shape
        qkv_states = m.act_fn(m.qkv_proj(hidden_states))
        qkv_states = module.apply_mask_to_padding_states(qkv_states, attention_mask)
        qkv_states = qkv_states.reshape(batch_size, seq_len, m.num_attention_heads,
                                        3 * m.head_dim)
        query_states, key_states, value_states = torch.split(qkv_states, m.head_dim, dim=3)
        attn_output, states.rec[m.layer_idx] = torch.ops.dcp.lightning_attention(
            query_states, key_states, value_states, m.slope_rate.reshape(-1),
            states.rec[m.layer_idx], states.state_slot, states.fresh, states.lengths,
            *states.snap())
        attn_output = attn_output.reshape(batch_size, seq_len, m.num_attention_heads * m.head_dim)
        attn_output = m.norm(attn_output)
        attn_output = F.sigmoid(m.output_gate(hidden_states)) * attn_output
        return m.out_proj(attn_output), None
    return forward


def _mamba2_shape(m: nn.Module) -> StateShape:
    return StateShape(conv=(m.conv_dim, m.conv_kernel_size - 1),
                      rec=(m.num_heads, m.head_dim, m.ssm_state_size))


def _mamba2_forward(m: nn.Module, states: RecurrentStates) -> Callable:
    """Bamba's mixer forward (eval) with its conv + selective scan as ``dcp.mamba2_ssm``
    over ``states``; the model's own projection, gated norm and output projection."""
    module = sys.modules[type(m).__module__]

    def forward(hidden_states: Tensor, cache=None, attention_mask=None, **kwargs) -> Tensor:
        batch_size, seq_len, _ = hidden_states.shape
        dtype = hidden_states.dtype
        hidden_states = module.apply_mask_to_padding_states(hidden_states, attention_mask)
        projected_states = m.in_proj(hidden_states)
        gate, hidden_states_B_C, dt = projected_states.split(
            [m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        dt_min, dt_max = m.time_step_limit
        scan_output, states.conv[m.layer_idx], states.rec[m.layer_idx] = \
            torch.ops.dcp.mamba2_ssm(
                hidden_states_B_C, dt, m.conv1d.weight.squeeze(1), m.conv1d.bias, m.A_log, m.D,
                m.dt_bias, states.conv[m.layer_idx], states.rec[m.layer_idx],
                states.state_slot, states.fresh, states.lengths, m.n_groups, m.head_dim,
                m.ssm_state_size, m.activation, float(dt_min), float(dt_max), *states.snap())
        scan_output = scan_output.reshape(batch_size, seq_len, m.intermediate_size)
        scan_output = m.norm(scan_output, gate)
        return m.out_proj(scan_output.to(dtype))
    return forward


def _falcon_h1_forward(m: nn.Module, states: RecurrentStates) -> Callable:
    """Falcon-H1's mixer forward (eval): Bamba's, with its mup multipliers (the input times
    ``ssm_in_multiplier``, the projection times the per-segment ``mup_vector``) and its
    optional gated RMSNorm (else ``silu(gate)``), the model's own lines; the conv +
    selective scan as ``dcp.mamba2_ssm`` over ``states``."""
    module = sys.modules[type(m).__module__]

    def forward(hidden_states: Tensor, cache=None, attention_mask=None, **kwargs) -> Tensor:
        batch_size, seq_len, _ = hidden_states.shape
        dtype = hidden_states.dtype
        hidden_states = module.apply_mask_to_padding_states(hidden_states, attention_mask)
        hidden_states = hidden_states * m.ssm_in_multiplier
        projected_states = m.in_proj(hidden_states)
        projected_states = projected_states * m.mup_vector
        gate, hidden_states_B_C, dt = projected_states.split(
            [m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        dt_min, dt_max = m.time_step_limit
        scan_output, states.conv[m.layer_idx], states.rec[m.layer_idx] = \
            torch.ops.dcp.mamba2_ssm(
                hidden_states_B_C, dt, m.conv1d.weight.squeeze(1), m.conv1d.bias, m.A_log, m.D,
                m.dt_bias, states.conv[m.layer_idx], states.rec[m.layer_idx],
                states.state_slot, states.fresh, states.lengths, m.n_groups, m.head_dim,
                m.ssm_state_size, m.activation, float(dt_min), float(dt_max), *states.snap())
        scan_output = scan_output.reshape(batch_size, seq_len, m.intermediate_size)
        if m.mamba_rms_norm:
            scan_output = m.norm(scan_output, gate)
        else:
            scan_output = scan_output * F.silu(gate)
        return m.out_proj(scan_output.to(dtype))
    return forward


def _mamba_shape(m: nn.Module) -> StateShape:
    return StateShape(conv=(m.intermediate_size, m.conv_kernel_size - 1),
                      rec=(m.intermediate_size, m.ssm_state_size))


def _jamba_forward(m: nn.Module, states: RecurrentStates) -> Callable:
    """Jamba's Mamba-1 mixer forward (eval): its convolution as ``dcp.short_conv`` (then the
    mixer's own activation), its selective scan as ``dcp.mamba_ssm`` over ``states``; the
    model's own projections and dt / B / C norms between the two, tokens on dim 1 (the model
    transposes to channels-first around its kernels: the same values)."""
    module = sys.modules[type(m).__module__]

    def forward(hidden_states: Tensor, cache=None, attention_mask=None, **kwargs) -> Tensor:
        dtype = hidden_states.dtype
        hidden_states = module.apply_mask_to_padding_states(hidden_states, attention_mask)
        projected_states = m.in_proj(hidden_states)
        hidden_states, gate = projected_states.chunk(2, dim=-1)
        conv_out, states.conv[m.layer_idx] = torch.ops.dcp.short_conv(
            hidden_states, m.conv1d.weight.squeeze(1), m.conv1d.bias,
            states.conv[m.layer_idx], states.state_slot, states.fresh, states.lengths,
            *states.snap())
        hidden_states = m.act(conv_out)
        time_step, B, C = torch.split(
            m.x_proj(hidden_states), [m.time_step_rank, m.ssm_state_size, m.ssm_state_size],
            dim=-1)
        time_step = m.dt_layernorm(time_step)
        B = m.b_layernorm(B)
        C = m.c_layernorm(C)
        time_step = F.linear(time_step, m.dt_proj.weight)    # dt_proj.weight @ time_step^T
        scan_output, states.rec[m.layer_idx] = torch.ops.dcp.mamba_ssm(
            hidden_states, time_step, m.A_log, B, C, m.D, m.dt_proj.bias,
            states.rec[m.layer_idx], states.state_slot, states.fresh, states.lengths,
            *states.snap())
        scan_output = scan_output * F.silu(gate)            # the scan kernel's z gate
        return m.out_proj(scan_output.to(dtype))
    return forward


def _zamba_forward(m: nn.Module, states: RecurrentStates) -> Callable:
    """Zamba's multi-head Mamba-1 mixer forward (eval): its convolution as ``dcp.short_conv``
    (then its activation), its per-head scans as one ``dcp.mamba_ssm`` (B and C per head)
    over ``states``; the model's own per-head x_proj / dt_proj weights as batched matmuls
    between the two, tokens on dim 1. The in projection interleaves each channel's input and gate
    (the model's ``view(B, -1, 2, S)``)."""
    module = sys.modules[type(m).__module__]

    def forward(hidden_states: Tensor, cache=None, attention_mask=None, **kwargs) -> Tensor:
        batch_size, seq_len, _ = hidden_states.shape
        dtype = hidden_states.dtype
        H, P, N = m.n_mamba_heads, m.mamba_head_dim, m.ssm_state_size
        hidden_states = module.apply_mask_to_padding_states(hidden_states, attention_mask)
        projected_states = m.in_proj(hidden_states).view(batch_size, seq_len, -1, 2)
        hidden_states, gate = projected_states[..., 0], projected_states[..., 1]
        conv_out, states.conv[m.layer_idx] = torch.ops.dcp.short_conv(
            hidden_states, m.conv1d.weight.squeeze(1), m.conv1d.bias,
            states.conv[m.layer_idx], states.state_slot, states.fresh, states.lengths,
            *states.snap())
        hidden_states = m.act(conv_out)
        heads = hidden_states.view(batch_size, seq_len, H, P)
        ssm_parameters = (m.x_proj_weight @ heads[..., None]).squeeze(-1)   # [B, S, H, R+2N]
        time_step, B, C = torch.split(ssm_parameters, [m.time_step_rank, N, N], dim=-1)
        time_step = (m.dt_proj_weight @ time_step[..., None]).squeeze(-1)   # [B, S, H, P]
        scan_output, states.rec[m.layer_idx] = torch.ops.dcp.mamba_ssm(
            hidden_states, time_step.reshape(batch_size, seq_len, H * P),
            m.A_log.reshape(H * P, N), B, C, m.D.reshape(H * P),
            None if m.dt_proj_bias is None else m.dt_proj_bias.reshape(H * P),
            states.rec[m.layer_idx], states.state_slot, states.fresh, states.lengths,
            *states.snap())
        scan_output = scan_output * F.silu(gate)            # the scan kernel's z gate
        return m.out_proj(scan_output.to(dtype))
    return forward


def _short_conv_shape(m: nn.Module) -> StateShape:
    return StateShape(conv=(m.conv.in_channels, m.conv_kernel_size - 1), rec=None)


def _short_conv_forward(m: nn.Module, states: RecurrentStates) -> Callable:
    """LFM2's short-conv forward with its convolution as ``dcp.short_conv`` over ``states``;
    the model's own gates and projections."""
    module = sys.modules[type(m).__module__]

    def forward(hidden_states: Tensor, cache=None, attention_mask=None, **kwargs) -> Tensor:
        hidden_states = module.apply_mask_to_padding_states(hidden_states, attention_mask)
        BCx = m.in_proj(hidden_states).transpose(-1, -2)
        B, C, x = BCx.chunk(3, dim=-2)
        hidden_states = B * x
        conv_out, states.conv[m.layer_idx] = torch.ops.dcp.short_conv(
            hidden_states.transpose(-1, -2), m.conv.weight.squeeze(1), m.conv.bias,
            states.conv[m.layer_idx], states.state_slot, states.fresh, states.lengths,
            *states.snap())
        y = C * conv_out.transpose(-1, -2)
        y = y.transpose(-1, -2).contiguous()
        return m.out_proj(y)
    return forward


def _rglru_shape(m: nn.Module) -> StateShape:
    return StateShape(conv=(m.lru_width, m.conv1d_width - 1), rec=(m.lru_width,))


def _rglru_forward(m: nn.Module, states: RecurrentStates) -> Callable:
    """RecurrentGemma's recurrent block forward with its causal Conv1d as ``dcp.short_conv``
    and its RG-LRU as ``dcp.rg_lru`` over ``states`` (runtime/kernels/rg_lru.py); the
    model's own ``linear_y`` branch and activation, ``linear_x`` and ``linear_out``, tokens
    on dim 1 (the model transposes to channels-first around its conv: the same values). The
    RG-LRU's reset at position 0 is the op's ``fresh`` (the step contract's state-fresh)."""

    def forward(input_states: Tensor, position_ids=None, attention_mask=None, use_cache=True,
                **kwargs):
        y_branch = m.act_fn(m.linear_y(input_states))
        x_branch = m.linear_x(input_states)
        x_branch, states.conv[m.layer_idx] = torch.ops.dcp.short_conv(
            x_branch, m.conv_1d.weight.squeeze(1), m.conv_1d.bias, states.conv[m.layer_idx],
            states.state_slot, states.fresh, states.lengths, *states.snap())
        lru = m.rg_lru
        x_branch, states.rec[m.layer_idx] = torch.ops.dcp.rg_lru(
            x_branch, lru.input_gate_weight, lru.input_gate_bias, lru.recurrent_gate_weight,
            lru.recurrent_gate_bias, lru.recurrent_param, states.rec[m.layer_idx],
            states.state_slot, states.fresh, states.lengths, *states.snap())
        return m.linear_out(x_branch * y_branch), None
    return forward
