"""The recurrent ops (runtime/kernels/recurrent.py; RecurrentGemma's conv + dcp.rg_lru) drawn
at random: any split of each row's tokens into chunks, rows of any lengths (0 included: a
padding row) packed in one batch, any slots, gives the outputs and end states of the whole
sequence run at once; slots no row names keep their bytes; a padding row changes only the
garbage slot. A width-K step that keeps a state snapshot per draft position rolls back
exactly to any accepted prefix."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_compile.runtime.kernels.recurrent import gated_delta_net, mamba2_ssm, short_conv
from dcp_compile.runtime.kernels.rg_lru import rg_lru

SLOTS, K = 5, 3


def _gdn(gen, B, S):
    nk, dk, nv, dv = 1, 4, 2, 3
    C = 2 * nk * dk + nv * dv
    data = dict(x=torch.randn(B, S, C, generator=gen), g=-torch.rand(B, S, nv, generator=gen),
                beta=torch.rand(B, S, nv, generator=gen))
    weight = torch.randn(C, K, generator=gen)
    shapes = ((C, K - 1), (nv, dk, dv))

    def run(d, conv, rec, slot, fresh, lengths, snapshot_slot=None):
        return gated_delta_net(d["x"], d["g"], d["beta"], weight, conv, rec, slot, fresh,
                               lengths, nk, dk, dv, snapshot_slot=snapshot_slot)
    return data, shapes, run


def _mamba2(gen, B, S):
    G, H, P, N = 2, 4, 2, 3
    C = H * P + 2 * G * N
    data = dict(x=torch.randn(B, S, C, generator=gen), dt=torch.randn(B, S, H, generator=gen))
    w = dict(conv_weight=torch.randn(C, K, generator=gen), conv_bias=torch.randn(C, generator=gen),
             A_log=0.3 * torch.randn(H, generator=gen), D=torch.randn(H, generator=gen),
             dt_bias=torch.randn(H, generator=gen))
    shapes = ((C, K - 1), (H, P, N))

    def run(d, conv, rec, slot, fresh, lengths, snapshot_slot=None):
        return mamba2_ssm(d["x"], d["dt"], w["conv_weight"], w["conv_bias"], w["A_log"], w["D"],
                          w["dt_bias"], conv, rec, slot, fresh, lengths, G, P, N, "silu", 0.0,
                          float("inf"), snapshot_slot=snapshot_slot)
    return data, shapes, run


def _short(gen, B, S):
    C = 5
    data = dict(x=torch.randn(B, S, C, generator=gen))
    weight, bias = torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    shapes = ((C, K - 1), (1,))       # no recurrent state: its cache only passes through

    def run(d, conv, rec, slot, fresh, lengths, snapshot_slot=None):
        out, conv = short_conv(d["x"], weight, bias, conv, slot, fresh, lengths, snapshot_slot)
        return out, conv, rec
    return data, shapes, run


def _rglru(gen, B, S):
    """RecurrentGemma's block core: its conv (dcp.short_conv), then dcp.rg_lru (2 heads)."""
    H, bw = 2, 3
    W = H * bw
    data = dict(x=torch.randn(B, S, W, generator=gen))
    weight, bias = torch.randn(W, K, generator=gen), torch.randn(W, generator=gen)
    gates = [torch.randn(*shape, generator=gen) for shape in
             ((H, bw, bw), (H, bw), (H, bw, bw), (H, bw), (W,))]
    shapes = ((W, K - 1), (W,))

    def run(d, conv, rec, slot, fresh, lengths, snapshot_slot=None):
        x, conv = short_conv(d["x"], weight, bias, conv, slot, fresh, lengths, snapshot_slot)
        h, rec = rg_lru(x, *gates, rec, slot, fresh, lengths, snapshot_slot)
        return h, conv, rec
    return data, shapes, run


OPS = [_gdn, _mamba2, _short, _rglru]


