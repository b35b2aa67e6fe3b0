"""Plan a prefill -> decode KV transfer: remote ranks, heads and blocks of each decode rank.

Prints, for every decode rank, the prefill ranks it reads from (spec: "Remote Rank
Computation"; see runtime/transfer/plan.py for where the plan departs from the spec's formula),
the KV heads it takes from each with their head offsets (splitting / merging), and the block
mapping pattern (which remote block-table entry lands in which local one).
"""

from __future__ import annotations

import json

from .options import positive_int

# Largest KV head count tried when --num-kv-heads is not given (Llama-style GQA models).
_DEFAULT_MAX_KV_HEADS = 8


def add_arguments(p):
    p.add_argument("--prefill-tp", type=positive_int, required=True,
                   help="tensor-parallel size of the prefill engine")
    p.add_argument("--prefill-dcp", type=positive_int, default=1,
                   help="decode context parallel size of the prefill engine")
    p.add_argument("--decode-tp", type=positive_int, required=True,
                   help="tensor-parallel size of the decode engine")
    p.add_argument("--decode-dcp", type=positive_int, default=1,
                   help="decode context parallel size of the decode engine")
    p.add_argument("--num-kv-heads", type=positive_int, default=None,
                   help=f"model's KV heads (default: the largest count <= "
                        f"{_DEFAULT_MAX_KV_HEADS} that both engines can serve)")
    p.add_argument("--block-size", type=positive_int, default=16,
                   help="KV cache block size of both engines (= cp_kv_cache_interleave_size)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    from dcp_compile.runtime.errors import DCPTransferError
    from dcp_compile.runtime.transfer.plan import engine_configs, plan_transfer

    sizes = dict(prefill_tp=args.prefill_tp, prefill_dcp=args.prefill_dcp,
                 decode_tp=args.decode_tp, decode_dcp=args.decode_dcp,
                 block_size=args.block_size)
    if args.num_kv_heads is not None:
        plan = plan_transfer(*engine_configs(num_kv_heads=args.num_kv_heads, **sizes))
    else:
        plan, first_error = None, None
        for h in range(_DEFAULT_MAX_KV_HEADS, 0, -1):
            try:
                plan = plan_transfer(*engine_configs(num_kv_heads=h, **sizes))
                break
            except DCPTransferError as e:
                first_error = first_error or e
        if plan is None:
            raise DCPTransferError(f"{first_error} (no KV head count from "
                                   f"{_DEFAULT_MAX_KV_HEADS} down to 1 can be served either; "
                                   f"pass --num-kv-heads to see the error for yours)")
    print(json.dumps(plan.to_json()) if args.json else plan.format_table())
    return 0
