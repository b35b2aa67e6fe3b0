"""Print the process groups of every role and each rank's cp_rank for a TP/DCP layout."""

from __future__ import annotations

import json


def add_arguments(p):
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--dcp", type=int, required=True)
    p.add_argument("--mode", choices=["decode", "prefill"], default="decode")
    p.add_argument("--num-kv-heads", type=int, default=None,
                   help="also show which KV heads each rank holds")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    from dcp_compile.topology import topology
    topo = topology(args.tp, args.dcp, args.mode, num_kv_heads=args.num_kv_heads)
    print(json.dumps(topo.to_json()) if args.json else topo.format_table())
    return 0
