"""Test harness: prefill and decode engines on one machine, moving real KV over NIXL (the NIXL
tests and benchmarks/bench_transfer.py; not part of the installed package).

``python -m tests.support.nixl_loopback prefill|prefill-doomed|decode SPEC.json OUT.json`` runs one
engine process:
every rank of every engine in the spec gets its own NIXL agent in that process, and the two
processes talk over UCX on 127.0.0.1 (one agent per rank; a process per engine keeps a
two-core machine responsive). Results go to OUT.json (NIXL logs to stdout).

Caches are built from a reference: per request and layer a random key and value
``[seq_len, num_kv_heads, head_dim]`` (seeded, so both processes regenerate it), scattered into
each rank's layout by :func:`dcp_compile.runtime.transfer.cache_layout.scatter_cache` (the layout formulas
``owner``, ``local_slot``, ``physical_slot``).
The decode process checks its caches, bit for bit, against the same scatter into its own
layout -- the whole cache, so a stray write anywhere (the garbage block included) fails.

Spec (JSON)::

    {"num_kv_heads": 4, "head_dim": 8, "layers": 2, "dtype": "float32", "block_size": 4,
     "seed": 0, "timeout": 20, "mla": false,
     "prefill": [{"engine_id": "pA", "tp": 4, "dcp": 2, "port": 31000}],
     "decode":  [{"engine_id": "d0", "prefill": "pA", "tp": 2, "dcp": 1,
                  "partial_rows": "staged"}],
     "requests": [{"id": "long", "seq_len": 61}, {"id": "empty", "seq_len": 0}],
     "failures": ["no_answer", "silent", "metadata_mismatch", "remote_gone"],
     "repeat": 1}
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time
import traceback

import torch

from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransferError
from dcp_compile.runtime.names import Mode
from dcp_compile.runtime.topology import topology
from dcp_compile.runtime.transfer.cache_layout import scatter_cache
from dcp_compile.runtime.serving.kv_cache import BlockAllocator
from dcp_compile.runtime.transfer.plan import table_entries
from dcp_compile.runtime.distributed.launch import free_port_base

SENTINEL = -7.25  # what a cache holds before anything is written to it


# ---------------------------------------------------------------------------------------
# Reference KV and the layouts
# ---------------------------------------------------------------------------------------


def reference_kv(spec: dict, request_index: int, seq_len: int) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (key, value), each [seq_len, num_kv_heads, head_dim], seeded per request."""
    return _reference_kv(spec["seed"], request_index, seq_len, spec["num_kv_heads"],
                         spec["head_dim"], spec["dtype"], spec["layers"])


@functools.lru_cache(maxsize=4)
def _reference_kv(seed, request_index, seq_len, num_kv_heads, head_dim, dtype, layers):
    g = torch.Generator().manual_seed(seed * 1000 + request_index)
    shape = (seq_len, num_kv_heads, head_dim)
    dtype = getattr(torch, dtype)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(layers)]


def engine_config(spec: dict, eng: dict, mode: str) -> DCPConfig:
    # "mla": one latent head ([latent ; k_pe] per token, its halves as key and value; the
    # config's MLA rules: any tp, dcp dividing it).
    return DCPConfig(tp=eng["tp"], dcp=eng["dcp"], mode=mode, block_size=spec["block_size"],
                     num_kv_heads=spec["num_kv_heads"], mla=bool(spec.get("mla")))


def block_tables(spec: dict, cfg: DCPConfig, engine_id: str) -> tuple[int, dict[str, list[int]]]:
    """(num_blocks, request id -> block table), distinct across requests: shuffled blocks
    (fragmented: the default), or with ``"allocation": "contiguous"`` what the engine's
    BlockAllocator gives, entries grouped by ``spec["block_groups"][engine_id]`` (default 1;
    ``TransferPlan.decode_block_groups`` / ``prefill_block_groups``)."""
    need = {r["id"]: table_entries(r["seq_len"], cfg) for r in spec["requests"]}
    usable = sum(need.values()) + 3
    if spec.get("allocation", "shuffled") == "contiguous":
        alloc = BlockAllocator(usable + 1, cfg.vblock)
        groups = spec.get("block_groups", {}).get(engine_id, 1)
        return usable + 1, {r["id"]: list(alloc.ensure(i, r["seq_len"], groups))
                            for i, r in enumerate(spec["requests"])}
    g = torch.Generator().manual_seed(sum(map(ord, engine_id)) + spec["seed"])
    order = torch.randperm(usable, generator=g).tolist()
    tables, i = {}, 0
    for rid, n in need.items():
        tables[rid] = order[i:i + n]
        i += n
    return usable + 1, tables  # + the garbage block, last


