"""Real KV transfers over NIXL between processes on 127.0.0.1 (runtime/transfer/nixl/connector.py).

Three processes (tests/support/nixl_loopback.py, through tests/support/nixl_runs.py): prefill engines, a
prefill engine that dies on request, and decode engines of other topologies. Each rank has
its own NIXL agent; UCX runs over tcp on loopback. Prefill caches are the reference KV
scattered into their DCP layout; the decode engines pull by the plan and their whole caches
must equal, bit for bit, the same reference scattered directly into the decode layout. The
processes run three scenarios one after the other (a process starts once for all), each
checked in a section below:

1. The connector: head-split, head-merge and DCP layouts, staged and descriptor partial
   rows, and its failures (a remote that never answers, inconsistent metadata, a remote
   gone after the handshake).

2. MLA's latent cache (issue 17). The cache of an MLA program is one KV head whose key and
   value caches hold the two halves of [latent ; k_pe] (passes/absorb_latent_attention.py):
   DeepSeek's L=512, dr=64 give ``kv_heads=1, head_dim=288``. Every rank of a DCP group
   holds different tokens of that same head, so the transfer planner
   (runtime/transfer/plan.py) has no head to split or merge: each decode rank reads its owned
   tokens from whichever prefill ranks own them. The bytes moved must be exactly the latent
   cache's (nothing expanded, nothing twice).

3. Any pair of DCP degrees, with the engines' own block allocator (runtime/serving/kv_cache.py):
   prefill engines TP2/DCP2, standard TP1 and TP4/DCP4; decode engines TP8/DCP4 (a prefill
   DCP smaller than the decode DCP), TP8/DCP8 (a standard prefill feeding eight DCP ranks)
   and TP6/DCP3 (gcd(4, 3) = 1: every decode cp_rank reads every prefill cp_rank). Block
   tables come from BlockAllocator with the entries grouped as the plan says
   (``TransferPlan.prefill_block_groups`` / ``decode_block_groups``); each (remote rank,
   head range) with data must be one descriptor per cache tensor (structural: the coalesced
   count, never a timing).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_compile.runtime.distributed.launch import free_port_base
from nixl_loopback import block_tables, engine_config
from dcp_compile.runtime.topology import topology
from dcp_compile.runtime.transfer.plan import plan_transfer

from nixl_runs import run_loopback

pytestmark = pytest.mark.multiprocess  # three engine processes, ~10-30 s on two cores

# --- 1. the connector ----------------------------------------------------------------------

FAILURE_BOUND = 1.0  # seconds a failing handshake / transfer may take to be reported
# What the timing asserts show: the failure came from FAILURE_BOUND, not from the spec's 60 s
# timeout. The slack is wide so that a loaded machine (2 cores, xdist) cannot fail them.
FAILURE_SLACK = 15.0

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


def _connector_spec(tmp: Path, base: int) -> dict:
    prefill = [{"engine_id": "pA", "tp": 4, "dcp": 2, "port": base},
               {"engine_id": "pB", "tp": 4, "dcp": 4, "port": base + 10},
               {"engine_id": "pC", "tp": 2, "dcp": 1, "port": base + 20},
               {"engine_id": "pD", "tp": 1, "dcp": 1, "port": base + 30, "doomed": True}]
    return {"num_kv_heads": 4, "head_dim": 8, "layers": 2, "dtype": "bfloat16",
            "block_size": 4, "seed": 3, "timeout": 60, "failure_timeout": FAILURE_BOUND,
            "prefill": prefill,
            "decode": [{"engine_id": e, "prefill": p, "tp": tp, "dcp": dcp, "partial_rows": pr}
                       for e, (p, tp, dcp, _, pr) in DECODE.items()],
            "requests": [{"id": k, "seq_len": n} for k, n in REQUESTS.items()],
            "failures": ["no_answer", "silent", "metadata_mismatch", "remote_gone"],
            "stop_file": str(tmp / "decode.json")}


def _plan(spec: dict, p_id: str, tp: int, dcp: int):
    """The transfer plan of a (tp, dcp) decode engine reading prefill engine ``p_id``."""
    p_eng = next(e for e in spec["prefill"] if e["engine_id"] == p_id)
    return plan_transfer(engine_config(spec, p_eng, "prefill"),
                         engine_config(spec, {"tp": tp, "dcp": dcp}, "decode"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three scenarios, run once by the same engine processes (ports apart)."""
    tmp = tmp_path_factory.mktemp("nixl")
    base = free_port_base(100)
    return run_loopback(tmp, {
        "connector": (_connector_spec(tmp / "connector", base),
                      ("prefill", "prefill-doomed", "decode")),
        "mla": (_mla_spec(tmp / "mla", base + 40), ("prefill", "decode")),
        "any_pair": (_any_pair_spec(tmp / "any_pair", base + 70), ("prefill", "decode"))},
        timeout=300)