@st.composite
def cases(draw):
    op = draw(st.sampled_from(OPS))
    lengths = draw(st.lists(st.integers(0, 7), min_size=1, max_size=3))
    chunk = draw(st.integers(1, 4))
    slots = draw(st.permutations(range(SLOTS)))[:len(lengths)]
    seed = draw(st.integers(0, 2 ** 16))
    return op, lengths, chunk, slots, seed


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(cases())
def test_chunks_with_carried_state_equal_the_whole_sequence(case):
    op, lengths, chunk, slots, seed = case
    gen = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(max(lengths), 1)
    data, (conv_shape, rec_shape), run = op(gen, B, S)
    lengths_t = torch.tensor(lengths)
    # padding rows (length 0) name no slot
    slot_t = torch.tensor([s if n else -1 for s, n in zip(slots, lengths)])
    conv0 = torch.randn(SLOTS + 1, *conv_shape, generator=gen)
    rec0 = torch.randn(SLOTS + 1, *rec_shape, generator=gen)
    # whole sequence, one step
    out, conv_w, rec_w = run(data, conv0, rec0, slot_t, torch.ones(B, dtype=torch.bool),
                             lengths_t)
    # chunk by chunk, the state carried in each row's slot
    conv, rec, start, pieces = conv0, rec0, torch.zeros(B, dtype=torch.int64), []
    while bool((start < lengths_t).any()):
        n = (lengths_t - start).clamp(min=0, max=chunk)
        idx = (start[:, None] + torch.arange(chunk)[None, :]).clamp(max=S - 1)
        piece = {k: torch.stack([v[b, idx[b]] for b in range(B)]) for k, v in data.items()}
        o, conv, rec = run(piece, conv, rec, torch.where(n > 0, slot_t, -1), start == 0, n)
        pieces.append((start.clone(), n, o))
        start = start + n
    for b, total in enumerate(lengths):
        if total:
            got = torch.cat([o[b, :n[b]] for _, n, o in pieces])
            assert (got - out[b, :total]).abs().max() < 1e-4, (b, lengths, chunk)
        assert (out[b, total:] == 0).all()          # padding tokens: no output
    named = {s for s, n in zip(slots, lengths) if n}
    for s in range(SLOTS):
        if s in named:
            assert (conv[s] - conv_w[s]).abs().max() < 1e-4
            assert (rec[s] - rec_w[s]).abs().max() < 1e-4
        else:
            assert torch.equal(conv_w[s], conv0[s]) and torch.equal(rec_w[s], rec0[s])
            assert torch.equal(conv[s], conv0[s]) and torch.equal(rec[s], rec0[s])


@st.composite
def speculative_cases(draw):
    op = draw(st.sampled_from(OPS))
    prompt = draw(st.integers(1, 5))
    width = draw(st.integers(1, 4))                # K draft positions in the verify step
    accepted = draw(st.integers(1, width))         # the first is the sampled token: kept
    after = draw(st.integers(1, 3))
    return op, prompt, width, accepted, after, draw(st.integers(0, 2 ** 16))


@settings(max_examples=40, derandomize=True, deadline=None, database=None)
@given(speculative_cases())
def test_a_rejected_draft_rolls_the_state_back_exactly(case):
    """Width-K step with per-position snapshots: continuing from the snapshot of the last
    accepted token equals never having seen the rejected drafts (outputs and states)."""
    op, prompt, width, accepted, after, seed = case
    gen = torch.Generator().manual_seed(seed)
    total = prompt + width + after
    data, (conv_shape, rec_shape), run = op(gen, 1, total)
    one = torch.ones(1, dtype=torch.int64)

    def part(a, b):
        return {k: v[:, a:b] for k, v in data.items()}

    zeros = (torch.zeros(SLOTS + 1, *conv_shape), torch.zeros(SLOTS + 1, *rec_shape))
    # speculative: prompt in slot 0, K drafts with snapshots in slots 1..K, then continue
    # from the last accepted token's snapshot
    _, conv, rec = run(part(0, prompt), *zeros, 0 * one, one.bool(), prompt * one)
    snaps = torch.arange(1, width + 1)[None]
    _, conv, rec = run(part(prompt, prompt + width), conv, rec, 0 * one, ~one.bool(),
                       width * one, snapshot_slot=snaps)
    keep = int(snaps[0, accepted - 1])
    cont = part(prompt + accepted, prompt + accepted + after)
    out_spec, conv_s, rec_s = run(cont, conv, rec, keep * one, ~one.bool(), after * one)
    # reference: only the accepted tokens, no drafts
    _, conv, rec = run(part(0, prompt + accepted), *zeros, 0 * one, one.bool(),
                       (prompt + accepted) * one)
    out_ref, conv_r, rec_r = run(cont, conv, rec, 0 * one, ~one.bool(), after * one)
    assert (out_spec - out_ref).abs().max() < 1e-4, case
    assert (conv_s[keep] - conv_r[0]).abs().max() < 1e-4
    assert (rec_s[keep] - rec_r[0]).abs().max() < 1e-4
