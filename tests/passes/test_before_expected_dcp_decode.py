"""dcp_decode and dcp_context, Before/Expected: one `dcp.attention` of a rank's heads (after
shard_tensor_parallel) becomes the spec's DCP decode pattern (owner-only cache write, Q
all-gather, partial attention over the local shard, LSE all-gather + correction,
reduce-scatter of the heads) or, for the context step, plain attention with owner-only
writes. With dcp=1 the rewrite computes exactly what the attention did."""

import pytest
import torch

from dcp_compile import DCPTransformError
from dcp_compile.passes.collectives import collective_summary
from dcp_compile.passes.dcp_decode import DCPContext, DCPDecode

from before_expected import assert_code, attention_inputs, before, call, context, run_alone, \
    run_world

dcp = torch.ops.dcp


def _attention(tp_rank, q, k, v, key_cache, value_cache, positions, block_table):
    out, kc, vc = dcp.attention.default(q, k, v, key_cache, value_cache, positions,
                                        block_table, 0.5)
    return out, kc, vc


def _before(tokens=1, dtype=torch.float32):
    # One rank's share: 2 q heads, 1 KV head, head_dim 8, batch 2.
    inputs = attention_inputs(tokens=tokens, hq=2, hkv=1, start=20)
    for k in ("q", "k", "v", "key_cache", "value_cache"):
        inputs[k] = inputs[k].to(dtype)
    return before(_attention, tp_rank=torch.tensor(0), **inputs)


# tp=4, dcp=2, interleave = block = 16; b=2, s=1, hq=2, d=8 (W*hq = 4 heads gathered).
DECODE = """
    def forward(self, tp_rank, q, k, v, key_cache, value_cache, positions, block_table):
        cp_rank = aten.remainder.Scalar(tp_rank, 2)
        slot_mapping = dcp.slot_mapping.default(positions, block_table, cp_rank, 2, 16, 16)
        select_int = aten.select.int(positions, 1, 0)
        prior_local = dcp.local_filled.default(select_int, cp_rank, 2, 16, 16)
        active_mask_default = dcp.active_mask.default(positions, cp_rank, 2, 16, 16)
        eq_scalar = aten.eq.Scalar(active_mask_default, 1)
        current_key_positions = aten.where.ScalarOther(eq_scalar, positions, -1)
        cache_write_default = dcp.cache_write.default(key_cache, value_cache, k, v, slot_mapping)
        getitem = cache_write_default[0]
        getitem_1 = cache_write_default[1]
        all_gather_into_tensor_default = _c10d_functional.all_gather_into_tensor.default(q, 2, 'dcp_role:dcp')
        wait_tensor_default = _c10d_functional.wait_tensor.default(all_gather_into_tensor_default)
        view_default = aten.view.default(wait_tensor_default, [2, 2, 1, 2, 8])
        permute_default = aten.permute.default(view_default, [1, 2, 0, 3, 4])
        reshape_default = aten.reshape.default(permute_default, [2, 1, 4, 8])
        partial_attention_default = dcp.partial_attention.default(reshape_default, positions, k, v, current_key_positions, getitem, getitem_1, block_table, prior_local, cp_rank, 2, 16, 0.5)
        getitem_2 = partial_attention_default[0]
        getitem_3 = partial_attention_default[1]
        all_gather_into_tensor_default_1 = _c10d_functional.all_gather_into_tensor.default(getitem_3, 2, 'dcp_role:dcp')
        wait_tensor_default_1 = _c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1)
        view_default_1 = aten.view.default(wait_tensor_default_1, [2, 2, 1, 4])
        lse_correct_default = dcp.lse_correct.default(getitem_2, getitem_3, view_default_1)
        to_dtype = aten.to.dtype(lse_correct_default, torch.float32)
        view_default_2 = aten.view.default(to_dtype, [2, 1, 2, 2, 8])
        permute_default_1 = aten.permute.default(view_default_2, [2, 0, 1, 3, 4])
        reshape_default_1 = aten.reshape.default(permute_default_1, [4, 1, 2, 8])
        reduce_scatter_tensor_default = _c10d_functional.reduce_scatter_tensor.default(reshape_default_1, 'sum', 2, 'dcp_role:dcp')
        wait_tensor_default_2 = _c10d_functional.wait_tensor.default(reduce_scatter_tensor_default)
        to_dtype_1 = aten.to.dtype(wait_tensor_default_2, torch.float32)
        return (to_dtype_1, getitem, getitem_1)
    """