@pytest.fixture(scope="module")
def run(runs):
    return runs["connector"]


@pytest.fixture(scope="module")
def mla_run(runs):
    return runs["mla"]


@pytest.fixture(scope="module")
def any_pair_run(runs):
    return runs["any_pair"]


@pytest.mark.parametrize("engine", list(DECODE))
def test_decode_caches_equal_direct_scatter_bit_for_bit(run, engine):
    res = run["decode"]["engines"][engine]
    p_id, tp, dcp, kind, partial_rows = DECODE[engine]
    assert res["mismatches"] == []
    assert res["kind"] == kind
    spec = run["spec"]
    plan = _plan(spec, p_id, tp, dcp)
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
    assert f["seconds"] < FAILURE_BOUND + FAILURE_SLACK


def test_handshake_metadata_inconsistent_with_plan(run):
    f = run["decode"]["failures"]["metadata_mismatch"]
    assert f["error"] and "does not match the transfer plan" in f["error"], f
    assert "dcp_size advertised 2, plan expects 4" in f["error"]


def test_remote_gone_after_handshake_is_an_error_not_a_partial_cache(run):
    f = run["decode"]["failures"]["remote_gone"]
    assert f["error"] and "must not be used" in f["error"], f
    assert f["seconds"] < FAILURE_BOUND + FAILURE_SLACK


# --- 2. MLA's latent cache -----------------------------------------------------------------

MLA_LATENT, MLA_ROPE, MLA_LAYERS = 512, 64, 2   # DeepSeek-V3's kv_lora_rank, qk_rope_head_dim
MLA_HEAD_DIM = (MLA_LATENT + MLA_ROPE) // 2     # each cache of the pair holds one half
# Prefill engines (MLA: dcp divides tp): A = TP4/DCP2, B = TP8/DCP8.
MLA_PREFILL = {"pA": (4, 2), "pB": (8, 8)}
# Decode engine -> (prefill engine, tp, dcp): the layouts and a standard decode
# (the planner reads decode dcp_rank r from prefill cp_ranks {r, r + D_DCP, ...}, so the
# prefill's dcp is a multiple of the decode's).
MLA_DECODE = {"d-tp8dcp8": ("pB", 8, 8), "d-tp4dcp4": ("pB", 4, 4),
              "d-tp8dcp2": ("pB", 8, 2), "dA-tp8dcp2": ("pA", 8, 2), "d-tp2": ("pA", 2, 1)}
MLA_REQUESTS = {"long": 61, "vblock": 16, "short": 3, "empty": 0}


def _mla_spec(tmp: Path, base: int) -> dict:
    return {"num_kv_heads": 1, "head_dim": MLA_HEAD_DIM, "mla": True, "layers": MLA_LAYERS,
            "dtype": "bfloat16", "block_size": 4, "seed": 5, "timeout": 60,
            "prefill": [{"engine_id": e, "tp": tp, "dcp": dcp, "port": base + 10 * i}
                        for i, (e, (tp, dcp)) in enumerate(MLA_PREFILL.items())],
            "decode": [{"engine_id": e, "prefill": p, "tp": tp, "dcp": dcp,
                        "partial_rows": "staged"} for e, (p, tp, dcp) in MLA_DECODE.items()],
            "requests": [{"id": k, "seq_len": n} for k, n in MLA_REQUESTS.items()],
            "stop_file": str(tmp / "decode.json")}


def test_single_latent_head_topology_and_plan():
    """One head: every rank of a DCP group holds that head, different tokens; each decode
    rank reads from prefill ranks of one attention group only (no head split or merge)."""
    spec = _mla_spec(Path("."), 0)
    for e, (p, tp, dcp) in MLA_DECODE.items():
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


