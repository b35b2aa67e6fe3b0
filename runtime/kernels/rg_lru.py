"""RecurrentGemma's RG-LRU (Griffin's Real-Gated Linear Recurrent Unit) as ``dcp.rg_lru``, a
recurrent op beside those of runtime/kernels/recurrent.py (same slot, fresh, padding and
snapshot rules; docs/hybrid.md, "RecurrentGemma").

transformers' ``RecurrentGemmaRecurrentBlock`` runs ``linear_x``, a depthwise causal Conv1d
(``dcp.short_conv``: its state the conv's last ``conv1d_width - 1`` inputs), then the RG-LRU,
whose state is ``h [lru_width]``. Per channel c of head ``c // block_width``:

    i_t = sigmoid(x_t W_i[head] + b_i)                 the input gate (block-diagonal)
    r_t = sigmoid(x_t W_r[head] + b_r)                 the recurrence gate
    log a_t = -8 r_t softplus(recurrent_param)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)      (a token at position 0 resets:
    h_t = i_t x_t                                        no decay, no normalisation)

A row's token t is at position 0 exactly when the row is ``fresh`` and t = 0 (the step
contract's state-fresh rule), so the op takes no positions. The gates are token-wise but read
the conv's output, which only the op sees in order; they are computed inside it with the
module's own weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dcp_compile.runtime.kernels.op_defs import dcp_op
from dcp_compile.runtime.kernels.recurrent_slots import (_read_state, _write_states,
                                                         garbage_state_slot, state_rows)

# Griffin's constant c in a_t = a^(c r_t) (transformers' -8.0).
RG_LRU_C = 8.0


def _block_gate(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """sigmoid of the block-diagonal linear: x [B, S, H * bw] by head, weight [H, bw, bw]
    (``x_head @ weight[head]``), bias [H, bw]."""
    B, S, W = x.shape
    H, bw = bias.shape
    heads = x.reshape(B, S, H, bw)
    return torch.sigmoid(torch.einsum("bshi,hij->bshj", heads, weight.to(x.dtype))
                         + bias.to(x.dtype)).reshape(B, S, W)


def rg_lru_scan(x: Tensor, a: Tensor, state: Tensor, valid: Tensor, *,
                per_token: bool = False):
    """The diagonal linear recurrence h_t = a_t h_{t-1} + x_t, token by token (fp32):
    x, a [B, S, W], state [B, W], valid [B, S]. Returns (h [B, S, W], state') and,
    ``per_token``, the state after every token [B, S, W]."""
    outs, states = [], []
    for t in range(x.shape[1]):
        new = a[:, t] * state + x[:, t]
        keep = valid[:, t].view(-1, 1)
        state = torch.where(keep, new, state)
        outs.append(torch.where(keep, new, torch.zeros_like(new)))
        states.append(state)
    if per_token:
        return torch.stack(outs, dim=1), state, torch.stack(states, dim=1)
    return torch.stack(outs, dim=1), state


def _rg_lru_impl(x: Tensor, input_gate_weight: Tensor, input_gate_bias: Tensor,
                 recurrent_gate_weight: Tensor, recurrent_gate_bias: Tensor,
                 recurrent_param: Tensor, rec_state: Tensor, state_slot: Tensor, fresh: Tensor,
                 lengths: Tensor, snapshot_slot: Tensor | None = None) -> tuple[Tensor, Tensor]:
    S = x.shape[1]
    rows = state_rows(rec_state, state_slot)
    usable = rows != garbage_state_slot(rec_state)
    positions = torch.arange(S, device=x.device)[None, :]
    valid = positions < lengths.view(-1, 1)
    reset = ((positions == 0) & fresh.bool().view(-1, 1))[..., None]          # [B, S, 1]
    input_gate = _block_gate(x, input_gate_weight, input_gate_bias)
    recurrent_gate = _block_gate(x, recurrent_gate_weight, recurrent_gate_bias)
    log_a = -RG_LRU_C * recurrent_gate * F.softplus(recurrent_param.to(x.dtype))
    a = torch.exp(log_a)
    multiplier = torch.where(reset, torch.ones_like(a), torch.sqrt(1 - torch.exp(2 * log_a)))
    normalized = x * input_gate * multiplier
    a = torch.where(reset, torch.zeros_like(a), a)
    state = _read_state(rec_state, rows, fresh, usable).float()
    h, state, *each = rg_lru_scan(normalized.float(), a.float(), state, valid,
                                  per_token=snapshot_slot is not None)
    return h.to(x.dtype), _write_states(rec_state, rows, state, snapshot_slot, *each or [None])


@dcp_op("rg_lru", mutates_args=())
def rg_lru(x: Tensor, input_gate_weight: Tensor, input_gate_bias: Tensor,
           recurrent_gate_weight: Tensor, recurrent_gate_bias: Tensor, recurrent_param: Tensor,
           rec_state: Tensor, state_slot: Tensor, fresh: Tensor, lengths: Tensor,
           snapshot_slot: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The RG-LRU over a chunk (module doc): x [B, S, W] (the block's conv output), the gates'
    block-diagonal weights [H, W/H, W/H] and biases [H, W/H], recurrent_param [W]; the
    recurrence cache [slots + 1, W] (fp32) and the rows as in dcp.gated_delta_net. Returns
    (h [B, S, W], rec_state')."""
    return _rg_lru_impl(x, input_gate_weight, input_gate_bias, recurrent_gate_weight,
                        recurrent_gate_bias, recurrent_param, rec_state, state_slot, fresh,
                        lengths, snapshot_slot)


def rg_lru_cut(num_heads: int, tp: int) -> str | None:
    """Whether RecurrentGemma's block (``dcp.short_conv`` then ``dcp.rg_lru``) runs cut by
    heads over ``tp`` ranks (None) or with replicated weights (the reason). Exact when tp
    divides the heads: the conv is depthwise, the gates are block-diagonal by head and the
    recurrence is per channel, so a rank's heads (their ``lru_width / tp`` contiguous
    channels) need no other channel. The rule the placement analysis
    (passes/placement/recurrent.py) and the program's state cache both read."""
    if tp == 1:
        return "tp=1"
    if num_heads % tp:
        return f"tp={tp} does not divide the RG-LRU's {num_heads} heads"
    return None


@rg_lru.register_fake
def _(x, input_gate_weight, input_gate_bias, recurrent_gate_weight, recurrent_gate_bias,
      recurrent_param, rec_state, state_slot, fresh, lengths, snapshot_slot=None):
    return torch.empty_like(x), torch.empty_like(rec_state)
