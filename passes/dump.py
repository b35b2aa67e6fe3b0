"""Pass-by-pass dump: every pass's graph as code, diff, picture, history entry and certificate.

A dump root holds one folder per step kind, and one ``index.html`` that shows them:

    DIR/index.html                       the passes side by side (self-contained, no network)
    DIR/certificate.json                 the proof certificate of the last step written
    DIR/<step>/manifest.json             step, source, config, the step's pipeline (pass names
                                         in order) and the entries in pass order
    DIR/<step>/NN_<pass>.py              the graph after the pass, readable (shapes annotated)
    DIR/<step>/NN_<pass>.diff            unified diff against the previous entry (not for 00)
    DIR/<step>/NN_<pass>.dot             the graph as Graphviz DOT, inserted nodes coloured
    DIR/<step>/NN_<pass>.svg             the same rendered, when Graphviz ``dot`` is on PATH
    DIR/<step>/NN_<pass>.json            the pass's history entry, its inserted/new/removed
                                         nodes and the certificate known after it

Entry 00 is the captured graph; entry N is the graph after the N-th pass of the step. Nodes a
pass inserted are filled with the colour of their ``meta["dcp_kind"]`` (collective, slice,
mask, cache write, LSE combine, ...); untagged helper nodes new in that pass are pale yellow;
kind-tagged nodes of earlier passes keep a coloured outline.

:class:`PassDump` is the pass manager's ``on_pass`` callback: it writes each entry as soon as
the pass ran (a transform that fails half way leaves the dump up to the failing pass), and
``close()`` rewrites the history entries once the step is final. With ``TORCH_TRACE`` set,
every entry is also emitted as structured-trace artifacts (``dcp_<step>_NN_<pass>_graph``,
``_diff``, ``_dot``, ``_history``) that ``tlparse`` lists with the compile's other artifacts.

``DCP_COMPILE_DUMP=DIR`` turns dumps on for ``transform()`` (``DIR/transform-<mode>/``) and
the torch.compile backend (``DIR/backend-<mode>/``); ``DIR/index.html`` links them.

A dump only ever replaces or deletes files it wrote: every directory it writes into keeps a
ledger (``.dcp-dump-files.json``) of the files the dump wrote there. A re-dump of a step
deletes that step's listed files and nothing else; a file of that name that the dump did not
write (a user's ``index.html``, ``decode/manifest.json``) is never overwritten: the dump
refuses with :class:`DCPConfigError` naming it.
"""

from __future__ import annotations

import difflib
import html
import json
import os
import shutil
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

from torch.fx import GraphModule, Node

from runtime.errors import DCPConfigError
from runtime.names import META_CERTIFICATE, META_KIND, META_PASS

from .infra import (KIND_ATTENTION, KIND_CACHE_WRITE, KIND_COLLECTIVE, KIND_LSE, KIND_MASK,
                    KIND_RANK, KIND_SHARD, KIND_SLICE)
from .pipeline import PIPELINE, pass_names

ENV_VAR = "DCP_COMPILE_DUMP"

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

_DOT_TIMEOUT = 120.0
# Graphviz takes minutes on graphs of many thousand nodes: above this, DOT text only.
MAX_RENDERED_NODES = 2500
_MAX_RENDERS_RUNNING = 2


LEDGER = ".dcp-dump-files.json"


