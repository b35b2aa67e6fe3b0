"""The README is a front door and docs/ holds the rest: the README's length, every page
reachable from it, every relative link landing on a page and a heading that exist, and
every benchmark section of docs/benchmarks.md written by a benchmark
(benchmarks/docs_section.py). The pages' code blocks run in tests/e2e/test_readme.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from test_readme import README, ROOT, doc_pages

sys.path.insert(0, str(ROOT / "benchmarks"))
import docs_section  # noqa: E402

MAX_README_LINES = 400
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def relative_links(path: Path) -> list[tuple[str, Path, str]]:
    """(link, target page, anchor) of every link of a page that is not a URL."""
    out = []
    for link in _LINK.findall(_FENCE.sub("", path.read_text())):
        if re.match(r"\w+://", link) or link.startswith("mailto:"):
            continue
        file, _, anchor = link.partition("#")
        out.append((link, (path.parent / file).resolve() if file else path, anchor))
    return out


def test_the_readme_is_a_front_door():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines, more than {MAX_README_LINES}: move the detail to its page "
        f"under docs/ and link it from the README's 'Where to read on'.")


def test_every_page_is_linked_from_the_readme():
    linked = {target for _, target, _ in relative_links(README)}
    missing = [p.name for p in doc_pages()[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_land_on_a_page_and_heading(page):
    broken = []
    for link, target, anchor in relative_links(page):
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(ROOT)}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading with anchor #{anchor} in {target.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_a_broken_anchor_is_found(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Title: one `two`\n\n[ok](#title-one-two) [bad](#title-two) [f](b.md)\n")
    links = relative_links(page)
    assert [a for _, _, a in links if a and a not in anchors(page)] == ["title-two"]
    assert not links[2][1].exists()


def _benchmark_writes(name: str) -> bool:
    """Does a benchmark write section ``name`` (stem, then an optional variant word)?"""
    stem, _, variant = name.partition(" ")
    path = ROOT / "benchmarks" / f"{stem}.py"
    if not path.exists():
        return False
    source = path.read_text()
    return ("docs_section.recorded(" in source and "docs_section.add_argument(ap)" in source
            and (f'"{name}"' in source if variant else f'"{stem}"' in source))


def test_every_benchmark_section_has_a_benchmark_that_writes_it():
    names = docs_section.sections((ROOT / "docs" / "benchmarks.md").read_text())
    assert names, "docs/benchmarks.md has no benchmark sections"
    assert len(names) == len(set(names)), f"a section is named twice: {names}"
    orphans = [n for n in names if not _benchmark_writes(n)]
    assert not orphans, f"sections no benchmark writes (benchmarks/<name>.py with --write-docs): {orphans}"
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for name in names:                     # each section is closed, so a rewrite keeps the rest
        docs_section.replace_section(text, name, "")


def test_every_benchmark_writes_a_section_of_the_page():
    names = set(docs_section.sections((ROOT / "docs" / "benchmarks.md").read_text()))
    missing = [p.name for p in sorted((ROOT / "benchmarks").glob("bench_*.py"))
               if p.stem not in {n.partition(" ")[0] for n in names}]
    assert not missing, f"benchmarks without a section in docs/benchmarks.md: {missing}"


def test_write_docs_rewrites_only_its_section(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# B\n\n<!-- benchmark: bench_a -->\nold one\n<!-- benchmark-end: bench_a -->\n"
                    "between\n<!-- benchmark: bench_a x -->\nold ax\n"
                    "<!-- benchmark-end: bench_a x -->\n")
    with docs_section.recorded("bench_a", True, ["benchmarks/bench_a.py", "--n", "2"], page):
        print("| n | s |\n|---|---|\n| 2 | 0.1 |")
    text = page.read_text()
    assert "old one" not in text and "| 2 | 0.1 |" in text and "old ax" in text
    assert "`python3 benchmarks/bench_a.py --n 2` on " in text and "between" in text
    assert docs_section.sections(text) == ["bench_a", "bench_a x"]


def test_write_docs_refuses_a_page_without_the_section_before_running(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# B\n")
    ran = []
    with pytest.raises(docs_section.DocsSectionError, match="<!-- benchmark: bench_b -->"):
        with docs_section.recorded("bench_b", True, ["bench_b.py"], page):
            ran.append(1)
    assert not ran and page.read_text() == "# B\n"
