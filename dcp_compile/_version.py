"""The package version, defined once: pyproject.toml reads it (``[tool.setuptools.dynamic]``)
and ``dcp-compile --version`` falls back to it when no package metadata is installed."""

__version__ = "0.1.0"
