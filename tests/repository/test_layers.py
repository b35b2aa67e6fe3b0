"""The three layers are strict, lazy (function-level) imports included: the compiler's own
modules > dcp_compile.passes > dcp_compile.runtime (import-linter's `layers` contract in
pyproject.toml). The layers are folders at the repository's top level that install under the
`dcp_compile` namespace (setuptools package-dir), so the linter reads a copy of the tree laid
out as it installs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from importlinter.api import read_configuration

from suite_path import ROOT  # noqa: E402  (the repository root)
# Folder at the repository's top level -> where it installs inside the `dcp_compile` package.
MAPPED = {"passes": "passes", "runtime": "runtime"}
# import-linter's command line, run by this interpreter (it puts its cwd first on sys.path).
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
        "--no-cache", "--no-logo"]


def installed_layout(root: Path, into: Path) -> Path:
    """Copy the tree at ``root`` into ``into`` as it installs: dcp_compile/ with passes/ and
    runtime/ inside it (grimp walks the file system, not setuptools' package-dir)."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(root / "dcp_compile", into / "dcp_compile", ignore=ignore)
    for folder, name in MAPPED.items():
        shutil.copytree(root / folder, into / "dcp_compile" / name, ignore=ignore)
    shutil.copy(root / "pyproject.toml", into)
    return into


def lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(LINT, cwd=tree, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree)})


def contract() -> dict:
    config = read_configuration(str(ROOT / "pyproject.toml"))
    assert config["session_options"]["root_packages"] == ["dcp_compile"]
    (layers,) = [c for c in config["contracts_options"] if c["type"] == "layers"]
    assert not any(c.get("ignore_imports") for c in config["contracts_options"])
    return layers


def test_the_contract_is_the_three_layers_with_no_exceptions():
    layers = contract()
    assert layers["containers"] == ["dcp_compile"] and str(layers["exhaustive"]).lower() == "true"
    assert layers["layers"][1:] == ["passes", "runtime"]
    assert not layers.get("ignore_imports"), "the layers contract must ignore no import"
    # Every module and package of dcp_compile is in the top layer (exhaustive), by name.
    children = {p.stem for p in (ROOT / "dcp_compile").iterdir()
                if p.name != "__init__.py" and not p.name.startswith(".")
                and (p.suffix == ".py" or (p / "__init__.py").exists())}
    top = {name.strip() for name in layers["layers"][0].split(":")}
    assert top == children, (
        f"pyproject.toml's layers contract must name every module of dcp_compile in its top "
        f"layer: add {sorted(children - top)}, remove {sorted(top - children)}")


def test_no_import_runs_upward(tmp_path):
    out = lint(installed_layout(ROOT, tmp_path))
    assert out.returncode == 0, (
        "an import runs upward (compiler > passes > runtime; each line below names the "
        "importing module, the imported one and the line). Move the needed piece down, or "
        "pass it in from the upper layer:\n" + out.stdout + out.stderr)
    assert "1 kept, 0 broken" in out.stdout


def test_a_lazy_upward_import_breaks_the_contract(tmp_path):
    # The contract is not vacuous: a copy of the tree with one upward import inside a
    # function (the kind that used to hide a loop) is refused, naming that import.
    tree = installed_layout(ROOT, tmp_path)
    errors = tree / "dcp_compile" / "runtime" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _upward():\n"
                      "    from dcp_compile import driver\n    return driver\n")
    out = lint(tree)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "dcp_compile.runtime.errors -> dcp_compile.driver" in out.stdout, out.stdout


def test_the_layers_install_under_the_dcp_compile_namespace():
    # A fresh interpreter: `import dcp_compile` loads neither torch nor sympy, and the layers
    # are dcp_compile.runtime / dcp_compile.passes (no top-level `runtime` or `passes` of ours).
    code = """if True:
        import sys
        import dcp_compile
        assert "torch" not in sys.modules and "sympy" not in sys.modules, "import is heavy"
        import dcp_compile.runtime.kernels.ops, dcp_compile.passes.prove.theorems
        assert dcp_compile.runtime.kernels.ops.__spec__.name == "dcp_compile.runtime.kernels.ops"
        assert "runtime" not in sys.modules and "passes" not in sys.modules
        assert hasattr(__import__("torch").ops.dcp, "attention")
        print("ok")
    """
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True,
                         text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "ok", out.stdout + out.stderr


# Import cycles between the package's modules (lazy imports included): a strongly connected
# component of more than one module in grimp's import graph. Printed one per line.
CYCLES = r'''
import sys, grimp
graph = grimp.build_graph("dcp_compile", cache_dir=None)
edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
index, low, stack, on, out = {}, {}, [], set(), []
sys.setrecursionlimit(10000)
def visit(v):
    index[v] = low[v] = len(index); stack.append(v); on.add(v)
    for w in edges[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            out.append(sorted(comp))
for v in sorted(edges):
    if v not in index:
        visit(v)
for comp in out:
    print(" <-> ".join(comp))
'''


def import_cycles(tree: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CYCLES], cwd=tree, capture_output=True,
                         text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree)})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_no_import_cycle(tmp_path):
    cycles = import_cycles(installed_layout(ROOT, tmp_path))
    assert not cycles, (
        "modules import each other (lazy imports included); move the shared piece into a "
        "module both import:\n" + "\n".join(cycles))


def test_a_cycle_is_found(tmp_path):
    # Not vacuous: a lazy import back from a module its importer depends on is a cycle.
    tree = installed_layout(ROOT, tmp_path)
    names = tree / "dcp_compile" / "runtime" / "names.py"
    names.write_text(names.read_text() + "\n\ndef _back():\n"
                     "    from dcp_compile.runtime import topology\n    return topology\n")
    topology = (tree / "dcp_compile" / "runtime" / "topology.py").read_text()
    assert "from dcp_compile.runtime.names import" in topology, "the probe needs this edge"
    assert any("dcp_compile.runtime.topology" in c and "dcp_compile.runtime.names" in c
               for c in import_cycles(tree))
