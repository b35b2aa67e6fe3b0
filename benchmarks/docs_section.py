"""A benchmark's section of docs/benchmarks.md, rewritten from its own run (``--write-docs``).

Each section of the page sits between two markers that name it::

    <!-- benchmark: bench_prove -->
    ...written by the benchmark...
    <!-- benchmark-end: bench_prove -->

A section is named by its benchmark's file stem, plus a variant word when one benchmark
writes several (``bench_xla buckets``). ``recorded(name, args)`` tees what the benchmark
prints and, when the run asked for ``--write-docs``, replaces the section with the command,
the date, the machine's load and that output. tests/repository/test_docs_pages.py checks that every
section of the page has a benchmark that writes it.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
MARKER = re.compile(r"<!-- benchmark: ([\w-]+(?: [\w-]+)?) -->")


class DocsSectionError(Exception):
    """The page lacks a section a benchmark writes, or names it twice."""


def start_marker(name: str) -> str:
    return f"<!-- benchmark: {name} -->"


def end_marker(name: str) -> str:
    return f"<!-- benchmark-end: {name} -->"


def sections(text: str) -> list[str]:
    """The section names of a page, in order."""
    return MARKER.findall(text)


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with section ``name``'s content replaced by ``body``."""
    start, end = start_marker(name), end_marker(name)
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise DocsSectionError(
            f"docs/benchmarks.md needs exactly one {start} followed by one {end}: found "
            f"{text.count(start)} and {text.count(end)}. Add the two markers where the "
            f"section belongs.")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body.rstrip()}\n{end}{tail}"


def add_argument(parser) -> None:
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite this benchmark's section of docs/benchmarks.md with "
                             "this run's output")


def _load() -> str:
    try:
        return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def section_body(command: str, output: str, when: datetime.datetime | None = None) -> str:
    when = when or datetime.datetime.now(datetime.timezone.utc)
    return (f"`{command}` on {when:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, {_load()} "
            f"at the end of the run:\n\n```text\n{output.rstrip()}\n```")


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for stream in self.streams:
            stream.write(s)
        return len(s)

    def flush(self):
        for stream in self.streams:
            stream.flush()


@contextlib.contextmanager
def recorded(name: str, write: bool, argv: list[str] | None = None, page: Path = PAGE):
    """Run the body printing as usual; with ``write``, put what it printed into section
    ``name`` of ``page``. The page is checked for the section before the run, so a long
    benchmark never runs only to find nowhere to write."""
    if not write:
        yield
        return
    replace_section(page.read_text(), name, "")          # raises before the run, not after
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    command = " ".join(["python3", f"benchmarks/{script.name}", *argv[1:]])
    captured = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, captured)):
        yield
    page.write_text(replace_section(page.read_text(), name,
                                    section_body(command, captured.getvalue())))
    print(f"wrote section '{name}' of {page}", file=sys.stderr)
