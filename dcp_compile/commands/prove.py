"""Prove the DCP layout theorems for a (dcp, interleave_size, block_size) for every length N.

Exit status 0 when every theorem is proven, 1 when one fails (its counterexample is shown).
"""

from __future__ import annotations

import json

from .options import positive_int


def add_arguments(p):
    p.add_argument("--dcp", type=positive_int, required=True,
                   help="decode context parallel size W")
    p.add_argument("--block-size", type=positive_int, default=16, help="KV cache block size B")
    p.add_argument("--interleave-size", type=positive_int, default=None,
                   help="cp_kv_cache_interleave_size I (default: the block size)")
    p.add_argument("--json", action="store_true", help="print the certificate as JSON")


def validate(args) -> None:
    from dcp_compile.runtime.config import layout_config
    layout_config(args.dcp, args.interleave_size or args.block_size, args.block_size)


def run(args) -> int:
    from dcp_compile.passes.prove.theorems import layout_config, prove_config
    # Invalid sizes raise DCPConfigError naming the rule (the CLI prints it, exit 2).
    interleave = args.block_size if args.interleave_size is None else args.interleave_size
    cert = prove_config(layout_config(args.dcp, interleave, args.block_size))
    print(json.dumps(cert.to_json(), indent=2) if args.json else cert.format_table())
    return 0 if cert.ok else 1
