"""Pass-by-pass dump: one entry per pass, diffs, pictures, history, certificate, index.html
(opened in headless Chromium), DCP_COMPILE_DUMP, `dcp-compile dump`, TORCH_TRACE artifacts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.fx import Graph, GraphModule

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.passes import dump as D
from dcp_compile.passes.manager import PassRecord
from dcp_compile.runtime.serving.engine import StepShapes

SMALL = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5)
from suite_path import ROOT  # noqa: E402  (the repository root)


@pytest.fixture(scope="module")
def decode_dump(tmp_path_factory):
    """transform(tp=4, dcp=2, decode) of a 1-layer demo model, dumped via DCP_COMPILE_DUMP."""
    root = tmp_path_factory.mktemp("dump")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(D.ENV_VAR, str(root))
        # check=False: these tests read the dump's files; the default check of the demo
        # model at tp=4/dcp=2 is test_transform_check's.
        program = dcp_compile.transform(demo_model(DemoConfig(num_layers=1)), tp=4, dcp=2,
                                        mode="decode", shapes=SMALL, check=False)
    return root, program


def test_env_var_dump_has_one_entry_per_pass_in_order(decode_dump):
    root, program = decode_dump
    out = root / "transform-decode"
    assert program.dump_dir == str(out)
    assert (root / "index.html").exists() and (out / "index.html").exists()
    assert "transform-decode/index.html" in (root / "index.html").read_text()
    for step in ("context", "decode"):
        manifest = json.loads((out / step / "manifest.json").read_text())
        records = [r for r in program.history if r.step == step]
        assert [e["pass"] for e in manifest["entries"]] == ["capture"] + [r.name for r in
                                                                          records]
        assert [e["index"] for e in manifest["entries"]] == list(range(len(records) + 1))
        for entry in manifest["entries"]:
            for kind in ("code", "dot", "json"):
                assert (out / step / entry["files"][kind]).stat().st_size > 0, (step, entry)


def test_each_diff_is_non_empty_exactly_for_passes_that_changed_the_graph(decode_dump):
    root, program = decode_dump
    out = root / "transform-decode"
    for step in ("context", "decode"):
        entries = json.loads((out / step / "manifest.json").read_text())["entries"]
        assert entries[0]["files"]["diff"] is None           # the captured graph: no diff
        records = [r for r in program.history if r.step == step]
        for entry, record in zip(entries[1:], records):
            diff = (out / step / entry["files"]["diff"]).read_text()
            assert bool(diff) == record.modified, (step, record.name, record.modified)
            if record.modified:
                assert diff.startswith(f"--- {step}/") and "\n@@ " in diff
        rewrite = (out / step / entries[-1]["files"]["diff"]).read_text()
        assert re.search(r"^\+.*dcp\.partial_attention", rewrite, re.M)


def test_history_entries_and_certificate_are_json(decode_dump):
    root, program = decode_dump
    out = root / "transform-decode" / "decode"
    entries = json.loads((out / "manifest.json").read_text())["entries"]
    records = [r for r in program.history if r.step == "decode"]
    for entry, record in zip(entries[1:], records):
        data = json.loads((out / entry["files"]["json"]).read_text())
        assert data["history"] == json.loads(json.dumps(record.to_json()))
        assert {k: len(v) for k, v in data["inserted_nodes"].items()} == record.inserted
    by_pass = {e["pass"]: json.loads((out / e["files"]["json"]).read_text())
               for e in entries}
    assert by_pass["canonicalize_attention"]["certificate"] is None   # not proven yet
    cert = by_pass["dcp_decode"]["certificate"]
    assert cert["ok"] and cert == program.certificate.to_json()
    assert json.loads((out / "certificate.json").read_text()) == cert
    assert by_pass["drop_export_asserts"]["history"]["matched"]["capture_seconds"] >= 0


def test_picture_highlights_the_inserted_nodes_by_kind(decode_dump):
    root, program = decode_dump
    out = root / "transform-decode" / "decode"
    entries = json.loads((out / "manifest.json").read_text())["entries"]
    last = entries[-1]
    dot = (out / last["files"]["dot"]).read_text()
    for kind in ("collective", "cache_write", "mask", "lse_combine", "attention"):
        colour = D.KIND_COLOURS[kind]
        filled = re.findall(rf'fillcolor="{colour}", penwidth=2.5', dot)
        assert len(filled) == last["inserted"][kind], kind
    if D.dot_executable():
        svg = (out / last["files"]["svg"]).read_text()
        assert "<svg" in svg and D.KIND_COLOURS["collective"] in svg
    else:
        assert last["files"]["svg"] is None


def _tiny_graph() -> GraphModule:
    g = Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.relu.default, (x,))
    g.output(y)
    return GraphModule(torch.nn.Module(), g)


def test_without_graphviz_the_picture_is_dot_text(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "dot_executable", lambda: None)
    gm = _tiny_graph()
    dump = D.PassDump(tmp_path, "decode", source="unit")
    dump(PassRecord("capture", "decode", True, {}, {}, 0.0), gm)
    g = gm.graph
    relu = next(n for n in g.nodes if n.op == "call_function")
    with g.inserting_after(relu):
        c = g.call_function(torch.ops.aten.neg.default, (relu,))
        helper = g.call_function(torch.ops.aten.abs.default, (c,))
    c.meta.update(dcp_kind="collective", dcp_pass="fake_pass")
    relu.replace_all_uses_with(helper, delete_user_cb=lambda u: u is not c)
    gm.recompile()
    dump(PassRecord("fake_pass", "decode", True, {}, {"collective": 1}, 0.0), gm)
    dump(PassRecord("no_op", "decode", False, {}, {}, 0.0), gm)
    page = dump.close()
    files = sorted(p.name for p in (tmp_path / "decode").iterdir())
    assert not [f for f in files if f.endswith(".svg")]
    dot = (tmp_path / "decode" / "01_fake_pass.dot").read_text()
    assert f'"{c.name}" [label=' in dot and D.KIND_COLOURS["collective"] in dot
    assert D.NEW_COLOUR in dot                       # the untagged helper node is new too
    assert (tmp_path / "decode" / "02_no_op.diff").read_text() == ""
    assert "No SVG: Graphviz `dot` was not on PATH" in page.read_text()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _open_in_chromium(page: Path, tmp_path: Path) -> tuple[str, Path]:
    """Load ``page`` in headless Chromium: (DOM after its scripts ran, screenshot path)."""
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium is not installed: scripts/setup.sh installs it with apt-get "
                    "when run as root, unless DCP_SETUP_APT=0")
    shot = tmp_path / f"{page.parent.name}.png"
    common = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
              "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--window-size=1400,1000",
              "--enable-logging=stderr", "--v=0"]
    url = page.resolve().as_uri()
    dom = subprocess.run(common + [f"--user-data-dir={tmp_path / 'profile1'}", "--dump-dom",
                                   url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert not re.search(r"<body[^>]*data-dcp-error", dom.stdout), dom.stdout[:2000]
    assert "Uncaught" not in dom.stderr, dom.stderr[-2000:]
    snap = subprocess.run(common + [f"--user-data-dir={tmp_path / 'profile2'}",
                                    f"--screenshot={shot}", url],
                          capture_output=True, text=True, timeout=120)
    assert snap.returncode == 0, snap.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    return dom.stdout, shot


def test_index_page_opens_in_headless_chromium(decode_dump, tmp_path):
    root, _ = decode_dump
    dom, _ = _open_in_chromium(root / "transform-decode" / "index.html", tmp_path)
    steps = json.loads((root / "transform-decode" / "decode" / "manifest.json").read_text())
    assert 'data-dcp-ready="2"' in dom                    # both steps' data rendered
    assert dom.count('class="card pass-card') == len(steps["entries"])
    assert "diff 09 \u2192 10" in dom or "diff 09 → 10" in dom     # the last pass is shown


def test_dot_text_page_opens_in_headless_chromium(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "dot_executable", lambda: None)
    dump = D.PassDump(tmp_path / "dump", "decode", source="unit")
    gm = _tiny_graph()
    dump(PassRecord("capture", "decode", True, {}, {}, 0.0), gm)
    dump(PassRecord("no_op", "decode", False, {}, {}, 0.0), gm)
    dom, _ = _open_in_chromium(dump.close(), tmp_path)
    assert 'data-dcp-ready="1"' in dom and "No SVG: Graphviz" in dom


def test_cli_dump_prefill_tp8_dcp4(tmp_path, capsys):
    from dcp_compile.cli import main
    out = tmp_path / "dump"
    assert main(["dump", "--tp", "8", "--dcp", "4", "--mode", "prefill", "--out", str(out),
                 "--layers", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["index"] == str(out / "index.html") and (out / "index.html").exists()
    passes = [e["pass"] for e in report["entries"]]
    assert passes[0] == "capture" and "shard_tensor_parallel" in passes
    assert {e["step"] for e in report["entries"]} == {"prefill"}
    for e in report["entries"][1:]:
        assert (e["diff_lines"] > 0) == e["modified"], e["pass"]


def test_torch_trace_gets_every_pass_as_artifacts(tmp_path):
    """With TORCH_TRACE and no dump dir, every pass is still a structured-trace artifact."""
    trace = tmp_path / "trace"
    code = ("import dcp_compile; from dcp_compile.models.demo import DemoConfig, demo_model; "
            "from dcp_compile.runtime.serving.engine import StepShapes; "
            "dcp_compile.transform(demo_model(DemoConfig(num_layers=1)), tp=2, dcp=1, "
            "shapes=StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5), "
            "check=False)")   # the trace artifacts only; the check is test_transform_check's
    env = dict(os.environ, TORCH_TRACE=str(trace), PYTHONPATH=str(ROOT))
    env.pop(D.ENV_VAR, None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = "".join(p.read_text() for p in trace.glob("*.log"))
    names = set(re.findall(r'"artifact": \{"name": "(dcp_[a-z]+_\d\d_\w+?)"', logs))
    for step, last in (("context", "10_dcp_context"), ("decode", "10_dcp_decode")):
        for suffix in ("graph", "diff", "dot", "history"):
            assert f"dcp_{step}_{last}_{suffix}" in names, sorted(names)
        assert f"dcp_{step}_00_capture_graph" in names
    assert not (tmp_path / "dcp_dump").exists()
    tlparse = shutil.which("tlparse")
    if tlparse:  # optional: the parser itself lists them
        out = tmp_path / "tl_out"
        run = subprocess.run([tlparse, str(next(trace.glob("*.log"))), "-o", str(out),
                              "--no-browser", "--overwrite"], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        listing = "".join(p.read_text(errors="replace") for p in out.rglob("*.html"))
        assert "dcp_decode_10_dcp_decode_graph" in listing


@pytest.mark.parametrize("torch_trace", [False, True])
def test_tracing_is_on_exactly_when_torch_trace_is_set(tmp_path, torch_trace):
    """In a fresh process torch's lazy trace handler is installed whether or not TORCH_TRACE
    is set (it removes itself at its first event when it is not): only TORCH_TRACE turns the
    source lines on, so a process's first transform does not record them for no one."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_TRACE"}
    if torch_trace:
        env["TORCH_TRACE"] = str(tmp_path / "trace")
    out = subprocess.run([sys.executable, "-c", "from dcp_compile.passes.dump import "
                          "tracing_enabled; print(tracing_enabled())"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(torch_trace)
