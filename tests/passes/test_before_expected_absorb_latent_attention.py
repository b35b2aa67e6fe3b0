"""absorb_latent_attention, Before/Expected: DeepSeek's MLA attention with expanded K/V
(``k = cat(k_nope, k_pe.expand(heads))``, k_nope and v per-head blocks of one kv_b_proj
linear of the latent) becomes attention in latent space over one shared head that is both
key and value, ``[latent ; k_pe]``; ``W_UK`` is folded into the query and ``W_UV`` applied to
the output. Same values; a kv_b_proj with a bias is refused; a model without MLA is left
alone."""

import pytest
import torch

from dcp_compile.passes.absorb_latent_attention import AbsorbLatentAttention
from dcp_compile.runtime.errors import DCPTransformError

from before_expected import aten, assert_code, before, call, context, run_alone

B, S, H, DN, DV, DR, L = 1, 3, 2, 4, 4, 2, 6


def _mla(p_kv_b, latent, q, k_pe):
    kv = aten.linear.default(latent, p_kv_b)                           # [B, S, H*(dn+dv)]
    kv = aten.transpose.int(aten.view.default(kv, [B, S, H, DN + DV]), 1, 2)
    parts = aten.split_with_sizes.default(kv, [DN, DV], -1)
    k = aten.cat.default([parts[0], aten.expand.default(k_pe, [B, H, S, DR])], -1)
    return (aten.scaled_dot_product_attention.default(q, k, parts[1], is_causal=True),)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(p_kv_b=torch.randn(H * (DN + DV), L, generator=g),
                latent=torch.randn(B, S, L, generator=g),
                q=torch.randn(B, H, S, DN + DR, generator=g),
                k_pe=torch.randn(B, 1, S, DR, generator=g))


# q_abs = cat(q_nope_h @ W_UK_h, q_pe) [B, H, S, L + dr]; kv = cat(latent, k_pe) [B, 1, S,
# L + dr], both the key and the value, GQA over the H query heads at the original scale
# (dn + dr) ** -0.5; the output's first L columns times W_UV_h^T are the [B, H, S, dv] result.
EXPECTED = """
    def forward(self, p_kv_b, latent, q, k_pe):
        unsqueeze_default = aten.unsqueeze.default(latent, 2)
        transpose_int = aten.transpose.int(k_pe, 1, 2)
        cat_default = aten.cat.default([unsqueeze_default, transpose_int], -1)
        transpose_int_1 = aten.transpose.int(cat_default, 1, 2)
        slice_tensor = aten.slice.Tensor(q, 3, 0, 4)
        slice_tensor_1 = aten.slice.Tensor(q, 3, 4, 6)
        view_default = aten.view.default(p_kv_b, [2, 8, 6])
        slice_tensor_2 = aten.slice.Tensor(view_default, 1, 0, 4)
        unsqueeze_default_1 = aten.unsqueeze.default(slice_tensor_2, 0)
        matmul_default = aten.matmul.default(slice_tensor, unsqueeze_default_1)
        cat_default_1 = aten.cat.default([matmul_default, slice_tensor_1], -1)
        scaled_dot_product_attention_default = aten.scaled_dot_product_attention.default(cat_default_1, transpose_int_1, transpose_int_1, attn_mask = None, is_causal = True, scale = 0.408248290463863, enable_gqa = True)
        slice_tensor_3 = aten.slice.Tensor(scaled_dot_product_attention_default, 3, 0, 6)
        view_default_1 = aten.view.default(p_kv_b, [2, 8, 6])
        slice_tensor_4 = aten.slice.Tensor(view_default_1, 1, 4, 8)
        transpose_int_2 = aten.transpose.int(slice_tensor_4, 1, 2)
        unsqueeze_default_2 = aten.unsqueeze.default(transpose_int_2, 0)
        matmul_default_1 = aten.matmul.default(slice_tensor_3, unsqueeze_default_2)
        return (matmul_default_1,)
    """


