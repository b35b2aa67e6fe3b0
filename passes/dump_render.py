"""Dump rendering: a graph as readable code and as a Graphviz picture, and the dump's
``index.html`` page (filled from the template ``dump_index.html`` shipped beside this module).

Nodes a pass inserted are filled with the colour of their ``meta["dcp_kind"]`` (collective,
slice, mask, cache write, LSE combine, ...); untagged helper nodes new in that pass are pale
yellow; kind-tagged nodes of earlier passes keep a coloured outline. :mod:`dcp_compile.passes.dump`
writes what is rendered here.
"""

from __future__ import annotations

import functools
import html
import json
import shutil
import subprocess
import warnings
from importlib import resources
from pathlib import Path

from torch.fx import GraphModule, Node

from dcp_compile.runtime.names import META_KIND, META_PASS

from .infra import (KIND_ATTENTION, KIND_CACHE_WRITE, KIND_COLLECTIVE, KIND_LSE, KIND_MASK,
                    KIND_RANK, KIND_SHARD, KIND_SLICE)

# Fill colours by meta["dcp_kind"]; NEW_COLOUR for untagged nodes new in a pass.
KIND_COLOURS = {
    KIND_COLLECTIVE: "#f08a5d",
    KIND_SLICE: "#f9d56e",
    KIND_MASK: "#a8d5a2",
    KIND_CACHE_WRITE: "#7fb3e0",
    KIND_LSE: "#c39bd3",
    KIND_ATTENTION: "#f4a6c8",
    KIND_SHARD: "#8fd8e6",
    KIND_RANK: "#c8ccd4",
}
NEW_COLOUR = "#fff6bf"
KIND_LABELS = {KIND_COLLECTIVE: "collective", KIND_SLICE: "slice", KIND_MASK: "mask",
               KIND_CACHE_WRITE: "cache write", KIND_LSE: "LSE combine",
               KIND_ATTENTION: "attention", KIND_SHARD: "weight shard", KIND_RANK: "rank"}

DOT_TIMEOUT = 120.0
# Graphviz takes minutes on graphs of many thousand nodes: above this, DOT text only.
MAX_RENDERED_NODES = 2500


def dot_executable() -> str | None:
    """Graphviz ``dot`` on PATH, or None (pictures are then DOT text only)."""
    return shutil.which("dot")


# ------------------------------------------------------------------------------------------
# Graph text and pictures
# ------------------------------------------------------------------------------------------


def readable_code(gm: GraphModule, header: list[str] = ()) -> str:
    """The graph as Python with shapes annotated, one forward argument per line."""
    try:
        body = gm.print_readable(print_output=False, include_stride=False,
                                 include_device=False, colored=False)
    except Exception:  # noqa: BLE001 - a graph without meta['val'] still prints as code
        body = gm.code
    lines = body.splitlines()
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if stripped.startswith("def forward(self, ") and stripped.endswith("):"):
            indent = line[:len(line) - len(stripped)]
            args = _split_args(stripped[len("def forward(self, "):-2])
            lines[i:i + 1] = ([f"{indent}def forward(self,"]
                              + [f"{indent}        {a}," for a in args] + [f"{indent}):"])
            break
    return "".join(f"# {h}\n" for h in header) + "\n".join(lines).rstrip() + "\n"


def _split_args(text: str) -> list[str]:
    """Split ``a: "f32[2, 3]", b`` at top-level commas (not inside quotes or brackets)."""
    out, depth, quote, cur = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def inserted_nodes(gm: GraphModule, pass_name: str) -> dict[str, list[str]]:
    """kind -> names of the nodes ``pass_name`` inserted (its meta['dcp_pass'] tags)."""
    out: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        if n.meta.get(META_PASS) == pass_name and META_KIND in n.meta:
            out.setdefault(n.meta[META_KIND], []).append(n.name)
    return out


def _short_target(n: Node) -> str:
    if n.op == "placeholder":
        return "input"
    if n.op == "output":
        return "output"
    if n.op == "get_attr":
        return f"get_attr {n.target}"
    t = n.target
    name = getattr(t, "__name__", None)
    if hasattr(t, "_schema"):  # OpOverload: aten.linear.default -> aten.linear
        ns = t.namespace
        name = f"{'c10d' if ns == '_c10d_functional' else ns}.{t._opname}"
        if t._overloadname not in ("default",):
            name += f".{t._overloadname}"
    return name or str(t)


def _shape_text(n: Node) -> str:
    v = n.meta.get("val")
    vals = v if isinstance(v, (list, tuple)) else [v]
    parts = []
    for x in vals:
        shape = getattr(x, "shape", None)
        if shape is not None:
            dtype = str(getattr(x, "dtype", "")).replace("torch.", "")
            parts.append(f"{dtype}[{', '.join(str(s) for s in shape)}]")
    return " ".join(parts[:3]) + (" ..." if len(parts) > 3 else "")


