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

Entry 00 is the captured graph; entry N is the graph after the N-th pass of the step. This
module writes the files; :mod:`dcp_compile.passes.dump_render` renders the code, the pictures (nodes a
pass inserted coloured by kind) and the page, from the template ``passes/dump_index.html``.

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
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from torch.fx import GraphModule

from dcp_compile.runtime.errors import DCPConfigError
from dcp_compile.runtime.names import META_CERTIFICATE

from .dump_render import (DOT_TIMEOUT, KIND_COLOURS, MAX_RENDERED_NODES, NEW_COLOUR,
                          dot_executable, finish_svg_render, graph_to_dot, inserted_nodes,
                          readable_code, render_index, start_svg_render)
from .pipeline import PIPELINE, pass_names

ENV_VAR = "DCP_COMPILE_DUMP"
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


# ------------------------------------------------------------------------------------------
# One step kind's dump
# ------------------------------------------------------------------------------------------


class PassDump:
    """``on_pass(record, gm)`` callback of ``dcp_compile.passes.manager.run_passes`` for one step kind.

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
                running[0][0].wait(timeout=DOT_TIMEOUT)
            except subprocess.TimeoutExpired:
                running[0][0].kill()   # finish_svg_render reports it
        render = start_svg_render(dot_executable(), dot_file, svg_file)
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
    """Whether structured tracing (``TORCH_TRACE``) is on in this process.

    torch installs its lazy trace handler in every process; without ``TORCH_TRACE`` its
    ``root_dir`` is None and it removes itself at the first event it sees, so until then its
    presence says nothing (a process's first transform would record source lines for no one)."""
    from torch._logging._internal import LazyTraceHandler, trace_log
    return any(not (isinstance(h, LazyTraceHandler) and h.root_dir is None and h.stream is None)
               for h in trace_log.handlers)


def pass_dump(root: str | Path | None, step: str, *, source: str = "transform",
              config: Any = None) -> PassDump | None:
    """The ``on_pass`` callback for one step: files under ``root`` (if given) and trace
    artifacts when ``TORCH_TRACE`` is set; None when neither is wanted."""
    if not dump_wanted(root):
        return None
    return PassDump(root, step, source=source, config=config)


def dump_wanted(root: str | Path | None) -> bool:
    """Whether anyone will see the passes' graphs: files under ``root``, or ``TORCH_TRACE``."""
    return root is not None or tracing_enabled()


def dump_root_for(source: str, mode: str, explicit: str | Path | None = None) -> Path | None:
    """Where a dump goes: ``explicit`` if given, else ``$DCP_COMPILE_DUMP/<source>-<mode>``."""
    if explicit is not None:
        return Path(explicit)
    env = env_dump_root()
    return env / f"{source}-{mode}" if env is not None else None


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
# index.html: the steps read back, the page written
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


# What callers import from here; the rendering names live in dcp_compile.passes.dump_render.
__all__ = ["ENV_VAR", "LEDGER", "OwnedDir", "PassDump", "pass_dump", "dump_root_for",
           "env_dump_root", "tracing_enabled", "dump_wanted", "load_steps", "write_index",
           "dot_executable", "KIND_COLOURS", "NEW_COLOUR"]
