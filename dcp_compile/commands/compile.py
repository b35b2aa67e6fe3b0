"""Compile a model once and write its weightless program file (no weights read).

The model is the demo model, --model, --hf-config or --checkpoint (its config only: the
model is built on the meta device). The file holds the graphs, shard specs and each
weight's checkpoint names, not the weights: a few MB for any model size. Every rank of a
launch then loads it and reads only its own shards from the checkpoint
(``torchrun ... -m dcp_compile.workers.decode --program FILE --checkpoint DIR``,
``program.state_dict_for(rank, checkpoint=DIR)``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .model_arg import add_model_arguments
from .options import add_layout_arguments, check_layout, model_heads, positive_int


def add_arguments(p):
    add_layout_arguments(p)
    p.add_argument("-o", "--output", type=Path, required=True, metavar="FILE",
                   help="the program file to write")
    p.add_argument("--batch", type=positive_int, default=8, help="sequences per step")
    p.add_argument("--max-model-len", type=positive_int, default=4096,
                   help="context tokens a sequence may reach (the program's capacity)")
    p.add_argument("--chunk", type=positive_int, default=128,
                   help="prompt tokens per context/prefill step")
    add_model_arguments(p)


def validate(args) -> None:
    check_layout(args, **model_heads(args))


def run(args) -> int:
    import dcp_compile
    from dcp_compile.runtime.serving.engine import StepShapes

    from .model_arg import load_model
    if args.checkpoint:     # the config only: load_model builds it on the meta device
        loaded = load_model(args)
        model = loaded.model
    elif args.hf_config:
        from dcp_compile.meta_init import meta_model
        model = meta_model(args.hf_config, attn_implementation=args.attn_implementation)
    else:
        model = load_model(args).model
    shapes = StepShapes.fitting(args.batch, args.chunk, args.max_model_len,
                                block_size=args.block_size, dcp=args.dcp)
    print(f"compiling {type(model).__name__}: tp={args.tp} dcp={args.dcp} mode={args.mode}",
          file=sys.stderr)
    program = dcp_compile.transform(model, tp=args.tp, dcp=args.dcp, mode=args.mode,
                                    block_size=args.block_size,
                                    interleave_size=args.interleave_size, shapes=shapes,
                                    check=False)
    program.save(args.output, weights=False)
    size = args.output.stat().st_size
    print(f"wrote {args.output} ({size / 2**20:.2f} MiB, {len(program.weight_names)} named "
          f"weights, no weight data)")
    return 0