def _dot_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _dot_quote(s: str) -> str:
    return f'"{_dot_escape(s)}"'


def graph_to_dot(gm: GraphModule, *, title: str, pass_name: str | None = None,
                 new_names: set[str] = frozenset()) -> str:
    """Graphviz DOT of ``gm``: nodes ``pass_name`` inserted filled by kind, other nodes new in
    this entry pale yellow, kind-tagged nodes of earlier passes outlined in their colour."""
    lines = [f"digraph {_dot_quote(title)} {{",
             f"  graph [label={_dot_quote(title)}, labelloc=t, fontsize=20, rankdir=TB, "
             "nodesep=0.15, ranksep=0.3, fontname=Helvetica];",
             '  node [shape=box, style="rounded,filled", fillcolor="#ffffff", '
             'color="#9aa0a6", fontname=Helvetica, fontsize=10, height=0.3];',
             '  edge [color="#b0b4ba", arrowsize=0.5];']
    for n in gm.graph.nodes:
        parts = [n.name, _short_target(n), _shape_text(n)]
        label = "\\n".join(_dot_escape(p) for p in parts if p)   # DOT's line break
        kind, origin = n.meta.get(META_KIND), n.meta.get(META_PASS)
        attrs = [f'label="{label}"']
        if kind is not None and origin == pass_name:
            attrs += [f'fillcolor="{KIND_COLOURS.get(kind, NEW_COLOUR)}"', "penwidth=2.5",
                      'color="#202124"', f"tooltip={_dot_quote(f'{kind} (inserted here)')}"]
        elif n.name in new_names:
            attrs += [f'fillcolor="{NEW_COLOUR}"', "penwidth=1.5", 'color="#5f6368"',
                      'tooltip="new in this pass"']
        elif kind is not None:
            attrs += [f'color="{KIND_COLOURS.get(kind, "#9aa0a6")}"', "penwidth=2.5",
                      f"tooltip={_dot_quote(f'{kind} (from {origin})')}"]
        if n.op in ("placeholder", "output"):
            attrs.append("shape=oval")
        lines.append(f"  {_dot_quote(n.name)} [{', '.join(attrs)}];")
    for n in gm.graph.nodes:
        for src in n.all_input_nodes:
            lines.append(f"  {_dot_quote(src.name)} -> {_dot_quote(n.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def start_svg_render(exe: str | None, dot_file: Path, svg_file: Path) -> subprocess.Popen | None:
    """Start Graphviz ``exe`` (from :func:`dot_executable`) on ``dot_file``; None without it."""
    if exe is None:
        return None
    try:
        return subprocess.Popen([exe, "-Tsvg", str(dot_file), "-o", str(svg_file)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        warnings.warn(f"Graphviz could not start on {dot_file}: {e}. The dump keeps the DOT "
                      "text.", stacklevel=2)
        return None


def finish_svg_render(proc: subprocess.Popen, svg_file: Path) -> bool:
    """Wait for a render; False (and no SVG file) if Graphviz failed or hung."""
    try:
        _, err = proc.communicate(timeout=DOT_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        err = f"no picture after {DOT_TIMEOUT:.0f} s"
    if proc.returncode != 0:
        warnings.warn(f"Graphviz could not render {svg_file.with_suffix('.dot')}: "
                      f"{(err or '').strip()[:300]}. The dump keeps the DOT text.",
                      stacklevel=2)
        svg_file.unlink(missing_ok=True)
        return False
    return True


# ------------------------------------------------------------------------------------------
# index.html
# ------------------------------------------------------------------------------------------

TEMPLATE = "dump_index.html"


@functools.lru_cache(maxsize=1)
def _page() -> str:
    """The page template: placeholders __TITLE__, __LINKS__ and __DATA__."""
    return resources.files(__package__).joinpath(TEMPLATE).read_text(encoding="utf-8")


def render_index(steps: list[dict], subdumps: list[str], *, title: str) -> str:
    data = json.dumps({"title": title, "steps": steps, "subdumps": subdumps,
                       "kinds": KIND_COLOURS, "kind_labels": KIND_LABELS,
                       "new_colour": NEW_COLOUR, "max_rendered": MAX_RENDERED_NODES})
    data = data.replace("</", "<\\/")  # never close the <script> early
    links = " ".join(f'<a href="{html.escape(d)}/index.html" style="margin-right:12px">'
                     f'{html.escape(d)}/</a>' for d in subdumps)
    return (_page().replace("__TITLE__", html.escape(title)).replace("__LINKS__", links)
            .replace("__DATA__", data))
