"""Transform a model, run it on a threaded world and compare with the single device.

The model is the demo model, --model, --hf-config or --checkpoint (compiled on the meta
device, each rank reading its own weight shards, compared with the checkpoint's model loaded
whole); an ordinary model is compared with its own full forward. ``--backend xla`` lowers the program to StableHLO and runs it compiled by
XLA:CPU on tp host devices instead (the ``[xla]`` extra).

Prints the max absolute logit error and whether greedy tokens agree; exits 1 on mismatch.
``--speculative ngram:K`` / ``draft:PKG.MODULE:FACTORY:K`` decodes with drafts verified in
width-K steps (compared with the single-device model's plain greedy decoding);
``--shared-prefix N`` gives every prompt the same first N tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from dcp_compile.runtime.names import Mode

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
    p.add_argument("--speculative", type=speculative_spec, default=None,
                   metavar="ngram:K | draft:PKG.MODULE:FACTORY:K",
                   help="greedy speculative decoding, drafts verified in decode steps of "
                        "width K (2..8): n-gram prompt lookup, or a draft model (a factory "
                        "returning any model transform accepts; built for the same tp, "
                        "dcp=1); default: off, one-token decode steps")
    p.add_argument("--shared-prefix", type=positive_int, default=None, metavar="N",
                   help="the prompts share their first N tokens (prefix caching); "
                        "default: none shared")
    add_backend_argument(p)
    add_buckets_argument(p)
    add_model_arguments(p)


BACKENDS = ("threads", "xla")


@dataclass(frozen=True)
class Speculative:
    drafter: str                  # "ngram" | "draft"
    width: int                    # K: tokens per row of the verifying decode step
    factory: str | None = None    # PKG.MODULE:FACTORY of the draft model


def speculative_spec(text: str) -> Speculative:
    """``ngram:K`` or ``draft:PKG.MODULE:FACTORY:K`` with 2 <= K <= 8."""
    from dcp_compile.passes.prove.theorems import MAX_SPECULATIVE_LEN
    parts = text.split(":")
    bad = argparse.ArgumentTypeError(
        f"must be ngram:K or draft:PKG.MODULE:FACTORY:K with K in [2, {MAX_SPECULATIVE_LEN}]: "
        f"{text!r}. Pass e.g. ngram:4.")
    if not parts[-1].isdigit() or not 2 <= int(parts[-1]) <= MAX_SPECULATIVE_LEN:
        raise bad
    if parts[0] == "ngram" and len(parts) == 2:
        return Speculative("ngram", int(parts[-1]))
    if parts[0] == "draft" and len(parts) == 4 and parts[1] and parts[2]:
        return Speculative("draft", int(parts[-1]), f"{parts[1]}:{parts[2]}")
    raise bad


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
    if getattr(args, "checkpoint", None) and (
            args.mode != Mode.DECODE or args.backend != "threads" or args.speculative
            or args.shared_prefix):
        from dcp_compile.runtime.errors import DCPConfigError
        raise DCPConfigError(
            f"--checkpoint verifies plain greedy decoding on threads (each rank reading its "
            f"shards): --mode {args.mode} --backend {args.backend}"
            f"{' --speculative' if args.speculative else ''}"
            f"{' --shared-prefix' if args.shared_prefix else ''}. Use --mode decode "
            f"--backend threads without drafts, or --hf-config for the others.")
    if args.speculative is not None and args.mode != Mode.DECODE:
        from dcp_compile.runtime.errors import DCPConfigError
        raise DCPConfigError(f"--speculative verifies drafts in decode steps: --mode "
                             f"{args.mode}. Use --mode decode.")


def default_lengths(dcp: int, interleave: int, block: int) -> list[int]:
    """Edge cases: a single token (empty shards), +-1 around the interleave period and a
    full vblock."""
    period, vblock = interleave * dcp, block * dcp
    return sorted({1, max(period - 1, 2), period + 1, vblock})[:4]


def run(args) -> int:
    import torch

    import dcp_compile
    from dcp_compile.runtime.serving.engine import StepShapes

    interleave = args.interleave_size or args.block_size
    lengths = args.lengths or default_lengths(args.dcp, interleave, args.block_size)
    loaded = load_model(args)
    model = loaded.model
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, loaded.vocab_size, (args.shared_prefix or 0,),
                           generator=g).tolist()
    prompts = [prefix + torch.randint(0, loaded.vocab_size, (n,), generator=g).tolist()
               for n in lengths]
    lengths = [len(p) for p in prompts]
    if args.mode == Mode.DECODE:
        total = max(lengths) + args.steps
    else:
        total = max(lengths) * args.chunks
    width = args.speculative.width if args.speculative else 1
    shapes = StepShapes.fitting(len(prompts), max(lengths), capacity_for_buckets(args, total),
                                block_size=args.block_size, dcp=args.dcp, decode_len=width)
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
    if args.mode == Mode.DECODE and (args.speculative or args.shared_prefix):
        drafter = drafter_for(args, program, shapes) if args.speculative else None
        report = V.verify_speculative(loaded.make_reference(), program, prompts, args.steps,
                                      drafter, atol=args.atol,
                                      prefix_caching=bool(args.shared_prefix))
    elif args.mode == Mode.DECODE and loaded.checkpoint:
        report = V.verify(loaded.make_reference(), program, prompts, args.steps,
                          atol=args.atol, checkpoint=loaded.checkpoint)
    elif args.mode == Mode.DECODE:
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
              f"tokens_agree={report.tokens_agree}"
              + (f" mean_accepted={report.mean_accepted:.2f}"
                 if hasattr(report, "mean_accepted") else "")
              + f" ({report.seconds:.1f}s)")
        if report.first_mismatch:
            print(f"first mismatch: {report.first_mismatch}")
    return 0 if report.ok else 1



def drafter_for(args, program, shapes):
    """The drafter of ``--speculative``: threads take one per rank (``drafter_for(rank)``),
    XLA one for its SPMD engine. A draft model is transformed for the same tp, dcp=1."""
    from dataclasses import replace

    import dcp_compile
    from dcp_compile.runtime.serving.speculative import NgramDrafter
    spec = args.speculative
    if spec.drafter == "ngram":
        return NgramDrafter() if args.backend == "xla" else (lambda rank: NgramDrafter())
    draft_args = argparse.Namespace(model=spec.factory, hf_config=None)
    draft = load_model(draft_args).model
    print(f"transforming the draft model {spec.factory}: tp={args.tp} dcp=1",
          file=sys.stderr)
    draft_program = dcp_compile.transform(
        draft, tp=args.tp, dcp=1, mode=Mode.DECODE, block_size=args.block_size,
        shapes=replace(shapes, max_blocks=shapes.max_blocks * args.dcp,
                       num_blocks=(shapes.num_blocks - 1) * args.dcp + 1, decode_len=2))
    if args.backend == "xla":
        from dcp_compile.xla import draft_drafter
        return draft_drafter(draft_program)
    from dcp_compile.verify import draft_program_drafter
    return draft_program_drafter(draft_program, program)
