"""Rank every decode layout of a model on N ranks by predicted step time (``--mode prefill``:
every prefill layout and chunk by predicted time to first token).

Each layout (tp = N, every dcp that divides it, experts by TP or EP for a mixture of
experts, the decode combine, the interleave size) is compiled on the meta device (no
weights) and priced from its program: weight bytes, KV bytes read at the context, collective
bytes and count, FLOPs, on a hardware profile (dcp_compile.hardware). Layouts that break a
rule are listed with the rule. See docs/planner.md.
"""

from __future__ import annotations

import json

from .options import positive_int


def add_arguments(p):
    from dcp_compile.hardware import HARDWARE_NAMES
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", metavar="demo|PKG.MODULE:FACTORY", default=None,
                   help="the built-in demo model ('demo') or a function returning the model "
                        "(default: the demo model)")
    g.add_argument("--hf-config", metavar="PATH_OR_DIR", default=None,
                   help="a Hugging Face config.json (or its directory): compiled on the meta "
                        "device, nothing is downloaded (default: none)")
    g.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="a Hugging Face checkpoint directory: its config.json, compiled on "
                        "the meta device; no weight is read (default: none)")
    p.add_argument("--ranks", type=positive_int, required=True,
                   help="chips (ranks) of the engine: tp = ranks, dcp divides it")
    p.add_argument("--context", type=positive_int, required=True,
                   help="context length in tokens the decode steps run at (prefill: the "
                        "prompt length)")
    p.add_argument("--mode", choices=("decode", "prefill"), default="decode",
                   help="rank decode layouts by step time, or prefill layouts by time to "
                        "first token")
    p.add_argument("--chunks", type=positive_int, nargs="+", default=None, metavar="N",
                   help="prefill only: prompt tokens per sequence per step to try (default: "
                        "512 2048 8192, capped at the prompt)")
    p.add_argument("--batch", type=positive_int, default=1,
                   help="sequences decoded per step")
    p.add_argument("--block-size", type=positive_int, default=16,
                   help="KV cache block size")
    p.add_argument("--hardware", choices=HARDWARE_NAMES, default="this-machine",
                   help="the hardware profile to price on (this-machine: calibrated once, "
                        "cached in ~/.cache/dcp_compile)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _model(args):
    if args.hf_config or args.checkpoint:
        return args.hf_config or args.checkpoint
    if args.model in (None, "demo"):
        from dcp_compile.models.demo import demo_model
        return demo_model()
    from .model_arg import _from_factory
    return _from_factory(args.model)


def run(args) -> int:
    from dcp_compile.planner import plan
    result = plan(_model(args), ranks=args.ranks, context_len=args.context,
                  batch=args.batch, hardware=args.hardware, block_size=args.block_size,
                  mode=args.mode, chunks=args.chunks)
    print(json.dumps(result.to_json()) if args.json else result.format_table())
    return 0
