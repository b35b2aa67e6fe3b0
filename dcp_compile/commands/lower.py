"""Lower a model's DCP program to StableHLO: one module per step kind, with collectives.

The model is the demo model, --model or --hf-config.

Writes DIR/<step>.stablehlo.mlir (text), DIR/<step>.stablehlo.mlirbc (StableHLO portable
artifact) and DIR/lowering.json, then prints per collective its kind, dimension, role,
channel handle and full replica groups (every group of the role, as global device ids =
tp ranks). One module serves every rank: the rank is its ``tp_rank`` input.
"""

from __future__ import annotations

import json

from .model_arg import add_model_arguments, load_model


def add_arguments(p):
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--dcp", type=int, required=True)
    p.add_argument("--mode", choices=["decode", "prefill"], default="decode")
    p.add_argument("--out", required=True, help="directory for the modules and lowering.json")
    p.add_argument("--layers", type=int, default=2, help="demo model layers (default 2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context-len", type=int, default=64,
                   help="tokens per sequence in a prompt (context/prefill) step")
    p.add_argument("--max-blocks", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=40)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--interleave-size", type=int, default=None)
    p.add_argument("--kv-role", default=None, help="prefill DCP: disaggregated role")
    p.add_argument("--target-version", default=None,
                   help="StableHLO version of the portable artifact (default: current)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_model_arguments(p)


def run(args) -> int:
    import torch

    import dcp_compile
    from dcp_compile.lowering import lower
    from dcp_compile.models import DemoConfig
    from runtime.engine import StepShapes

    model = load_model(args, demo_config=DemoConfig(num_layers=args.layers),
                       dtype=getattr(torch, args.dtype)).model
    shapes = StepShapes(batch=args.batch, context_len=args.context_len,
                        max_blocks=args.max_blocks, num_blocks=args.num_blocks)
    program = dcp_compile.transform(model, tp=args.tp, dcp=args.dcp, mode=args.mode,
                                    shapes=shapes, block_size=args.block_size,
                                    interleave_size=args.interleave_size, kv_role=args.kv_role,
                                    progress=True)
    result = lower(program, target="stablehlo", out_dir=args.out,
                   target_version=args.target_version)
    print(json.dumps(result.to_json()) if args.json else result.format_table())
    return 0
