"""README.md's code blocks run as written.

Every ```python block runs in a fresh interpreter in a temporary directory; every line of a
```bash block that is a ``dcp-compile ...`` or ``python3 -m ...`` command runs there too
(``dcp-compile`` as ``python3 -m dcp_compile.cli``, this source tree first on PYTHONPATH);
every ``$ command`` of a ```console block runs and must print the lines shown under it.
Tags in an HTML comment right above a fence change how a block runs:

    <!-- readme-test: name NAME -->    the block can be continued by another
    <!-- readme-test: after NAME -->   runs appended to block NAME, in the same interpreter
    <!-- readme-test: torchrun N -->   runs on N torchrun ranks (a multiprocess test)
    <!-- readme-test: world N -->      runs first, as written, in the N-rank torchrun world
                                       of tests/test_torchrun_world.py (one launch for both)

A ```bash line that is not run must match NOT_RUN, with the reason.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TIMEOUT = 300                      # seconds for one block or command (none needs a tenth)

# A ```bash command (without its comment), or the start of one when the key ends with a
# space or "/", -> why it is not run here.
NOT_RUN = {
    "bash scripts/setup.sh ": "the set-up commands at the top install packages; CI runs the "
                              "second one through .ci/run",
    "python3 benchmarks/": "benchmarks take minutes and assert nothing",
    "python3 -m benchmarks.bench_transform": "benchmarks take minutes and assert nothing",
    "torchrun ": "a 4-process world; tests/test_torchrun_world.py runs "
                 "dcp_compile.workers.decode on torchrun",
    "dcp-compile verify --tp 4 --dcp 2 --steps 2 --backend xla":
        "tests/test_xla.py::test_cli_verify_backend_xla runs this very command (XLA compiles "
        "take most of a minute on two shared cores)",
}


def _not_run(cmd: str, keys=NOT_RUN) -> bool:
    cmd = " ".join(cmd.split("#")[0].split())
    return any(cmd == key or (key[-1] in " /" and cmd.startswith(key)) for key in keys)

_TAG = re.compile(r"<!-- readme-test: (\w+) (.+?) -->")


@dataclass
class Block:
    lang: str
    code: str
    line: int                                  # README line of the opening fence
    tags: dict = field(default_factory=dict)


def readme_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.fullmatch(r"```(\w*)", lines[i])
        if not m:
            i += 1
            continue
        tags, j = {}, i - 1
        while j >= 0 and (t := _TAG.fullmatch(lines[j].strip())):
            tags[t.group(1)] = t.group(2)
            j -= 1
        end = lines.index("```", i + 1)
        blocks.append(Block(m.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1, tags))
        i = end + 1
    return blocks


def bash_commands(block: Block) -> list[str]:
    """The block's commands, continuation lines joined."""
    return [c.strip() for c in block.code.replace("\\\n", " ").splitlines() if c.strip()]


BLOCKS = readme_blocks(README.read_text())
NAMED = {b.tags["name"]: b for b in BLOCKS if "name" in b.tags}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _python_cases():
    cases = []
    for b in BLOCKS:
        if b.lang != "python" or "after" in b.tags or "world" in b.tags:
            continue                       # a continuation runs appended to the block it names;
                                           # a world block in tests/test_torchrun_world.py
        marks = [pytest.mark.multiprocess] if "torchrun" in b.tags else []
        cases.append(pytest.param(b, id=f"python-line{b.line}", marks=marks))
    return cases


def _command_cases():
    seen, cases = set(), []
    for b in BLOCKS:
        if b.lang != "bash":
            continue
        for cmd in bash_commands(b):
            runs = cmd.startswith(("dcp-compile ", "python3 -m "))
            key = " ".join(cmd.split("#")[0].split())     # the same command without comment
            if _not_run(cmd) or not runs or key in seen:
                continue
            seen.add(key)
            cases.append(pytest.param(cmd, id=f"line{b.line}:{key}"))
    return cases


def test_every_bash_line_runs_or_is_excluded_with_a_reason():
    unknown = [(b.line, c) for b in BLOCKS if b.lang == "bash" for c in bash_commands(b)
               if not c.startswith(("dcp-compile ", "python3 -m "))
               and not _not_run(c)]
    assert not unknown, f"README bash lines neither run nor in NOT_RUN: {unknown}"
    for key in NOT_RUN:                                 # no stale exclusions
        assert any(_not_run(c, [key]) for b in BLOCKS if b.lang == "bash"
                   for c in bash_commands(b)), f"NOT_RUN entry matches no README line: {key}"
    tags = {k for b in BLOCKS for k in b.tags}
    assert tags <= {"name", "after", "torchrun", "world"}, tags
    assert all(b.tags["after"] in NAMED for b in BLOCKS if "after" in b.tags)


@pytest.mark.parametrize("block", _python_cases())
def test_python_block_runs(block, tmp_path):
    code = block.code + "".join(o.code for o in BLOCKS if o.tags.get("after") ==
                                block.tags.get("name") and "name" in block.tags)
    script = tmp_path / "readme_block.py"
    script.write_text(code)
    if "torchrun" in block.tags:
        from dcp_compile.runtime.launch import run_torchrun
        run_torchrun(int(block.tags["torchrun"]), "readme_block", cwd=tmp_path,
                     timeout=TIMEOUT)                   # raises, naming the failing rank
        return
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"README line {block.line}:\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("command", _command_cases())
def test_bash_command_runs(command, tmp_path):
    if command.startswith("dcp-compile "):
        command = "python3 -m dcp_compile.cli " + command[len("dcp-compile "):]
    r = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"{command}\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}"


def _console_cases():
    cases = []
    for b in BLOCKS:
        if b.lang != "console":
            continue
        for part in re.split(r"^\$ ", b.code, flags=re.M)[1:]:
            cmd, _, shown = part.partition("\n")
            cases.append(pytest.param(cmd, shown, id=f"line{b.line}:{cmd}"))
    return cases


@pytest.mark.parametrize("command,shown", _console_cases())
def test_console_transcript_prints_what_it_shows(command, shown, tmp_path):
    argv = shlex.split(command)
    assert argv[0] == "dcp-compile", command
    r = subprocess.run([sys.executable, "-m", "dcp_compile.cli", *argv[1:]], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    printed = " ".join((r.stdout + r.stderr).split())
    assert " ".join(shown.split()) in printed, printed
