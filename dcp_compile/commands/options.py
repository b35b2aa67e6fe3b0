"""Option types and checks shared by every subcommand: argparse ``type=`` validators (a bad
value is an argparse error, exit 2, no traceback) and the layout check each command runs
before any work (``validate(args)``: a :class:`DCPConfigError` becomes the same error)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def positive_int(text: str) -> int:
    """An int >= 1 (``--tp``, ``--dcp``, ``--steps``, sizes)."""
    try:
        value = int(text, 10)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"must be a positive integer: {text!r}. Pass e.g. 4.") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer: {text!r}. "
                                         "Pass an integer >= 1.")
    return value


def positive_int_list(text: str) -> list[int]:
    """A comma-separated list of ints >= 1, e.g. ``1,15,17,64`` (``--lengths``)."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of positive integers: {text!r}. "
            "Pass e.g. 1,15,17,64.")
    out = []
    for t in items:
        try:
            out.append(positive_int(t))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"must be a comma-separated list of positive integers: {text!r} "
                f"(bad item {t!r}). Pass e.g. 1,15,17,64.") from None
    return out


def choice_list(*choices: str):
    """A comma-separated, non-empty list of distinct ``choices`` (``--modes decode,prefill``)."""
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if not items or bad or len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(
                f"must be a comma-separated list of distinct values from {list(choices)}: "
                f"{text!r}. Pass e.g. {','.join(choices)}.")
        return items
    parse.__name__ = "choice list"
    return parse


def non_negative_float(text: str) -> float:
    """A finite float >= 0 (``--atol``)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0: {text!r}. "
                                         "Pass e.g. 1e-4.")
    return value


def output_dir(text: str) -> Path:
    """A directory to write into: it may exist, but not as a file."""
    path = Path(text)
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a directory path: ''. Pass e.g. dcp_dump.")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"is an existing file, not a directory: {text!r}. "
                                         "Pass a directory path.")
    return path


def add_layout_arguments(p, *, tp_default=None, dcp_default=None, block_size: bool = True,
                         mode: bool = True) -> None:
    """``--tp``, ``--dcp`` (required unless given a default), ``--mode``, ``--block-size`` and
    ``--interleave-size``, validated by :func:`check_layout`."""
    for name, default, what in (("--tp", tp_default, "tensor-parallel size"),
                                ("--dcp", dcp_default, "decode context parallel size")):
        if default is None:
            p.add_argument(name, type=positive_int, required=True, help=what)
        else:
            p.add_argument(name, type=positive_int, default=default, help=what)
    if mode:
        p.add_argument("--mode", choices=["decode", "prefill"], default="decode",
                       help="decode: a prompt (context) and a decode program; prefill: a "
                            "chunked-prefill program")
    if block_size:
        p.add_argument("--block-size", type=positive_int, default=16,
                       help="KV cache block size")
        p.add_argument("--interleave-size", type=positive_int, default=None,
                       help="cp_kv_cache_interleave_size (default: the block size)")


def check_layout(args, *, modes=None, **heads) -> None:
    """Raise DCPConfigError unless the layout options (and ``heads``, e.g. num_kv_heads)
    form a valid DCPConfig in every one of ``modes`` (default: ``args.mode``)."""
    from dcp_compile.runtime.config import DCPConfig
    for mode in modes or [args.mode]:
        DCPConfig(tp=args.tp, dcp=args.dcp, mode=mode,
                  block_size=getattr(args, "block_size", 16),
                  interleave_size=getattr(args, "interleave_size", None),
                  kv_role=getattr(args, "kv_role", None), **heads)


def model_heads(args) -> dict:
    """Head counts to validate the layout against before work starts: the demo model's. A
    ``--model`` / ``--hf-config`` model's own heads are checked when it is transformed."""
    if getattr(args, "model", None) or getattr(args, "hf_config", None) or \
            getattr(args, "checkpoint", None):
        return {}
    from dcp_compile.models.demo import DemoConfig
    c = DemoConfig()
    return dict(num_q_heads=c.num_q_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)


def add_buckets_argument(p) -> None:
    """``--buckets 64,256``: context buckets in tokens (docs/lowering.md "Context buckets")."""
    p.add_argument("--buckets", type=positive_int_list, default=None,
                   help="comma-separated context buckets in tokens, each a multiple of "
                        "block_size * dcp: one graph (and lowered module) per step kind and "
                        "bucket; a step runs in the smallest that holds its batch (default: "
                        "none, one bucket: the full capacity)")


def check_buckets_option(args, block_size: int) -> None:
    """Raise DCPConfigError unless every ``--buckets`` entry is a multiple of the vblock."""
    if getattr(args, "buckets", None):
        from dcp_compile.runtime.program.buckets import check_buckets
        check_buckets(args.buckets, block_size=block_size, dcp=args.dcp,
                      max_blocks=max(args.buckets))


def capacity_for_buckets(args, max_tokens: int) -> int:
    """Tokens the program must hold: ``max_tokens``, and at least the largest bucket."""
    return max([max_tokens] + list(getattr(args, "buckets", None) or []))
