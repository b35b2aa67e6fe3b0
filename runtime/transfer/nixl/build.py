"""The NIXL Python API, from the one NIXL build installed.

The ``[nixl]`` extra installs one build, ``nixl-cu12``: its DRAM transfers over UCX run on
CPU. The ``nixl`` meta-package on PyPI requires every CUDA variant (``nixl-cu12`` and
``nixl-cu13``, about 200 MB each); a user who installed it anyway gets it, and it picks
the build that the CUDA version torch reports needs.
"""

from __future__ import annotations

import importlib

# (module, where it comes from), tried in order; the extra in pyproject.toml installs the
# last one (tests/transfer/test_nixl_build.py checks that the two agree).
NIXL_MODULES = (
    ("nixl", "the `nixl` meta-package (every CUDA variant; picks one for torch's CUDA)"),
    ("nixl_cu12", "the `nixl-cu12` wheel, which `pip install -e '.[nixl]'` installs"),
)


def nixl_api():
    """The ``_api`` module (``nixl_agent``, ``nixl_agent_config``) of the first build in
    :data:`NIXL_MODULES` that is installed. A build that is installed but fails to load
    raises its own error; none installed raises ModuleNotFoundError saying how to get one."""
    for name, _ in NIXL_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        return importlib.import_module(f"{name}._api")
    tried = "; ".join(f"{name} ({where})" for name, where in NIXL_MODULES)
    raise ModuleNotFoundError(f"no NIXL build is installed: tried {tried}. Install one with "
                              f"`pip install -e '.[nixl]'`.", name=NIXL_MODULES[-1][0])
