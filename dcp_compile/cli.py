"""`dcp-compile` command line: one module per subcommand in dcp_compile/commands/."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand name -> module in dcp_compile.commands exposing add_arguments(p) and run(args).
SUBCOMMANDS = {
    "prove": "prove",
    "topology": "topology",
    "verify": "verify",
    "compile": "compile",
    "dump": "dump",
    "demo": "demo",
    "plan-transfer": "plan_transfer",
    "lower": "lower",
    "plan": "plan",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """Keeps a command's description (its module docstring) as written, and appends
    ``(default: X)`` to an option's help unless the help already says its default or there
    is no value to show (a required option, a flag, None: those helps say what absence
    means themselves; tests/e2e/test_cli.py checks every option)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.required or action.default in (None, False, argparse.SUPPRESS)
                or "default" in text):
            return text
        return super()._get_help_string(action)


def version() -> str:
    """The installed distribution's version; the source constant when not installed."""
    from importlib import metadata
    try:
        return metadata.version("dcp-compile")
    except metadata.PackageNotFoundError:
        from ._version import __version__
        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dcp-compile", formatter_class=HelpFormatter,
        description="Decode Context Parallel compiler: prove layouts, show topologies, "
                    "transform and verify models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="print the package version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"dcp_compile.commands.{module_name}")
        except ModuleNotFoundError as e:
            if e.name == f"dcp_compile.commands.{module_name}":
                continue  # subcommand not built in this version
            raise
        summary = " ".join(module.__doc__.strip().split("\n\n")[0].split())
        p = sub.add_parser(name, help=summary,
                           description=module.__doc__, formatter_class=HelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _validate=getattr(module, "validate", None),
                       _parser=p)
    return parser


def main(argv=None) -> int:
    """Parse and check every option before any work, with no traceback: a bad value (the
    argparse ``type=`` validators of commands/options.py) exits 2 as argparse does; a layout
    that DCPConfig refuses (the command's ``validate(args)``) prints the usage and the
    message and returns 2. A DCPError raised while working prints ``error: ...``, returns 2."""
    args = build_parser().parse_args(argv)
    from dcp_compile.runtime.errors import DCPError
    if args._validate is not None:
        try:
            args._validate(args)
        except DCPError as e:
            args._parser.print_usage(sys.stderr)
            print(f"{args._parser.prog}: error: {e}", file=sys.stderr)
            return 2
    try:
        return int(args._run(args) or 0)
    except DCPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