def test_decode_all_gather_combine():
    p = DCPDecode(context(4, 2, "decode"))
    gm = run_alone(p, _before())
    assert_code(gm, DECODE)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert tuple(out.meta["val"].shape) == (2, 1, 2, 8)     # this rank's heads again
    assert p.inserted == {"mask": 4, "cache_write": 1, "collective": 3, "lse_combine": 1,
                          "attention": 1}


# Steps 5-8 as one all-to-all of the partial outputs packed with their LSEs (d + 1 = 9).
ALL_TO_ALL_COMBINE = """
        getitem_2 = partial_attention_default[0]
        getitem_3 = partial_attention_default[1]
        view_default_1 = aten.view.default(getitem_2, [2, 1, 2, 2, 8])
        permute_default_1 = aten.permute.default(view_default_1, [2, 0, 1, 3, 4])
        to_dtype = aten.to.dtype(permute_default_1, torch.float32)
        view_default_2 = aten.view.default(getitem_3, [2, 1, 2, 2, 1])
        permute_default_2 = aten.permute.default(view_default_2, [2, 0, 1, 3, 4])
        cat_default = aten.cat.default([to_dtype, permute_default_2], -1)
        reshape_default_1 = aten.reshape.default(cat_default, [4, 1, 2, 9])
        all_to_all_single_default = _c10d_functional.all_to_all_single.default(reshape_default_1, [2, 2], [2, 2], 'dcp_role:dcp')
        wait_tensor_default_1 = _c10d_functional.wait_tensor.default(all_to_all_single_default)
        view_default_3 = aten.view.default(wait_tensor_default_1, [2, 2, 1, 2, 9])
        slice_tensor = aten.slice.Tensor(view_default_3, -1, 0, 8)
        slice_tensor_1 = aten.slice.Tensor(view_default_3, -1, 8, 9)
        reshape_default_2 = aten.reshape.default(slice_tensor_1, [2, 2, 1, 2])
        lse_merge_default = dcp.lse_merge.default(slice_tensor, reshape_default_2)
        to_dtype_1 = aten.to.dtype(lse_merge_default, torch.float32)
        return (to_dtype_1, getitem, getitem_1)
    """


def test_decode_all_to_all_combine():
    gm = run_alone(DCPDecode(context(4, 2, "decode", combine="all_to_all")), _before())
    head = DECODE[:DECODE.index("        getitem_2")]      # up to the partial attention
    assert_code(gm, head + ALL_TO_ALL_COMBINE.lstrip("\n"))


# Bytes each DCP collective moves (b=2, hq=2 q heads per rank, d=8, W = dcp), float32.
B, HQ, D = 2, 2, 8


@pytest.mark.parametrize("tp,dcp_", [(4, 2), (8, 4)], ids=["tp4-dcp2", "tp8-dcp4"])
def test_all_gather_combine_bytes(tp, dcp_):
    p = DCPDecode(context(tp, dcp_, "decode"))
    gm = run_alone(p, _before())
    on_dcp = [c for c in collective_summary(gm) if c["role"] == "dcp"]
    assert [(c["op"], c["layer"]) for c in on_dcp] == [
        ("all_gather_into_tensor", 0), ("all_gather_into_tensor", 0),
        ("reduce_scatter_tensor", 0)]
    q_gather, lse_gather, heads_rs = on_dcp
    assert q_gather["bytes_in"] == B * HQ * D * 4                   # this rank's q heads
    assert q_gather["bytes_out"] == dcp_ * B * HQ * D * 4           # the replica set's
    assert lse_gather["bytes_in"] == B * dcp_ * HQ * 4              # float32 LSE
    assert heads_rs["bytes_in"] == dcp_ * B * HQ * D * 4            # corrected partials
    assert heads_rs["bytes_out"] == B * HQ * D * 4
    assert p.inserted["collective"] == 3 and p.inserted["lse_combine"] == 1


@pytest.mark.parametrize("tp,dcp_", [(4, 2), (8, 4)], ids=["tp4-dcp2", "tp8-dcp4"])
def test_all_to_all_combine_bytes(tp, dcp_):
    """Q all-gather, then one all-to-all of the partial outputs packed with their float32
    LSEs, merged locally: 2 DCP collectives per layer instead of 3."""
    p = DCPDecode(context(tp, dcp_, "decode", combine="all_to_all"))
    gm = run_alone(p, _before())
    on_dcp = [c for c in collective_summary(gm) if c["role"] == "dcp"]
    assert [c["op"] for c in on_dcp] == ["all_gather_into_tensor", "all_to_all_single"]
    a2a = on_dcp[1]
    # Every rank's W*hq partial heads (d floats + 1 LSE each) out; as many in, W sources.
    assert a2a["shape_in"] == (dcp_ * B, 1, HQ, D + 1)
    assert a2a["bytes_in"] == a2a["bytes_out"] == dcp_ * B * HQ * (D + 1) * 4
    assert p.inserted["collective"] == 2 and p.inserted["lse_combine"] == 1


