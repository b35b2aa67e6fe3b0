"""The three packages are layered strictly, lazy (function-level) imports included:
dcp_compile > passes > runtime (import-linter's `layers` contract in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from importlinter.api import read_configuration

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["dcp_compile", "passes", "runtime"]
# import-linter's command line, run by this interpreter (it puts its cwd first on sys.path).
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
        "--no-cache", "--no-logo"]


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(LINT, cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def contracts() -> list[dict]:
    config = read_configuration(str(ROOT / "pyproject.toml"))
    assert config["session_options"]["root_packages"] == LAYERS
    return config["contracts_options"]


def test_the_contract_is_the_three_layers_with_no_exceptions():
    (layers,) = [c for c in contracts() if c["type"] == "layers"]
    assert layers["layers"] == LAYERS
    assert not layers.get("ignore_imports"), "the layers contract must ignore no import"
    assert not any(c.get("ignore_imports") for c in contracts())


def test_no_import_runs_upward():
    out = lint(ROOT)
    assert out.returncode == 0, (
        "an import runs upward (dcp_compile > passes > runtime; each line below names the "
        "importing module, the imported one and the line). Move the needed piece down, or "
        "pass it in from the upper layer:\n" + out.stdout + out.stderr)
    assert "1 kept, 0 broken" in out.stdout


def test_a_lazy_upward_import_breaks_the_contract(tmp_path):
    # The contract is not vacuous: a copy of the tree with one upward import inside a
    # function (the kind that used to hide a loop) is refused, naming that import.
    for name in LAYERS:
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    errors = tmp_path / "runtime" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _upward():\n"
                      "    from dcp_compile import pipeline\n    return pipeline\n")
    out = lint(tmp_path)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "runtime.errors -> dcp_compile.pipeline" in out.stdout, out.stdout


def test_old_module_paths_import_the_moved_modules_on_first_use():
    # A fresh interpreter: `import dcp_compile` loads neither torch nor sympy; each old path
    # then imports the moved module itself (same classes, same registered ops).
    code = """if True:
        import sys
        import dcp_compile
        assert "torch" not in sys.modules and "sympy" not in sys.modules, "import is heavy"
        import dcp_compile.ops
        from dcp_compile.errors import DCPError
        from dcp_compile import config, layout, proofs
        import passes.proofs, runtime.config, runtime.errors, runtime.layout, runtime.ops
        assert dcp_compile.ops is runtime.ops and DCPError is runtime.errors.DCPError
        assert (config, layout, proofs) == (runtime.config, runtime.layout, passes.proofs)
        assert runtime.ops.__spec__.name == "runtime.ops"
        assert hasattr(__import__("torch").ops.dcp, "attention")
        print("ok")
    """
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={"PATH": "/usr/bin:/bin",
                                                      "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "ok", out.stdout + out.stderr
