"""Multi-head Latent Attention (DeepSeek MLA) in DCP form (passes/absorb_latent_attention.py).

An ordinary MLA model (expanded K/V through SDPA) is transformed; the cache holds only
[RMSNorm(latent) ; RoPE(k_pe)] per token (one KV head, halves in the key/value cache pair),
and the decode program must produce the model's own full-forward logits (fp32, 1e-4) and
greedy tokens over 8 steps, on mixed-length batches around the interleave period.
"""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPConfigError, DCPTransformError
from dcp_compile.models.mla import MLAConfig, plain_mla
from dcp_compile.verify import run_threaded_program
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.names import SPEC_STEP

from full_runs import full
from helpers import assert_close_report, assert_runs_match, full_forward_reference, prompts_of

ATOL = 1e-4
STEPS = 8
CFG = MLAConfig()                                   # 8 heads, L=32, dr=8, dn=16, dv=12


def _decode_equals_own_forward(program, model, prompts) -> float:
    """Every rank's greedy tokens equal the model's own full forward's, and its logits are
    within ATOL at every step (the garbage block NaN-poisoned); returns the worst error."""
    runs = run_threaded_program(program, prompts, STEPS, poison_garbage=True)
    ref_tokens, ref_logits = full_forward_reference(model, prompts, STEPS)
    return assert_runs_match(runs, ref_tokens, ref_logits, atol=ATOL)


