"""Disaggregated prefill -> decode end to end: real processes, KV over NIXL on 127.0.0.1.

Three torchrun/gloo worlds run at the same time (dcp_compile/workers/disagg.py), each with its own
master port: a prefill world (TP=4/DCP=2, the prefill DCP program, a two-chunk prompt plan)
and two decode worlds of other topologies, a standard TP=2 decode (dcp=1) and a TP=4/DCP=2
decode. Each decode rank pulls its KV from the prefill ranks its transfer plan names, over
NIXL (one agent per rank, UCX over tcp on loopback), then the decode world greedy-decodes
from the first token of the prefill's last-token logits.

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
"""

from __future__ import annotations

import json

import pytest
import torch

from dcp_compile.runtime.config import DCPConfig
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.topology import topology
from dcp_compile.runtime.cache_layout import gather_cache, scatter_cache
from dcp_compile.workers.disagg import prefill_chunks
from dcp_compile.runtime.engine import Engine, LocalExecutor, StepShapes
from dcp_compile.runtime.kv_cache import KVCacheSpec
from dcp_compile.workers.prefill import plan_tokens
from dcp_compile.runtime.transfer_plan import plan_transfer

from disagg_runs import launch_worlds
from helpers import assert_close_report

pytestmark = pytest.mark.multiprocess  # 3 torchrun worlds (10 ranks) at once, ~1-2 min

BLOCK = 8                   # block size = interleave size on both sides (DI)
PLAN = [[20, 11, 5], [17, 9, 0]]  # chunk -> prompt tokens per sequence: 37, 20, 5 tokens
LENGTHS = [sum(c[b] for c in PLAN) for b in range(len(PLAN[0]))]
STEPS = 8
MAX_CONTEXT = 48            # >= longest prompt + STEPS
PREFILL = (4, 2)            # tp, dcp
DECODE = {"d-tp2": (2, 1), "d-tp4dcp2": (4, 2)}   # engine -> (tp, dcp)
RESERVE_BLOCKS = 3          # decode block numbers differ from the prefill's


def _cfg(tp, dcp, mode):
    c = DemoConfig(num_layers=2)
    return DCPConfig(tp=tp, dcp=dcp, mode=mode, block_size=BLOCK, num_q_heads=c.num_q_heads,
                     num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return launch_worlds(tmp_path_factory.mktemp("disagg"), model="demo", block=BLOCK,
                         plan=PLAN, prefill=PREFILL, prefill_id="p-tp4dcp2", decoders=DECODE,
                         max_context=MAX_CONTEXT, steps=STEPS, reserve_blocks=RESERVE_BLOCKS)


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
    runs = {r: torch.load(worlds["tmp"] / "prefill" / f"prefill_rank{r}.pt")
            for r in range(PREFILL[0])}
    for run in runs.values():
        assert run["lengths"] == LENGTHS
        assert torch.equal(run["block_table"], runs[0]["block_table"])
    out = [torch.full_like(t, float("nan")) for t in reference["caches"]]
    gather_cache({r: run["caches"] for r, run in runs.items()}, runs[0]["block_table"], LENGTHS,
                 out, reference["table"], cp_rank_of=p_topo.cp_rank, dcp=PREFILL[1],
                 interleave=BLOCK, kv_heads_of=p_topo.kv_heads_of)
    return out


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
    out = worlds["tmp"] / engine
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
        for i, (g, e) in enumerate(zip(run["caches"], expected)):
            same = g.view(torch.int32) == e.view(torch.int32)
            if not same.all():
                rows = (~same).flatten(2).any(-1).nonzero()[:4].tolist()
                pytest.fail(f"{engine} decode rank {d}, cache {i}: differs from the direct "
                            f"scatter at [block, offset] {rows}")
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
