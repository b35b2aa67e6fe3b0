"""sequence_parallel + dcp_prefill: the picture of the prefill rewrite, per layer, with bytes.

The spec's Compute Pattern, per layer (W = dcp, S_pad = S rounded up to TP, C = the owned
capacity, S/W when W*I divides S):
  1 all_gather world  [B, S_pad/TP, H] -> full     5 all_gather cp_kv  Q [B, C, hq, D]
  2 interleave slice  S -> C                        6 unshuffle         [B, W*C] -> [B, S]
  3 q/k/v projections on C tokens                   7 partial attention, LSE all_gather cp_kv
  4 cache write of owned slots                      8 reduce_scatter cp_kv  S_pad -> S_pad/W
                                                    9 O projection, reduce_scatter dcp_tp
plus the MLP's all_gather / reduce_scatter over world (sequence parallelism between layers).
"""

import functools

import pytest
import torch

import dcp_compile
from dcp_compile.runtime import layout
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.ops import owned_capacity
from dcp_compile.passes.canonicalize_attention import CanonicalizeAttention
from dcp_compile.passes.collectives import collective_summary
from dcp_compile.passes.dcp_prefill import DCPPrefill
from dcp_compile.passes.drop_export_asserts import DropExportAsserts
from dcp_compile.passes.infra import TransformContext
from dcp_compile.passes.insert_rank import InsertRank
from dcp_compile.passes.sequence_parallel import SPEC_STEP, SequenceParallel
from dcp_compile.passes.shard_tensor_parallel import ShardTensorParallel
from dcp_compile.passes.validate_and_prove import ValidateAndProve

from passes_helpers import ctx_for, op_counts, run, tiny_graph

AG, RS = "all_gather_into_tensor", "reduce_scatter_tensor"
BATCH, H, HQ, D = 2, 128, 16, 8


def _sharded(tp, dcp, tokens, interleave, layers=1, model=None):
    if model is None:
        model, cap = tiny_graph(tokens=tokens, batch=BATCH, block=interleave,
                                cfg=DemoConfig(num_layers=layers))
    else:
        from dcp_compile.capture import capture, example_step_inputs
        cap = capture(model, example_step_inputs(
            BATCH, tokens, 2, model.kv_cache_shape(5, interleave), model.num_layers,
            device="cpu", dtype=torch.float32))
    ctx = TransformContext(config=DCPConfig(tp=tp, dcp=dcp, mode="prefill",
                                            block_size=interleave), step="prefill")
    gm = run(cap.gm, [DropExportAsserts(ctx), CanonicalizeAttention(ctx), ValidateAndProve(ctx),
                      InsertRank(ctx, cap.user_inputs[0]), ShardTensorParallel(ctx)])
    return ctx, gm


@functools.lru_cache(maxsize=None)
def _prefill(tp, dcp, tokens, interleave, layers=1):
    """(ctx, rewritten graph, the two passes); cached: tests only read the result."""
    ctx, gm = _sharded(tp, dcp, tokens, interleave, layers)
    sp, p = SequenceParallel(ctx), DCPPrefill(ctx)
    return ctx, run(gm, [sp, p]), sp, p


CASES = [  # tp, dcp, S, I
    pytest.param(4, 2, 32, 8, id="tp4-dcp2-S32-I8-aligned"),
    pytest.param(8, 4, 64, 16, id="tp8-dcp4-S64-I16-aligned"),
    pytest.param(8, 4, 30, 8, id="tp8-dcp4-S30-I8-padded-S_pad32"),
]


@pytest.mark.parametrize("tp,dcp,S,I", CASES)
def test_nine_steps_per_layer_in_spec_order(tp, dcp, S, I):
    _, gm, _, _ = _prefill(tp, dcp, S, I, layers=2)
    for layer in range(2):
        steps = [n.meta[SPEC_STEP] for n in gm.graph.nodes
                 if SPEC_STEP in n.meta and n.meta.get("dcp_layer") == layer]
        assert sorted(set(steps)) == list(range(1, 10)), f"layer {layer}: {steps}"
        firsts = [steps.index(s) for s in range(1, 10)]
        assert firsts == sorted(firsts), f"layer {layer} steps out of order: {steps}"
    ops = op_counts(gm)
    assert ops["dcp.attention.default"] == 0 and ops["_c10d_functional.all_reduce.default"] == 0
    for op in ("cache_write", "partial_attention", "lse_correct"):
        assert ops[f"dcp.{op}.default"] == 2, op
    # Per-step index metadata is built once per graph and shared by the layers.
    for op in ("interleave_slice_index", "q_unshuffle_index", "slot_mapping", "local_filled"):
        assert ops[f"dcp.{op}.default"] == 1, op


