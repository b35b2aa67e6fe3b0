"""The package version, re-exported from ``dcp_compile.runtime.version`` (defined there once).

``dcp-compile --version`` falls back to it when no package metadata is installed; program
files carry it too (runtime/program/program_file.py)."""

from dcp_compile.runtime.version import __version__  # noqa: F401
