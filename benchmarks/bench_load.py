"""One rank's weight load from a real checkpoint, at tp 1/2/4/8 (issue #36).

The benchmark writes a ~1 GB bf16 Llama-shaped checkpoint (hidden 2048, 16 heads, 4 KV
heads, MLP 5632, vocab 32000, 9 layers; ``save_pretrained`` in 200 MB files), compiles the
model on the meta device (``dcp_compile.meta_init.meta_model``) at each tp (decode; dcp 2
where tp > the 4 KV heads, else 1),
saves the weightless program file, and then, in a fresh process per row, loads the program
file and reads rank 0's shard (``program.read_checkpoint(0, DIR)``). Per row:

  program   the weightless program file's size (MiB)
  read      bytes of tensor data the rank read (MiB), and its share of the checkpoint
  rss       peak RSS growth of the load (MiB): the peak (VmHWM, reset just before) minus
            the RSS before it
  bound     the issue's bound for it: 1.3 x (checkpoint / tp) + 256 MiB
  seconds   the load's wall time

and, for comparison, ``transformers.AutoModelForCausalLM.from_pretrained`` of the whole
model (dtype bfloat16) in a fresh process, every weight touched once (its tensors may map
the files lazily): its RSS growth and seconds.

    python3 -m benchmarks.bench_load [--dir /tmp/bench_load] [--tp 1,2,4,8] [--keep]
                                     [--write-docs]

Measured, never asserted (tests/runtime/test_checkpoint.py asserts what the reader reads). The
page cache is warm after the checkpoint is written; each row reads the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)

MiB = 1 << 20
CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
              num_hidden_layers=9, num_attention_heads=16, num_key_value_heads=4,
              max_position_embeddings=4096, tie_word_embeddings=False)


def write_checkpoint(directory: Path) -> int:
    """The bf16 checkpoint (seeded random weights); returns its bytes on disk."""
    import torch
    import transformers
    if not (directory / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**CONFIG)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(directory, max_shard_size="200MB")
        del model
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def compile_programs(directory: Path, tps: list[int], out: Path) -> dict[int, Path]:
    import dcp_compile
    from dcp_compile.meta_init import meta_model
    from dcp_compile.runtime.serving.engine import StepShapes
    files = {}
    for tp in tps:
        path = out / f"tp{tp}.dcp"
        # decode DCP needs tp > num_kv_heads: dcp 2 at tp 8, none below
        dcp = 2 if tp > CONFIG["num_key_value_heads"] else 1
        program = dcp_compile.transform(meta_model(directory), tp=tp, dcp=dcp,
                                        shapes=StepShapes(batch=1, context_len=16,
                                                          max_blocks=8, num_blocks=16))
        program.save(path, weights=False)
        files[tp] = path
    return files


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024          # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> float:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux ``clear_refs`` 5),
    so the peak read after a load is the load's own, not an earlier one (imports); returns
    the current RSS in MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def _peak_mib() -> float:
    return _status_mib("VmHWM")


def child_load(program_path: str, checkpoint: str) -> dict:
    """One rank's load in this (fresh) process."""
    import torch  # noqa: F401 - imported before the baseline
    from dcp_compile.runtime.program.program_file import load_program
    program = load_program(program_path)
    before = _reset_peak()
    start = time.perf_counter()
    state, stats = program.read_checkpoint(0, checkpoint, progress=False)
    seconds = time.perf_counter() - start
    return {"rss_mib": _peak_mib() - before, "seconds": seconds,
            "read_mib": stats.bytes_read / MiB, "files": stats.files,
            "tensors": stats.tensors, "held_mib": sum(
                t.numel() * t.element_size() for t in state.values()) / MiB}


def child_hf(checkpoint: str) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM  # noqa: F401 - its lazy import, before
    before = _reset_peak()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    with torch.no_grad():   # its tensors may map the files lazily: touch them, as serving does
        sum(float(p.sum()) for p in model.parameters())
    return {"rss_mib": _peak_mib() - before, "seconds": time.perf_counter() - start}


def _in_child(*argv: str) -> dict:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *argv],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/bench_load")
    ap.add_argument("--tp", default="1,2,4,8")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint for next time")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    docs_section.add_argument(ap)
    args = ap.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        print(json.dumps(child_load(*rest) if kind == "load" else child_hf(*rest)))
        return 0
    with docs_section.recorded("bench_load", args.write_docs):
        run(args)
    return 0


def run(args) -> None:
    root = Path(args.dir)
    checkpoint = root / "checkpoint"
    checkpoint.mkdir(parents=True, exist_ok=True)
    tps = [int(t) for t in args.tp.split(",")]
    size = write_checkpoint(checkpoint)
    programs = compile_programs(checkpoint, tps, root)
    print(f"checkpoint: {size / MiB:.0f} MiB bf16 in "
          f"{len(list(checkpoint.glob('*.safetensors')))} files; rank 0's load per tp "
          f"(fresh process each; load {os.getloadavg()[0]:.1f})")
    print(f"{'tp':>3} {'program MiB':>11} {'read MiB':>9} {'share':>6} {'rss MiB':>8} "
          f"{'bound MiB':>9} {'seconds':>8}")
    for tp in tps:
        r = _in_child("load", str(programs[tp]), str(checkpoint))
        bound = 1.3 * size / tp / MiB + 256
        print(f"{tp:>3} {programs[tp].stat().st_size / MiB:>11.2f} {r['read_mib']:>9.0f} "
              f"{r['read_mib'] * MiB / size:>6.3f} {r['rss_mib']:>8.0f} {bound:>9.0f} "
              f"{r['seconds']:>8.2f}")
    hf = _in_child("hf", str(checkpoint))
    print(f"transformers.from_pretrained (whole model): rss {hf['rss_mib']:.0f} MiB, "
          f"{hf['seconds']:.2f} s")
    if not args.keep:
        shutil.rmtree(root)


if __name__ == "__main__":
    raise SystemExit(main())
