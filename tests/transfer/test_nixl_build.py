"""One NIXL build: the `[nixl]` extra installs exactly one wheel, and dcp_compile.runtime.transfer.nixl.build
loads the API from it when the `nixl` meta-package (every CUDA variant) is absent."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from dcp_compile.runtime.transfer.nixl.build import NIXL_MODULES, nixl_api

from suite_path import ROOT  # noqa: E402  (the repository root)


def _hide(monkeypatch, *names):
    """Make ``import name`` fail as if ``name`` were not installed."""
    for mod in list(sys.modules):
        if mod.split(".")[0] in names:
            monkeypatch.delitem(sys.modules, mod)
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_the_nixl_extra_installs_exactly_one_build():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (requirement,) = extras["nixl"]
    dist = requirement.split(">")[0].split("=")[0].split("<")[0].strip()
    assert dist == "nixl-cu12", "the `nixl` meta-package pulls every CUDA variant"
    assert NIXL_MODULES[-1][0] == dist.replace("-", "_")


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None,
                    reason="nixl-cu12 is not installed (pip install -e '.[nixl]')")
def test_the_extras_build_alone_serves_the_api():
    # In a fresh interpreter: two NIXL builds' bindings cannot both load into one process
    # (pybind refuses to register a type twice), and other tests may have loaded `nixl`.
    code = textwrap.dedent("""
        import sys
        sys.modules["nixl"] = None          # as if only the extra's build were installed
        from dcp_compile.runtime.transfer.nixl.build import nixl_api
        api = nixl_api()
        assert api.__name__ == "nixl_cu12._api", api.__name__
        # The agent the connector builds exists and is constructible on CPU.
        agent = api.nixl_agent("nixl-build-test", api.nixl_agent_config(backends=[]))
        assert agent.name == "nixl-build-test", agent.name
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def test_no_build_installed_says_how_to_install(monkeypatch):
    _hide(monkeypatch, *(name for name, _ in NIXL_MODULES))
    with pytest.raises(ModuleNotFoundError, match=r"no NIXL build is installed: tried nixl "
                                                  r".*pip install -e '\.\[nixl\]'"):
        nixl_api()


def test_loopback_port_bases_stay_below_the_ephemeral_range():
    """Outgoing connections (UCX, gloo) take ephemeral ports at any moment: a scenario's
    side-channel ports chosen there could be taken before it binds them (a flake seen once)."""
    from dcp_compile.runtime.distributed.launch import ephemeral_port_start, free_port_base
    start = ephemeral_port_start()
    for n in (1, 8, 100):
        for _ in range(20):
            base = free_port_base(n)
            assert 20000 <= base and base + n <= start, (n, base, start)
