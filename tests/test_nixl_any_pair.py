"""Any pair of DCP degrees moved over real NIXL on 127.0.0.1, with the engines' own block
allocator (runtime/transfer_plan.py, runtime/nixl/connector.py, runtime/kv_cache.py).

Two processes (runtime/nixl/loopback.py, one NIXL agent per rank, UCX over tcp on loopback):
prefill engines TP2/DCP2, standard TP1 and TP4/DCP4; decode engines TP8/DCP4 (a prefill DCP
smaller than the decode DCP), TP8/DCP8 (a standard prefill feeding eight DCP ranks) and
TP6/DCP3 (gcd(4, 3) = 1: every decode cp_rank reads every prefill cp_rank). Block tables
come from BlockAllocator with the entries grouped as the plan says
(``TransferPlan.prefill_block_groups`` / ``decode_block_groups``). Each decode rank's whole
cache must equal, bit for bit, the reference scattered directly into its layout; each
(remote rank, head range) with data must be one descriptor per cache tensor (structural:
the coalesced count, never a timing).
"""

from __future__ import annotations

import pytest

from dcp_compile.runtime.nixl.loopback import block_tables, engine_config, free_port_base
from dcp_compile.runtime.transfer_plan import plan_transfer

from nixl_runs import run_loopback

pytestmark = pytest.mark.multiprocess  # two engine processes, ~10-30 s on two cores

PREFILL = {"p-tp2dcp2": (2, 2), "p-tp1": (1, 1), "p-tp4dcp4": (4, 4)}
# Decode engine -> (prefill engine, tp, dcp).
DECODE = {"d-tp8dcp4": ("p-tp2dcp2", 8, 4), "d-tp8dcp8": ("p-tp1", 8, 8),
          "d-tp6dcp3": ("p-tp4dcp4", 6, 3)}
REQUESTS = {"long": 61, "vblock": 16, "short": 3, "empty": 0}
LAYERS = 2


def _plans(spec) -> dict:
    p_by_id = {e["engine_id"]: e for e in spec["prefill"]}
    return {d: plan_transfer(engine_config(spec, p_by_id[p], "prefill"),
                             engine_config(spec, {"tp": tp, "dcp": dcp}, "decode"))
            for d, (p, tp, dcp) in DECODE.items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nixl_any_pair")
    base = free_port_base(10 * len(PREFILL))
    spec = {"num_kv_heads": 1, "head_dim": 8, "layers": LAYERS, "dtype": "bfloat16",
            "block_size": 4, "seed": 7, "timeout": 60,
            "prefill": [{"engine_id": e, "tp": tp, "dcp": dcp, "port": base + 10 * i}
                        for i, (e, (tp, dcp)) in enumerate(PREFILL.items())],
            "decode": [{"engine_id": e, "prefill": p, "tp": tp, "dcp": dcp,
                        "partial_rows": "staged"} for e, (p, tp, dcp) in DECODE.items()],
            "requests": [{"id": k, "seq_len": n} for k, n in REQUESTS.items()],
            "allocation": "contiguous", "stop_file": str(tmp / "decode.json")}
    groups = {}
    for d, plan in _plans(spec).items():
        groups[DECODE[d][0]], groups[d] = plan.prefill_block_groups, plan.decode_block_groups
    spec["block_groups"] = groups
    return run_loopback(tmp, spec, ("prefill", "decode"), timeout=180)


@pytest.mark.parametrize("engine", list(DECODE))
def test_any_dcp_pair_moves_bit_for_bit_in_coalesced_reads(run, engine):
    res = run["decode"]["engines"][engine]
    assert res["mismatches"] == []
    spec, plan = run["spec"], _plans(run["spec"])[engine]
    assert res["remote_ranks"] == [rp.remote_ranks for rp in plan.ranks]
    p_id = DECODE[engine][0]
    _, p_tables = block_tables(spec, plan.prefill, p_id)
    _, d_tables = block_tables(spec, plan.decode, engine)
    for rid, n in REQUESTS.items():
        got = res["requests"][rid][0]
        # Every (position, KV head) once per decode replica of it (the one KV head is on
        # tp / dcp ranks of each cp_rank): layers x (K, V) x tokens x head_dim x bf16.
        replicas = plan.decode.tp // plan.decode.dcp
        assert got["kv_bytes"] == got["bytes"] == replicas * LAYERS * 2 * n * 8 * 2, rid
        with_data = sum(1 for rp in plan.ranks for r in rp.reads
                        if len(plan.chunks(rp.rank, r.remote_cp_rank, n, p_tables[rid],
                                           d_tables[rid])))
        assert got["descriptors"] == 2 * LAYERS * with_data, rid
    assert run["prefill"]["missing_notifications"] == []
