"""Real KV transfers over NIXL between processes on 127.0.0.1 (runtime/nixl/connector.py).

Three processes (runtime/nixl/loopback.py): prefill engines, a prefill engine that dies on
request, and decode engines of other topologies. Each rank has its own NIXL agent; UCX runs
over tcp on loopback. Prefill caches are the reference KV scattered into their DCP layout;
the decode engines pull by the plan and their whole caches must equal, bit for bit, the same
reference scattered directly into the decode layout.
"""

from __future__ import annotations


import pytest

from dcp_compile.runtime.nixl.loopback import engine_config, free_port_base
from dcp_compile.runtime.transfer_plan import plan_transfer

from nixl_runs import run_loopback

pytestmark = pytest.mark.multiprocess  # three engine processes, ~10-20 s on two cores

FAILURE_BOUND = 1.0  # seconds a failing handshake / transfer may take to be reported

# Prefill engines (num_kv_heads=4): A = TP4/DCP2 (2 heads per rank), B = TP4/DCP4 (4 heads),
# C = standard TP2 (2 heads), D = standard TP1 that dies when told to.
# Decode engine -> (prefill engine, tp, dcp, kind, partial_rows).
DECODE = {
    "d-tp2": ("pA", 2, 1, "match", "staged"),         # DCP prefill -> standard decode
    "d-tp4": ("pA", 4, 1, "split", "staged"),         # ... with head splitting
    "d-tp4-desc": ("pA", 4, 1, "split", "descriptors"),
    "d-tp1": ("pA", 1, 1, "merge", "staged"),         # ... with head merging
    "d-tp1-desc": ("pA", 1, 1, "merge", "descriptors"),
    "d-tp8dcp2": ("pA", 8, 2, "split", "staged"),     # DCP prefill -> DCP decode, same degree
    "dB-tp8dcp2": ("pB", 8, 2, "split", "staged"),    # P_DCP=4 > D_DCP=2
    "dC-tp8dcp2": ("pC", 8, 2, "split", "descriptors"),  # standard prefill -> DCP decode
}
REQUESTS = {"long": 61, "vblock": 16, "short": 3, "empty": 0}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nixl")
    base = free_port_base(40)
    prefill = [{"engine_id": "pA", "tp": 4, "dcp": 2, "port": base},
               {"engine_id": "pB", "tp": 4, "dcp": 4, "port": base + 10},
               {"engine_id": "pC", "tp": 2, "dcp": 1, "port": base + 20},
               {"engine_id": "pD", "tp": 1, "dcp": 1, "port": base + 30, "doomed": True}]
    spec = {"num_kv_heads": 4, "head_dim": 8, "layers": 2, "dtype": "bfloat16",
            "block_size": 4, "seed": 3, "timeout": 60, "failure_timeout": FAILURE_BOUND,
            "prefill": prefill,
            "decode": [{"engine_id": e, "prefill": p, "tp": tp, "dcp": dcp, "partial_rows": pr}
                       for e, (p, tp, dcp, _, pr) in DECODE.items()],
            "requests": [{"id": k, "seq_len": n} for k, n in REQUESTS.items()],
            "failures": ["no_answer", "silent", "metadata_mismatch", "remote_gone"],
            "stop_file": str(tmp / "decode.json")}
    return run_loopback(tmp, spec, ("prefill", "prefill-doomed", "decode"), timeout=120)


@pytest.mark.parametrize("engine", list(DECODE))
def test_decode_caches_equal_direct_scatter_bit_for_bit(run, engine):
    res = run["decode"]["engines"][engine]
    p_id, tp, dcp, kind, partial_rows = DECODE[engine]
    assert res["mismatches"] == []
    assert res["kind"] == kind
    spec = run["spec"]
    p_eng = next(e for e in spec["prefill"] if e["engine_id"] == p_id)
    plan = plan_transfer(engine_config(spec, p_eng, "prefill"),
                         engine_config(spec, {"tp": tp, "dcp": dcp}, "decode"))
    assert res["remote_ranks"] == [rp.remote_ranks for rp in plan.ranks]
    long = res["requests"]["long"][0]
    kv_bytes = 2 * 2 * 61 * 4 * 8 * 2  # layers * (k, v) * tokens * heads * head_dim * bf16
    assert long["kv_bytes"] == kv_bytes
    # Staged splitting reads whole remote rows (2 heads for 1): twice the KV bytes.
    staged_split = kind == "split" and partial_rows == "staged" and p_id == "pA"
    assert long["bytes"] == kv_bytes * (2 if staged_split else 4 if engine == "dB-tp8dcp2"
                                        else 1)


def test_decode_rank_with_nothing_to_read_still_notifies(run):
    # 3 tokens < one block: decode dcp_rank 1 owns none of them.
    short = run["decode"]["engines"]["d-tp8dcp2"]["requests"]["short"][0]
    assert short["reads"] == [1, 0] * 4 and short["notify_only"] == [0, 1] * 4
    got = {(d, st) for e, _, rid, de, d, st in run["prefill"]["notifications"]
           if rid == "short" and de == "d-tp8dcp2"}
    assert {d for d, st in got if st == "empty"} == {1, 3, 5, 7}
    assert {d for d, st in got if st == "read"} == {0, 2, 4, 6}


def test_request_without_transfers_completes_and_notifies(run):
    for engine, res in run["decode"]["engines"].items():
        empty = res["requests"]["empty"][0]
        assert empty["bytes"] == 0 and set(empty["reads"]) == {0}, engine
        assert min(empty["notify_only"]) >= 1, engine
    assert run["prefill"]["missing_notifications"] == []
    statuses = {st for *_, rid, de, d, st in run["prefill"]["notifications"] if rid == "empty"}
    assert statuses == {"empty"}


@pytest.mark.parametrize("kind", ["no_answer", "silent"])
def test_remote_that_never_answers_fails_in_bounded_time(run, kind):
    f = run["decode"]["failures"][kind]
    assert f["error"] and "did not answer the handshake" in f["error"], f
    assert f["seconds"] < FAILURE_BOUND + 1.0


def test_handshake_metadata_inconsistent_with_plan(run):
    f = run["decode"]["failures"]["metadata_mismatch"]
    assert f["error"] and "does not match the transfer plan" in f["error"], f
    assert "dcp_size advertised 2, plan expects 4" in f["error"]


def test_remote_gone_after_handshake_is_an_error_not_a_partial_cache(run):
    f = run["decode"]["failures"]["remote_gone"]
    assert f["error"] and "must not be used" in f["error"], f
    assert f["seconds"] < FAILURE_BOUND + 1.0
