"""The step contract's recurrent-state rules (runtime/serving/step_contract.py, ``state-*``):
no row of a hybrid model's step reads or writes another sequence's state, a padding row
touches only the garbage slot, and fresh is exactly "starts at position 0". Each rule has a
probe that breaks it alone; the valid step passes; and the op run on a step the rules accept
never changes a slot no row was given."""

from __future__ import annotations

import pytest
import torch

from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.kernels.recurrent import gated_delta_net
from dcp_compile.runtime.serving.step_contract import RULE_NAMES, StepContract

SLOTS = 4
# row 0 starts its sequence (0, 1, 2), row 1 continues at 5, row 2 is padding
POS = torch.tensor([[0, 1, 2], [5, 6, -1], [-1, -1, -1]])
TABLE = torch.tensor([[0, -1], [1, 2], [-1, -1]])
CONTRACT = StepContract(block_size=4, dcp=1, num_blocks=8, num_state_slots=SLOTS,
                        max_blocks=2, rules=None)


def _check(slot, fresh, snapshot=None):
    CONTRACT.check(None, POS, TABLE, state_slot=torch.tensor(slot), fresh=torch.tensor(fresh),
                   snapshot_slot=None if snapshot is None else torch.tensor(snapshot))


def test_a_valid_hybrid_step_passes():
    _check([3, 0, -1], [True, False, False])


def test_a_valid_speculative_hybrid_step_passes():
    _check([3, 0, -1], [True, False, False], [[1, 2, -1], [-1, -1, -1], [-1, -1, -1]])


SNAPSHOT_PROBES = {
    "snapshot-on-padding": ([[1, -1, -1], [-1, -1, 2], [-1, -1, -1]],
                            ["state_snapshot_slot[1, 2] = 2 names a padding token"]),
    "snapshot-beyond-cache": ([[SLOTS, -1, -1], [-1, -1, -1], [-1, -1, -1]],
                              [f"state_snapshot_slot[0, 0] = {SLOTS} is outside"]),
    "snapshot-twice": ([[1, 1, -1], [-1, -1, -1], [-1, -1, -1]],
                       ["state_snapshot_slot[0, 0] = 1 is named twice"]),
    "snapshot-is-a-live-slot": ([[0, -1, -1], [-1, -1, -1], [-1, -1, -1]],
                                ["state_snapshot_slot[0, 0] = 0 is named twice",
                                 "a live sequence"]),
    "snapshot-wrong-shape": ([[1, 2]], ["state_snapshot_slot is torch.int64 [1, 2]"]),
}


@pytest.mark.parametrize("probe", SNAPSHOT_PROBES, ids=list(SNAPSHOT_PROBES))
def test_each_snapshot_fault_is_refused(probe):
    snapshot, words = SNAPSHOT_PROBES[probe]
    with pytest.raises(DCPInputError) as e:
        _check([3, 0, -1], [True, False, False], snapshot)
    assert e.value.rule == "state-snapshot-slot", str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_step_without_state_inputs_skips_the_state_rules():
    CONTRACT.check(None, POS, TABLE)


# id: (state_slot, fresh, rule, substrings)
PROBES = {
    "slot-beyond-cache": ([3, SLOTS, -1], [True, False, False], "state-slot-range",
                          [f"state_slot[1] = {SLOTS} is outside the state cache",
                           "garbage slot"]),
    "slot-below-minus-one": ([-2, 0, -1], [True, False, False], "state-slot-range",
                             ["state_slot[0] = -2"]),
    "slot-as-int32": (torch.tensor([3, 0, -1], dtype=torch.int32), [True, False, False],
                      "state-slot-range", ["state_slot is torch.int32"]),
    "shared-slot": ([1, 1, -1], [True, False, False], "state-shared-slot",
                    ["state_slot[1] = 1 is also state_slot[0]", "never share a slot"]),
    "real-row-without-slot": ([3, -1, -1], [True, False, False], "state-slot-of-rows",
                              ["row 1 (state_slot[1] = -1) has tokens and no state slot"]),
    "padding-row-with-slot": ([3, 0, 2], [True, False, False], "state-slot-of-rows",
                              ["row 2 (state_slot[2] = 2) is padding"]),
    "continuing-row-fresh": ([3, 0, -1], [True, True, False], "state-fresh",
                             ["state_fresh[1] = True for a row starting at position 5"]),
    "starting-row-not-fresh": ([3, 0, -1], [False, False, False], "state-fresh",
                               ["state_fresh[0] = False for a row starting at position 0"]),
}


