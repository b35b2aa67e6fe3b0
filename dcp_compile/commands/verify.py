"""Transform a model, run it on a threaded world and compare with the single device.

The model is the demo model, --model or --hf-config; an ordinary model is compared with its
own full forward. ``--backend xla`` lowers the program to StableHLO and runs it compiled by
XLA:CPU on tp host devices instead (the ``[xla]`` extra).

Prints the max absolute logit error and whether greedy tokens agree; exits 1 on mismatch.
"""

from __future__ import annotations

import json
import sys

from .model_arg import add_model_arguments, load_model
from .options import (add_buckets_argument, add_layout_arguments, capacity_for_buckets,
                      check_buckets_option, check_layout, model_heads, non_negative_float,
                      positive_int, positive_int_list)


def add_arguments(p):
    add_layout_arguments(p)
    p.add_argument("--steps", type=positive_int, default=16, help="decode steps (decode mode)")
    p.add_argument("--chunks", type=positive_int, default=3,
                   help="prompt chunks (prefill mode)")
    p.add_argument("--lengths", type=positive_int_list, default=None,
                   help="comma-separated prompt lengths (default: edge cases for the layout)")
    p.add_argument("--atol", type=non_negative_float, default=1e-4,
                   help="largest absolute logit error accepted")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_backend_argument(p)
    add_buckets_argument(p)
    add_model_arguments(p)


BACKENDS = ("threads", "xla")


def add_backend_argument(p) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="threads",
                   help="threads: the FX program, one eager rank per thread; xla: the program "
                        "lowered to StableHLO, compiled by XLA:CPU, one host device per rank")


def check_backend(args) -> None:
    """--backend xla needs jax and torch-mlir; ask XLA for tp host devices before jax
    initialises its CPU backend."""
    if args.backend != "xla":
        return
    import importlib.util

    from dcp_compile.runtime.errors import DCPConfigError
    from dcp_compile.xla import request_host_devices, xla_available
    ok, why = xla_available()
    if ok and importlib.util.find_spec("torch_mlir") is None:
        ok, why = False, "lowering needs torch-mlir: pip install -e '.[stablehlo]'"
    if not ok:
        raise DCPConfigError(f"--backend xla cannot run here: {why}.")
    request_host_devices(args.tp)


def verifier(backend: str):
    """The module whose verify / verify_prefill run the program on ``backend``."""
    if backend == "xla":
        from dcp_compile import xla
        return xla
    from dcp_compile import verify
    return verify


def validate(args) -> None:
    check_layout(args, **model_heads(args))
    check_buckets_option(args, args.block_size)
    check_backend(args)


def default_lengths(dcp: int, interleave: int, block: int) -> list[int]:
    """Edge cases: a single token (empty shards), +-1 around the interleave period and a
    full vblock."""
    period, vblock = interleave * dcp, block * dcp
    return sorted({1, max(period - 1, 2), period + 1, vblock})[:4]


def run(args) -> int:
    import torch

    import dcp_compile
    from dcp_compile.runtime.engine import StepShapes

    interleave = args.interleave_size or args.block_size
    lengths = args.lengths or default_lengths(args.dcp, interleave, args.block_size)
    loaded = load_model(args)
    model = loaded.model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, loaded.vocab_size, (n,), generator=g).tolist()
               for n in lengths]
    if args.mode == "decode":
        total = max(lengths) + args.steps
    else:
        total = max(lengths) * args.chunks
    shapes = StepShapes.fitting(len(prompts), max(lengths), capacity_for_buckets(args, total),
                                block_size=args.block_size, dcp=args.dcp)
    print(f"transforming {loaded.label}: tp={args.tp} dcp={args.dcp} mode={args.mode} "
          f"interleave={interleave} block={args.block_size}", file=sys.stderr)
    program = dcp_compile.transform(model, tp=args.tp, dcp=args.dcp, mode=args.mode,
                                    block_size=args.block_size,
                                    interleave_size=args.interleave_size, shapes=shapes,
                                    buckets=args.buckets, progress=True)
    where = "threads" if args.backend == "threads" else "XLA:CPU devices (lowered StableHLO)"
    print(f"running {args.tp} ranks on {where} vs the single-device model "
          f"(lengths {lengths})...", file=sys.stderr)
    V = verifier(args.backend)
    if args.mode == "decode":
        report = V.verify(loaded.make_reference(), program, prompts, args.steps,
                          atol=args.atol)
    else:
        report = V.verify_prefill(loaded.make_reference(), program, prompts, args.chunks,
                                  atol=args.atol, check_cache=loaded.reference_has_cache)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        status = "OK" if report.ok else "MISMATCH"
        print(f"{status}: backend={args.backend} tp={report.tp} dcp={report.dcp} "
              f"mode={report.mode} "
              f"lengths={report.lengths} max_abs_error={report.max_abs_error:.3e} "
              f"tokens_agree={report.tokens_agree} ({report.seconds:.1f}s)")
        if report.first_mismatch:
            print(f"first mismatch: {report.first_mismatch}")
    return 0 if report.ok else 1

