"""Write the pass-by-pass dump of a model for a (tp, dcp, mode).

The model is the built-in demo model, --model or --hf-config.

For every step kind (decode mode: context and decode; prefill mode: prefill) and every pass
in order: the graph as readable code, its diff against the previous pass, a picture (SVG when
Graphviz `dot` is on PATH, DOT text otherwise) with the inserted nodes coloured by kind, the
pass's history entry and the proof certificate; plus OUT/index.html showing the passes side
by side. Open index.html in a browser (it needs no network).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .model_arg import add_model_arguments, load_model
from .options import add_layout_arguments, check_layout, model_heads, output_dir, positive_int


def add_arguments(p):
    add_layout_arguments(p, tp_default=8, dcp_default=4)
    p.add_argument("--out", type=output_dir, default=Path("dcp_dump"),
                   help="dump directory")
    p.add_argument("--layers", type=positive_int, default=2,
                   help="decoder layers of the demo model")
    p.add_argument("--json", action="store_true",
                   help="print the dump's entries (step, pass, files) as JSON")
    add_model_arguments(p)


def validate(args) -> None:
    check_layout(args, **model_heads(args))


def run(args) -> int:
    import dcp_compile
    from dcp_compile.models.demo import DemoConfig
    from dcp_compile.passes.dump import dot_executable
    from dcp_compile.runtime.serving.engine import StepShapes

    loaded = load_model(args, demo_config=DemoConfig(num_layers=args.layers))
    model = loaded.model
    out = Path(args.out)
    t0 = time.perf_counter()
    print(f"transforming {loaded.label} (tp={args.tp}, dcp={args.dcp}, mode={args.mode}) "
          f"and dumping every pass to {out}/ ...", file=sys.stderr)
    program = dcp_compile.transform(
        model, tp=args.tp, dcp=args.dcp, mode=args.mode, block_size=args.block_size,
        interleave_size=args.interleave_size, dump_dir=out,
        shapes=StepShapes(batch=2, context_len=8 * args.tp, max_blocks=4,
                          num_blocks=9), progress=True)
    seconds = time.perf_counter() - t0
    entries = []
    for step in program.graphs:
        manifest = json.loads((out / step / "manifest.json").read_text())
        for e in manifest["entries"]:
            entries.append({"step": step, "index": e["index"], "pass": e["pass"],
                            "modified": e["modified"], "inserted": e["inserted"],
                            "diff_lines": e["diff_lines"],
                            "files": {k: str(out / step / v) for k, v in e["files"].items()
                                      if v}})
    if args.json:
        print(json.dumps({"dump_dir": str(out), "index": str(out / "index.html"),
                          "pictures": "svg" if dot_executable() else "dot",
                          "seconds": round(seconds, 2), "entries": entries}, indent=2))
        return 0
    for step in program.graphs:
        print(f"{step}:")
        for e in (e for e in entries if e["step"] == step):
            ins = ", ".join(f"{k} {v}" for k, v in e["inserted"].items()) or "-"
            change = "captured" if e["index"] == 0 else (
                f"{e['diff_lines']:4d} lines changed" if e["modified"] else "   unchanged")
            print(f"  {e['index']:02d} {e['pass']:<24} {change:<20} inserted: {ins}")
    pictures = ("SVG pictures" if dot_executable() else
                "DOT text pictures (install Graphviz `dot` for SVG)")
    print(f"dump written to {out}/ ({pictures}, {seconds:.1f} s); open "
          f"{(out / 'index.html').resolve()}")
    return 0

