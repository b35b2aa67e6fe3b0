"""The suite's own layout (tests/support/suite_path.py, tests/conftest.py): tests in rooms by
job, the modules they share in support/, no two modules with one basename, and every path or
module name of a test file written anywhere in the repository names a file that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import suite_path
from suite_path import ROOT, SUPPORT, TESTS

MAX_TOP_FILES = 30          # issue #34: at most 30 files at the top of tests/
# Where a path ("tests/runtime/test_world.py") or a module name ("tests.support.world_worker",
# run with python -m) of a test file may be written.
REFERRING = ["README.md", "pyproject.toml", "dcp_compile", "passes", "runtime", "benchmarks",
             "scripts", "tests", ".ci", "docs"]
PATH = re.compile(r"(?<![\w/.-])tests/\w+(?:/\w+)*")
MODULE = re.compile(r"(?<![\w/.-])tests(?:\.\w+)+")


def _exists(ref: str) -> bool:
    """A path (with or without .py), or a dotted module name, perhaps followed by attributes
    (``tests.support.full_runs.SWITCHES``), that names a file or folder of the repository."""
    if "/" in ref:
        return (ROOT / ref).exists() or (ROOT / f"{ref}.py").exists()
    parts = ref.split(".")
    return any((ROOT.joinpath(*parts[:i]).with_suffix(".py")).is_file()
               or ROOT.joinpath(*parts[:i]).is_dir() for i in range(len(parts), 1, -1))


def test_top_of_tests_holds_conftest_and_rooms_only():
    files = [p.name for p in TESTS.iterdir() if p.is_file()]
    assert len(files) <= MAX_TOP_FILES, files
    assert not [f for f in files if f.endswith(".py") and f != "conftest.py"], \
        f"modules at the top of tests/: {files}. Put a test in its room, a shared module in support/."


def test_every_test_module_is_in_a_room_and_support_has_none():
    assert not list(SUPPORT.glob("test_*.py")), "support/ holds the modules tests share, no tests"
    for path in suite_path.modules():
        if path.name.startswith("test_"):
            assert path.parent.parent == TESTS and path.parent != SUPPORT, path


def test_conftest_put_support_and_every_room_on_the_path():
    rooms = suite_path.rooms()
    assert rooms[0] == SUPPORT
    assert {p.name for p in rooms} >= {"support", "passes", "runtime", "frontends", "lowering",
                                       "transfer", "e2e", "corpora", "repository"}
    assert all(str(p) in sys.path for p in rooms)


def test_the_tree_has_no_two_modules_with_one_basename():
    assert suite_path.duplicate_basenames() == {}


def test_a_duplicate_basename_is_refused_naming_both_paths():
    paths = [TESTS / "passes" / "test_x.py", TESTS / "runtime" / "test_x.py",
             TESTS / "support" / "helpers.py"]
    with pytest.raises(suite_path.DuplicateTestModule,
                       match=r"test_x\.py: passes/test_x\.py, runtime/test_x\.py\. Rename"):
        suite_path.refuse_duplicate_basenames(paths)
    suite_path.refuse_duplicate_basenames(paths[1:])     # one of each: accepted


def test_pytest_stops_before_collection_on_a_duplicate(tmp_path):
    """conftest refuses the clash as a usage error (exit 4) before any test is collected: run
    on a copy of the suite's conftest and import path with two rooms sharing a basename."""
    tests = tmp_path / "tests"
    (tests / "support").mkdir(parents=True)
    (tests / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tests / "support" / "suite_path.py").write_text((SUPPORT / "suite_path.py").read_text())
    for room in ("passes", "runtime"):
        (tests / room).mkdir()
        (tests / room / "test_twin.py").write_text("def test_nothing():\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "tests"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "test_twin.py: passes/test_twin.py, runtime/test_twin.py" in proc.stderr, \
        proc.stderr[-2000:]


def _referring_files():
    for name in REFERRING:
        top = ROOT / name
        if top.is_file():
            yield top
        elif top.is_dir():
            yield from (p for p in top.rglob("*") if p.is_file() and p.suffix in
                        {".py", ".md", ".toml", ".sh", ".txt", ".html", ""})


def stale_references(text: str) -> list[str]:
    return [ref for ref in PATH.findall(text) + MODULE.findall(text) if not _exists(ref)]


def test_every_tests_path_and_module_name_written_in_the_repository_exists():
    here = Path(__file__).resolve()     # its examples of stale references are deliberate
    missing = [f"{path.relative_to(ROOT)}: {ref}" for path in _referring_files() if path != here
               for ref in stale_references(path.read_text(errors="replace"))]
    assert not missing, "paths or module names of tests/ that name no file (moved? rewrite " \
                        "the reference to the file's room: tests/<room>/...):\n" + "\n".join(missing)


@pytest.mark.parametrize("text, stale", [
    ("see tests/test_world.py", ["tests/test_world"]),
    ("python -m tests.world_worker", ["tests.world_worker"]),
    ("`tests/runtime/test_world.py::test_x`, tests/support/full_runs.SWITCHES", []),
    ("python -m tests.support.world_worker; tests.support.full_runs.SWITCHES", []),
    ("tests/support/no_such_helper.py", ["tests/support/no_such_helper"]),
    ("docs/incoming/tests.md, benchmarks/tests/x.py", []),
], ids=["old-flat-path", "old-flat-module", "paths", "modules", "missing-support-module",
        "not-ours"])
def test_the_reference_check_tells_stale_from_current(text, stale):
    assert stale_references(text) == stale
