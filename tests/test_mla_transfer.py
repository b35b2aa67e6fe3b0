"""MLA's latent cache moved prefill -> decode over real NIXL on 127.0.0.1 (issue 17).

The cache of an MLA program is one KV head whose key and value caches hold the two halves of
[latent ; k_pe] (passes/absorb_latent_attention.py): DeepSeek's L=512, dr=64 give
``kv_heads=1, head_dim=288``. Every rank of a DCP group holds different tokens of that same
head, so the transfer planner (runtime/transfer_plan.py) has no head to split or merge: each
decode rank reads its owned tokens from whichever prefill ranks own them. Two processes
(runtime/nixl/loopback.py, one NIXL agent per rank, UCX over tcp on loopback) move seeded
reference caches; each decode rank's whole cache (every block, the garbage block included)
must equal, bit for bit, the same reference scattered directly into its own layout, and the
bytes moved must be exactly the latent cache's (nothing expanded, nothing twice).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_compile.runtime.nixl.loopback import engine_config, free_port_base
from dcp_compile.runtime.topology import topology
from dcp_compile.runtime.transfer_plan import plan_transfer

from nixl_runs import run_loopback

pytestmark = pytest.mark.multiprocess  # two engine processes, ~10-30 s on two cores

LATENT, ROPE, LAYERS = 512, 64, 2            # DeepSeek-V3's kv_lora_rank, qk_rope_head_dim
HEAD_DIM = (LATENT + ROPE) // 2              # each cache of the pair holds one half
# Prefill engines (MLA: dcp divides tp): A = TP4/DCP2, B = TP8/DCP8.
PREFILL = {"pA": (4, 2), "pB": (8, 8)}
# Decode engine -> (prefill engine, tp, dcp): the layouts and a standard decode
# (the planner reads decode dcp_rank r from prefill cp_ranks {r, r + D_DCP, ...}, so the
# prefill's dcp is a multiple of the decode's).
DECODE = {"d-tp8dcp8": ("pB", 8, 8), "d-tp4dcp4": ("pB", 4, 4), "d-tp8dcp2": ("pB", 8, 2),
          "dA-tp8dcp2": ("pA", 8, 2), "d-tp2": ("pA", 2, 1)}
REQUESTS = {"long": 61, "vblock": 16, "short": 3, "empty": 0}


def _spec(tmp: Path, base: int) -> dict:
    return {"num_kv_heads": 1, "head_dim": HEAD_DIM, "mla": True, "layers": LAYERS,
            "dtype": "bfloat16", "block_size": 4, "seed": 5, "timeout": 60,
            "prefill": [{"engine_id": e, "tp": tp, "dcp": dcp, "port": base + 10 * i}
                        for i, (e, (tp, dcp)) in enumerate(PREFILL.items())],
            "decode": [{"engine_id": e, "prefill": p, "tp": tp, "dcp": dcp,
                        "partial_rows": "staged"} for e, (p, tp, dcp) in DECODE.items()],
            "requests": [{"id": k, "seq_len": n} for k, n in REQUESTS.items()],
            "stop_file": str(tmp / "decode.json")}


def _run_once(tmp: Path) -> dict:
    spec = _spec(tmp, free_port_base(20))
    return run_loopback(tmp, spec, ("prefill", "decode"), timeout=180)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _run_once(tmp_path_factory.mktemp("mla_nixl"))


def test_single_latent_head_topology_and_plan():
    """One head: every rank of a DCP group holds that head, different tokens; each decode
    rank reads from prefill ranks of one attention group only (no head split or merge)."""
    spec = _spec(Path("."), 0)
    for e, (p, tp, dcp) in DECODE.items():
        p_eng = next(x for x in spec["prefill"] if x["engine_id"] == p)
        pcfg = engine_config(spec, p_eng, "prefill")
        dcfg = engine_config(spec, {"tp": tp, "dcp": dcp}, "decode")
        assert pcfg.mla and dcfg.mla
        topo = topology(tp, dcp, "decode", config=dcfg)
        for r in range(tp):
            assert topo.kv_heads_of(r) == [0]
        plan = plan_transfer(pcfg, dcfg)
        assert plan.kind == "match", (e, plan.kind)
        for rp in plan.ranks:
            assert rp.remote_ranks, (e, rp)


@pytest.mark.parametrize("engine", list(DECODE))
def test_decode_latent_caches_equal_direct_scatter_bit_for_bit(run, engine):
    res = run["decode"]["engines"][engine]
    p_id, tp, dcp = DECODE[engine]
    assert res["mismatches"] == []
    spec = run["spec"]
    p_eng = next(e for e in spec["prefill"] if e["engine_id"] == p_id)
    plan = plan_transfer(engine_config(spec, p_eng, "prefill"),
                         engine_config(spec, {"tp": tp, "dcp": dcp}, "decode"))
    assert res["remote_ranks"] == [rp.remote_ranks for rp in plan.ranks]
    long = res["requests"]["long"][0]
    # The latent cache: layers x (key half, value half) x tokens x 1 head x 288 x bf16 =
    # layers x tokens x (L + dr) values: [latent ; k_pe] once per token, never expanded; each
    # of the tp/dcp DCP groups holds (and reads) one copy, spread over its dcp ranks.
    latent_bytes = LAYERS * 61 * (LATENT + ROPE) * 2
    assert long["kv_bytes"] == (tp // dcp) * latent_bytes
    assert long["bytes"] == long["kv_bytes"]
