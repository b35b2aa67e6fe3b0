"""Disaggregated prefill -> decode end to end: real processes, KV over NIXL on 127.0.0.1.

Two scenarios, each a prefill world and decode worlds running at the same time
(dcp_compile/workers/disagg.py, each world with its own master port). They share three
torchrun launches (tests/support/disagg_runs.py: a world runs a part of each scenario, one after the
other, so its ranks start once): 4 ranks (demo prefill, then MLA decode), 2 ranks (demo
decode, then MLA prefill), 4 ranks (demo decode).

The demo model: a prefill world (TP=4/DCP=2, the prefill DCP program, a two-chunk prompt
plan) and two decode worlds of other topologies, a standard TP=2 decode (dcp=1) and a
TP=4/DCP=2 decode. Each decode rank pulls its KV from the prefill ranks its transfer plan
names, over NIXL (one agent per rank, UCX over tcp on loopback), then the decode world
greedy-decodes from the first token of the prefill's last-token logits.

What is compared, and how exactly:

* Tokens: every generated token equals the single-device model's greedy token (the demo
  model run through the same engine with the same chunk plan, dcp=1). Logits: within fp32
  tolerance (atol 1e-4) of the single-device model's, every step.
* Caches, bit for bit: each decode rank's whole cache right after the transfer (all layers,
  keys and values, every block including unused ones and the garbage block, NaN-poisoned
  before the transfer) equals a direct decode-side scatter (``cache_layout.scatter_cache``)
  of the *prefill world's* caches gathered into the single-device layout
  (``cache_layout.gather_cache``). The transfer moves bytes, so it must be exact.
  The reference is the prefill world's KV, not the single-device model's: the prefill
  program computes K and V with TP-sharded matmuls, so its values differ from the
  single-device model's by ~1e-6. That difference is checked separately, within 1e-5 (the
  gathered prefill caches against the single-device caches after the same prompt chunks).

An MLA model (the second scenario, ``--model deepseek-v3``): Hugging Face
DeepseekV3ForCausalLM (tiny config), prefill DCP -> KV over NIXL -> decode DCP: a prefill
world TP=2/DCP=2 (the prefill DCP program over the latent cache, a two-chunk prompt plan)
and a decode world TP=4/DCP=4 -- a prefill DCP *smaller* than the decode DCP (decode
cp_rank r reads prefill cp_rank r % 2, its blocks 2m + r // 2). The cache of either program
is one latent head per token ([RMSNorm(latent) ; RoPE(k_pe)], halves in the key / value
pair, passes/absorb_latent_attention.py).

What is compared for it:

* Tokens and logits against the model's *own* forward (HF's expanded-K/V attention, no
  cache): every greedy token equal, logits within 1e-4 at every step.
* Caches, bit for bit: each decode rank's whole latent cache right after the transfer equals
  the direct scatter (``cache_layout.scatter_cache``) of the prefill world's caches gathered
  into the single-device layout; every (position, latent) moved exactly once.
"""

from __future__ import annotations

import json

import pytest
import torch

from dcp_compile.runtime.config import DCPConfig
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.topology import topology
from dcp_compile.runtime.transfer.cache_layout import gather_cache, scatter_cache
from dcp_compile.workers.disagg import MODELS, build_model, prefill_chunks
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes
from dcp_compile.runtime.serving.kv_cache import KVCacheSpec
from dcp_compile.workers.prefill import plan_tokens
from dcp_compile.runtime.transfer.plan import plan_transfer

from disagg_runs import launch_worlds
from helpers import assert_close_report, full_forward_reference

pytestmark = pytest.mark.multiprocess  # 3 torchrun worlds (10 ranks) at once, ~1-2 min

# The demo scenario.
BLOCK = 8                   # block size = interleave size on both sides (DI)
PLAN = [[20, 11, 5], [17, 9, 0]]  # chunk -> prompt tokens per sequence: 37, 20, 5 tokens
LENGTHS = [sum(c[b] for c in PLAN) for b in range(len(PLAN[0]))]
STEPS = 8
MAX_CONTEXT = 48            # >= longest prompt + STEPS
PREFILL = (4, 2)            # tp, dcp
DECODE = {"d-tp2": (2, 1), "d-tp4dcp2": (4, 2)}   # engine -> (tp, dcp)
RESERVE_BLOCKS = 3          # decode block numbers differ from the prefill's

