"""The module tree of docs/architecture.md ("Packages and layers") names every module of the three
packages, no more (scripts/module_tree.py prints it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from suite_path import ROOT  # noqa: E402  (the repository root)
sys.path.insert(0, str(ROOT / "scripts"))

import module_tree  # noqa: E402


def test_the_architecture_page_tree_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## The module tree: module", 1)[1].split("```text\n", 1)[1]
    listed = [re.split(r" — ", line, maxsplit=1)[0]
              for line in section.split("```", 1)[0].splitlines() if line.strip()]
    assert listed == [name for name, _ in module_tree.modules()]


def test_no_module_is_over_600_lines():
    long = {p.relative_to(ROOT).as_posix(): n
            for folder in ("dcp_compile", "passes", "runtime", "tests", "benchmarks")
            for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
