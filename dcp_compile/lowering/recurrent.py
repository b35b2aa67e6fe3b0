"""Lowering rules of the recurrent ops of hybrid models (RECURRENT_LOWERING, op -> rule).

docs/lowering.md, "Hybrid models on XLA"; docs/hybrid.md.

A recurrent op (runtime/kernels/recurrent.py) lowers through its reference implementation,
which is static by construction: the token-by-token recurrence is a loop over the chunk's S
tokens unrolled at trace time, the convolution is K static slices (``sliding_windows``), and
the state cache is an input returned updated -- each row's slot read by a gather
(``state_rows``: -1 and out-of-range slots read the garbage slot, a fresh row reads zeros)
and written by a scatter of B rows, which the finalize rule ``cache_writes`` turns into one
``dynamic_update_slice`` per row. No shape depends on the data: a padding row writes the
garbage slot, a short row's later tokens are masked, not sliced away.

A step that keeps state snapshots (``snapshot_slot [B, S]``: a speculative width-K decode
step) writes the state after each token to its snapshot slot by the same rule (B * S more
rows; -1 writes the garbage slot).

``RECURRENT_LOWERING`` is the table: op -> its lowering (a decomposition to ATen). A
recurrent op without a row is refused by name (``check_recurrent``).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from dcp_compile.passes.op_classes import RECURRENT_OPS
from dcp_compile.runtime.errors import DCPLoweringError
from dcp_compile.runtime.kernels import recurrent as R
from dcp_compile.runtime.kernels.rg_lru import _rg_lru_impl

_dcp = torch.ops.dcp


def _gated_delta_net(mixed_qkv, g, beta, conv_weight, conv_state, rec_state, state_slot,
                     fresh, lengths, num_k_heads, head_k_dim, head_v_dim, activation="silu",
                     snapshot_slot=None):
    # the op's schema defaults: a node may leave them out, the reference has none
    return R._gated_delta_net_impl(mixed_qkv, g, beta, conv_weight, conv_state, rec_state,
                                   state_slot, fresh, lengths, num_k_heads, head_k_dim,
                                   head_v_dim, activation, snapshot_slot)


def _kimi_delta_attention(mixed_qkv, g, beta, conv_weight, conv_state, rec_state, state_slot,
                          fresh, lengths, num_heads, head_dim, activation="silu",
                          snapshot_slot=None):
    # the op is the gated delta rule with a decay per key channel (its eager body)
    return R._gated_delta_net_impl(mixed_qkv, g, beta, conv_weight, conv_state, rec_state,
                                   state_slot, fresh, lengths, num_heads, head_dim, head_dim,
                                   activation, snapshot_slot)


# op -> lowering rule, each checked on XLA:CPU against the model's own forward
# (tests/lowering/test_hybrid_xla.py).
RECURRENT_LOWERING = {
    _dcp.short_conv.default: R._short_conv_impl,        # LFM2's short convolution, Mamba-1's conv
    _dcp.mamba2_ssm.default: R._mamba2_ssm_impl,        # Mamba2: Bamba, Granite-4-H
    _dcp.mamba_ssm.default: R._mamba_ssm_impl,          # Mamba-1: Jamba, Zamba
    _dcp.gated_delta_net.default: _gated_delta_net,     # Qwen3-Next, Qwen3.5
    _dcp.kimi_delta_attention.default: _kimi_delta_attention,   # Kimi Linear, Bailing
    _dcp.lightning_attention.default: R._lightning_attention_impl,   # MiniMax
    _dcp.rg_lru.default: _rg_lru_impl,                  # RecurrentGemma (its conv: short_conv)
}


def check_recurrent(node: Node, step: str, where: str) -> bool:
    """True if ``node`` is a recurrent op the lowering takes; raise DCPLoweringError naming
    the op if it has no rule; False for any other node."""
    if node.target not in RECURRENT_OPS:
        return False
    if node.target not in RECURRENT_LOWERING:
        op = node.target._schema.name
        lowered = sorted(t._schema.name for t in RECURRENT_LOWERING)
        raise DCPLoweringError(
            f"cannot lower recurrent op {op} {where}: its lowering to StableHLO is not built "
            f"(lowered recurrent ops: {lowered}). Run this hybrid on the eager runtime "
            f"(threads or a torch.distributed world), or add a row to "
            f"dcp_compile.lowering.recurrent.RECURRENT_LOWERING with a test on XLA:CPU.")
    return True
