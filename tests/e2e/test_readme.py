"""The code blocks of README.md and of every docs/*.md page run as written.

The pages are README.md and docs/*.md (not recursive: a folder under docs/ holds no
pages); a block's test is named by its page and its name tag, or its page and line.

Every ```python block runs as a script in a temporary directory; every line of a ```bash
block that is a ``dcp-compile ...`` or ``python3 -m ...`` command runs there too
(``dcp-compile`` as ``python3 -m dcp_compile.cli``, this source tree first on PYTHONPATH);
every ``$ command`` of a ```console block runs and must print the lines shown under it.
They all run, in page order (README first), in one fresh interpreter
(tests/support/readme_runner.py: each as its own process would, in a directory of its own; a process
per block paid ~3 CPU-s of start-up and imports for every block), except a command with
shell syntax (run by bash) and a torchrun block; each test reads its block's result.
Tags in an HTML comment right above a fence change how a block runs:

    <!-- readme-test: name NAME -->    the block can be continued by another
    <!-- readme-test: after NAME -->   runs appended to block NAME, in the same interpreter
    <!-- readme-test: torchrun N -->   runs on N torchrun ranks (a multiprocess test)
    <!-- readme-test: world N -->      runs first, as written, in the N-rank torchrun world
                                       of tests/e2e/test_torchrun_world.py (one launch for both)
    <!-- readme-test: env vllm -->     runs as its own script in the vLLM environment
                                       (.venv-vllm, tests/support/vllm_env.py: vLLM pins
                                       another transformers than the suite's)

A ```bash line that is not run must match NOT_RUN, with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from suite_path import ROOT  # noqa: E402  (the repository root)
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def doc_pages() -> list[Path]:
    """README.md, then docs/*.md by name (folders under docs/ are not pages)."""
    return [README, *sorted(DOCS.glob("*.md"))]
TIMEOUT = 300                      # seconds for one block or command (none needs a tenth)

# A ```bash command (without its comment), or the start of one when the key ends with a
# space or "/", -> why it is not run here.
NOT_RUN = {
    "bash scripts/setup.sh ": "the set-up commands at the top install packages; CI runs the "
                              "second one through .ci/run",
    "python3 benchmarks/": "benchmarks take minutes and assert nothing",
    "python3 -m benchmarks.bench_transform": "benchmarks take minutes and assert nothing",
    "torchrun ": "a 4-process world; tests/e2e/test_torchrun_world.py runs "
                 "dcp_compile.workers.decode on torchrun",
    "dcp-compile verify --tp 4 --dcp 2 --steps 2 --backend xla":
        "tests/lowering/test_xla.py::test_cli_verify_backend_xla runs this very command (XLA compiles "
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
    line: int                                  # page line of the opening fence
    tags: dict = field(default_factory=dict)
    page: str = "README.md"                    # the page, relative to the repository

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"

    @property
    def test_name(self) -> str:
        """Stable while the page is edited around the block when the block has a name."""
        return f"{self.page}:{self.tags.get('name') or f'line{self.line}'}"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
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
        blocks.append(Block(m.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1, tags, page))
        i = end + 1
    return blocks


def bash_commands(block: Block) -> list[str]:
    """The block's commands, continuation lines joined."""
    return [c.strip() for c in block.code.replace("\\\n", " ").splitlines() if c.strip()]


BLOCKS = [b for path in doc_pages()
          for b in readme_blocks(path.read_text(), path.relative_to(ROOT).as_posix())]
NAMED = {b.tags["name"]: b for b in BLOCKS if "name" in b.tags}   # names span every page


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
                                           # a world block in tests/e2e/test_torchrun_world.py
        cases.append(pytest.param(b, id=f"python-{b.test_name}",
                                  marks=[pytest.mark.multiprocess]))
    return cases


def _block_code(block: Block) -> str:
    """The block, with the blocks that continue it (``after NAME``) appended."""
    return block.code + "".join(o.code for o in BLOCKS if o.tags.get("after") ==
                                block.tags.get("name") and "name" in block.tags)


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
            cases.append(pytest.param(cmd, id=f"{b.page}:line{b.line}:{key}",
                                      marks=[pytest.mark.multiprocess]))
    return cases


def test_every_bash_line_runs_or_is_excluded_with_a_reason():
    unknown = [(b.where, c) for b in BLOCKS if b.lang == "bash" for c in bash_commands(b)
               if not c.startswith(("dcp-compile ", "python3 -m "))
               and not _not_run(c)]
    assert not unknown, f"bash lines neither run nor in NOT_RUN: {unknown}"
    for key in NOT_RUN:                                 # no stale exclusions
        assert any(_not_run(c, [key]) for b in BLOCKS if b.lang == "bash"
                   for c in bash_commands(b)), f"NOT_RUN entry matches no line of a page: {key}"
    tags = {k for b in BLOCKS for k in b.tags}
    assert tags <= {"name", "after", "torchrun", "world", "env"}, tags
    assert all(b.tags["env"] == "vllm" for b in BLOCKS if "env" in b.tags)
    assert all(b.tags["after"] in NAMED for b in BLOCKS if "after" in b.tags)
    names = [b.tags["name"] for b in BLOCKS if "name" in b.tags]
    assert len(names) == len(set(names)), f"a block name is used twice: {sorted(names)}"


def _console_cases():
    cases = []
    for b in BLOCKS:
        if b.lang != "console":
            continue
        for part in re.split(r"^\$ ", b.code, flags=re.M)[1:]:
            cmd, _, shown = part.partition("\n")
            cases.append(pytest.param(cmd, shown, id=f"{b.page}:line{b.line}:{cmd}",
                                      marks=[pytest.mark.multiprocess]))
    return cases


_SHELL = set("|&;<>()$`\\\"'*?[]{}~")   # a command with any of these runs through bash


def module_argv(command: str) -> list[str] | None:
    """``[MODULE, *ARGS]`` of a ``dcp-compile ...`` (= ``python3 -m dcp_compile.cli ...``) or
    ``python3 -m MODULE ...`` command without shell syntax (its comment dropped), else None."""
    command = command.split("#")[0]
    if _SHELL & set(command):
        return None
    argv = command.split()
    if argv[0] == "dcp-compile":
        return ["dcp_compile.cli", *argv[1:]]
    if argv[:2] == ["python3", "-m"] and len(argv) > 2:
        return argv[2:]
    return None


def _job(test: str, params: dict) -> dict | None:
    """The job of tests/support/readme_runner.py that runs one case, or None (it runs on its own)."""
    if test == "test_python_block_runs":
        block = params["block"]
        return None if "torchrun" in block.tags or "env" in block.tags \
            else {"code": _block_code(block)}
    argv = module_argv(params["command"])
    if test == "test_console_transcript_prints_what_it_shows":
        assert argv and argv[0] == "dcp_compile.cli", params["command"]
    return None if argv is None else {"module": argv[0], "args": argv[1:]}


# Two jobs of the runner's own, run after the README's: the first changes what a process
# owns (environment, default dtype, a file in its directory) and exits 3; the second must
# see none of it, and fails with a NameError.
PROBES = {
    "probe-changes": "import os, sys, torch\nos.environ['DCP_README_PROBE'] = '1'\n"
                     "torch.set_default_dtype(torch.float64)\nopen('mine.txt', 'w').close()\n"
                     "sys.exit(3)\n",
    "probe-sees": "import os, torch\nprint('env', os.environ.get('DCP_README_PROBE'), "
                  "torch.get_default_dtype(), sorted(os.listdir('.')))\nundefined_name\n",
}


@pytest.fixture(scope="module")
def shared_interpreter(request, tmp_path_factory):
    """Run every selected case that tests/support/readme_runner.py can run, in one interpreter, in
    page order, each in a directory of its own, then PROBES; {"test[case id]": result}.
    (Every case is marked multiprocess: tests/conftest.py keeps a module's multiprocess
    tests on one xdist worker, so the interpreter starts once.)"""
    jobs = []
    for item in request.session.items:
        if item.module is not request.module or not hasattr(item, "callspec"):
            continue
        job = _job(item.originalname, item.callspec.params)
        if job is None:
            continue
        cwd = tmp_path_factory.mktemp("readme_job")
        job.update(id=f"{item.originalname}[{item.callspec.id}]", cwd=str(cwd))
        if "code" in job:
            (cwd / "readme_block.py").write_text(job.pop("code"))
            job["script"] = str(cwd / "readme_block.py")
        jobs.append(job)
    for name, code in PROBES.items():
        cwd = tmp_path_factory.mktemp("readme_job")
        (cwd / "readme_block.py").write_text(code)
        jobs.append({"id": name, "cwd": str(cwd), "script": str(cwd / "readme_block.py")})
    tmp = tmp_path_factory.mktemp("readme_runner")
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "readme_runner.py"),
                           str(tmp / "jobs.json"), str(tmp / "results.jsonl"), "--timeout",
                           str(TIMEOUT)], cwd=tmp, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT * max(len(jobs), 1))
    path = tmp / "results.jsonl"
    results = {r["id"]: r for r in map(json.loads, path.read_text().splitlines())} \
        if path.exists() else {}
    return {"results": results, "runner": proc}


def _shared_result(request, shared_interpreter, key: str | None = None) -> dict:
    key = key or f"{request.node.originalname}[{request.node.callspec.id}]"
    result = shared_interpreter["results"].get(key)
    if result is None:
        runner = shared_interpreter["runner"]
        pytest.fail(f"tests/support/readme_runner.py did not finish {key} (exit "
                    f"{runner.returncode}):\n{runner.stderr[-4000:]}")
    return result


@pytest.mark.parametrize("block", _python_cases())
def test_python_block_runs(block, tmp_path, request, shared_interpreter):
    if "torchrun" in block.tags:
        from dcp_compile.runtime.distributed.launch import run_torchrun
        (tmp_path / "readme_block.py").write_text(_block_code(block))
        run_torchrun(int(block.tags["torchrun"]), "readme_block", cwd=tmp_path,
                     timeout=TIMEOUT)                   # raises, naming the failing rank
        return
    if "env" in block.tags:                             # the vLLM environment's python
        from vllm_env import child_env, vllm_python
        (tmp_path / "readme_block.py").write_text(_block_code(block))
        r = subprocess.run([str(vllm_python()), "readme_block.py"], cwd=tmp_path,
                           env=child_env(), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{block.where}:\n{r.stderr[-3000:]}"
        return
    r = _shared_result(request, shared_interpreter)
    assert r["returncode"] == 0, f"{block.where}:\n{r['output'][-3000:]}"


@pytest.mark.parametrize("command", _command_cases())
def test_bash_command_runs(command, tmp_path, request, shared_interpreter):
    if module_argv(command) is not None:
        r = _shared_result(request, shared_interpreter)
        assert r["returncode"] == 0, f"{command}\n{r['output'][-3000:]}"
        return
    if command.startswith("dcp-compile "):
        command = "python3 -m dcp_compile.cli " + command[len("dcp-compile "):]
    r = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"{command}\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("command,shown", _console_cases())
def test_console_transcript_prints_what_it_shows(command, shown, request, shared_interpreter):
    assert shlex.split(command)[0] == "dcp-compile", command
    printed = " ".join(_shared_result(request, shared_interpreter)["output"].split())
    assert " ".join(shown.split()) in printed, printed


@pytest.mark.multiprocess
def test_shared_interpreter_runs_each_job_as_its_own_process(request, shared_interpreter):
    changes = _shared_result(request, shared_interpreter, "probe-changes")
    assert changes["returncode"] == 3, changes["output"]
    sees = _shared_result(request, shared_interpreter, "probe-sees")
    assert sees["returncode"] == 1 and "NameError: name 'undefined_name'" in sees["output"]
    assert "env None torch.float32 ['readme_block.py']" in sees["output"], sees["output"]