@pytest.mark.parametrize("engine", list(MLA_DECODE))
def test_decode_latent_caches_equal_direct_scatter_bit_for_bit(mla_run, engine):
    res = mla_run["decode"]["engines"][engine]
    p_id, tp, dcp = MLA_DECODE[engine]
    assert res["mismatches"] == []
    spec = mla_run["spec"]
    plan = _plan(spec, p_id, tp, dcp)
    assert res["remote_ranks"] == [rp.remote_ranks for rp in plan.ranks]
    long = res["requests"]["long"][0]
    # The latent cache: layers x (key half, value half) x tokens x 1 head x 288 x bf16 =
    # layers x tokens x (L + dr) values: [latent ; k_pe] once per token, never expanded; each
    # of the tp/dcp DCP groups holds (and reads) one copy, spread over its dcp ranks.
    latent_bytes = MLA_LAYERS * 61 * (MLA_LATENT + MLA_ROPE) * 2
    assert long["kv_bytes"] == (tp // dcp) * latent_bytes
    assert long["bytes"] == long["kv_bytes"]


# --- 3. any pair of DCP degrees ------------------------------------------------------------

ANY_PREFILL = {"p-tp2dcp2": (2, 2), "p-tp1": (1, 1), "p-tp4dcp4": (4, 4)}
# Decode engine -> (prefill engine, tp, dcp).
ANY_DECODE = {"d-tp8dcp4": ("p-tp2dcp2", 8, 4), "d-tp8dcp8": ("p-tp1", 8, 8),
              "d-tp6dcp3": ("p-tp4dcp4", 6, 3)}
ANY_REQUESTS = {"long": 61, "vblock": 16, "short": 3, "empty": 0}
ANY_LAYERS = 2


def _any_pair_plans(spec) -> dict:
    p_by_id = {e["engine_id"]: e for e in spec["prefill"]}
    return {d: plan_transfer(engine_config(spec, p_by_id[p], "prefill"),
                             engine_config(spec, {"tp": tp, "dcp": dcp}, "decode"))
            for d, (p, tp, dcp) in ANY_DECODE.items()}


def _any_pair_spec(tmp: Path, base: int) -> dict:
    spec = {"num_kv_heads": 1, "head_dim": 8, "layers": ANY_LAYERS, "dtype": "bfloat16",
            "block_size": 4, "seed": 7, "timeout": 60,
            "prefill": [{"engine_id": e, "tp": tp, "dcp": dcp, "port": base + 10 * i}
                        for i, (e, (tp, dcp)) in enumerate(ANY_PREFILL.items())],
            "decode": [{"engine_id": e, "prefill": p, "tp": tp, "dcp": dcp,
                        "partial_rows": "staged"} for e, (p, tp, dcp) in ANY_DECODE.items()],
            "requests": [{"id": k, "seq_len": n} for k, n in ANY_REQUESTS.items()],
            "allocation": "contiguous", "stop_file": str(tmp / "decode.json")}
    groups = {}
    for d, plan in _any_pair_plans(spec).items():
        groups[ANY_DECODE[d][0]], groups[d] = plan.prefill_block_groups, plan.decode_block_groups
    spec["block_groups"] = groups
    return spec


@pytest.mark.parametrize("engine", list(ANY_DECODE))
def test_any_dcp_pair_moves_bit_for_bit_in_coalesced_reads(any_pair_run, engine):
    res = any_pair_run["decode"]["engines"][engine]
    assert res["mismatches"] == []
    spec, plan = any_pair_run["spec"], _any_pair_plans(any_pair_run["spec"])[engine]
    assert res["remote_ranks"] == [rp.remote_ranks for rp in plan.ranks]
    p_id = ANY_DECODE[engine][0]
    _, p_tables = block_tables(spec, plan.prefill, p_id)
    _, d_tables = block_tables(spec, plan.decode, engine)
    for rid, n in ANY_REQUESTS.items():
        got = res["requests"][rid][0]
        # Every (position, KV head) once per decode replica of it (the one KV head is on
        # tp / dcp ranks of each cp_rank): layers x (K, V) x tokens x head_dim x bf16.
        replicas = plan.decode.tp // plan.decode.dcp
        assert got["kv_bytes"] == got["bytes"] == replicas * ANY_LAYERS * 2 * n * 8 * 2, rid
        with_data = sum(1 for rp in plan.ranks for r in rp.reads
                        if len(plan.chunks(rp.rank, r.remote_cp_rank, n, p_tables[rid],
                                           d_tables[rid])))
        assert got["descriptors"] == 2 * ANY_LAYERS * with_data, rid
    assert any_pair_run["prefill"]["missing_notifications"] == []
