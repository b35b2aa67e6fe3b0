"""An MLA model disaggregated end to end: Hugging Face DeepseekV3ForCausalLM (tiny config),
prefill DCP -> KV over NIXL -> decode DCP, as real torchrun worlds on 127.0.0.1.

Two torchrun/gloo worlds run at the same time (dcp_compile/workers/disagg.py ``--model
deepseek-v3``): a prefill world TP=2/DCP=2 (the prefill DCP program over the latent cache, a
two-chunk prompt plan) and a decode world TP=4/DCP=4 -- a prefill DCP *smaller* than the
decode DCP (decode cp_rank r reads prefill cp_rank r % 2, its blocks 2m + r // 2). The cache
of either program is one latent head per token ([RMSNorm(latent) ; RoPE(k_pe)], halves in
the key / value pair, passes/absorb_latent_attention.py).

What is compared:

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

from dcp_compile.runtime.cache_layout import gather_cache, scatter_cache
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.topology import topology
from dcp_compile.runtime.transfer_plan import plan_transfer
from dcp_compile.workers.disagg import MODELS, build_model
from dcp_compile.workers.prefill import plan_tokens

from disagg_runs import launch_worlds
from helpers import assert_close_report, full_forward_reference

pytestmark = pytest.mark.multiprocess  # 2 torchrun worlds (6 ranks) at once

MODEL = "deepseek-v3"
BLOCK = 4                   # block size = interleave size on both sides (DI)
PLAN = [[9, 6, 3], [6, 3, 0]]     # chunk -> prompt tokens per sequence: 15, 9, 3 tokens
LENGTHS = [sum(c[b] for c in PLAN) for b in range(len(PLAN[0]))]
STEPS = 6
MAX_CONTEXT = 24            # >= longest prompt + STEPS
PREFILL = (2, 2)            # tp, dcp
DECODE = {"d-tp4dcp4": (4, 4)}
RESERVE_BLOCKS = 2          # decode block numbers differ from the prefill's
LATENT, ROPE = 32, 8        # the tiny config's kv_lora_rank, qk_rope_head_dim
HEAD_DIM = (LATENT + ROPE) // 2


def _cfg(tp, dcp, mode):
    return DCPConfig(tp=tp, dcp=dcp, mode=mode, block_size=BLOCK, num_q_heads=8,
                     num_kv_heads=1, mla=True)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    pytest.importorskip("transformers")
    return launch_worlds(tmp_path_factory.mktemp("disagg_mla"), model=MODEL, block=BLOCK,
                         plan=PLAN, prefill=PREFILL, prefill_id="p-tp2dcp2", decoders=DECODE,
                         max_context=MAX_CONTEXT, steps=STEPS, reserve_blocks=RESERVE_BLOCKS)


def test_mla_prefill_dcp_to_larger_decode_dcp_over_nixl(worlds):
    (engine, (tp, dcp)), = DECODE.items()
    out = worlds["tmp"] / engine

    # 1. Tokens and logits equal the model's own forward (no cache, expanded K/V).
    model = build_model(MODEL, 2)
    chunks = plan_tokens(PLAN, 0, vocab=MODELS[MODEL][1])
    prompts = [sum((c[b] for c in chunks), []) for b in range(len(LENGTHS))]
    ref_tokens, ref_logits = full_forward_reference(model, prompts, STEPS)
    got = json.loads((out / "decode.json").read_text())
    assert got["tokens"] == ref_tokens
    assert len(got["logits"]) == STEPS
    for t, step in enumerate(got["logits"]):
        for b in range(len(LENGTHS)):
            assert_close_report(torch.tensor(step[b]), ref_logits[b][t], atol=1e-4,
                                what=f"step {t} seq {b}")

    # 2. Each decode rank's latent cache right after the transfer equals, bit for bit, the
    #    direct scatter of the prefill world's caches (gathered) into its layout.
    p_cfg, d_cfg = _cfg(*PREFILL, "prefill"), _cfg(tp, dcp, "decode")
    plan = plan_transfer(p_cfg, d_cfg)
    p_topo = topology(*PREFILL, "prefill", config=p_cfg)
    d_topo = topology(tp, dcp, "decode", config=d_cfg)
    runs = {r: torch.load(worlds["tmp"] / "prefill" / f"prefill_rank{r}.pt")
            for r in range(PREFILL[0])}
    assert runs[0]["lengths"] == LENGTHS
    ref_blocks = -(-max(LENGTHS) // BLOCK)
    ref_table = torch.arange(len(LENGTHS) * ref_blocks).view(len(LENGTHS), ref_blocks)
    shape = (len(LENGTHS) * ref_blocks + 1, BLOCK, 1, HEAD_DIM)
    gathered = [torch.full(shape, float("nan")) for _ in runs[0]["caches"]]
    gather_cache({r: run["caches"] for r, run in runs.items()}, runs[0]["block_table"],
                 LENGTHS, gathered, ref_table, cp_rank_of=p_topo.cp_rank, dcp=PREFILL[1],
                 interleave=BLOCK, kv_heads_of=p_topo.kv_heads_of)
    assert all(int((~torch.isnan(g)).all(-1).sum()) == sum(LENGTHS) for g in gathered)
    kv_bytes = 0
    for d in range(tp):
        run = torch.load(out / f"decode_rank{d}.pt")
        assert run["remote_ranks"] == plan.rank(d).remote_ranks == [d % PREFILL[1]]
        table = run["block_table"]
        assert int(table[table >= 0].min()) >= RESERVE_BLOCKS
        expected = [torch.full_like(t, float("nan")) for t in run["caches"]]
        scatter_cache(gathered, ref_table, LENGTHS, expected, table, cp_rank=d_topo.cp_rank(d),
                      dcp=dcp, interleave=BLOCK, kv_heads=d_topo.kv_heads_of(d))
        for i, (g, e) in enumerate(zip(run["caches"], expected)):
            same = g.view(torch.int32) == e.view(torch.int32)
            if not same.all():
                rows = (~same).flatten(2).any(-1).nonzero()[:4].tolist()
                pytest.fail(f"decode rank {d}, cache {i}: differs from the direct scatter at "
                            f"[block, offset] {rows}")
        kv_bytes += sum(s["kv_bytes"] for s in run["stats"])
    # Each (position, latent) moved once: layers x (K, V) x tokens x head_dim x fp32.
    assert kv_bytes == 2 * 2 * sum(LENGTHS) * HEAD_DIM * 4
