"""The suite's import path, defined once: the repository root, tests/support and every room.

Test modules and helpers import each other by plain module name (``from helpers import
prompts_of``, ``from test_moe import MATRIX``), as pytest's default ("prepend") import mode
imports a test file that is in no package. ``tests/conftest.py`` calls :func:`install` before
collection; a test that re-runs itself (or a support module) as a child script calls it too:

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
    from tests.support.suite_path import install; install()

Plain names need unique basenames across the rooms: :func:`duplicate_basenames` finds the
clashes, and conftest refuses to collect while there is one.
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
SUPPORT = TESTS / "support"


def rooms() -> list[Path]:
    """Every folder of tests/ that holds Python modules, tests/support first."""
    found = sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("*.py")))
    return sorted(found, key=lambda p: p != SUPPORT)


def modules() -> list[Path]:
    """Every Python module under tests/ (conftest.py included)."""
    return sorted(TESTS.rglob("*.py"))


def duplicate_basenames(paths: list[Path] | None = None) -> dict[str, list[Path]]:
    """Basename -> its paths, for each basename that more than one module of tests/ has."""
    by_name: dict[str, list[Path]] = {}
    for path in modules() if paths is None else paths:
        by_name.setdefault(path.name, []).append(path)
    return {name: found for name, found in by_name.items() if len(found) > 1}


class DuplicateTestModule(Exception):
    """Two modules of tests/ share a basename: plain-name imports would mix them up."""


def refuse_duplicate_basenames(paths: list[Path] | None = None) -> None:
    """Raise :class:`DuplicateTestModule` naming every clash (conftest calls it before
    collection)."""
    clashes = duplicate_basenames(paths)
    if clashes:
        listed = "; ".join(f"{name}: {', '.join(str(p.relative_to(TESTS)) for p in found)}"
                           for name, found in sorted(clashes.items()))
        raise DuplicateTestModule(
            f"modules of tests/ share a basename (tests import each other by plain module "
            f"name, so one would shadow the other): {listed}. Rename one of each pair.")


def install() -> None:
    """Put the repository root, tests/support and every room on sys.path (each once, in front:
    this worktree's modules before any installed copy)."""
    for path in reversed([ROOT, *rooms()]):
        if str(path) in sys.path:
            sys.path.remove(str(path))
        sys.path.insert(0, str(path))
