"""scripts/setup.sh says what it installs with apt before installing it, and DCP_SETUP_APT=0
opts out; the corpus and the vLLM environment likewise. Run against stub commands (python3,
apt-get, id) on a PATH without chromium or dot, so nothing is installed (the apt and corpus
cases with DCP_SETUP_VLLM=0; the vLLM cases in a temporary DCP_VLLM_VENV)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from suite_path import ROOT  # noqa: E402  (the repository root)
BASH = shutil.which("bash")


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)


def _run(tmp_path, *, uid=0, apt=None):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("dirname", "mktemp", "rm", "tail", "cat"):
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(shutil.which(tool))
    _stub(bin_dir, "python3", 'echo "PYTHON $*" >&2')          # torch "present", pip no-op
    # apt-get's output goes to a log the script deletes: the stub appends to the same file as
    # the script's stderr, so the transcript keeps the order of messages and calls.
    transcript = tmp_path / "transcript"
    transcript.write_text("")
    _stub(bin_dir, "apt-get", f'echo "APT-GET $*" >>{transcript}')
    _stub(bin_dir, "id", f"echo {uid}")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "DCP_SETUP_VLLM": "0"}
    if apt is not None:
        env["DCP_SETUP_APT"] = apt
    with open(transcript, "a") as err:
        r = subprocess.run([BASH, str(ROOT / "scripts" / "setup.sh")], env=env,
                           stdout=subprocess.PIPE, stderr=err, text=True, timeout=60)
    r.stderr = transcript.read_text()
    return r


def test_default_says_what_and_why_before_apt_runs(tmp_path):
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    announce = r.stderr.index("installing with apt-get (set DCP_SETUP_APT=0 to skip): "
                              "chromium graphviz")
    assert "chromium: headless browser: tests/passes/test_dump.py" in r.stderr
    assert "graphviz: Graphviz dot draws the dump's SVG pictures" in r.stderr
    assert announce < r.stderr.index("APT-GET update")
    assert "APT-GET install -y -qq chromium graphviz" in r.stderr
    assert "-e .[test,hf,nixl,stablehlo,xla]" in r.stderr      # pip still runs


def test_opt_out_never_runs_apt(tmp_path):
    r = _run(tmp_path, apt="0")
    assert r.returncode == 0, r.stderr
    assert "APT-GET" not in r.stderr
    assert "not installing with apt (DCP_SETUP_APT=0): chromium graphviz" in r.stderr
    assert "-e .[test,hf,nixl,stablehlo,xla]" in r.stderr


def test_not_root_prints_the_command_instead(tmp_path):
    r = _run(tmp_path, uid=1000)
    assert r.returncode == 0, r.stderr
    assert "APT-GET" not in r.stderr
    assert "sudo apt-get install -y chromium graphviz" in r.stderr


@pytest.mark.parametrize("value", ["yes", "2", "false"])
def test_bad_value_is_refused_before_apt(tmp_path, value):
    r = _run(tmp_path, apt=value)
    assert r.returncode == 2
    assert "APT-GET" not in r.stderr
    assert f"DCP_SETUP_APT must be 0 or 1: '{value}'" in r.stderr


def _run_corpus(tmp_path, *, corpus=None, pins_installed=True):
    """setup.sh with a python3 stub whose corpus pin check (python3 - requirements/...)
    exits 0 (pins installed) or 1 (a pin missing); every other call succeeds."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("dirname", "mktemp", "rm", "tail", "cat"):
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(shutil.which(tool))
    check_rc = 0 if pins_installed else 1
    _stub(bin_dir, "python3", 'echo "PYTHON $*" >&2\n'
                              f'[ "$1" = "-" ] && {{ cat >/dev/null; exit {check_rc}; }}\nexit 0')
    for tool in ("chromium", "dot"):        # present: apt has nothing to do
        _stub(bin_dir, tool, "exit 0")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "DCP_SETUP_VLLM": "0"}
    if corpus is not None:
        env["DCP_SETUP_CORPUS"] = corpus
    return subprocess.run([BASH, str(ROOT / "scripts" / "setup.sh")], env=env,
                          capture_output=True, text=True, timeout=60)


CORPUS_PIP = ("-m pip install --quiet --disable-pip-version-check --no-deps "
              "-r requirements/corpus.txt")


