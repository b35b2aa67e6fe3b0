"""The package version, defined once, in the lowest layer (program files carry it).

pyproject.toml reads it (``[tool.setuptools.dynamic]``), ``dcp-compile --version`` falls back
to it when no package metadata is installed, and runtime/program/program_file.py writes it into every
program file and refuses a file of another version."""

__version__ = "0.1.0"