@pytest.mark.parametrize("tp,dcp,S,I", CASES)
def test_collectives_roles_and_bytes(tp, dcp, S, I):
    _, gm, _, _ = _prefill(tp, dcp, S, I)
    s_pad = -(-S // tp) * tp
    hq = HQ // (tp // dcp)                    # q heads per rank: sharded over dcp_tp_group
    C = owned_capacity(S, dcp=dcp, interleave=I)
    if S % (dcp * I) == 0:
        assert C == S // dcp                  # the spec's S/DCP
    f32 = 4
    got = [(c["op"], c["role"], c["layer"], c["bytes_in"], c["bytes_out"])
           for c in collective_summary(gm)]
    expected = [
        (RS, "world", None, BATCH * s_pad * H * f32, BATCH * s_pad // tp * H * f32),  # embed
        # 1. SP all-gather over world: S/TP -> S
        (AG, "world", 0, BATCH * s_pad // tp * H * f32, BATCH * s_pad * H * f32),
        # 5. Q all-gather over cp_kv: C -> W*C tokens of this rank's q heads
        (AG, "cp_kv", 0, BATCH * C * hq * D * f32, dcp * BATCH * C * hq * D * f32),
        # 7. LSE all-gather over cp_kv (float32)
        (AG, "cp_kv", 0, BATCH * S * hq * f32, dcp * BATCH * S * hq * f32),
        # 8. reduce-scatter over cp_kv: S_pad -> S_pad/W (corrected partials, float32)
        (RS, "cp_kv", 0, BATCH * s_pad * hq * D * f32, BATCH * s_pad // dcp * hq * D * f32),
        # 9. O projection output, reduce-scatter over dcp_tp: S_pad/W -> S_pad/TP
        (RS, "dcp_tp", 0, BATCH * s_pad // dcp * H * f32, BATCH * s_pad // tp * H * f32),
        # MLP: sequence parallelism over world
        (AG, "world", 0, BATCH * s_pad // tp * H * f32, BATCH * s_pad * H * f32),
        (RS, "world", 0, BATCH * s_pad * H * f32, BATCH * s_pad // tp * H * f32),
        # final norm on S/TP, gather, vocab-parallel LM head, gather the vocab shards
        (AG, "world", None, BATCH * s_pad // tp * H * f32, BATCH * s_pad * H * f32),
        (AG, "world", None, BATCH * S * 256 // tp * f32, BATCH * S * 256 * f32),
    ]
    assert got == expected


def test_padding_nodes_only_when_S_does_not_split_over_tp():
    _, gm, sp, p = _prefill(8, 4, 30, 8)
    assert sp.matched["padded_tokens"] == 32 and sp.matched["tokens_per_rank"] == 4
    assert op_counts(gm)["aten.constant_pad_nd.default"] == 3   # embed RS, cp_kv RS, MLP RS
    _, gm, sp, _ = _prefill(8, 4, 32, 8)
    assert op_counts(gm)["aten.constant_pad_nd.default"] == 0


def test_cp_rank_is_tp_rank_floor_div_tp_over_dcp():
    _, gm, _, _ = _prefill(8, 4, 32, 8)
    cp = next(n for n in gm.graph.nodes if n.name == "cp_rank")
    assert cp.target == torch.ops.aten.floor_divide.default
    assert cp.args == (next(n for n in gm.graph.nodes if n.name == "tp_rank"), 2)


def test_inserted_nodes_are_tagged_by_kind():
    _, gm, sp, p = _prefill(4, 2, 32, 8, layers=2)
    assert p.inserted["cache_write"] == 2 and p.inserted["lse_combine"] == 2
    assert p.inserted["attention"] == 2
    assert p.inserted["collective"] == 2 * 4              # steps 5, 7 (LSE), 8, 9 per layer
    assert sp.inserted["collective"] == 1 + 2 * 3 + 1     # embed RS, per layer 3, LM head AG
    kinds = {n.meta.get("dcp_kind") for n in gm.graph.nodes}
    assert {"collective", "slice", "mask", "cache_write", "lse_combine"} <= kinds
    # RoPE's cos and sin are sliced once for every layer.
    assert p.matched["side_inputs_sliced"] == 2


def test_transform_runs_sequence_parallel_right_before_dcp_prefill():
    model = demo_model(DemoConfig(num_layers=1))
    from dcp_compile.runtime.engine import StepShapes
    prog = dcp_compile.transform(model, tp=4, dcp=2, mode="prefill", block_size=8,
                                 shapes=StepShapes(batch=2, context_len=24, max_blocks=2,
                                                   num_blocks=5))
    names = [r.name for r in prog.history]
    assert names.index("sequence_parallel") + 1 == names.index("dcp_prefill")
    sp = next(r for r in prog.history if r.name == "sequence_parallel")
    assert sp.matched["tokens_per_rank"] == 6
    rec = next(r for r in prog.history if r.name == "dcp_prefill")
    assert rec.matched["owned_capacity"] == 8 + min(24 % 16, 8)
    assert list(prog.graphs) == ["prefill"]
    per_layer = prog.collectives_per_layer("prefill")
    assert per_layer["all_gather_into_tensor@cp_kv"] == 2
    assert per_layer["reduce_scatter_tensor@dcp_tp"] == 1


def test_token_mixing_in_the_residual_stream_is_refused():
    model = demo_model(DemoConfig(num_layers=1))
    layer = model.layers[0]
    plain = layer.forward

    def mixing(x, *args):
        x = x + x.cumsum(1)          # mixes tokens: cannot run on S/TP shards
        return plain(x, *args)

    layer.forward = mixing
    ctx, gm = _sharded(4, 2, 16, 8, model=model)
    with pytest.raises(DCPTransformError, match=r"cumsum.*not token-wise"):
        SequenceParallel(ctx)(gm)


def test_token_mixing_on_the_qkv_path_is_refused(monkeypatch):
    """An op that moves tokens between the projections and attention (here a roll along the
    token dim inside RoPE) cannot follow the interleave slice: named error."""
    from dcp_compile.models import demo as models
    plain = models.rotate_half
    monkeypatch.setattr(models, "rotate_half", lambda x: plain(x).roll(1, dims=1))
    ctx, gm = _sharded(4, 2, 16, 8, model=demo_model(DemoConfig(num_layers=1)))
    gm = run(gm, [SequenceParallel(ctx)])
    with pytest.raises(DCPTransformError, match=r"node roll .* on the q/k/v \(layer 0\) path"):
        DCPPrefill(ctx)(gm)


def test_decode_mode_is_refused():
    ctx = ctx_for(4, 2, "decode")
    _, cap = tiny_graph()
    with pytest.raises(DCPTransformError, match="prefill"):
        SequenceParallel(ctx)(cap.gm)


# -- the index ops against the spec's formulas ----------------------------------------------


def _positions(start, length, S):
    pos = torch.full((1, S), -1)
    pos[0, :length] = torch.arange(start, start + length)
    return pos


@pytest.mark.parametrize("W,I", [(2, 8), (4, 16), (4, 8), (8, 8)])
def test_aligned_chunk_slice_is_the_spec_view(W, I):
    """Aligned start, full chunk: exactly view(S // (W*I), W, I)[:, R, :] and its inverse."""
    S = 3 * W * I
    for start in (0, W * I, 5 * W * I):
        pos = _positions(start, S, S)
        un = torch.ops.dcp.q_unshuffle_index(pos, S // W, W, I, I)[0]
        for R in range(W):
            got = torch.ops.dcp.interleave_slice_index(pos, torch.tensor(R), S // W, W, I, I)
            spec = torch.arange(S).view(S // (W * I), W, I)[:, R, :].reshape(-1)
            assert torch.equal(got[0], spec)
            assert torch.equal(got[0], layout.interleave_slice_index(
                torch.arange(S // W), R, dcp=W, interleave=I))
        assert torch.equal(un, layout.q_unshuffle_index(torch.arange(S), S, dcp=W,
                                                        interleave=I))


@pytest.mark.parametrize("W,I", [(2, 8), (4, 16), (4, 4)])
def test_any_start_keeps_exactly_the_owned_positions(W, I):
    """Brute force over starts in two vblocks and lengths: the slice is the owned tokens in
    order, padded with -1; the unshuffle finds every token; the capacity bound is tight."""
    kw = dict(dcp=W, interleave=I, block=I)
    for S in (1, W * I - 1, W * I, W * I + 1, 2 * W * I + 3):
        C = owned_capacity(S, dcp=W, interleave=I)
        most = 0
        for start in range(0, 2 * W * I + 1):
            for length in {S, max(S - 2, 0)}:
                pos = _positions(start, length, S)
                un = torch.ops.dcp.q_unshuffle_index(pos, C, W, I, I)[0]
                slices = []
                for R in range(W):
                    idx = torch.ops.dcp.interleave_slice_index(pos, torch.tensor(R), C, W, I,
                                                               I)[0]
                    owned = [p for p in range(length) if layout.owner(start + p, **kw) == R]
                    assert idx.tolist() == owned + [-1] * (C - len(owned))
                    most = max(most, len(owned))
                    slices.append(idx)
                for p in range(length):
                    r, j = divmod(int(un[p]), C)
                    assert int(slices[r][j]) == p
        assert most == C, f"capacity {C} not tight for S={S}: most {most}"