def test_corpus_libraries_are_installed_without_deps_when_a_pin_is_missing(tmp_path):
    r = _run_corpus(tmp_path, pins_installed=False)
    assert r.returncode == 0, r.stderr
    assert "pip: the third-party corpus (requirements/corpus.txt, --no-deps)" in r.stderr
    assert CORPUS_PIP in r.stderr


def test_corpus_already_installed_runs_no_pip(tmp_path):
    r = _run_corpus(tmp_path, pins_installed=True)
    assert r.returncode == 0, r.stderr
    assert "PYTHON - requirements/corpus.txt" in r.stderr       # the pins were checked
    assert CORPUS_PIP not in r.stderr


def test_corpus_opt_out(tmp_path):
    r = _run_corpus(tmp_path, corpus="0", pins_installed=False)
    assert r.returncode == 0, r.stderr
    assert "not installing the third-party corpus (DCP_SETUP_CORPUS=0)" in r.stderr
    assert "requirements/corpus.txt" not in r.stderr.replace("(DCP_SETUP_CORPUS=0)", "")


def test_corpus_bad_value_is_refused(tmp_path):
    r = _run_corpus(tmp_path, corpus="yes")
    assert r.returncode == 2
    assert "DCP_SETUP_CORPUS must be 0 or 1: 'yes'" in r.stderr


def _run_vllm(tmp_path, *, vllm=None, complete=False):
    """setup.sh with a python3 stub whose ``-m venv DIR`` makes DIR/bin/python a stub that
    logs its calls and answers the completeness check with ``complete``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("dirname", "mktemp", "rm", "tail", "cat", "mkdir", "chmod"):
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(shutil.which(tool))
    venv_python = (f'#!{BASH}\necho "VENV-PYTHON $*" >&2\n'
                   f'[ "$1" = "-" ] && {{ cat >/dev/null; exit {0 if complete else 1}; }}\nexit 0')
    venv = tmp_path / "venv-vllm"
    if complete:
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").write_text(venv_python)
        (venv / "bin" / "python").chmod(0o755)
    _stub(bin_dir, "python3", 'echo "PYTHON $*" >&2\n'
                              '[ "$1" = "-" ] && { cat >/dev/null; exit 0; }\n'
                              'if [ "$2" = venv ]; then mkdir -p "$4/bin"; '
                              f"cat >\"$4/bin/python\" <<'PY'\n{venv_python}\nPY\n"
                              'chmod +x "$4/bin/python"; fi\nexit 0')
    for tool in ("chromium", "dot"):
        _stub(bin_dir, tool, "exit 0")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "DCP_VLLM_VENV": str(venv)}
    if vllm is not None:
        env["DCP_SETUP_VLLM"] = vllm
    return subprocess.run([BASH, str(ROOT / "scripts" / "setup.sh")], env=env,
                          capture_output=True, text=True, timeout=60), venv


def test_vllm_environment_is_created_with_its_pin_and_without_the_cuda_wheels(tmp_path):
    r, venv = _run_vllm(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "vLLM environment" in r.stderr and "transformers < 5.20" in r.stderr
    assert f"PYTHON -m venv --system-site-packages {venv}" in r.stderr
    install = r.stderr.index("VENV-PYTHON -m pip install --quiet --disable-pip-version-check "
                             "-e .[vllm]")
    assert install < r.stderr.index("VENV-PYTHON -m pip uninstall --quiet "
                                    "--disable-pip-version-check -y torchvision torchaudio "
                                    "torchcodec")


def test_a_complete_vllm_environment_is_left_as_it_is(tmp_path):
    r, _ = _run_vllm(tmp_path, complete=True)
    assert r.returncode == 0, r.stderr
    assert "-m venv" not in r.stderr and "[vllm]" not in r.stderr


def test_vllm_environment_opt_out_and_bad_value(tmp_path):
    r, _ = _run_vllm(tmp_path, vllm="0")
    assert r.returncode == 0, r.stderr
    assert "not creating the vLLM environment (DCP_SETUP_VLLM=0)" in r.stderr
    assert "VENV-PYTHON" not in r.stderr and "-m venv" not in r.stderr
    r, _ = _run_vllm(tmp_path, vllm="yes")
    assert r.returncode == 2
    assert "DCP_SETUP_VLLM must be 0 or 1: 'yes'" in r.stderr
