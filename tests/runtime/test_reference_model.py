"""The paged single-device demo model against a plain contiguous-KV SDPA implementation."""

import pytest
import torch
import torch.nn.functional as F

from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.models.demo import DemoConfig, demo_model, rope_cos_sin, rotate_half
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes
from dcp_compile.runtime.serving.kv_cache import BlockAllocator, KVCacheSpec, check_step_inputs

from helpers import assert_close_report, prompts_of


def contiguous_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of every position of one sequence, attention by SDPA over contiguous K/V."""
    cfg = model.config
    ids = torch.tensor([tokens])
    pos = torch.arange(len(tokens))[None]
    x = model.embed_tokens(ids)
    cos, sin = rope_cos_sin(pos, model.inv_freq, x.dtype)
    for layer in model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(1, len(tokens), cfg.num_q_heads, cfg.head_dim)
        k = a.k_proj(h).view(1, len(tokens), cfg.num_kv_heads, cfg.head_dim)
        v = a.v_proj(h).view(1, len(tokens), cfg.num_kv_heads, cfg.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True, scale=a.scale)
        x = x + a.o_proj(o.transpose(1, 2).reshape(1, len(tokens), -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x))[0]


def single_device_engine(model, shapes, block_size=16, fill=0.0):
    c = model.config
    spec = KVCacheSpec(c.num_layers, shapes.num_blocks, block_size, c.num_kv_heads,
                       c.head_dim)
    return Engine(LocalExecutor(model, spec.allocate(fill=fill)), shapes,
                  block_size=block_size)


@pytest.mark.parametrize("lengths", [(1, 16, 33), (5, 17, 31, 40)],
                         ids=["len=1,B,2B+1", "mixed-4"])
@torch.no_grad()
def test_paged_model_matches_contiguous_sdpa(lengths):
    model = demo_model()
    shapes = StepShapes(batch=4, context_len=40, max_blocks=8, num_blocks=40)
    # Poison unused cache rows: correct masking never reads them.
    eng = single_device_engine(model, shapes, fill=float("nan"))
    prompts = prompts_of(lengths)
    steps = 6
    res = eng.generate(prompts, steps)
    for b, prompt in enumerate(prompts):
        full = prompt + res.tokens[b]
        ref = contiguous_logits(model, full)
        for t in range(steps):
            got = res.logits[t][b]
            assert_close_report(got, ref[len(prompt) - 1 + t], atol=1e-4,
                                what=f"seq {b} step {t}")
        assert res.tokens[b] == ref[len(prompt) - 1:len(full) - 1].argmax(-1).tolist()


def test_mixed_batch_chunked_prompt_matches_whole_prompt():
    model = demo_model()
    shapes = StepShapes(batch=2, context_len=24, max_blocks=8, num_blocks=20)
    prompts = prompts_of((30, 9))
    eng = single_device_engine(model, shapes)
    eng.prefill([prompts[0][:20], prompts[1][:4]])
    last = eng.prefill([prompts[0][20:], prompts[1][4:]])
    ref = [contiguous_logits(model, p)[-1] for p in prompts]
    assert_close_report(last, torch.stack(ref), atol=1e-4)


def test_garbage_block_never_allocated_and_rejected_in_block_tables():
    alloc = BlockAllocator(num_blocks=3, tokens_per_block=16)
    alloc.ensure(0, 32)
    assert alloc.table([0], 4).tolist() == [[0, 1, -1, -1]]
    with pytest.raises(DCPInputError, match="out of KV cache blocks"):
        alloc.ensure(1, 1)
    with pytest.raises(DCPInputError, match="garbage block"):
        check_step_inputs(torch.tensor([[0]]), torch.tensor([[2, -1]]), num_blocks=3,
                          block_size=16, dcp=1)


def test_position_beyond_block_table_is_rejected_before_any_write():
    with pytest.raises(DCPInputError, match="beyond its block table"):
        check_step_inputs(torch.tensor([[16]]), torch.tensor([[0, -1]]), num_blocks=3,
                          block_size=16, dcp=1)
    with pytest.raises(DCPInputError, match="beyond its block table"):
        check_step_inputs(torch.tensor([[64]]), torch.tensor([[0, 1]]), num_blocks=3,
                          block_size=16, dcp=2)


def test_prompt_longer_than_program_is_rejected_and_cache_untouched():
    model = demo_model()
    shapes = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=4)
    eng = single_device_engine(model, shapes)
    before = [c.clone() for c in eng.executor.caches]
    with pytest.raises(DCPInputError, match="context_len"):
        eng.prefill(prompts_of((9, 3)))
    assert all(torch.equal(a, b) for a, b in zip(before, eng.executor.caches))


def test_meta_device_model_has_shapes_only():
    m = demo_model(DemoConfig(num_layers=1), device="meta")
    assert all(p.is_meta for p in m.parameters())


def test_context_prompt_step_refuses_a_second_chunk():
    model = demo_model()
    shapes = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5)
    c = model.config
    spec = KVCacheSpec(c.num_layers, shapes.num_blocks, 16, c.num_kv_heads, c.head_dim)
    eng = Engine(LocalExecutor(model, spec.allocate()), shapes, block_size=16,
                 prompt_kind="context")
    eng.prefill(prompts_of((3, 2)))
    with pytest.raises(DCPInputError, match="first prompt chunk only"):
        eng.prefill(prompts_of((3, 2)))