class OwnedDir:
    """A directory the dump writes into, with the ledger of the files it wrote there: the
    dump replaces or deletes only those, and refuses to overwrite any other file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.ledger = self.path / LEDGER

    def owned(self) -> set[str]:
        """Names of the files the dump wrote in this directory."""
        if not self.ledger.exists():
            return set()
        try:
            names = json.loads(self.ledger.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            names = None
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise DCPConfigError(f"the dump's ledger is not one the dump wrote: {self.ledger}. "
                                 "Point dump_dir at a new or empty directory.")
        return set(names)

    def claim(self, name: str) -> Path:
        """The path of file ``name``, after checking the dump may write it (it is listed, or
        does not exist yet: it is then listed before it is written)."""
        names = self.owned()
        target = self.path / name
        if name not in names:
            if target.exists() or target.is_symlink():
                raise DCPConfigError(
                    f"the dump directory holds a file the dump did not write: {target}. Move "
                    f"it, or point dump_dir at a new or empty directory (a dump replaces only "
                    f"the files listed in {LEDGER}).")
            self.path.mkdir(parents=True, exist_ok=True)
            self._save(names | {name})
        elif target.is_symlink():
            raise DCPConfigError(f"a file the dump wrote was replaced by a link: {target}. "
                                 "Remove the link, or point dump_dir elsewhere.")
        return target

    def write_text(self, name: str, text: str) -> Path:
        target = self.claim(name)
        target.write_text(text)
        return target

    def remove_owned(self) -> None:
        """Delete every file the dump wrote here (and only those); the directory stays."""
        for name in sorted(self.owned()):
            target = self.path / name
            if target.is_file() and not target.is_symlink():
                target.unlink()
        self._save(set())

    def _save(self, names: set[str]) -> None:
        self.ledger.write_text(json.dumps(sorted(names), indent=0))


def env_dump_root() -> Path | None:
    """The root named by ``DCP_COMPILE_DUMP``, or None when it is unset or empty."""
    value = os.environ.get(ENV_VAR, "").strip()
    return Path(value) if value else None


def dot_executable() -> str | None:
    """Graphviz ``dot`` on PATH, or None (pictures are then DOT text only)."""
    return shutil.which("dot")


# ------------------------------------------------------------------------------------------
# One step kind's dump
# ------------------------------------------------------------------------------------------


class PassDump:
    """``on_pass(record, gm)`` callback of ``passes.manager.run_passes`` for one step kind.

    ``root`` is the dump root (the step goes to ``root/<step>/``), or None for structured-
    trace artifacts only; ``source`` and ``config`` label the step on the page (e.g.
    ``"transform"``, ``"torch.compile backend"``). Build one with :func:`pass_dump`.
    """

    def __init__(self, root: str | Path | None, step: str, *, source: str = "transform",
                 config: Any = None):
        self.root = Path(root) if root is not None else None
        self.step = step
        self.source = source
        self.config = config
        self.dir = self.root / step if self.root is not None else None
        self._files = OwnedDir(self.dir) if self.dir is not None else None
        self.entries: list[dict] = []
        self.records: list = []
        self._created = time.time()
        self._certificate = None
        self._prev_body = ""
        self._prev_names: set[str] = set()
        self._prev_file: str | None = None
        # entry index -> (inserted by kind, new node names, removed node names)
        self._changes: dict[int, tuple[dict, list, list]] = {}
        self._certs: dict[int, Any] = {}   # entry index -> certificate known after it
        self._renders: list[tuple[subprocess.Popen, Path, dict]] = []
        if self.dir is not None:
            # A new transform of this step replaces the files an earlier dump wrote, only.
            self.dir.mkdir(parents=True, exist_ok=True)
            self._files.remove_owned()

    # -- the callback ----------------------------------------------------------------------

    def __call__(self, record, gm: GraphModule) -> None:
        index = len(self.entries)
        stem = f"{index:02d}_{record.name}"
        body = readable_code(gm)
        text = (f"# dcp_compile dump: step={self.step} entry={index:02d} pass={record.name}\n"
                f"# modified={record.modified} inserted={dict(record.inserted)}\n" + body)
        names = {n.name for n in gm.graph.nodes}
        new = sorted(names - self._prev_names) if index else []
        removed = sorted(self._prev_names - names) if index else []
        inserted = inserted_nodes(gm, record.name)
        self._certificate = gm.meta.get(META_CERTIFICATE) or self._certificate
        files = {"code": f"{stem}.py", "dot": f"{stem}.dot", "json": f"{stem}.json",
                 "diff": f"{stem}.diff" if index else None, "svg": None}
        # The graphs' code only (not the header): an unchanged graph has an empty diff.
        diff = "".join(difflib.unified_diff(
            self._prev_body.splitlines(keepends=True), body.splitlines(keepends=True),
            fromfile=f"{self.step}/{self._prev_file}", tofile=f"{self.step}/{files['code']}",
            n=2)) if index else ""
        dot = graph_to_dot(gm, title=f"{self.step} {index:02d} {record.name}",
                           pass_name=record.name, new_names=set(new))
        entry = {"index": index, "pass": record.name, "step": self.step, "files": files,
                 "modified": bool(record.modified), "inserted": dict(record.inserted),
                 "seconds": round(record.seconds, 6), "nodes": len(names),
                 "diff_lines": sum(1 for ln in diff.splitlines()
                                   if ln[:1] in "+-" and ln[:3] not in ("+++", "---"))}
        self.entries.append(entry)
        self.records.append(record)
        self._changes[index] = (inserted, new, removed)
        self._certs[index] = gm.meta.get(META_CERTIFICATE)
        self._prev_body, self._prev_names, self._prev_file = body, names, files["code"]

        if self.dir is not None:
            self._files.write_text(files["code"], text)
            if index:
                self._files.write_text(files["diff"], diff)
            self._files.write_text(files["dot"], dot)
            if len(names) <= MAX_RENDERED_NODES:
                self._start_render(self.dir / files["dot"], self._files.claim(f"{stem}.svg"),
                                   files)
            self._write_entry_json(entry, record)
            self._write_manifest()
        _trace_artifacts(self.step, stem, text, diff, dot, self._entry_json(entry, record))

    def close(self, config: Any = None, certificate: Any = None) -> Path | None:
        """Collect the pictures, rewrite the history entries (records may have been amended
        since), write the certificate and the page; returns the path of ``index.html``.

        Call it also when a pass failed: the page then shows the passes up to the failure.
        """
        if config is not None:
            self.config = config
        if certificate is not None:
            self._certificate = certificate
        if self.dir is None:
            return None
        for proc, svg, files in self._renders:
            if finish_svg_render(proc, svg):
                files["svg"] = svg.name
        self._renders = []
        for entry, record in zip(self.entries, self.records):
            self._write_entry_json(entry, record)
        self._write_manifest()
        if self._certificate is not None:
            cert = json.dumps(_certificate_json(self._certificate), indent=2)
            self._files.write_text("certificate.json", cert)
            OwnedDir(self.root).write_text("certificate.json", cert)
        return write_index(self.root)

    # -- files -----------------------------------------------------------------------------

    def _start_render(self, dot_file: Path, svg_file: Path, files: dict) -> None:
        """Graphviz runs beside the next passes (at most two at a time); close() waits."""
        running = [r for r in self._renders if r[0].poll() is None]
        if len(running) >= _MAX_RENDERS_RUNNING:
            try:
                running[0][0].wait(timeout=_DOT_TIMEOUT)
            except subprocess.TimeoutExpired:
                running[0][0].kill()   # finish_svg_render reports it
        render = start_svg_render(dot_file, svg_file)
        if render is not None:
            self._renders.append((render, svg_file, files))

    def _entry_json(self, entry, record) -> dict:
        inserted, new, removed = self._changes[entry["index"]]
        return {"step": self.step, "index": entry["index"], "pass": record.name,
                "history": record.to_json(),
                "inserted_nodes": inserted, "new_nodes": new, "removed_nodes": removed,
                "certificate": _certificate_json(self._certs.get(entry["index"]))}

    def _write_entry_json(self, entry, record) -> None:
        data = self._entry_json(entry, record)
        self._files.write_text(entry["files"]["json"], json.dumps(data, indent=2))

    def _write_manifest(self) -> None:
        manifest = {"step": self.step, "source": self.source,
                    "config": _config_json(self.config), "created": self._created,
                    "pipeline": pass_names(self.step) if self.step in PIPELINE else None,
                    "entries": self.entries}
        self._files.write_text("manifest.json", json.dumps(manifest, indent=2))


def tracing_enabled() -> bool:
    """Whether structured tracing (``TORCH_TRACE``) is on in this process."""
    from torch._logging._internal import trace_log
    return bool(trace_log.handlers)


def pass_dump(root: str | Path | None, step: str, *, source: str = "transform",
              config: Any = None) -> PassDump | None:
    """The ``on_pass`` callback for one step: files under ``root`` (if given) and trace
    artifacts when ``TORCH_TRACE`` is set; None when neither is wanted."""
    if root is None and not tracing_enabled():
        return None
    return PassDump(root, step, source=source, config=config)


def dump_root_for(source: str, mode: str, explicit: str | Path | None = None) -> Path | None:
    """Where a dump goes: ``explicit`` if given, else ``$DCP_COMPILE_DUMP/<source>-<mode>``."""
    if explicit is not None:
        return Path(explicit)
    env = env_dump_root()
    return env / f"{source}-{mode}" if env is not None else None


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


def start_svg_render(dot_file: Path, svg_file: Path) -> subprocess.Popen | None:
    """Start Graphviz on ``dot_file`` if ``dot`` is on PATH (None otherwise)."""
    exe = dot_executable()
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
        _, err = proc.communicate(timeout=_DOT_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        err = f"no picture after {_DOT_TIMEOUT:.0f} s"
    if proc.returncode != 0:
        warnings.warn(f"Graphviz could not render {svg_file.with_suffix('.dot')}: "
                      f"{(err or '').strip()[:300]}. The dump keeps the DOT text.",
                      stacklevel=2)
        svg_file.unlink(missing_ok=True)
        return False
    return True


def render_svg(dot_file: Path, svg_file: Path) -> bool:
    """Render ``dot_file`` with Graphviz if it is on PATH; False (and no file) otherwise."""
    proc = start_svg_render(dot_file, svg_file)
    return proc is not None and finish_svg_render(proc, svg_file)


# ------------------------------------------------------------------------------------------
# Structured trace (tlparse)
# ------------------------------------------------------------------------------------------


def _trace_artifacts(step: str, stem: str, code: str, diff: str, dot: str,
                     entry: dict) -> None:
    from torch._logging import trace_structured

    base = f"dcp_{step}_{stem}"
    for suffix, encoding, payload in (("graph", "string", code), ("diff", "string", diff),
                                      ("dot", "string", dot), ("history", "json", entry)):
        if suffix == "diff" and not payload:
            continue
        trace_structured(
            "artifact",
            metadata_fn=lambda name=f"{base}_{suffix}", enc=encoding: {"name": name,
                                                                       "encoding": enc},
            payload_fn=lambda p=payload: p,
            expect_trace_id=False)


# ------------------------------------------------------------------------------------------
# JSON helpers
# ------------------------------------------------------------------------------------------


def _certificate_json(cert) -> dict | None:
    if cert is None:
        return None
    return cert.to_json() if hasattr(cert, "to_json") else {"certificate": str(cert)}


def _config_json(config) -> dict | None:
    if config is None:
        return None
    if isinstance(config, dict):
        return config
    import dataclasses
    if dataclasses.is_dataclass(config):
        return {k: v for k, v in dataclasses.asdict(config).items()
                if isinstance(v, (int, float, str, bool)) or v is None}
    return {"config": str(config)}


# ------------------------------------------------------------------------------------------
# index.html
# ------------------------------------------------------------------------------------------


def load_steps(root: str | Path) -> list[dict]:
    """Every step dumped under ``root``, with each entry's files read back, in creation order."""
    root = Path(root)
    steps = []
    for manifest in sorted(root.glob("*/manifest.json")):
        if not _wrote(manifest.parent, "manifest.json"):
            continue  # not a dump's step folder
        try:
            data = json.loads(manifest.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        d = manifest.parent
        for e in data.get("entries", []):
            files = e["files"]
            e["code"] = _read(d, files.get("code"))
            e["diff"] = _read(d, files.get("diff"))
            e["dot"] = _read(d, files.get("dot"))
            svg = _read(d, files.get("svg"))
            e["svg"] = svg[svg.find("<svg"):] if svg and "<svg" in svg else None
            e["json"] = _read(d, files.get("json"))
        data["dir"] = d.name
        data["certificate"] = _read(d, "certificate.json")
        steps.append(data)
    steps.sort(key=lambda s: (s.get("created", 0), s["dir"]))
    return steps


def _read(d: Path, name: str | None) -> str | None:
    if not name:
        return None
    p = d / name
    return p.read_text() if p.exists() else None


def write_index(root: str | Path) -> Path:
    """(Re)write ``root/index.html`` from the steps under ``root``; link sub-dumps too."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    steps = load_steps(root)
    subdumps = sorted(p.parent.name for p in root.glob("*/index.html")
                      if _wrote(p.parent, "index.html"))
    out = OwnedDir(root).write_text("index.html", render_index(
        steps, subdumps, title=f"dcp_compile dump: {root.resolve().name}"))
    env = env_dump_root()
    if env is not None and root.resolve().parent == env.resolve():
        write_index(env)  # the DCP_COMPILE_DUMP root links every sub-dump
    return out


def _wrote(d: Path, name: str) -> bool:
    try:
        return name in OwnedDir(d).owned()
    except DCPConfigError:
        return False


def render_index(steps: list[dict], subdumps: list[str], *, title: str) -> str:
    data = json.dumps({"title": title, "steps": steps, "subdumps": subdumps,
                       "kinds": KIND_COLOURS, "kind_labels": KIND_LABELS,
                       "new_colour": NEW_COLOUR, "max_rendered": MAX_RENDERED_NODES})
    data = data.replace("</", "<\\/")  # never close the <script> early
    links = " ".join(f'<a href="{html.escape(d)}/index.html" style="margin-right:12px">'
                     f'{html.escape(d)}/</a>' for d in subdumps)
    return (_PAGE.replace("__TITLE__", html.escape(title)).replace("__LINKS__", links)
            .replace("__DATA__", data))


_PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
  :root { --line: #dadce0; --muted: #5f6368; --bg: #f8f9fa; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif;
         color: #202124; background: #fff; }
  header { padding: 12px 20px; border-bottom: 1px solid var(--line); background: var(--bg); }
  h1 { font-size: 18px; margin: 0 0 6px; }
  .legend span { display: inline-block; margin: 2px 10px 2px 0; font-size: 12px; }
  .legend i { display: inline-block; width: 12px; height: 12px; border: 1px solid #555;
              vertical-align: -2px; margin-right: 4px; border-radius: 2px; }
  .tabs { display: flex; gap: 6px; padding: 8px 20px 0; flex-wrap: wrap; }
  .tabs button { border: 1px solid var(--line); border-bottom: none; background: var(--bg);
                 padding: 6px 14px; border-radius: 6px 6px 0 0; cursor: pointer; font: inherit; }
  .tabs button.on { background: #fff; font-weight: 600; }
  main { padding: 12px 20px 40px; border-top: 1px solid var(--line); }
  .meta { color: var(--muted); font-size: 12px; margin-bottom: 8px; }
  .strip { display: flex; gap: 10px; overflow-x: auto; padding-bottom: 8px; }
  .card { flex: 0 0 220px; border: 1px solid var(--line); border-radius: 8px; padding: 8px;
          cursor: pointer; background: #fff; }
  .card.on { border-color: #1a73e8; box-shadow: 0 0 0 2px #1a73e855; }
  .card h3 { font-size: 13px; margin: 0 0 4px; }
  .card .thumb { height: 140px; overflow: hidden; border: 1px solid #eee; margin-top: 6px;
                 background: #fff; }
  .card .thumb svg { width: 100%; height: 100%; }
  .card .thumb pre { font-size: 6px; margin: 0; }
  .badge { display: inline-block; font-size: 11px; padding: 0 6px; border-radius: 8px;
           margin: 1px 2px 1px 0; border: 1px solid #0002; }
  .unchanged { color: var(--muted); font-size: 11px; }
  .compare { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; margin-top: 12px; }
  .pane { border: 1px solid var(--line); border-radius: 8px; min-width: 0; }
  .pane h2 { font-size: 14px; margin: 0; padding: 8px 10px; background: var(--bg);
             border-bottom: 1px solid var(--line); border-radius: 8px 8px 0 0; }
  .pic { height: 60vh; overflow: auto; background: #fff; }
  .pic.fit svg { width: 100%; height: auto; }
  .pic pre, .code pre, .diff pre, details pre { margin: 0; padding: 8px; font: 12px/1.35
      ui-monospace, "SFMono-Regular", Menlo, monospace; white-space: pre; }
  .code { max-height: 50vh; overflow: auto; border-top: 1px solid var(--line); }
  .diff { margin-top: 12px; border: 1px solid var(--line); border-radius: 8px;
          max-height: 60vh; overflow: auto; }
  .diff .add { background: #e6ffec; } .diff .del { background: #ffebe9; }
  .diff .hunk { color: #8250df; background: #f6f0ff; }
  details { margin-top: 10px; border: 1px solid var(--line); border-radius: 8px; }
  summary { cursor: pointer; padding: 6px 10px; background: var(--bg); }
  .tools { float: right; font-weight: normal; font-size: 12px; }
  .tools button { font: inherit; font-size: 12px; }
  table { border-collapse: collapse; font-size: 12px; margin-top: 8px; }
  td, th { border: 1px solid var(--line); padding: 3px 8px; text-align: left; }
  tr.sel td { background: #e8f0fe; }
  a { color: #1a73e8; }
</style>
</head>
<body>
<header>
  <h1 id="title"></h1>
  <div class="legend" id="legend"></div>
  <div id="links">__LINKS__</div>
</header>
<nav class="tabs" id="tabs"></nav>
<main id="main"></main>
<script type="application/json" id="dcp-data">__DATA__</script>
<script>
(function () {
  "use strict";
  window.addEventListener("error", function (ev) {
    document.body.setAttribute("data-dcp-error", String(ev.message));
  });
  var data = JSON.parse(document.getElementById("dcp-data").textContent);
  var el = function (tag, attrs, children) {
    var e = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") e.textContent = attrs[k];
      else if (k === "html") e.innerHTML = attrs[k];
      else if (k.slice(0, 2) === "on") e.addEventListener(k.slice(2), attrs[k]);
      else e.setAttribute(k, attrs[k]);
    });
    (children || []).forEach(function (c) { if (c) e.appendChild(c); });
    return e;
  };
  document.getElementById("title").textContent = data.title;
  var legend = document.getElementById("legend");
  Object.keys(data.kinds).forEach(function (k) {
    legend.appendChild(el("span", {}, [el("i", {style: "background:" + data.kinds[k]}),
      document.createTextNode(data.kind_labels[k] || k)]));
  });
  legend.appendChild(el("span", {}, [el("i", {style: "background:" + data.new_colour}),
    document.createTextNode("other node new in this pass")]));

  function badges(inserted) {
    var box = el("div");
    var kinds = Object.keys(inserted || {});
    if (!kinds.length) box.appendChild(el("span", {class: "unchanged", text: "inserts nothing"}));
    kinds.forEach(function (k) {
      box.appendChild(el("span", {class: "badge", style: "background:" + (data.kinds[k] || "#eee"),
                                  text: (data.kind_labels[k] || k) + " " + inserted[k]}));
    });
    return box;
  }
  function picture(entry, fit) {
    var box = el("div", {class: "pic" + (fit ? " fit" : "")});
    if (entry.svg) box.innerHTML = entry.svg;
    else box.appendChild(el("pre", {text: "No SVG: Graphviz `dot` was not on PATH when this " +
      "dump was written (or the graph has over " + data.max_rendered + " nodes). The picture " +
      "is DOT text; render it with `dot -Tsvg`.\n\n" + (entry.dot || "")}));
    return box;
  }
  function diffView(text) {
    var pre = el("pre");
    (text || "").split("\n").forEach(function (line) {
      var cls = line.slice(0, 2) === "@@" ? "hunk" :
                (line[0] === "+" && line.slice(0, 3) !== "+++") ? "add" :
                (line[0] === "-" && line.slice(0, 3) !== "---") ? "del" : "";
      pre.appendChild(el("div", {class: cls, text: line || " "}));
    });
    return el("div", {class: "diff"}, [pre]);
  }
  function pane(title, entry) {
    var p = el("div", {class: "pane"});
    var pic = picture(entry, true);
    var fitBtn = el("button", {text: "fit / 100%", onclick: function () {
      pic.classList.toggle("fit"); }});
    p.appendChild(el("h2", {}, [document.createTextNode(title),
      el("span", {class: "tools"}, [fitBtn])]));
    p.appendChild(pic);
    p.appendChild(el("div", {class: "code"}, [el("pre", {text: entry.code || ""})]));
    return p;
  }

  var tabs = document.getElementById("tabs"), main = document.getElementById("main");
  function showStep(si, ei) {
    Array.prototype.forEach.call(tabs.children, function (b, i) {
      b.classList.toggle("on", i === si); });
    var step = data.steps[si];
    main.innerHTML = "";
    var cfg = step.config ? Object.keys(step.config).map(function (k) {
      return k + "=" + step.config[k]; }).join(" ") : "";
    main.appendChild(el("div", {class: "meta", text: "step " + step.step + " \u00b7 " +
      step.source + (cfg ? " \u00b7 " + cfg : "") + " \u00b7 " + step.entries.length +
      " entries (00 = captured graph, then one per pass)"}));
    var strip = el("div", {class: "strip"});
    step.entries.forEach(function (e, i) {
      var thumb = el("div", {class: "thumb"});
      if (e.svg) thumb.innerHTML = e.svg; else thumb.appendChild(el("pre", {text: e.dot || ""}));
      strip.appendChild(el("div", {class: "card pass-card" + (i === ei ? " on" : ""),
                                   "data-index": String(i),
                                   onclick: function () { showStep(si, i); }},
        [el("h3", {text: ("0" + e.index).slice(-2) + " " + e.pass}),
         el("div", {class: "unchanged", text: (i === 0 ? "captured graph" : e.modified ?
           "changed the graph" : "left the graph as it was") + " \u00b7 " + e.nodes +
           " nodes \u00b7 " + (e.seconds * 1000).toFixed(1) + " ms"}),
         badges(e.inserted), thumb]));
    });
    main.appendChild(strip);
    var chosen = strip.children[ei];
    if (chosen) strip.scrollLeft = Math.max(0, chosen.offsetLeft - strip.offsetLeft - 40);
    var cur = step.entries[ei], prev = step.entries[Math.max(ei - 1, 0)];
    var cmp = el("div", {class: "compare"});
    cmp.appendChild(pane(ei ? "before: " + ("0" + prev.index).slice(-2) + " " + prev.pass
                            : "captured graph", prev));
    cmp.appendChild(pane("after: " + ("0" + cur.index).slice(-2) + " " + cur.pass, cur));
    main.appendChild(cmp);
    if (ei) {
      main.appendChild(el("h3", {text: "diff " + ("0" + prev.index).slice(-2) + " \u2192 " +
        ("0" + cur.index).slice(-2) + " (" + cur.diff_lines + " lines changed)"}));
      main.appendChild(diffView(cur.diff));
    }
    main.appendChild(el("details", {}, [el("summary", {text: "history entry (JSON)"}),
      el("pre", {text: cur.json || ""})]));
    main.appendChild(el("details", {}, [el("summary", {text: "proof certificate (JSON)"}),
      el("pre", {text: step.certificate || "no certificate yet"})]));
  }
  data.steps.forEach(function (s, i) {
    tabs.appendChild(el("button", {text: s.step + " (" + s.source + ")",
                                   onclick: function () { showStep(i, s.entries.length - 1); }}));
  });
  if (data.steps.length) showStep(0, data.steps[0].entries.length - 1);
  else main.appendChild(el("p", {text: data.subdumps.length ?
    "Dumps below this folder are linked above." : "No passes were dumped here."}));
  document.body.setAttribute("data-dcp-ready", String(data.steps.length));
})();
</script>
</body>
</html>
"""
