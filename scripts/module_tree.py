"""Print the package tree, one line per module: its import path and the first line of its
docstring (docs/architecture.md's "Packages and layers" lists it; tests/repository/test_module_tree.py keeps the
two in step). Run from the repository root: ``python3 scripts/module_tree.py``."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folder -> import path (the layers install under dcp_compile: pyproject's package-dir).
FOLDERS = {"dcp_compile": "dcp_compile", "passes": "dcp_compile.passes",
           "runtime": "dcp_compile.runtime"}


def modules() -> list[tuple[str, str]]:
    """(import path, first docstring line) of every module, in tree order."""
    out = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if name.startswith("dcp_compile.passes") and folder == "dcp_compile":
                continue
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            out.append((name, doc.strip().splitlines()[0] if doc.strip() else ""))
    return out


def main() -> int:
    for name, line in modules():
        print(f"{name} — {line}" if line else name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
