"""The main job: transform the built-in demo model (tp=8, dcp=4) in decode and prefill mode,
run it on a threaded world, check it against the single-device model, print a summary and
write the pass-by-pass dump (--model / --hf-config: your model instead)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dcp_compile.runtime.names import Mode, StepKind

from .model_arg import add_model_arguments, load_model
from .options import (add_buckets_argument, add_layout_arguments, capacity_for_buckets,
                      check_buckets_option, check_layout, choice_list, model_heads,
                      output_dir, positive_int)
from .verify import add_backend_argument, check_backend, verifier


def add_arguments(p):
    add_layout_arguments(p, tp_default=8, dcp_default=4, block_size=False, mode=False)
    p.add_argument("--modes", type=choice_list("decode", "prefill"),
                   default=["decode", "prefill"],
                   help="comma-separated modes to run (default: decode,prefill)")
    p.add_argument("--steps", type=positive_int, default=16, help="greedy decode steps")
    p.add_argument("--chunks", type=positive_int, default=3,
                   help="prompt chunks in prefill mode")
    p.add_argument("--out", type=output_dir, default=Path("dcp_dump"),
                   help="where the pass-by-pass dump goes")
    p.add_argument("--json", action="store_true",
                   help="print the summary rows as JSON instead of text")
    add_backend_argument(p)
    add_buckets_argument(p)
    add_model_arguments(p)


def validate(args) -> None:
    check_layout(args, modes=args.modes, **model_heads(args))
    check_buckets_option(args, 16)
    check_backend(args)


def _kv_bytes(program, lengths_total: int) -> tuple[int, int]:
    """KV bytes one rank holds for ``lengths_total`` tokens vs the single device."""
    c = program.config
    per_token_single = 2 * program.num_layers * c.num_kv_heads * c.head_dim * 4
    per_token_rank = 2 * program.num_layers * c.kv_heads_per_rank * c.head_dim * 4
    return (per_token_rank * -(-lengths_total // c.dcp), per_token_single * lengths_total)


def run(args) -> int:
    import torch

    import dcp_compile
    from dcp_compile.commands.verify import default_lengths
    from dcp_compile.runtime.serving.engine import StepShapes

    loaded = load_model(args)
    model = loaded.model
    out_dir = Path(args.out)
    rows, ok = [], True
    cert = dcp_compile.prove(args.dcp, 16, 16)
    print(cert.format_table())
    print()
    print(dcp_compile.topology(args.tp, args.dcp, "prefill",
                               num_kv_heads=loaded.num_kv_heads).format_table())
    print(dcp_compile.topology(args.tp, args.dcp, "decode",
                               num_kv_heads=loaded.num_kv_heads).format_table())
    print()
    for mode in args.modes:
        lengths = default_lengths(args.dcp, 16, 16)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, loaded.vocab_size, (n,), generator=g).tolist()
                   for n in lengths]
        total = max(lengths) + args.steps if mode == Mode.DECODE else max(lengths) * args.chunks
        shapes = StepShapes.fitting(len(prompts), max(lengths),
                                    capacity_for_buckets(args, total), block_size=16,
                                    dcp=args.dcp)
        t0 = time.perf_counter()
        print(f"[{mode}] transforming {loaded.label} (tp={args.tp}, dcp={args.dcp})...",
              file=sys.stderr)
        program = dcp_compile.transform(model, tp=args.tp, dcp=args.dcp, mode=mode,
                                        shapes=shapes, dump_dir=out_dir / mode,
                                        certificate=cert, buckets=args.buckets,
                                        progress=True)
        transform_s = time.perf_counter() - t0
        print(f"[{mode}] running {args.tp} ranks on {args.backend} vs the single-device "
              f"model...", file=sys.stderr)
        V, extra = verifier(args.backend), {}
        if args.backend == "xla":      # the lowered modules go next to the dump
            extra["lowered"] = V.lower_for_xla(program, out_dir=out_dir / mode / "stablehlo")
        if mode == Mode.DECODE:
            report = V.verify(loaded.make_reference(), program, prompts, args.steps, **extra)
        else:
            report = V.verify_prefill(loaded.make_reference(), program, prompts, args.chunks,
                                      check_cache=loaded.reference_has_cache, **extra)
        ok &= report.ok
        step = StepKind.DECODE if mode == Mode.DECODE else StepKind.PREFILL
        kv_rank, kv_single = _kv_bytes(program, sum(report.lengths))
        rows.append({"mode": mode, "backend": args.backend, "tp": args.tp, "dcp": args.dcp,
                     "proofs": f"{sum(t.status == 'proven' for t in cert.theorems)}/"
                               f"{len(cert.theorems)}",
                     "collectives_per_layer": program.collectives_per_layer(step),
                     "kv_bytes_per_rank": kv_rank, "kv_bytes_single_device": kv_single,
                     "max_abs_error": report.max_abs_error,
                     "tokens_agree": report.tokens_agree, "ok": report.ok,
                     "transform_seconds": round(transform_s, 2),
                     "dump": str(out_dir / mode)})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"mode={r['mode']:<8} backend={r['backend']} tp={r['tp']} dcp={r['dcp']} "
                  f"proofs={r['proofs']} "
                  f"max_abs_error={r['max_abs_error']:.2e} tokens_agree={r['tokens_agree']} "
                  f"ok={r['ok']}")
            print(f"  KV bytes per rank {r['kv_bytes_per_rank']} vs single device "
                  f"{r['kv_bytes_single_device']} "
                  f"({r['kv_bytes_per_rank'] / r['kv_bytes_single_device']:.3f}x)")
            print(f"  collectives per layer: {r['collectives_per_layer']}")
            print(f"  pass-by-pass dump written to {r['dump']}/")
    print("demo " + ("PASSED" if ok else "FAILED: the transformed program differs"))
    return 0 if ok else 1