@pytest.mark.parametrize("combine,collective", [("all_gather", "reduce_scatter_tensor"),
                                                ("all_to_all", "all_to_all_single")])
def test_combine_dtype_model_sends_the_partial_outputs_in_the_model_dtype(combine, collective):
    """combine_dtype='model' on a bf16 graph: the partial outputs travel as bf16 (half the
    bytes); the all-to-all carries each float32 LSE as two bf16 words."""
    ctx = context(4, 2, "decode", combine=combine, combine_dtype="model")
    gm = run_alone(DCPDecode(ctx), _before(dtype=torch.bfloat16))
    combine_op = next(c for c in collective_summary(gm) if c["op"] == collective)
    width = D + 2 if combine == "all_to_all" else D
    assert combine_op["bytes_in"] == 2 * B * HQ * width * 2             # bf16 elements


def test_decode_rewrite_refuses_a_width_beyond_the_proof():
    with pytest.raises(DCPTransformError, match="proven for widths 1..64"):
        run_alone(DCPDecode(context(4, 2, "decode")), _before(tokens=65))


def test_width_k_decode_reads_every_key_through_the_query_bound():
    gm = run_alone(DCPDecode(context(4, 2, "decode")), _before(tokens=3))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    dcp_ops = torch.ops.dcp
    assert targets.count(dcp_ops.query_bound.default) == 1
    assert targets.count(dcp_ops.partial_attention.default) == 1
    assert dcp_ops.active_mask.default not in targets


def test_context_step_is_plain_attention_with_owner_only_writes():
    gm = run_alone(DCPContext(context(4, 2, "context")), _before(tokens=4))
    assert_code(gm, """
        def forward(self, tp_rank, q, k, v, key_cache, value_cache, positions, block_table):
            cp_rank = aten.remainder.Scalar(tp_rank, 2)
            slot_mapping = dcp.slot_mapping.default(positions, block_table, cp_rank, 2, 16, 16)
            select_int = aten.select.int(positions, 1, 0)
            no_prior = aten.mul.Tensor(select_int, 0)
            cache_write_default = dcp.cache_write.default(key_cache, value_cache, k, v, slot_mapping)
            getitem = cache_write_default[0]
            getitem_1 = cache_write_default[1]
            partial_attention_default = dcp.partial_attention.default(q, positions, k, v, positions, getitem, getitem_1, block_table, no_prior, cp_rank, 2, 16, 0.5)
            getitem_2 = partial_attention_default[0]
            return (getitem_2, getitem, getitem_1)
        """)


def _same_values(gm, before_gm):
    for what, got, want in zip(("out", "key_cache", "value_cache"), call(gm), call(before_gm)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)


def test_decode_with_dcp1_computes_the_attention():
    """dcp=1: no collectives, and the same output and caches as the attention."""
    gm = run_alone(DCPDecode(context(2, 1, "decode")), _before())
    assert "_c10d_functional" not in gm.code
    _same_values(gm, _before())


def test_context_with_dcp1_computes_the_attention_of_a_first_chunk():
    def first_chunk(**kw):
        return before(_attention, tp_rank=torch.tensor(0),
                      **attention_inputs(tokens=4, hq=2, hkv=1, start=0))
    gm = run_alone(DCPContext(context(2, 1, "context")), first_chunk())
    _same_values(gm, first_chunk())