def new_caches(spec: dict, cfg: DCPConfig, rank: int, num_blocks: int) -> list[tuple]:
    heads = len(topology(cfg.tp, cfg.dcp, cfg.mode, config=cfg).kv_heads_of(rank))
    shape = (num_blocks, cfg.block_size, heads, spec["head_dim"])
    dtype = getattr(torch, spec["dtype"])
    return [(torch.full(shape, SENTINEL, dtype=dtype), torch.full(shape, SENTINEL, dtype=dtype))
            for _ in range(spec["layers"])]


def scatter_reference(ref, cfg: DCPConfig, rank: int, caches, table: list[int]) -> None:
    """Write the positions and KV heads ``rank`` owns into its caches (its own layout).

    The reference ``[seq_len, heads, head_dim]`` is viewed as a single-device paged cache
    (block ``j`` = positions ``j*block_size ...``) and scattered with
    :func:`dcp_compile.runtime.transfer.cache_layout.scatter_cache`, the one host-side scatter every test uses.
    """
    topo = topology(cfg.tp, cfg.dcp, cfg.mode, config=cfg)
    seq_len = ref[0][0].shape[0]
    if not seq_len:
        return
    block = cfg.block_size
    n_blocks = -(-seq_len // block)

    def paged(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((n_blocks * block, *t.shape[1:]))
        out[:seq_len] = t
        return out.view(n_blocks, block, *t.shape[1:])

    scatter_cache([paged(t) for kv in ref for t in kv], torch.arange(n_blocks)[None], [seq_len],
                  [t for kv in caches for t in kv],
                  torch.as_tensor(table, dtype=torch.int64)[None],
                  cp_rank=topo.cp_rank(rank), dcp=cfg.dcp, interleave=cfg.interleave_size,
                  kv_heads=topo.kv_heads_of(rank))


def filled_caches(spec, cfg, engine_id, rank):
    num_blocks, tables = block_tables(spec, cfg, engine_id)
    caches = new_caches(spec, cfg, rank, num_blocks)
    for i, r in enumerate(spec["requests"]):
        scatter_reference(reference_kv(spec, i, r["seq_len"]), cfg, rank, caches, tables[r["id"]])
    return caches


# ---------------------------------------------------------------------------------------
# The two engine processes
# ---------------------------------------------------------------------------------------


def request_epoch(spec: dict, rep: int, index: int) -> int:
    """The lease epoch of request ``index`` in repeat ``rep`` (both processes compute it)."""
    return rep * len(spec["requests"]) + index + 1


def run_prefill(spec: dict, doomed: bool = False) -> dict:
    """Hold every request of the spec for its planned readers (one lease per request and
    repeat, readers from every decode engine of the spec) and serve until every planned
    notification arrived.

    ``doomed=True`` serves only the engines marked ``"doomed"``, and the process dies
    (``os._exit``, like a crash) as soon as any of their ranks is told ``kill`` (a
    notification the connector rejects, but records): the decode side's "remote gone"
    failure scenario.
    """
    from dcp_compile.runtime.transfer.nixl.connector import PrefillKVConnector
    from dcp_compile.runtime.transfer.plan import plan_transfer

    conns = {}
    engines = [e for e in spec["prefill"] if bool(e.get("doomed")) == doomed]
    for eng in engines:
        cfg = engine_config(spec, eng, "prefill")
        for r in range(cfg.tp):
            conns[(eng["engine_id"], r)] = PrefillKVConnector(
                cfg, r, filled_caches(spec, cfg, eng["engine_id"], r),
                engine_id=eng["engine_id"], side_channel_port=eng["port"])
    # What every prefill rank must hear: each request, from each decode rank that planned it;
    # the same (engine, rank) -> lease: epoch, request, its block table and its readers.
    want, leases = [], {}
    hosted = {e["engine_id"]: e for e in engines}
    for dec in spec["decode"]:
        p_eng = hosted.get(dec["prefill"])
        if p_eng is None:
            continue
        plan = plan_transfer(engine_config(spec, p_eng, "prefill"),
                             engine_config(spec, dec, "decode"))
        for rep in range(spec.get("repeat", 1)):
            for i, req in enumerate(spec["requests"]):
                rid = _rid(req["id"], rep)
                for p in range(plan.prefill.tp):
                    for d in plan.readers_of(p):
                        want.append((p_eng["engine_id"], p, rid, dec["engine_id"], d))
                        leases.setdefault((p_eng["engine_id"], p), {}).setdefault(
                            (request_epoch(spec, rep, i), rid, req["id"]), []).append(
                            (dec["engine_id"], d))
    for (e, p), held in leases.items():  # in epoch order: hold() needs increasing epochs
        _, tables = block_tables(spec, conns[(e, p)].config, e)
        for (epoch, rid, req_id), readers in sorted(held.items()):
            conns[(e, p)].hold(rid, tables[req_id], readers, timeout=spec["timeout"],
                               epoch=epoch)
    deadline = time.monotonic() + spec["timeout"]
    while True:
        for c in conns.values():
            c.poll()
            if doomed and any(r.request_id == "kill" for r in c.rejected):
                os._exit(0)
        missing = [w for w in want
                   if (w[3], w[4]) not in conns[(w[0], w[1])].notifications.get(w[2], {})]
        # Stay up until the decode process is done (its failure scenarios need us too).
        decode_done = not spec.get("stop_file") or os.path.exists(spec["stop_file"])
        if (not missing and decode_done) or time.monotonic() > deadline:
            break
        time.sleep(0.0005)
    out = {"missing_notifications": missing,
           "notifications": [[e, r, rid, de, d, st] for (e, r), c in conns.items()
                             for rid, got in c.notifications.items()
                             for (de, d), st in got.items()]}
    for c in conns.values():
        c.close()
    return out


def _rid(request_id: str, rep: int) -> str:
    return request_id if rep == 0 else f"{request_id}#{rep}"


def run_decode(spec: dict) -> dict:
    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector, TransferRequest, wait_all

    out = {"engines": {}, "failures": {}}
    timeout = spec["timeout"]
    p_by_id = {e["engine_id"]: e for e in spec["prefill"]}
    for dec in spec["decode"]:
        p_eng = p_by_id[dec["prefill"]]
        p_cfg, d_cfg = engine_config(spec, p_eng, "prefill"), engine_config(spec, dec, "decode")
        _, p_tables = block_tables(spec, p_cfg, p_eng["engine_id"])
        num_blocks, d_tables = block_tables(spec, d_cfg, dec["engine_id"])
        ranks = [DecodeKVConnector(p_cfg, d_cfg, d, new_caches(spec, d_cfg, d, num_blocks),
                                   engine_id=dec["engine_id"], side_channel_port=p_eng["port"],
                                   handshake_timeout=timeout, transfer_timeout=timeout,
                                   partial_rows=dec.get("partial_rows", "staged"))
                 for d in range(d_cfg.tp)]
        t0 = time.perf_counter()
        for c in ranks:
            c.handshake()
        res = {"handshake_s": time.perf_counter() - t0, "requests": {}}
        for rep in range(spec.get("repeat", 1)):
            for i, req in enumerate(spec["requests"]):
                rid = _rid(req["id"], rep)
                t0 = time.perf_counter()
                for c in ranks:  # every rank posts, then all complete: ranks run side by side
                    c.start_read(TransferRequest(rid, req["seq_len"], p_tables[req["id"]],
                                                 d_tables[req["id"]],
                                                 request_epoch(spec, rep, i)))
                stats = wait_all(ranks, rid)
                wall = time.perf_counter() - t0
                res["requests"].setdefault(req["id"], []).append({
                    "seconds": wall, "bytes": sum(s.bytes for s in stats),
                    "kv_bytes": sum(s.kv_bytes for s in stats),
                    "descriptors": sum(s.descriptors for s in stats),
                    "reads": [s.reads for s in stats],
                    "notify_only": [s.notify_only for s in stats]})
        # Bit for bit: every rank's whole cache against the direct scatter of the reference.
        mismatches = []
        for c in ranks:
            want = filled_caches(spec, d_cfg, dec["engine_id"], c.rank)
            got = [t for kv in c.kv_caches for t in kv]
            for i, (w, g) in enumerate(zip((t for kv in want for t in kv), got)):
                if not torch.equal(w.view(torch.uint8), g.view(torch.uint8)):
                    bad = (w.view(-1, w.shape[2] * w.shape[3]).view(torch.uint8)
                           != g.view(-1, g.shape[2] * g.shape[3]).view(torch.uint8))
                    rows = bad.view(bad.shape[0], -1).any(1).nonzero().flatten()[:5].tolist()
                    mismatches.append({"rank": c.rank, "tensor": i, "first_rows": rows})
        res["mismatches"] = mismatches
        res["remote_ranks"] = [c.rank_plan.remote_ranks for c in ranks]
        res["kind"] = ranks[0].plan.kind
        for c in ranks:
            c.close()
        out["engines"][dec["engine_id"]] = res
    for kind in spec.get("failures", []):
        out["failures"][kind] = _failure(spec, kind)
    return out


def _failure(spec: dict, kind: str) -> dict:
    """Run one failure scenario; report the error (or its absence) and how long it took."""
    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector, TransferRequest

    p_eng = spec["prefill"][0]
    p_cfg = engine_config(spec, p_eng, "prefill")
    d_cfg = engine_config(spec, {"tp": p_cfg.tp, "dcp": 1}, "decode")
    port = p_eng["port"]
    bound = spec.get("failure_timeout", 1.5)
    silent = None
    if kind == "no_answer":
        port = free_port_base(p_cfg.tp)
    elif kind == "silent":  # accepts connections (backlog) and never answers
        port = free_port_base(p_cfg.tp)
        silent = [socket.create_server(("127.0.0.1", port + r)) for r in range(p_cfg.tp)]
    elif kind == "metadata_mismatch":  # we plan for a prefill DCP the engine does not have
        p_cfg = DCPConfig(tp=p_cfg.tp, dcp=p_cfg.tp, mode=Mode.PREFILL,
                          block_size=p_cfg.block_size, num_kv_heads=p_cfg.num_kv_heads)
    elif kind == "remote_gone":
        p_eng = next(e for e in spec["prefill"] if e.get("doomed"))
        p_cfg = engine_config(spec, p_eng, "prefill")
        d_cfg = engine_config(spec, {"tp": p_cfg.tp, "dcp": 1}, "decode")
        port = p_eng["port"]
    num_blocks, d_tables = block_tables(spec, d_cfg, "fail")
    _, p_tables = block_tables(spec, engine_config(spec, p_eng, "prefill"), p_eng["engine_id"])
    conn = None
    t0 = time.monotonic()
    try:
        conn = DecodeKVConnector(p_cfg, d_cfg, 0, new_caches(spec, d_cfg, 0, num_blocks),
                                 engine_id="fail-" + kind, side_channel_port=port,
                                 handshake_timeout=bound, transfer_timeout=bound)
        conn.handshake()
        req = spec["requests"][0]
        if kind == "remote_gone":
            name = conn.remotes[conn.rank_plan.remote_ranks[0]][0]
            conn._agent.agent.send_notif(name, json.dumps(
                {"req": "kill", "epoch": 1, "engine": "x", "rank": 0, "status": "kill"}).encode())
            _wait_refused("127.0.0.1", port + conn.rank_plan.remote_ranks[0], 10.0)
            t0 = time.monotonic()
        conn.read(TransferRequest("fail", req["seq_len"], p_tables[req["id"]],
                                  d_tables[req["id"]], request_epoch(spec, 0, 0)))
        result = {"error": None}
    except DCPTransferError as e:
        result = {"error": str(e)}
    except Exception as e:  # anything else is a bug: report it as such
        result = {"error": None, "unexpected": f"{type(e).__name__}: {e}"}
    result["seconds"] = time.monotonic() - t0
    result["bound"] = bound
    if conn is not None:
        try:
            conn.close()
        except Exception:
            pass
    for s in silent or []:
        s.close()
    return result


def _wait_refused(host: str, port: int, timeout: float) -> None:
    """Until nothing listens at host:port any more (the process behind it is gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
        except OSError:
            return
        time.sleep(0.02)


def main(argv=None) -> int:
    role, spec_path, out_path = (argv or sys.argv[1:])[:3]
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    try:
        from dcp_compile.runtime.transfer.nixl.build import nixl_api
        nixl_api()  # fails here, not mid-run, when the wheel is unusable
    except Exception as e:
        result = {"nixl_import_error": f"{type(e).__name__}: {e}"}
    else:
        try:
            result = (run_decode(spec) if role == "decode"
                      else run_prefill(spec, doomed=role == "prefill-doomed"))
        except Exception as e:
            result = {"crash": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