def test_mla_attention_attends_in_latent_space_over_one_shared_head():
    p = AbsorbLatentAttention(context(2, 1, "context"))
    gm = run_alone(p, before(_mla, **_inputs()))
    assert_code(gm, EXPECTED)
    assert p.matched == {"mla_layers": 1}
    mla = p.ctx.facts.mla
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim) == (L, DR)


def test_same_values_as_before():
    gm = run_alone(AbsorbLatentAttention(context(2, 1, "context")), before(_mla, **_inputs()))
    (got,), (want,) = call(gm), call(before(_mla, **_inputs()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _mla_biased(p_kv_b, p_bias, latent, q, k_pe):
    kv = aten.linear.default(latent, p_kv_b, p_bias)
    kv = aten.transpose.int(aten.view.default(kv, [B, S, H, DN + DV]), 1, 2)
    parts = aten.split_with_sizes.default(kv, [DN, DV], -1)
    k = aten.cat.default([parts[0], aten.expand.default(k_pe, [B, H, S, DR])], -1)
    return (aten.scaled_dot_product_attention.default(q, k, parts[1], is_causal=True),)


def test_a_kv_b_proj_with_a_bias_is_refused():
    gm = before(_mla_biased, p_bias=torch.randn(H * (DN + DV)), **_inputs())
    with pytest.raises(DCPTransformError, match=r"kv_b_proj \(p_kv_b\) has a bias.*at node "
                                                r"scaled_dot_product_attention"):
        run_alone(AbsorbLatentAttention(context(2, 1, "context")), gm)


def test_attention_without_mla_is_left_alone():
    def f(q, k, v):
        return (aten.scaled_dot_product_attention.default(q, k, v, is_causal=True),)
    x = torch.randn(B, H, S, DN)
    p = AbsorbLatentAttention(context(2, 1, "context"))
    gm = run_alone(p, before(f, q=x, k=x.clone(), v=x.clone()))
    assert_code(gm, """
        def forward(self, q, k, v):
            scaled_dot_product_attention_default = aten.scaled_dot_product_attention.default(q, k, v, is_causal = True)
            return (scaled_dot_product_attention_default,)
        """)
    assert p.matched == {"mla_layers": 0} and p.ctx.facts.mla is None


# -- torchtitan's tokens-first key -----------------------------------------------------------

def _mla_tokens_first(p_kv_b, latent, q, k_pe):
    """torchtitan's DeepSeek-V3: the key built [B, S, H, D] (k_pe [B, S, 1, dr] expanded over
    the heads' dim 2), the value split likewise; its inner attention transposes q, k, v."""
    kv = aten.view.default(aten.linear.default(latent, p_kv_b), [B, S, H, DN + DV])
    parts = aten.split_with_sizes.default(kv, [DN, DV], -1)
    k = aten.cat.default([parts[0], aten.expand.default(k_pe, [-1, -1, H, -1])], -1)
    return (aten.scaled_dot_product_attention.default(
        q, aten.transpose.int(k, 1, 2), aten.transpose.int(parts[1], 1, 2), is_causal=True),)


def _tokens_first_inputs(seed=0):
    inputs = _inputs(seed)
    inputs["k_pe"] = inputs["k_pe"].transpose(1, 2).contiguous()     # [B, S, 1, dr]
    return inputs


def test_a_tokens_first_mla_key_is_absorbed_too():
    """The key's transpose moves in front of its cat and expand (heads_first_keys), so the
    attention reads as DeepSeek's layout and is absorbed: the same latent graph as above
    but for k_pe, transposed twice on its way into the latent head."""
    p = AbsorbLatentAttention(context(2, 1, "context"))
    gm = run_alone(p, before(_mla_tokens_first, **_tokens_first_inputs()))
    assert p.matched == {"mla_layers": 1}
    sdpa = [n for n in gm.graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 1 and tuple(sdpa[0].args[1].meta["val"].shape) == (B, 1, S, L + DR)
    assert not any(n.target == aten.expand.default for n in gm.graph.nodes)
    (got,), (want,) = call(gm), call(before(_mla_tokens_first, **_tokens_first_inputs()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
