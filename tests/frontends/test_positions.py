"""Positions as a dataflow fact (passes/positions.py): models that compute their positions
from ``torch.arange(S)`` or slice a table made in ``__init__`` by the length, with no
``position_ids`` input, match their own full forward (fp32, 1e-4) after the cache insertion,
in decode (8 greedy steps) and prefill, on lengths around the interleave period (dcp=2,
block 4: vblock 8) and a one-token prompt.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

import dcp_compile
from dcp_compile.models.demo import DemoConfig
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.verify import run_threaded_program

from helpers import assert_runs_match, full_forward_reference, prompts_of
from position_models import ArangeFloatRope, PositionsLM, position_models
from full_runs import full  # noqa: E402

TP, DCP, BLOCK = 4, 2, 4
VOCAB = 256
LENGTHS = (1, 7, 9, 12)          # one token; around the vblock of 8; a whole chunk
SHAPES = StepShapes(batch=4, context_len=12, max_blocks=6, num_blocks=28)
STEPS = {"decode": 8, "prefill": 1}
CFG = DemoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_q_heads=8,
                 num_kv_heads=2, head_dim=8, intermediate_size=96)
MODELS = position_models(CFG)
# A representative slice by default (each form of source once: arange, sliced real table,
# sliced complex table; a learned table through the prefill's sequence parallelism);
# DCP_POSITIONS_FULL=1 runs every form in both modes (and every HF family below).
FULL = full("DCP_POSITIONS_FULL")
SLICE = {("arange-float-rope", "decode"), ("cached-cos-sin-sliced", "decode"),
         ("complex-freqs_cis-sliced", "decode"),
         ("learned-table-opt-offset-2050-rows", "prefill")}
CASES = [(m, mode) for m in MODELS for mode in ("decode", "prefill")
         if FULL or (m, mode) in SLICE]


def transform(model, mode, **kw):
    return dcp_compile.transform(model, tp=TP, dcp=DCP, mode=mode, block_size=BLOCK,
                                 shapes=SHAPES, check=False, **kw)


def assert_matches_own_forward(model, program, steps, lengths=LENGTHS):
    prompts = prompts_of(lengths, vocab=VOCAB)
    runs = run_threaded_program(program, prompts, steps, poison_garbage=True)
    ref_tokens, ref_logits = full_forward_reference(model, prompts, steps)
    assert_runs_match(runs, ref_tokens, ref_logits, atol=1e-4)


@pytest.mark.parametrize("model_id,mode", CASES)
def test_positions_from_arange_and_tables_match_own_forward(model_id, mode):
    torch.manual_seed(0)
    model = MODELS[model_id]().eval()
    program = transform(model, mode)
    lifted = next(r for r in program.history if r.name == "lift_positions")
    assert lifted.matched["positional_values"] >= 1
    assert_matches_own_forward(model, program, STEPS[mode])


def test_tables_sliced_by_length_are_remembered_for_the_one_token_step():
    """The decode step (S=1) cannot tell cos_cached[:1] from a first row: it reads the
    tables the prompt step sliced by its length."""
    program = transform(MODELS["cached-cos-sin-sliced"]().eval(), "decode")
    matched = {r.step: r.matched for r in program.history if r.name == "lift_positions"}
    assert matched["context"]["position_tables"] == 2          # cos_cached, sin_cached
    assert matched["decode"]["positional_values"] >= 2


def test_learned_position_table_is_replicated_not_vocab_parallel():
    """OPT's 2050-row table does not divide by tp=4: it is looked up by positions on every
    rank (replicated); only the token embedding is vocab-parallel."""
    program = transform(MODELS["learned-table-opt-offset-2050-rows"]().eval(), "decode")
    names = {name for name, spec in program.shards.items()}
    assert not any("absolute_table" in n for n in names), names
    assert any("embed_tokens" in n for n in names), names


class _CumsumPositions(ArangeFloatRope):
    """RoPE angles from a running sum over the positions: mixes tokens."""

    def forward(self, s, device):
        t = torch.arange(s, device=device).float().cumsum(0)
        emb = torch.cat([torch.outer(t, self.inv_freq)] * 2, dim=-1)
        return emb.cos(), emb.sin(), None


def test_positions_mixed_across_tokens_are_refused_by_name():
    model = PositionsLM(CFG, rope=_CumsumPositions(CFG.head_dim)).eval()
    with pytest.raises(DCPTransformError, match="mixes tokens") as e:
        transform(model, "decode")
    assert "cumsum" in str(e.value) and "test_positions.py" in str(e.value)


# ---------------------------------------------------------------------------------------
# Hugging Face families on the direct path (no hf.prepare): positions, lifted constants and
# shape ops as those models write them. (family, mode) -> (config, model, config fields,
# tp, dcp); MHA families decode at dcp=1 (decode DCP needs tp > kv heads).
# ---------------------------------------------------------------------------------------

_NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None)
HF_CASES = {
    # Lifted constants (qkv[..., [-2], :]), FalconLinear's x @ w.T, fused multi-query qkv.
    ("falcon-sdpa", "decode"): ("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        new_decoder_architecture=False, multi_query=True, attn_implementation="sdpa",
        **_NO_SPECIAL), 4, 2),
    ("falcon-sdpa", "prefill"): ("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        new_decoder_architecture=False, multi_query=True, attn_implementation="sdpa",
        **_NO_SPECIAL), 4, 2),
    # Interleaved RoPE as stack(-1).flatten(-2), partial rotary.
    ("gptj-eager", "prefill"): ("GPTJConfig", "GPTJForCausalLM", dict(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, rotary_dim=4, n_positions=64,
        attn_implementation="eager", **_NO_SPECIAL), 4, 2),
    ("gptj-eager", "decode"): ("GPTJConfig", "GPTJForCausalLM", dict(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, rotary_dim=4, n_positions=64,
        attn_implementation="eager", **_NO_SPECIAL), 2, 1),
    # Learned positions, max positions + offset 2 = 2050 rows (not a multiple of tp=4).
    ("opt-sdpa", "decode"): ("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=2048, word_embed_proj_dim=64,
        pad_token_id=1, attn_implementation="sdpa", **_NO_SPECIAL), 4, 1),
    # GPT-BigCode: the literal residual view after the final norm; learned positions.
    ("bigcode-sdpa", "decode"): ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=8, n_positions=64,
        attn_implementation="sdpa", **_NO_SPECIAL), 4, 2),
    ("cohere2-sdpa", "prefill"): ("Cohere2Config", "Cohere2ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=4, pad_token_id=None, attn_implementation="sdpa", **_NO_SPECIAL), 4, 2),
    ("codegen-eager", "prefill"): ("CodeGenConfig", "CodeGenForCausalLM", dict(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, rotary_dim=4, n_positions=64,
        n_ctx=64, attn_implementation="eager", **_NO_SPECIAL), 4, 2),
}
HF_SLICE = (("falcon-sdpa", "decode"),)


@pytest.mark.parametrize("family,mode", [c for c in HF_CASES if FULL or c in HF_SLICE],
                         ids=lambda x: x)
def test_hf_family_direct_path_matches_own_forward(family, mode):
    transformers = pytest.importorskip("transformers")
    config_name, model_name, fields, tp, dcp = HF_CASES[(family, mode)]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(
        getattr(transformers, config_name)(**fields)).eval()
    program = dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, block_size=BLOCK,
                                    shapes=SHAPES, check=False)
    assert_matches_own_forward(model, program, STEPS[mode])
    if family.startswith("falcon"):
        canonical = next(r for r in program.history if r.name == "canonicalize_ops")
        # Its fused QKV is a matmul of the weight (transformers 5.25 routes Falcon through the
        # attention interface: no constant index left for constant_index_as_slice).
        assert "linear_from_matmul" in canonical.matched
    if family.startswith("opt"):          # the 2050-row table is replicated
        assert not any("embed_positions" in n for n in program.shards), program.shards



class _FeatureScaledLM(nn.Module):
    """hidden size == the captured chunk (12): ``scale[:S]`` broadcasts over the *features*;
    it slices a table by the length, but its rows do not line up with the tokens."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 12)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 20))
        self.qkv = nn.Linear(12, 36, bias=False)
        self.head = nn.Linear(12, VOCAB, bias=False)

    def forward(self, input_ids):
        b, s = input_ids.shape
        x = self.embed(input_ids) * self.scale[:s]
        q, k, v = (t.view(b, s, 2, 6).transpose(1, 2) for t in self.qkv(x).split(12, -1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + out.transpose(1, 2).reshape(b, s, 12))


def test_a_table_sliced_by_the_length_must_line_up_with_the_tokens():
    with pytest.raises(DCPTransformError, match="meets the tokens") as e:
        dcp_compile.transform(_FeatureScaledLM().eval(), tp=2, dcp=1, mode="decode",
                              block_size=BLOCK, shapes=SHAPES, check=False)
    assert "test_positions.py" in str(e.value)
