"""KV transfer over NIXL per topology vs the floor: time and bytes per request.

One long request is prefilled (its KV scattered into each prefill engine's DCP layout) in a
prefill process (tests/support/nixl_loopback.py); this process is the decode side. For each
topology every decode rank posts its planned READs at once and the request's time runs until
the last rank has finished (the handshake is excluded; the median of --repeat requests).

Floors, for the same number of bytes:
* ``nixl 1-read``: one NIXL READ whose descriptors are the whole contiguous cache tensors
  (one per layer and key/value) from one prefill rank -- a memcpy-style read over the same
  UCX path, no layout work;
* ``memcpy``: ``torch.Tensor.copy_`` of the same bytes inside this process.

    python benchmarks/bench_transfer.py [--seq-len 16384] [--repeat 5]

Measured, never asserted. UCX runs with UCX_TLS=tcp,self,sm on loopback (set below unless
already set); on one machine UCX may move the bytes through shared memory rather than TCP.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dcp_compile.runtime.distributed.launch import free_port_base, loopback_env
from tests.support.nixl_loopback import _rid, block_tables, engine_config, filled_caches, new_caches, request_epoch

# (name, prefill tp, prefill dcp, decode tp, decode dcp)
TOPOLOGIES = [
    ("P:TP2 -> D:TP2 (no DCP)", 2, 1, 2, 1),
    ("P:TP4/DCP2 -> D:TP2", 4, 2, 2, 1),
    ("P:TP4/DCP2 -> D:TP4 (split)", 4, 2, 4, 1),
    ("P:TP4/DCP2 -> D:TP1 (merge)", 4, 2, 1, 1),
    ("P:TP8/DCP2 -> D:TP16/DCP2", 8, 2, 16, 2),
    ("P:TP8/DCP4 -> D:TP16/DCP2", 8, 4, 16, 2),
    ("P:TP4 -> D:TP16/DCP2", 4, 1, 16, 2),
]


def main(argv=None) -> int:
    # Both engines run here (and in the children it starts): one side-channel key for this
    # run unless the caller set one (docs/transfer.md: The side channel's key).
    os.environ.setdefault("DCP_KV_KEY", secrets.token_hex(32))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-verify", action="store_true", help="skip the bit-for-bit check")
    ap.add_argument("--modes", default="staged,descriptors",
                    help="how head ranges move: staged and/or descriptors (comma-separated)")
    ap.add_argument("--only", default="",
                    help="only the topologies whose name contains this text")
    ap.add_argument("--shuffled", action="store_true",
                    help="scattered block tables (one run per block) instead of the allocator's")
    ap.add_argument("--profile", action="store_true",
                    help="only the floor READ cut into 1..N descriptors per tensor (same "
                         "bytes): where the time goes, descriptors vs bytes")
    docs_section.add_argument(ap)
    args = ap.parse_args(argv)
    with docs_section.recorded("bench_transfer profile" if args.profile else "bench_transfer", args.write_docs):
        os.environ.update(loopback_env())

        tmp = Path(tempfile.mkdtemp(prefix="bench_transfer_"))
        base = free_port_base(20 * (len(TOPOLOGIES) + 1))
        prefill = [{"engine_id": f"p{i}", "tp": ptp, "dcp": pdcp, "port": base + 20 * i}
                   for i, (_, ptp, pdcp, _, _) in enumerate(TOPOLOGIES)]
        prefill.append({"engine_id": "floor", "tp": 1, "dcp": 1, "port": base + 20 * len(TOPOLOGIES)})
        spec = {"num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim, "layers": args.layers,
                "dtype": args.dtype, "block_size": args.block_size, "seed": 0, "timeout": 3600,
                "prefill": prefill,
                # The prefill process holds the request (+1 warm-up repeat) for these readers.
                "decode": [{"engine_id": f"bench-{mode}", "prefill": f"p{i}", "tp": dtp, "dcp": ddcp}
                           for i, (_, _, _, dtp, ddcp) in enumerate(TOPOLOGIES)
                           for mode in ("staged", "descriptors")],
                "repeat": args.repeat + 1,
                # The engines' own allocator, entries grouped so that each remote rank's blocks
                # are one run on both sides (TransferPlan.*_block_groups); --shuffled: scattered.
                "allocation": "shuffled" if args.shuffled else "contiguous",
                "block_groups": _block_groups(args),
                "requests": [{"id": "long", "seq_len": args.seq_len}],
                "stop_file": str(tmp / "done")}
        if args.profile:
            return _profile(spec, prefill, tmp, args)
        rows, nbytes = [], None
        # The floor's prefill process lives through the run: each row's floor is measured right
        # after the row (the machine is shared: its load drifts over minutes).
        prefill[-1]["port"] = free_port_base(1)
        with _prefill_process(spec, prefill[-1:], [], tmp, "floor"):
            for i, (name, ptp, pdcp, dtp, ddcp) in enumerate(TOPOLOGIES):
                if args.only not in name:
                    continue
                # One prefill process per topology, serving only its engine (one process per
                # engine: each agent is polled as often as a prefill rank polls its own).
                readers = [d for d in spec["decode"] if d["prefill"] == f"p{i}"]
                prefill[i]["port"] = free_port_base(ptp)  # picked now: the machine is shared
                measured = []
                with _prefill_process(spec, prefill[i:i + 1], readers, tmp, f"p{i}"):
                    for mode in args.modes.split(","):
                        r = _measure(spec, prefill[i], {"tp": dtp, "dcp": ddcp}, args, mode)
                        if r["kind"] == "match" and mode == "descriptors":
                            continue  # whole rows: both modes are the same reads
                        measured.append(r)
                for r in measured:
                    nbytes = r["kv_bytes"]
                    r["floor_ms"] = _floor_read(spec, prefill[-1], nbytes, args.repeat)
                    rows.append((name, r))
                    print(f"  measured {name} [{r['mode']}]: {r['ms']:.1f} ms, floor "
                          f"{r['floor_ms']:.1f} ms", file=sys.stderr, flush=True)
        floor_ms = statistics.median(r["floor_ms"] for _, r in rows)
        memcpy_ms = _memcpy(nbytes, args.repeat)

        print(f"\nKV transfer per request: seq_len={args.seq_len}, num_kv_heads={args.num_kv_heads},"
              f" head_dim={args.head_dim}, layers={args.layers}, {args.dtype}, block_size="
              f"{args.block_size}; {nbytes / 2**20:.1f} MiB per request; median of {args.repeat}; "
              f"UCX_TLS={os.environ['UCX_TLS']}")
        print("MiB read = bytes over NIXL (staged splitting reads whole remote rows); KV GiB/s "
              "= the request's KV bytes / time; x 1-read = / the floor measured right after the row")
        head = (f"{'topology':<29} {'kind':<5} {'rows':<6} {'remotes':>7} {'descs':>7} "
                f"{'MiB read':>8} {'ms':>8} {'KV GiB/s':>8} {'x 1-read':>8} {'x memcpy':>8} verified")
        print(head)
        print("-" * len(head))
        for name, r in rows:
            rows_mode = r["mode"] if r["kind"] != "match" else "whole"
            print(f"{name:<29} {r['kind']:<5} {rows_mode[:6]:<6} {r['remotes']:>7} "
                  f"{r['descriptors']:>7} {r['bytes'] / 2**20:>8.1f} {r['ms']:>8.1f} "
                  f"{r['kv_bytes'] / 2**30 / (r['ms'] / 1e3):>8.2f} {r['ms'] / r['floor_ms']:>8.1f} "
                  f"{r['ms'] / memcpy_ms:>8.1f} {r['verified']}")
        for name, ms, descs in (("floor: nixl 1-read (median)", floor_ms, 2 * args.layers),
                                ("floor: memcpy", memcpy_ms, "")):
            print(f"{name:<29} {'':<5} {'':<6} {'':>7} {descs:>7} {nbytes / 2**20:>8.1f} "
                  f"{ms:>8.1f} {nbytes / 2**30 / (ms / 1e3):>8.2f} {ms / floor_ms:>8.1f} "
                  f"{ms / memcpy_ms:>8.1f}")
        return 0


def _block_groups(args) -> dict:
    """Block-table grouping of each engine of the bench (prefill p<i>, its decode d-p<i>)."""
    from dcp_compile.runtime.transfer.plan import engine_configs, plan_transfer
    out = {}
    for i, (_, ptp, pdcp, dtp, ddcp) in enumerate(TOPOLOGIES):
        plan = plan_transfer(*engine_configs(prefill_tp=ptp, prefill_dcp=pdcp, decode_tp=dtp,
                                             decode_dcp=ddcp, num_kv_heads=args.num_kv_heads,
                                             block_size=args.block_size))
        out[f"p{i}"], out[f"d-p{i}"] = plan.prefill_block_groups, plan.decode_block_groups
    return out


def _measure(spec, p_eng, d_eng, args, mode) -> dict:
    import torch

    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector, TransferRequest, wait_all
    p_cfg, d_cfg = engine_config(spec, p_eng, "prefill"), engine_config(spec, d_eng, "decode")
    _, p_tables = block_tables(spec, p_cfg, p_eng["engine_id"])
    num_blocks, d_tables = block_tables(spec, d_cfg, "d-" + p_eng["engine_id"])
    ranks = [DecodeKVConnector(p_cfg, d_cfg, d, new_caches(spec, d_cfg, d, num_blocks),
                               engine_id=f"bench-{mode}", side_channel_port=p_eng["port"],
                               handshake_timeout=600, transfer_timeout=600, partial_rows=mode)
             for d in range(d_cfg.tp)]
    for c in ranks:
        c.handshake()
    times, stats = [], None
    for rep in range(args.repeat + 1):  # rep 0 warms up (first use of each connection)
        rid = _rid("long", rep)
        t0 = time.perf_counter()
        for c in ranks:
            c.start_read(TransferRequest(rid, args.seq_len, p_tables["long"], d_tables["long"],
                                         request_epoch(spec, rep, 0)))
        stats = wait_all(ranks, rid)  # polls back to back, yielding the CPU (as the floor)
        if rep > 0:
            times.append(time.perf_counter() - t0)
    verified = "skipped"
    if not args.no_verify:
        ok = all(torch.equal(w.view(torch.uint8), g.view(torch.uint8))
                 for c in ranks
                 for kw, kg in zip(filled_caches(spec, d_cfg, "d-" + p_eng["engine_id"], c.rank),
                                   c.kv_caches)
                 for w, g in zip(kw, kg))
        verified = "bit-exact" if ok else "MISMATCH"
    remotes = sorted({len(c.rank_plan.remote_ranks) for c in ranks})
    out = {"kind": ranks[0].plan.kind, "ms": statistics.median(times) * 1e3,
           "bytes": sum(s.bytes for s in stats), "kv_bytes": sum(s.kv_bytes for s in stats),
           "descriptors": sum(s.descriptors for s in stats), "mode": mode,
           "remotes": "/".join(map(str, remotes)), "verified": verified}
    for c in ranks:
        c.close()
    return out


def _floor_read(spec, p_eng, nbytes: int, repeat: int, pieces: int = 1) -> float:
    """One READ of whole contiguous cache tensors, ``nbytes`` in all, from one prefill rank;
    ``pieces > 1`` cuts each tensor's range into that many adjacent descriptors (the same
    bytes: what the descriptor count alone costs, see --profile)."""
    import numpy as np

    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector
    p_cfg = engine_config(spec, p_eng, "prefill")
    d_cfg = engine_config(spec, {"tp": 1, "dcp": 1}, "decode")
    num_blocks, _ = block_tables(spec, d_cfg, "floor")
    conn = DecodeKVConnector(p_cfg, d_cfg, 0, new_caches(spec, d_cfg, 0, num_blocks),
                             engine_id="bench-floor", side_channel_port=p_eng["port"],
                             handshake_timeout=600)
    conn.handshake()
    name, md = conn.remotes[0]
    local = [t for kv in conn.kv_caches for t in kv]
    remote = [a for kv in md.kv_caches_base_addr for a in kv]
    per = nbytes // len(local)
    assert per <= local[0].numel() * local[0].element_size()
    api = conn._agent.agent  # the floor bypasses the plan on purpose: raw NIXL, same agent
    step = per // pieces
    ldesc = np.array([(t.data_ptr() + i * step, step, 0) for t in local for i in range(pieces)],
                     dtype=np.uint64)
    rdesc = np.array([(a + i * step, step, 0) for a in remote for i in range(pieces)],
                     dtype=np.uint64)
    times = []
    for rep in range(-1, repeat):
        t0 = time.perf_counter()
        h = api.initialize_xfer("READ", api.get_xfer_descs(ldesc, "DRAM"),
                                api.get_xfer_descs(rdesc, "DRAM"), name, b"")
        state = api.transfer(h)
        while state == "PROC":  # polled as wait_all polls: yielding the CPU between polls
            time.sleep(0)       # (the prefill process, on the same cores, must progress too)
            state = api.check_xfer_state(h)
        if rep >= 0:
            times.append(time.perf_counter() - t0)
        h.release()
        assert state == "DONE", state
    conn.close()
    return statistics.median(times) * 1e3


def _profile(spec, prefill, tmp, args) -> int:
    """The floor READ with the same bytes in more and more descriptors: time = a + b * descs
    (per-descriptor cost b) + bytes / bandwidth. One prefill process, one decode rank."""
    import torch
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    nbytes = 2 * args.layers * args.seq_len * args.num_kv_heads * args.head_dim * elem
    rows = []
    prefill[-1]["port"] = free_port_base(1)
    with _prefill_process(spec, prefill[-1:], [], tmp, "profile"):
        blocks = args.seq_len // args.block_size
        for pieces in sorted({1, 4, 16, 64, 256, blocks // 4, blocks // 2, blocks}):
            ms = _floor_read(spec, prefill[-1], nbytes, args.repeat, pieces)
            rows.append((2 * args.layers * pieces, nbytes // (2 * args.layers * pieces), ms))
            print(f"  profiled {rows[-1][0]} descriptors: {ms:.1f} ms", file=sys.stderr,
                  flush=True)
    print(f"\nOne READ of {nbytes / 2**20:.1f} MiB from one prefill rank, cut into N "
          f"descriptors (median of {args.repeat}; UCX_TLS={os.environ['UCX_TLS']})")
    print(f"{'descriptors':>11} {'bytes/desc':>10} {'ms':>8} {'x 1 desc/tensor':>15} "
          f"{'us/desc over floor':>18}")
    for n, size, ms in rows:
        extra = (ms - rows[0][2]) * 1e3 / max(n - rows[0][0], 1)
        print(f"{n:>11} {size:>10} {ms:>8.1f} {ms / rows[0][2]:>15.2f} {extra:>18.2f}")
    return 0


@contextlib.contextmanager
def _prefill_process(spec, engines, readers, tmp, tag):
    """A loopback prefill process serving ``engines`` (held for ``readers``) while inside."""
    spec = dict(spec, prefill=engines, decode=readers, stop_file=str(tmp / f"done-{tag}"))
    (tmp / f"{tag}.json").write_text(json.dumps(spec))
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.nixl_loopback", "prefill",
                             str(tmp / f"{tag}.json"), str(tmp / f"prefill-{tag}.json")],
                            cwd=ROOT, env=loopback_env(), stdout=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        (tmp / f"done-{tag}").write_text("1")
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _memcpy(nbytes: int, repeat: int) -> float:
    import torch
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)  # touched: no first-copy page faults in the measurement
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    sys.exit(main())
