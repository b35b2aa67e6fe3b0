"""Print the process groups of every role and each rank's cp_rank for a TP/DCP layout."""

from __future__ import annotations

import json

from .options import add_layout_arguments, positive_int


def add_arguments(p):
    add_layout_arguments(p, block_size=False)
    p.add_argument("--num-kv-heads", type=positive_int, default=None,
                   help="also show which KV heads each rank holds (checked against the "
                        "layout rules; default: not shown)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _config(args):
    from dcp_compile.runtime.config import DCPConfig
    return DCPConfig(tp=args.tp, dcp=args.dcp, mode=args.mode, num_kv_heads=args.num_kv_heads)


def validate(args) -> None:
    _config(args)


def run(args) -> int:
    from dcp_compile.runtime.topology import topology
    config = _config(args)  # the layout comes from a validated DCPConfig
    topo = topology(config.tp, config.dcp, config.mode, config=config)
    print(json.dumps(topo.to_json()) if args.json else topo.format_table())
    return 0
