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
from .options import (add_buckets_argument, add_layout_arguments, check_buckets_option,
                      check_layout, model_heads, output_dir, positive_int)


def add_arguments(p):
    add_layout_arguments(p)
    p.add_argument("--out", type=output_dir, required=True,
                   help="directory for the modules and lowering.json")
    p.add_argument("--layers", type=positive_int, default=2, help="demo model layers")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the model's weights and activations")
    p.add_argument("--batch", type=positive_int, default=4, help="sequences per step")
    p.add_argument("--context-len", type=positive_int, default=64,
                   help="tokens per sequence in a prompt (context/prefill) step")
    p.add_argument("--max-blocks", type=positive_int, default=8,
                   help="block-table entries per sequence")
    p.add_argument("--num-blocks", type=positive_int, default=40,
                   help="KV cache blocks per rank, the garbage block included")
    p.add_argument("--kv-role", choices=["kv_producer", "kv_consumer"], default=None,
                   help="prefill DCP: disaggregated role (default: none, not "
                        "disaggregated)")
    p.add_argument("--target-version", default=None,
                   help="StableHLO version of the portable artifact (default: current)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_buckets_argument(p)
    add_model_arguments(p)


def validate(args) -> None:
    check_layout(args, **model_heads(args))
    check_buckets_option(args, args.block_size)


def run(args) -> int:
    import torch

    import dcp_compile
    from dcp_compile.lowering import lower
    from dcp_compile.models.demo import DemoConfig
    from dcp_compile.runtime.serving.engine import StepShapes

    model = load_model(args, demo_config=DemoConfig(num_layers=args.layers),
                       dtype=getattr(torch, args.dtype)).model
    shapes = StepShapes(batch=args.batch, context_len=args.context_len,
                        max_blocks=args.max_blocks, num_blocks=args.num_blocks)
    program = dcp_compile.transform(model, tp=args.tp, dcp=args.dcp, mode=args.mode,
                                    shapes=shapes, block_size=args.block_size,
                                    interleave_size=args.interleave_size, kv_role=args.kv_role,
                                    buckets=args.buckets, progress=True)
    result = lower(program, target="stablehlo", out_dir=args.out,
                   target_version=args.target_version)
    print(json.dumps(result.to_json()) if args.json else result.format_table())
    return 0