# The MLA scenario.
MLA_MODEL = "deepseek-v3"
MLA_BLOCK = 4
MLA_PLAN = [[9, 6, 3], [6, 3, 0]]     # chunk -> prompt tokens per sequence: 15, 9, 3 tokens
MLA_LENGTHS = [sum(c[b] for c in MLA_PLAN) for b in range(len(MLA_PLAN[0]))]
MLA_STEPS = 6
MLA_MAX_CONTEXT = 24        # >= longest prompt + MLA_STEPS
MLA_PREFILL = (2, 2)        # tp, dcp
MLA_DECODE = {"d-tp4dcp4": (4, 4)}
MLA_RESERVE_BLOCKS = 2
LATENT, ROPE = 32, 8        # the tiny config's kv_lora_rank, qk_rope_head_dim
MLA_HEAD_DIM = (LATENT + ROPE) // 2


def _cfg(tp, dcp, mode):
    c = DemoConfig(num_layers=2)
    return DCPConfig(tp=tp, dcp=dcp, mode=mode, block_size=BLOCK, num_q_heads=c.num_q_heads,
                     num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Both scenarios' worlds, launched once: ``tmp/demo/...``, ``tmp/mla/...``."""
    pytest.importorskip("transformers")
    out = launch_worlds(tmp_path_factory.mktemp("disagg"), {
        "demo": dict(model="demo", block=BLOCK, plan=PLAN, prefill=PREFILL,
                     prefill_id="p-tp4dcp2", decoders=DECODE, max_context=MAX_CONTEXT,
                     steps=STEPS, reserve_blocks=RESERVE_BLOCKS),
        "mla": dict(model=MLA_MODEL, block=MLA_BLOCK, plan=MLA_PLAN, prefill=MLA_PREFILL,
                    prefill_id="p-tp2dcp2", decoders=MLA_DECODE, max_context=MLA_MAX_CONTEXT,
                    steps=MLA_STEPS, reserve_blocks=MLA_RESERVE_BLOCKS)})
    return {"demo": out["tmp"] / "demo", "mla": out["tmp"] / "mla"}


@pytest.fixture(scope="module")
def reference():
    """The single-device model through the engine: same chunk plan, then greedy decode."""
    c = DemoConfig(num_layers=2)
    shapes = StepShapes.fitting(len(LENGTHS), max(max(chunk) for chunk in PLAN), MAX_CONTEXT,
                                block_size=BLOCK, dcp=1)
    spec = KVCacheSpec(c.num_layers, shapes.num_blocks, BLOCK, c.num_kv_heads, c.head_dim)
    engine = Engine(LocalExecutor(demo_model(c), spec.allocate()), shapes, block_size=BLOCK)
    first_logits = prefill_chunks(engine, plan_tokens(PLAN))
    caches = [t.clone() for t in engine.executor.caches]
    table = engine.allocator.table(list(range(len(LENGTHS))), shapes.max_blocks)
    assert engine.lengths == LENGTHS
    with torch.no_grad():
        result = engine.continue_generate(first_logits, STEPS)
    return {"caches": caches, "table": table, "result": result}


@pytest.fixture(scope="module")
def prefill_gathered(worlds, reference):
    """The prefill world's caches, gathered into the single-device layout (reference's block
    table); rows no rank wrote stay NaN."""
    p_topo = topology(*PREFILL, "prefill", config=_cfg(*PREFILL, "prefill"))
    runs = {r: torch.load(worlds["demo"] / "prefill" / f"prefill_rank{r}.pt")
            for r in range(PREFILL[0])}
    for run in runs.values():
        assert run["lengths"] == LENGTHS
        assert torch.equal(run["block_table"], runs[0]["block_table"])
    out = [torch.full_like(t, float("nan")) for t in reference["caches"]]
    gather_cache({r: run["caches"] for r, run in runs.items()}, runs[0]["block_table"], LENGTHS,
                 out, reference["table"], cp_rank_of=p_topo.cp_rank, dcp=PREFILL[1],
                 interleave=BLOCK, kv_heads_of=p_topo.kv_heads_of)
    return out


def assert_bit_equal(caches, expected, who: str) -> None:
    """Each cache equals the direct scatter bit for bit (NaN where nothing was written)."""
    for i, (g, e) in enumerate(zip(caches, expected)):
        same = g.view(torch.int32) == e.view(torch.int32)
        if not same.all():
            rows = (~same).flatten(2).any(-1).nonzero()[:4].tolist()
            pytest.fail(f"{who}, cache {i}: differs from the direct scatter at [block, offset] "
                        f"{rows}")


def test_prefill_world_caches_match_single_device(prefill_gathered, reference):
    # Sanity of the source: every prompt position of every KV head was written by exactly the
    # prefill ranks that own it, within fp32 rounding of the single-device model's KV.
    c = DemoConfig(num_layers=2)
    for i, (got, exp) in enumerate(zip(prefill_gathered, reference["caches"])):
        written = ~torch.isnan(got)
        assert int(written.all(-1).sum()) == sum(LENGTHS) * c.num_kv_heads, f"cache {i}"
        assert_close_report(got[written], exp[written], atol=1e-5, what=f"prefill cache {i}")


@pytest.mark.parametrize("engine", list(DECODE))
def test_prefill_dcp_to_decode_over_nixl(worlds, reference, prefill_gathered, engine):
    tp, dcp = DECODE[engine]
    out = worlds["demo"] / engine
    d_cfg = _cfg(tp, dcp, "decode")
    d_topo = topology(tp, dcp, "decode", config=d_cfg)
    plan = plan_transfer(_cfg(*PREFILL, "prefill"), d_cfg)

    # 1. Tokens equal the single-device model's; logits within fp32 tolerance, every step.
    got = json.loads((out / "decode.json").read_text())
    ref = reference["result"]
    assert got["tokens"] == ref.tokens
    assert len(got["logits"]) == len(ref.logits) == STEPS
    for t, (g, r) in enumerate(zip(got["logits"], ref.logits)):
        assert_close_report(torch.tensor(g), r, atol=1e-4, what=f"{engine} step {t}")

    # 2. Each decode rank's cache right after the transfer equals, bit for bit, the direct
    #    scatter of the prefill world's (gathered) caches into its layout.
    kv_bytes, kv_values = 0, 0
    for d in range(tp):
        run = torch.load(out / f"decode_rank{d}.pt")
        assert run["lengths"] == LENGTHS
        assert run["remote_ranks"] == plan.rank(d).remote_ranks and run["kind"] == plan.kind
        table = run["block_table"]
        assert int(table[table >= 0].min()) >= RESERVE_BLOCKS  # local != remote numbering
        expected = [torch.full_like(t, float("nan")) for t in run["caches"]]
        scatter_cache(prefill_gathered, reference["table"], LENGTHS, expected, table,
                      cp_rank=d_topo.cp_rank(d), dcp=dcp, interleave=BLOCK,
                      kv_heads=d_topo.kv_heads_of(d))
        assert_bit_equal(run["caches"], expected, f"{engine} decode rank {d}")
        kv_values += sum(int((~torch.isnan(e)).sum()) for e in expected)
        kv_bytes += sum(s["kv_bytes"] for s in run["stats"])
        # Every request finished; a rank with nothing to read still notified.
        assert [s["request_id"] for s in run["stats"]] == \
            [f"p-tp4dcp2-seq{b}" for b in range(len(LENGTHS))]
    c = DemoConfig(num_layers=2)
    # Each (position, KV head) moved once: layers x (K, V) x tokens x heads x head_dim x fp32.
    # (Both decode topologies hold every (position, KV head) on exactly one rank, so the
    # expected caches, not vacuously NaN, hold each value once as well.)
    values = c.num_layers * 2 * sum(LENGTHS) * c.num_kv_heads * c.head_dim
    assert kv_bytes == values * 4 and kv_values == values


# --- the MLA scenario ---------------------------------------------------------------------

def _mla_cfg(tp, dcp, mode):
    return DCPConfig(tp=tp, dcp=dcp, mode=mode, block_size=MLA_BLOCK, num_q_heads=8,
                     num_kv_heads=1, mla=True)


def test_mla_prefill_dcp_to_larger_decode_dcp_over_nixl(worlds):
    (engine, (tp, dcp)), = MLA_DECODE.items()
    out = worlds["mla"] / engine

    # 1. Tokens and logits equal the model's own forward (no cache, expanded K/V).
    model = build_model(MLA_MODEL, 2)
    chunks = plan_tokens(MLA_PLAN, 0, vocab=MODELS[MLA_MODEL][1])
    prompts = [sum((c[b] for c in chunks), []) for b in range(len(MLA_LENGTHS))]
    ref_tokens, ref_logits = full_forward_reference(model, prompts, MLA_STEPS)
    got = json.loads((out / "decode.json").read_text())
    assert got["tokens"] == ref_tokens
    assert len(got["logits"]) == MLA_STEPS
    for t, step in enumerate(got["logits"]):
        for b in range(len(MLA_LENGTHS)):
            assert_close_report(torch.tensor(step[b]), ref_logits[b][t], atol=1e-4,
                                what=f"step {t} seq {b}")

    # 2. Each decode rank's latent cache right after the transfer equals, bit for bit, the
    #    direct scatter of the prefill world's caches (gathered) into its layout.
    p_cfg, d_cfg = _mla_cfg(*MLA_PREFILL, "prefill"), _mla_cfg(tp, dcp, "decode")
    plan = plan_transfer(p_cfg, d_cfg)
    p_topo = topology(*MLA_PREFILL, "prefill", config=p_cfg)
    d_topo = topology(tp, dcp, "decode", config=d_cfg)
    runs = {r: torch.load(worlds["mla"] / "prefill" / f"prefill_rank{r}.pt")
            for r in range(MLA_PREFILL[0])}
    assert runs[0]["lengths"] == MLA_LENGTHS
    ref_blocks = -(-max(MLA_LENGTHS) // MLA_BLOCK)
    ref_table = torch.arange(len(MLA_LENGTHS) * ref_blocks).view(len(MLA_LENGTHS), ref_blocks)
    shape = (len(MLA_LENGTHS) * ref_blocks + 1, MLA_BLOCK, 1, MLA_HEAD_DIM)
    gathered = [torch.full(shape, float("nan")) for _ in runs[0]["caches"]]
    gather_cache({r: run["caches"] for r, run in runs.items()}, runs[0]["block_table"],
                 MLA_LENGTHS, gathered, ref_table, cp_rank_of=p_topo.cp_rank, dcp=MLA_PREFILL[1],
                 interleave=MLA_BLOCK, kv_heads_of=p_topo.kv_heads_of)
    assert all(int((~torch.isnan(g)).all(-1).sum()) == sum(MLA_LENGTHS) for g in gathered)
    kv_bytes = 0
    for d in range(tp):
        run = torch.load(out / f"decode_rank{d}.pt")
        assert run["remote_ranks"] == plan.rank(d).remote_ranks == [d % MLA_PREFILL[1]]
        table = run["block_table"]
        assert int(table[table >= 0].min()) >= MLA_RESERVE_BLOCKS
        expected = [torch.full_like(t, float("nan")) for t in run["caches"]]
        scatter_cache(gathered, ref_table, MLA_LENGTHS, expected, table, cp_rank=d_topo.cp_rank(d),
                      dcp=dcp, interleave=MLA_BLOCK, kv_heads=d_topo.kv_heads_of(d))
        assert_bit_equal(run["caches"], expected, f"decode rank {d}")
        kv_bytes += sum(s["kv_bytes"] for s in run["stats"])
    # Each (position, latent) moved once: layers x (K, V) x tokens x head_dim x fp32.
    assert kv_bytes == 2 * 2 * sum(MLA_LENGTHS) * MLA_HEAD_DIM * 4