@pytest.mark.parametrize("combine", ["all_gather", "all_to_all"])
def test_decode_on_four_ranks_computes_each_ranks_attention(combine):
    """tp=4, dcp=2, interleave 4 (threaded world): every rank holds only its replica-set
    share of the prior tokens' K/V, yet returns the attention output of its own q heads
    over the whole sequence, as the attention did with the full cache."""
    start, hkv_total, g = 20, 2, torch.Generator().manual_seed(3)
    ctx = context(4, 2, "decode", interleave_size=4, combine=combine)
    base = attention_inputs(tokens=1, hq=2, hkv=1, start=start)
    prior_pos = torch.arange(start).expand(2, start).clone()
    prior = [(torch.randn(2, start, 1, 8, generator=g),
              torch.randn(2, start, 1, 8, generator=g)) for _ in range(hkv_total)]
    q = torch.randn(4, 2, 1, 2, 8, generator=g)                   # rank -> its q heads
    cur = [(torch.randn(2, 1, 1, 8, generator=g), torch.randn(2, 1, 1, 8, generator=g))
           for _ in range(hkv_total)]

    def caches(head, rank, dcp_):
        interleave = 4 if dcp_ > 1 else 16
        slots = dcp.slot_mapping(prior_pos, base["block_table"], torch.tensor(rank), dcp_,
                                 interleave, 16)
        empty = torch.zeros_like(base["key_cache"])
        return dcp.cache_write(empty, empty.clone(), *prior[head], slots)

    def inputs_of(dcp_):
        def of(rank):
            head = rank // 2                                      # a replica set's KV head
            kc, vc = caches(head, rank % 2 if dcp_ > 1 else 0, dcp_)
            return {**base, "tp_rank": torch.tensor(rank), "q": q[rank], "k": cur[head][0],
                    "v": cur[head][1], "key_cache": kc, "value_cache": vc}
        return of

    want = [call(_before(), **inputs_of(1)(r))[0] for r in range(4)]
    got = run_world(run_alone(DCPDecode(ctx), _before()), ctx.config, inputs_of(2))
    for rank, (out, _, _) in enumerate(got):
        torch.testing.assert_close(out, want[rank], rtol=1e-5, atol=1e-5, msg=f"rank {rank}")


def test_context_on_four_ranks_writes_each_ranks_share():
    """tp=4, dcp=2, interleave 4 (threaded world), a first chunk of 16 tokens: every rank
    returns the plain attention output, and its caches hold exactly the positions its
    cp_rank owns, where the DCP slot mapping puts them."""
    ctx = context(4, 2, "context", interleave_size=4)
    inputs = attention_inputs(tokens=16, hq=2, hkv=1, start=0)
    inputs["key_cache"] = torch.zeros_like(inputs["key_cache"])
    inputs["value_cache"] = torch.zeros_like(inputs["value_cache"])

    def of(rank):
        return {**inputs, "tp_rank": torch.tensor(rank)}

    def first_chunk():
        return before(_attention, tp_rank=torch.tensor(0), **inputs)
    want_out = call(first_chunk())[0]
    got = run_world(run_alone(DCPContext(ctx), first_chunk()), ctx.config, of)
    for rank, (out, kc, vc) in enumerate(got):
        slots = dcp.slot_mapping(inputs["positions"], inputs["block_table"],
                                 torch.tensor(rank % 2), 2, 4, 16)
        want_kc, want_vc = dcp.cache_write(inputs["key_cache"], inputs["value_cache"],
                                           inputs["k"], inputs["v"], slots)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc), f"rank {rank}"
        assert (slots >= 0).sum() == 2 * 8               # half of each 16-token row


def _attention_named_like_the_metadata(tp_rank, q, k, v, key_cache, value_cache, positions,
                                       block_table, slot_mapping, cp_rank, prior_local):
    """A step whose inputs carry the names the pass gives its own nodes (vLLM-style models
    take a ``slot_mapping`` input): the step adds them to its output, so a metadata node
    that took one of those names would shadow the input in the generated code."""
    out, kc, vc = dcp.attention.default(q, k, v, key_cache, value_cache, positions,
                                        block_table, 0.5)
    return out + (slot_mapping + cp_rank + prior_local).sum(), kc, vc


def test_metadata_names_never_shadow_a_step_input_of_the_same_name():
    inputs = {**attention_inputs(tokens=1, hq=2, hkv=1, start=20), "tp_rank": torch.tensor(0),
              "slot_mapping": torch.tensor([1.0]), "cp_rank": torch.tensor([2.0]),
              "prior_local": torch.tensor([3.0])}
    gm = run_alone(DCPDecode(context(4, 1, "decode")),
                   before(_attention_named_like_the_metadata, **inputs))
    names = [n.name for n in gm.graph.nodes]
    assert len(names) == len(set(names)), sorted(names)
    assert {"slot_mapping", "cp_rank", "prior_local"} <= {
        n.name for n in gm.graph.nodes if n.op == "placeholder"}
    gm.recompile()
    want = call(before(_attention_named_like_the_metadata, **inputs), **inputs)[0]
    torch.testing.assert_close(gm(**inputs)[0], want)
