"""The full-run switches (tests/support/full_runs.py): one list, read one way, documented in
docs/testing.md."""

from __future__ import annotations

import pathlib
import re

import pytest

import full_runs
from full_runs import EVERYTHING, SWITCHES, full

from suite_path import ROOT  # noqa: E402  (the repository root)
# Environment variables tests read that are not full-run switches (counts, outputs, set-up).
NOT_SWITCHES = {"DCP_FUZZ_EXAMPLES", "DCP_FUZZ_CHECK", "DCP_FUZZ_STATS", "DCP_TEST_CPU",
                "DCP_SETUP_APT", "DCP_SETUP_CORPUS", "DCP_COMPILE_DUMP", "DCP_SETUP_VLLM",
                "DCP_VLLM_VENV"}


def test_the_testing_page_has_the_table_of_switches():
    page = (ROOT / "docs" / "testing.md").read_text()
    block = re.search(r"<!-- full-runs:start -->\n(.*?)\n<!-- full-runs:end -->", page, re.S)
    assert block, "docs/testing.md lacks the <!-- full-runs:start/end --> table"
    assert block.group(1).strip() == full_runs.docs_table(), \
        "docs/testing.md's table of switches differs from tests/support/full_runs.SWITCHES: paste the output " \
        "of `python3 tests/support/full_runs.py` between the markers"


def test_every_switch_names_a_test_module_that_reads_it():
    for name, (module, _) in SWITCHES.items():
        assert f'full("{name}")' in (ROOT / "tests" / module).read_text(), (name, module)


def test_no_test_reads_a_full_run_switch_around_full():
    """A module reading its switch from os.environ would not see DCP_FULL."""
    for path in (ROOT / "tests").rglob("*.py"):
        for name in re.findall(r"environ(?:\.get)?[(\[]\s*\"(DCP_[A-Z_]+)\"", path.read_text()):
            assert name in NOT_SWITCHES, f"{path.name} reads {name} from os.environ: use " \
                                         f"full_runs.full({name!r}) or list it in NOT_SWITCHES"


@pytest.mark.parametrize("env, expected", [
    ({}, False), ({"DCP_MOE_MATRIX": "0"}, False), ({"DCP_MOE_MATRIX": "1"}, True),
    ({"DCP_MOE_MATRIX": "all"}, True), ({EVERYTHING: "1"}, True), ({"DCP_CORPUS": "1"}, False)])
def test_a_switch_or_everything_turns_a_full_run_on(monkeypatch, env, expected):
    for name in [*SWITCHES, EVERYTHING]:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert full("DCP_MOE_MATRIX") is expected


def test_an_unknown_switch_is_an_error():
    with pytest.raises(KeyError, match="unknown full-run switch 'DCP_NOPE'.*add it"):
        full("DCP_NOPE")