@pytest.mark.parametrize("probe", PROBES, ids=list(PROBES))
def test_each_state_rule_refuses_its_fault(probe):
    slot, fresh, rule, words = PROBES[probe]
    with pytest.raises(DCPInputError) as e:
        CONTRACT.check(None, POS, TABLE, state_slot=torch.as_tensor(slot),
                       fresh=torch.tensor(fresh))
    assert e.value.rule == rule, str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert str(e.value).rstrip().endswith(".")


def test_every_state_rule_has_a_probe():
    probed = {p[2] for p in PROBES.values()} | {"state-snapshot-slot"}   # SNAPSHOT_PROBES
    assert probed == {r for r in RULE_NAMES if r.startswith("state-")}


def test_an_accepted_step_touches_only_its_rows_slots():
    """The op on a step the rules accept: slots no row names keep their bytes exactly."""
    gen = torch.Generator().manual_seed(0)
    B, S, nk, dk, nv, dv, K = 3, 3, 1, 4, 2, 4, 3
    C = 2 * nk * dk + nv * dv
    conv = torch.randn(SLOTS + 1, C, K - 1, generator=gen)
    rec = torch.randn(SLOTS + 1, nv, dk, dv, generator=gen)
    slot, fresh = torch.tensor([3, 0, -1]), torch.tensor([True, False, False])
    _check(slot.tolist(), fresh.tolist())
    lengths = (POS >= 0).sum(1)
    _, conv2, rec2 = gated_delta_net(torch.randn(B, S, C, generator=gen),
                                     -torch.rand(B, S, nv, generator=gen),
                                     torch.rand(B, S, nv, generator=gen),
                                     torch.randn(C, K, generator=gen), conv, rec, slot, fresh,
                                     lengths, nk, dk, dv)
    for untouched in (1, 2):
        assert torch.equal(conv2[untouched], conv[untouched])
        assert torch.equal(rec2[untouched], rec[untouched])
    for written in (0, 3):
        assert not torch.equal(rec2[written], rec[written])


@pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda t: f"tp={t}")
def test_the_op_on_a_head_shard_is_that_shard_of_the_op(tp):
    """TP by heads is exact: each rank's op over its channels, v heads and state heads gives
    exactly its slice of the whole op's output and states (GQA-like grouping 8 v : 4 k)."""
    from dcp_compile.runtime.kernels.recurrent import gated_delta_net_head_shard
    gen = torch.Generator().manual_seed(1)
    B, S, nk, dk, nv, dv, K = 2, 5, 4, 4, 8, 3, 4
    C = 2 * nk * dk + nv * dv
    args = dict(mixed_qkv=torch.randn(B, S, C, generator=gen),
                g=-torch.rand(B, S, nv, generator=gen), beta=torch.rand(B, S, nv, generator=gen),
                conv_weight=torch.randn(C, K, generator=gen),
                conv_state=torch.randn(3, C, K - 1, generator=gen),
                rec_state=torch.randn(3, nv, dk, dv, generator=gen))
    rows = dict(state_slot=torch.tensor([1, 0]), fresh=torch.tensor([False, True]),
                lengths=torch.tensor([5, 2]))
    out, conv, rec = gated_delta_net(**args, **rows, num_k_heads=nk, head_k_dim=dk,
                                     head_v_dim=dv)
    for rank in range(tp):
        ch, heads = gated_delta_net_head_shard(nk, nv, dk, dv, tp, rank)
        local = dict(mixed_qkv=args["mixed_qkv"][..., ch], g=args["g"][..., heads],
                     beta=args["beta"][..., heads], conv_weight=args["conv_weight"][ch],
                     conv_state=args["conv_state"][:, ch], rec_state=args["rec_state"][:, heads])
        o, c, r = gated_delta_net(**local, **rows, num_k_heads=nk // tp, head_k_dim=dk,
                                  head_v_dim=dv)
        assert torch.equal(o, out[:, :, heads]) or (o - out[:, :, heads]).abs().max() < 1e-6
        assert (c - conv[:, ch]).abs().max() < 1e-6 and (r - rec[:, heads]).abs().max() < 1e-6


