"""Subcommands of the `dcp-compile` CLI, one module each (add_arguments + run)."""