def _shapes(period: int, block: int, dcp: int) -> StepShapes:
    longest = period + 1 + STEPS
    max_blocks = -(-longest // (block * dcp))
    return StepShapes(batch=4, context_len=period + 1, max_blocks=max_blocks,
                      num_blocks=4 * max_blocks + 1)


# (tp, dcp, block, interleave): the three layouts; tp=8/dcp=2 with interleave < block.
LAYOUTS = [(4, 4, 4, 4), (8, 8, 2, 2), (8, 2, 8, 4)]


@pytest.mark.parametrize("tp,dcp,block,interleave", LAYOUTS)
def test_mla_decode_matches_own_forward(tp, dcp, block, interleave):
    model = plain_mla(CFG)
    period = interleave * dcp
    shapes = _shapes(period, block, dcp)
    program = dcp_compile.transform(model, tp=tp, dcp=dcp, mode="decode", block_size=block,
                                    interleave_size=interleave, shapes=shapes, check=False)
    absorbed = next(r for r in program.history if r.name == "absorb_latent_attention")
    assert absorbed.matched["mla_layers"] == CFG.num_layers and program.config.mla
    # The cache: one head, [latent ; k_pe] once (two halves), nothing per query head.
    spec = program.cache_spec()
    width = CFG.kv_lora_rank + CFG.qk_rope_head_dim
    assert (spec.kv_heads, spec.head_dim) == (1, width // 2)
    # Bytes per rank = 1/DCP of the single device's latent cache (same token capacity) plus
    # one garbage block.
    per_token = CFG.num_layers * width * 4
    single_tokens = (shapes.num_blocks - 1) * dcp * block
    assert spec.bytes_per_rank() == per_token * (single_tokens // dcp + block)

    # Topology of a single-head cache: every rank of a DCP group holds a different cp_rank's
    # tokens of the same (only) latent head.
    topo = program.topology
    for r in range(tp):
        group = topo.group_of("dcp", r)
        assert len(group) == dcp and sorted(topo.cp_rank(x) for x in group) == list(range(dcp))
        assert topo.kv_heads_of(r) == [0]

    lengths = (1, period - 1, period, period + 1)
    prompts = prompts_of(lengths, vocab=CFG.vocab_size)
    worst = _decode_equals_own_forward(program, model, prompts)
    print(f"tp={tp} dcp={dcp}: max |logit error| {worst:.2e}")


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_mla_products_are_batched_over_heads(mode):
    """W_UK and W_UV are applied as matmuls batched over heads against a per-head view of
    kv_b_proj's weight: walking every value of every step graph, none holds the broadcast
    product [tokens, heads, dn + dv, L] (B*S*H_rank*(dn+dv)*L elements on a rank), and the
    weight is met only by those matmuls (through views of it)."""
    tp, dcp, batch, context = 4, 2, 4, 16
    program = dcp_compile.transform(plain_mla(CFG), tp=tp, dcp=dcp, mode=mode, block_size=4,
                                    check=False, shapes=StepShapes(batch=batch,
                                                                   context_len=context,
                                                                   max_blocks=4, num_blocks=13))
    rows = CFG.qk_nope_head_dim + CFG.v_head_dim
    # Heads per rank: full TP in decode, the dcp_tp group in prefill (which slices the
    # tokens of a chunk into dcp interleaved parts).
    heads = CFG.num_q_heads // (tp if mode == "decode" else tp // dcp)
    matmuls = 0
    for step, gm in program.graphs.items():
        nodes = {n.name: n for n in gm.graph.nodes}
        tokens = nodes["input_ids"].meta["val"].numel() // (1 if mode == "decode" else dcp)
        product = tokens * heads * rows * CFG.kv_lora_rank
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if n.op == "call_function" and isinstance(v, torch.Tensor):
                assert v.numel() < product, (step, n.name, tuple(v.shape))
        for layer in range(CFG.num_layers):
            w = nodes[f"p_model_layers_{layer}_self_attn_kv_b_proj_weight"]
            stack, seen = [w], []
            while stack:
                for u in stack.pop().users:
                    if u.target is torch.ops.aten.matmul.default:
                        seen.append(u)
                    else:
                        assert u.op == "call_function" and u.meta["val"].numel() <= \
                            w.meta["val"].numel(), (step, u.name, u.target)
                        stack.append(u)
            assert len(seen) == 2, (step, layer, seen)   # W_UK and W_UV
            matmuls += 2
    assert matmuls == 2 * CFG.num_layers * len(program.graphs)


def test_mla_q_lora_check():
    """q through its own low-rank path (q_a_proj -> RMSNorm -> q_b_proj): transform's own
    check (context + decode step against the model's forward) passes."""
    model = plain_mla(CFG, q_lora_rank=24)
    program = dcp_compile.transform(model, tp=4, dcp=2, mode="decode", block_size=4,
                                    shapes=StepShapes(batch=4, context_len=9, max_blocks=3,
                                                      num_blocks=13), check=True)
    assert program.report.check.ok
    mla = program.facts.mla                 # absorb_latent_attention returned the widths it found
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim) == (CFG.kv_lora_rank, CFG.qk_rope_head_dim)


def test_mla_config_rule():
    """One latent head: any tp, dcp dividing tp; errors name the rule."""
    DCPConfig(tp=6, dcp=3, num_q_heads=12, num_kv_heads=1, mla=True)
    DCPConfig(tp=8, dcp=8, num_q_heads=8, num_kv_heads=1, mla=True)
    with pytest.raises(DCPConfigError, match="TP % DCP"):
        DCPConfig(tp=4, dcp=8, num_kv_heads=1, mla=True)
    with pytest.raises(DCPConfigError, match="one latent KV head"):
        DCPConfig(tp=8, dcp=2, num_kv_heads=2, mla=True)
    with pytest.raises(DCPConfigError, match="MLA query heads"):
        DCPConfig(tp=3, dcp=3, num_q_heads=8, mla=True)


def _transform(model):
    return dcp_compile.transform(model, tp=4, dcp=2, mode="decode", block_size=4,
                                 shapes=StepShapes(batch=2, context_len=8, max_blocks=2,
                                                   num_blocks=5), check=False)


def test_mla_kv_b_bias_refused():
    model = plain_mla(CFG)
    attn = model.layers[0].self_attn
    attn.kv_b_proj.bias = torch.nn.Parameter(torch.zeros(attn.kv_b_proj.out_features))
    with pytest.raises(DCPTransformError, match="kv_b_proj .*kv_b_proj_weight.*has a bias.*models/mla.py"):
        _transform(model)


def test_mla_eager_attention_check():
    """Eager MLA (q @ k^T * scale + mask -> softmax -> @ v) is absorbed the same way."""
    program = dcp_compile.transform(plain_mla(CFG, attention="eager"), tp=4, dcp=4,
                                    mode="decode", block_size=4, check=True,
                                    shapes=StepShapes(batch=4, context_len=17, max_blocks=2,
                                                      num_blocks=9))
    assert program.report.check.ok and program.cache_spec().head_dim == 20


def test_mla_rope_first_key_refused():
    """A key cat([k_pe.expand, k_nope]) (not DeepSeek's order) is refused, never cached
    expanded."""
    model = plain_mla(CFG)

    class RopeFirst(type(model.layers[0].self_attn)):
        def forward(self, x, cos, sin):
            c = self.cfg
            b, s, _ = x.shape
            dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
            q = self.q_proj(x).view(b, s, -1, dn + dr).transpose(1, 2)
            latent, k_pe = torch.split(self.kv_a_proj_with_mqa(x), [c.kv_lora_rank, dr], -1)
            k_pe = k_pe.view(b, s, 1, dr).transpose(1, 2)
            kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, -1, dn + dv)
            k_nope, v = torch.split(kv.transpose(1, 2), [dn, dv], dim=-1)
            k = torch.cat((k_pe.expand(-1, k_nope.shape[1], -1, -1), k_nope), dim=-1)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    model.layers[0].self_attn.__class__ = RopeFirst
    with pytest.raises(DCPTransformError, match=r"head-shared part .*test_mla.py.*MLA keys must be"):
        _transform(model)


def test_mla_wrong_kv_split_refused():
    """kv_b_proj's output split [v | k_nope] per head (not DeepSeek's order) is refused by the
    column check, naming the node."""
    model = plain_mla(CFG)
    attn = model.layers[0].self_attn
    # v taken from the first dv columns of each head, k_nope from the rest.
    class Swapped(type(attn)):
        def forward(self, x, cos, sin):
            c = self.cfg
            b, s, _ = x.shape
            dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
            q = self.q_proj(x).view(b, s, -1, dn + dr).transpose(1, 2)
            q_nope, q_pe = torch.split(q, [dn, dr], dim=-1)
            latent, k_pe = torch.split(self.kv_a_proj_with_mqa(x), [c.kv_lora_rank, dr], -1)
            k_pe = k_pe.view(b, s, 1, dr).transpose(1, 2)
            kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, -1, dn + dv)
            v, k_nope = torch.split(kv.transpose(1, 2), [dv, dn], dim=-1)
            q = torch.cat((q_nope, q_pe), dim=-1)
            k = torch.cat((k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    attn.__class__ = Swapped
    with pytest.raises(DCPTransformError, match="not the per-head block"):
        _transform(model)


# ---------------------------------------------------------------------------------------
# Hugging Face DeepseekV3ForCausalLM (random weights from a tiny config, every layer dense).
# ---------------------------------------------------------------------------------------


def hf_deepseek(version: str = "V3", **overrides):
    pytest.importorskip("transformers")
    from dcp_compile.models.mla import hf_deepseek as build
    return build(version, **overrides)


# Transformers' DeepSeek V3 without a q LoRA at tp=8/dcp=8 (every rank in one DCP group); at
# the other two layouts behind DCP_MLA_FULL=1 (plain MLA runs every layout in the slice, and
# V3 runs tp=8/dcp=2 and tp=4/dcp=4 below, with a q LoRA).
HF_V3_LAYOUTS = LAYOUTS if full("DCP_MLA_FULL") else [(8, 8, 2, 2)]


@pytest.mark.parametrize("version,tp,dcp,block,interleave,q_lora_rank,attention",
                         [("V3", *layout, None, "sdpa") for layout in HF_V3_LAYOUTS]
                         + [("V3", 8, 2, 8, 4, 24, "sdpa"), ("V3", 4, 4, 4, 4, 24, "eager"),
                            # V2: complex RoPE (view_as_complex), rewritten to real form
                            ("V2", 4, 4, 4, 4, None, "sdpa"), ("V2", 8, 2, 8, 4, 24, "sdpa")])
def test_hf_deepseek_decode_matches_own_forward(version, tp, dcp, block, interleave,
                                                q_lora_rank, attention):
    model = hf_deepseek(version, q_lora_rank=q_lora_rank, attn_implementation=attention)
    period = interleave * dcp
    shapes = _shapes(period, block, dcp)
    program = dcp_compile.transform(model, tp=tp, dcp=dcp, mode="decode", block_size=block,
                                    interleave_size=interleave, shapes=shapes, check=False)
    spec = program.cache_spec()
    assert (spec.kv_heads, spec.head_dim) == (1, (32 + 8) // 2) and program.config.mla
    prompts = prompts_of((1, period - 1, period + 1), vocab=128)
    worst = _decode_equals_own_forward(program, model, prompts)
    print(f"HF Deepseek{version} {attention} q_lora_rank={q_lora_rank} tp={tp} dcp={dcp}: max |logit "
          f"error| "
          f"{worst:.2e}")


@pytest.mark.parametrize("tp,dcp,model,q_lora_rank", [
    (4, 2, "plain", 0), (8, 8, "plain", 0), (4, 2, "V3", None), (8, 2, "V2", None),
    # q through its own low-rank path (q_a_proj -> RMSNorm -> q_b_proj): the chain runs on
    # each rank's owned tokens (dcp_prefill slices the hidden state before q_a_proj).
    (4, 2, "plain", 24), (8, 8, "plain", 24), (4, 2, "V3", 24), (8, 8, "V3", 24)])
def test_mla_prefill_check(tp, dcp, model, q_lora_rank):
    """Prefill DCP (the nine-step pattern) over the latent cache: transform's own check runs
    a first chunk and a second chunk attending to it, against the model's forward."""
    model = plain_mla(CFG, q_lora_rank=q_lora_rank) if model == "plain" else \
        hf_deepseek(model, q_lora_rank=q_lora_rank)
    program = dcp_compile.transform(model, tp=tp, dcp=dcp, mode="prefill",
                                    block_size=4, check=True,
                                    shapes=StepShapes(batch=4, context_len=16, max_blocks=4,
                                                      num_blocks=13))
    report = program.report.check
    assert report.ok and max(report.step_errors) < ATOL
    assert (program.cache_spec().kv_heads, program.cache_spec().head_dim) == (1, 20)
    if q_lora_rank:   # q_a_proj, q_b_proj and kv_a_proj run on the owned tokens (step 3)
        step3 = [n for n in program.graphs["prefill"].graph.nodes
                 if n.meta.get(SPEC_STEP) == 3 and n.target is torch.ops.aten.linear.default]
        assert len(step3) == 3 * CFG.num_layers, [n.name for n in step3]
    print(f"{model.__class__.__name__} q_lora_rank={q_lora_rank} tp={tp} dcp={dcp}: "
          f"max step error {max(report.step_errors):.2e}")


@pytest.mark.parametrize("model,mode,tp,dcp", [("plain", "decode", 4, 4),
                                           ("V3", "decode", 4, 4), ("V3", "prefill", 4, 2)])
def test_mla_bf16_check(model, mode, tp, dcp):
    """bf16 weights and latent cache: transform's check (decode: context + decode step;
    prefill: two chunks) passes with the bf16 tolerance. Measured max logit errors: plain
    decode 0.055 / 0.029; HF V3 with q_lora_rank decode 0.059 / 0.031, prefill 0.066 / 0.056
    (tp=8/dcp=8: 0.053 / 0.035 and 0.063 / 0.047) against a tolerance of 0.2."""
    model = plain_mla(CFG, dtype=torch.bfloat16) if model == "plain" else \
        hf_deepseek(model, q_lora_rank=24).to(torch.bfloat16)
    program = dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, block_size=4,
                                    check=True, shapes=StepShapes(batch=4, context_len=16,
                                                                  max_blocks=4, num_blocks=13))
    report = program.report.check
    assert report.ok and program.cache_spec().dtype == torch.bfloat16
    assert max(report.step_errors) < 0.1     # bf16 noise, well inside the tolerance
    print(f"bf16 {mode} tp={tp} dcp={dcp}: step errors {report.step_errors}")


def test_mla_all_to_all_combine_check():
    """The all-to-all decode combine (partial [L + dr] outputs with their LSEs to the head
    group's rank, merged locally) over the latent head."""
    program = dcp_compile.transform(plain_mla(CFG), tp=4, dcp=4, mode="decode", block_size=4,
                                    combine="all_to_all", check=True,
                                    shapes=StepShapes(batch=4, context_len=17, max_blocks=2,
                                                      num_blocks=9))
    assert program.report.check.ok
    assert program.collectives_per_layer("decode").get("all_to_all_single@dcp") == 1


@pytest.mark.parametrize("build", [lambda: plain_mla(CFG),
                                   lambda: plain_mla(CFG, attention="eager", q_lora_rank=24),
                                   lambda: hf_deepseek("V2")],
                         ids=["plain-sdpa", "plain-eager-q_lora", "hf-v2"])
def test_absorbed_graph_equals_captured_graph(build):
    """The rewrite alone (no cache, no sharding): the captured graph and the absorbed one
    compute the same logits; the absorbed one has no complex view on the q/k path and
    attends over one shared head that is both key and value."""
    from dcp_compile.frontends.ordinary import OrdinaryStep, capture_ordinary
    from dcp_compile.passes.absorb_latent_attention import absorb_latent_attention

    step = OrdinaryStep(build())
    captured = capture_ordinary(step, 2, 6, device="cpu")
    state = {**dict(step.named_parameters()), **dict(step.named_buffers())}
    ids = torch.randint(0, CFG.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    args = [state[f] for f in (*captured.params.values(), *captured.buffers.values())]
    args += [ids, torch.arange(6).expand(2, 6).clone()]
    gm = captured.gm
    before = gm(*args)[0]
    records = absorb_latent_attention(gm)
    after = gm(*args)[0]
    assert len(records) == 2 and records[0]["kv_lora_rank"] == 32
    assert_close_report(after, before, atol=ATOL, what="absorbed graph")
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.view_as_complex.default not in targets      # q/k path is real
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    for n in gm.graph.nodes:   # attention over one shared head [latent ; k_pe]
        if n.target is sdpa:
            assert n.args[1].meta["val"].shape[1] == 1 and n.args[1] is n.args[2]