@pytest.mark.parametrize("G", [4, 1], ids=["4-groups", "one-group"])
@pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda t: f"tp={t}")
def test_mamba2_on_a_group_shard_is_that_shard_of_the_op(tp, G):
    """Mamba2 cut by groups (their heads and B, C columns) is exact, 8 heads in 4 groups;
    with one group (vLLM's cut) a rank's heads with B and C whole are exact too."""
    from dcp_compile.runtime.kernels.recurrent import mamba2_head_shard, mamba2_ssm
    gen = torch.Generator().manual_seed(2)
    B, S, H, P, N, K = 2, 5, 8, 3, 4, 4
    C = H * P + 2 * G * N
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    full = dict(hidden_b_c=r(B, S, C), dt=r(B, S, H), conv_weight=r(C, K), conv_bias=r(C),
                A_log=r(H) * 0.2, D=r(H), dt_bias=r(H), conv_state=r(3, C, K - 1),
                ssm_state=r(3, H, P, N))
    rows = dict(state_slot=torch.tensor([1, 0]), fresh=torch.tensor([False, True]),
                lengths=torch.tensor([5, 2]), head_dim=P, state_size=N, activation="silu",
                dt_min=0.0, dt_max=float("inf"))
    out, conv, ssm = mamba2_ssm(**full, **rows, n_groups=G)
    for rank in range(tp):
        ch, heads = mamba2_head_shard(G, H, P, N, tp, rank)
        local = dict(hidden_b_c=full["hidden_b_c"][..., ch], dt=full["dt"][..., heads],
                     conv_weight=full["conv_weight"][ch], conv_bias=full["conv_bias"][ch],
                     A_log=full["A_log"][heads], D=full["D"][heads],
                     dt_bias=full["dt_bias"][heads], conv_state=full["conv_state"][:, ch],
                     ssm_state=full["ssm_state"][:, heads])
        assert len(ch) == H // tp * P + 2 * N * (G // tp if G % tp == 0 else G)
        o, c, s = mamba2_ssm(**local, **rows, n_groups=G // tp if G % tp == 0 else G)
        assert (o - out[:, :, heads]).abs().max() < 1e-6
        assert (c - conv[:, ch]).abs().max() < 1e-6 and (s - ssm[:, heads]).abs().max() < 1e-6


def test_the_state_cache_is_replicated_over_dcp_and_cut_by_tp():
    """Bytes per rank: the same for every dcp (nothing in the spec depends on it), 1/tp of the
    replicated cache when heads are cut, the garbage slot counted; a tp that does not divide
    the heads is refused by name."""
    from dcp_compile.runtime.errors import DCPConfigError
    from dcp_compile.runtime.serving.state_cache import StateCacheSpec, StateLayer
    layers = (StateLayer(0, (96, 3), (8, 16, 16)), StateLayer(2, (64, 2)))   # GDN, short conv
    one = StateCacheSpec(layers, num_slots=7)
    assert one.bytes_per_rank() == 8 * 4 * (96 * 3 + 8 * 16 * 16 + 64 * 2)
    assert StateCacheSpec(layers, num_slots=7, tp=4).bytes_per_rank() * 4 == one.bytes_per_rank()
    caches = StateCacheSpec(layers, num_slots=7, tp=2).allocate()
    assert caches[0][0].shape == (8, 48, 3) and caches[0][1].shape == (8, 4, 16, 16)
    assert caches[2][1] is None and caches[2][0].shape == (8, 32, 2)
    with pytest.raises(DCPConfigError, match=r"tp=3 does not divide layer 0: heads 8, "
                                             r"layer 2: conv channels 64"):
        StateCacheSpec(layers, num_slots=7, tp=3)


def test_a_one_group_mamba2_state_keeps_b_and_c_whole_on_every_rank():
    """One Mamba2 group cut by heads: the conv state's x channels (128) cut tp ways, B's and
    C's (2·N = 16, ``conv_whole``) whole on every rank, the ssm state by heads; a tp that
    does not divide the x channels is refused naming them."""
    from dcp_compile.runtime.errors import DCPConfigError
    from dcp_compile.runtime.serving.state_cache import StateCacheSpec, StateLayer
    layer = StateLayer(0, (144, 3), (8, 16, 8), conv_whole=16)
    spec = StateCacheSpec((layer,), num_slots=3, tp=4)
    assert spec.shapes(layer) == ((4, 128 // 4 + 16, 3), (4, 2, 16, 8))
    assert spec.bytes_per_rank() == 4 * 4 * ((32 + 16) * 3 + 2 * 16 * 8)
    with pytest.raises(DCPConfigError, match=r"tp=3 does not divide layer 0: conv channels "
                                             r"128, layer 0: heads 8"):
        StateCacheSpec((layer,), num_slots=3, tp=3)
