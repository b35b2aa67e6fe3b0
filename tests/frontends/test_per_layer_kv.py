"""Per-layer KV layouts and KV shared across layers (Gemma 4; issue #38, item 3).

Gemma 4's layers differ by type: sliding layers have one head_dim, full layers another (and,
with ``attention_k_eq_v``, their own KV head count, ``num_global_key_value_heads``); its last
``num_kv_shared_layers`` layers compute no K/V and attend the K/V of the last earlier layer of
their type. ``transform(model)`` gives each layout its cache group (``program.cache_spec()``
lists one layout per group) and a layer that reads another layer's K/V reads that layer's
cache: no second copy, written once per step. Compared with the model's own forward: fp32,
1e-4, greedy tokens, prompts of 1, 7, 9 and 16 tokens (hf_corpus.run_model), decode (8 steps)
and prefill, tp=4/dcp=2 and tp=8/dcp=4. ``hf.prepare``, whose wrapper keeps one layout per
model, refuses them by name (DCPKVLayoutError), as does a layer sharing only one of K and V.

The tiny Gemma 4 is the corpus's (hf_corpus.OVR["gemma4_text"]: four layers, sliding / full
alternating, head_dim 8 / 16, the last two sharing KV), without the per-layer input
embeddings (``hidden_size_per_layer_input=0``) and, variant "per_layer_input", with them
(16 per layer): a token table of 4 x 16 columns whose rows meet the column-parallel
per-layer projection per layer, so it is cut along its features like it (each rank looks up
its own columns: no vocab mask, no all-reduce), and the per-layer norm over those features
is an all-reduce of the whole sequence's statistic even in prefill.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import hf_corpus as C  # noqa: E402
from full_runs import full  # noqa: E402

import dcp_compile  # noqa: E402
from dcp_compile.runtime.errors import DCPInputError, DCPKVLayoutError  # noqa: E402

# head_dim by layer type (8 sliding, 16 full); "kv_heads": the full layers also have 1 KV
# head of their own (attention_k_eq_v, V from the K projection), the sliding ones 2.
VARIANTS = {
    "head_dim": dict(hidden_size_per_layer_input=0),
    "kv_heads": dict(hidden_size_per_layer_input=0, attention_k_eq_v=True,
                     per_layer_config={i: {"head_dim": 16, "num_key_value_heads": 1}
                                       for i in ("01", "03")}),
    "per_layer_input": dict(),
}


def gemma4(variant: str):
    return C.build("gemma4_text", "sdpa", **VARIANTS[variant])


def test_the_per_layer_input_table_is_cut_along_its_features():
    """Gemma 4's per-layer input embeddings: the table [vocab, layers * 16] is cut along
    dim 1, in one segment of 16 per layer (each rank's 16 / tp columns of every layer), and
    its lookup has no vocab mask; the token table (tied to the LM head) stays
    vocab-parallel."""
    program = _program("per_layer_input", "decode")
    per_layer = program.shards["p_model_model_embed_tokens_per_layer_weight"]
    tokens = program.shards["p_model_lm_head_weight"]
    assert (per_layer.dim, per_layer.pieces) == (1, 4)
    assert [seg[:2] for seg in per_layer.segments] == [(16, 4)] * 4
    assert (tokens.dim, tokens.pieces) == (0, 4)
    gm = program.graphs["decode"]
    lookups = [n for n in gm.graph.nodes if n.target == torch.ops.aten.embedding.default]
    table = next(n for n in lookups if "per_layer" in n.args[0].name)
    assert table.args[1].op == "placeholder"          # the ids themselves: no vocab mask


def test_the_tiny_gemma4_has_two_layouts_and_shares_kv():
    for variant, full_heads in (("head_dim", 2), ("kv_heads", 1)):
        cfg = gemma4(variant).config
        assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
        layouts = [(cfg.per_layer_config[i].num_key_value_heads,
                    cfg.per_layer_config[i].head_dim) for i in range(4)]
        assert layouts == [(2, 8), (full_heads, 16)] * 2
        assert cfg.kv_sharing_modes == ["store", "store", "reuse", "reuse"]


CASES = [(v, t, d, m) for v in VARIANTS for t, d in ((4, 2), (8, 4))
         for m in ("decode", "prefill")]
if not full("DCP_KV_LAYOUTS_FULL"):   # the slice: one decode, one prefill at the other tp
    CASES = [("kv_heads", 4, 2, "decode"), ("head_dim", 8, 4, "prefill"),
             ("per_layer_input", 8, 4, "prefill")]


@pytest.mark.parametrize("variant,tp,dcp,mode", CASES,
                         ids=[f"{v}-tp{t}-dcp{d}-{m}" for v, t, d, m in CASES])
def test_gemma4_matches_its_own_forward(variant, tp, dcp, mode):
    out = C.run_model(gemma4(variant), mode, tp=tp, dcp=dcp)
    assert out.kind == "matches", f"{out.cell()}: {out.message[:500]}"


@functools.lru_cache(maxsize=None)
def _program(variant: str, mode: str, tp: int = 4, dcp: int = 2):
    from dcp_compile.runtime.serving.engine import StepShapes
    return dcp_compile.transform(gemma4(variant), tp=tp, dcp=dcp, mode=mode, block_size=4,
                                 shapes=StepShapes(batch=2, context_len=16, max_blocks=4,
                                                   num_blocks=10))


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_a_shared_layer_reads_its_owners_cache_no_second_copy(mode):
    """Layers 2 and 3 reuse the K/V of layers 0 and 1: two cache pairs for four layers,
    each written once per step, and layer 2's attention reads exactly the cache layer 0
    wrote (layer 3's, layer 1's)."""
    from dcp_compile.runtime.names import is_cache_input
    dcp_ops = torch.ops.dcp
    program = _program("kv_heads", mode)
    kv = program.facts.kv_layers
    assert kv.reads == (0, 1, 0, 1)
    assert [(x.kv_heads, x.head_dim) for x in kv.caches] == [(2, 8), (1, 16)]
    for step, gm in program.graphs.items():
        nodes = list(gm.graph.nodes)
        inputs = [n for n in nodes if n.op == "placeholder" and is_cache_input(n.name)]
        writes = [n for n in nodes if n.target == dcp_ops.cache_write.default]
        attends = [n for n in nodes if n.target == dcp_ops.partial_attention.default]
        assert len(inputs) == 4 and len(writes) == 2 and len(attends) == 4, step
        assert [w.args[0] for w in writes] == inputs[0::2], step
        cache_read = [a.args[5] for a in attends]       # partial_attention's key cache
        assert cache_read[2] is cache_read[0] and cache_read[3] is cache_read[1], step
        assert cache_read[0] is not cache_read[1], step
        out = next(n for n in nodes if n.op == "output").args[0]
        assert len(out) == 1 + 4, step                  # logits and the two pairs only


def test_the_cache_spec_lists_one_layout_per_group():
    program = _program("kv_heads", "decode")           # tp=4: 2 // 4 -> 1 head, 1 // 4 -> 1
    spec = program.cache_spec()
    assert [(g.kv_heads, g.head_dim, g.caches) for g in spec.groups] == [(1, 8, (0,)),
                                                                       (1, 16, (1,))]
    assert spec.num_layers == 2 and spec.reads == (0, 1, 0, 1)
    assert [s[2:] for s in spec.shapes()] == [(1, 8), (1, 8), (1, 16), (1, 16)]
    assert [tuple(t.shape[2:]) for t in spec.allocate()] == [(1, 8), (1, 8), (1, 16), (1, 16)]
    assert spec.bytes_per_token() == 2 * (1 * 8 + 1 * 16) * 4
    single = program.cache_spec(single_device=True)
    assert [(g.kv_heads, g.head_dim) for g in single.groups] == [(2, 8), (1, 16)]
    with pytest.raises(DCPInputError, match="2 layouts"):
        spec.shape


def test_the_step_contract_checks_each_caches_layout():
    from dcp_compile.runtime.serving.step_contract import StepContract
    program = _program("kv_heads", "decode")
    contract = StepContract.for_program(program, "decode")
    caches = program.cache_spec().allocate()
    ids = torch.zeros(2, 1, dtype=torch.int64)
    table = torch.full((2, 4), -1, dtype=torch.int64)
    table[:, 0] = torch.tensor([0, 1])
    contract.check(ids, ids.clone(), table, caches)
    caches[2] = torch.zeros_like(caches[0])                 # a head_dim-8 cache in slot 2
    with pytest.raises(DCPInputError, match=r"kv_caches\[2\]"):
        contract.check(ids, ids.clone(), table, caches)


def test_prepare_refuses_per_layer_layouts_by_name():
    from dcp_compile import hf
    model = C.build("gemma4_text", None, **VARIANTS["head_dim"])
    with pytest.raises(DCPKVLayoutError, match="num_kv_shared_layers=2"):
        hf.prepare(model, max_model_len=64)


class _ShareKeyOnly(torch.nn.Module):
    """Two causal SDPA layers; layer 1 reads layer 0's keys but its own values."""

    def __init__(self, vocab=64, hidden=32, heads=4, kv_heads=2):
        super().__init__()
        self.h, self.kvh, self.d = heads, kv_heads, hidden // heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.q = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(2))
        self.k = torch.nn.Linear(hidden, kv_heads * self.d)
        self.v = torch.nn.ModuleList(torch.nn.Linear(hidden, kv_heads * self.d)
                                     for _ in range(2))
        self.o = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(2))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        k = self.k(x).view(b, s, self.kvh, self.d).transpose(1, 2)
        for i in range(2):
            q = self.q[i](x).view(b, s, self.h, self.d).transpose(1, 2)
            v = self.v[i](x).view(b, s, self.kvh, self.d).transpose(1, 2)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=True)
            x = x + self.o[i](a.transpose(1, 2).reshape(b, s, -1))
        return self.head(x)


def test_sharing_only_the_key_is_refused_by_name():
    from dcp_compile.runtime.serving.engine import StepShapes
    with pytest.raises(DCPKVLayoutError, match="shares its key with layer 0 but not its value"):
        dcp_compile.transform(_ShareKeyOnly().eval(), tp=4, dcp=2, mode="decode",
                              block_size=4, shapes=StepShapes(batch=2, context_len=16,
                                                              max_blocks=4, num_blocks=10))


def test_the_corpus_names_these_refusals():
    assert C.reason_of("Gemma4ForCausalLM has per-layer KV layouts or KV shared across "
                       "layers (...)") == "per-layer KV layouts (hf.prepare keeps one)"
    assert C.reason_of("attention x (layer 1, ...) shares its key with layer 0 but not its "
                       "value: a layer reads another layer's KV cache whole") == \
        "KV shared in part (K or V only)"
