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
    "dump": "dump",
    "demo": "demo",
    "plan-transfer": "plan_transfer",
    "lower": "lower",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dcp-compile",
        description="Decode Context Parallel compiler: prove layouts, show topologies, "
                    "transform and verify models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"dcp_compile.commands.{module_name}")
        except ModuleNotFoundError as e:
            if e.name == f"dcp_compile.commands.{module_name}":
                continue  # subcommand not built in this version
            raise
        p = sub.add_parser(name, help=module.__doc__.strip().splitlines()[0],
                           description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import DCPError
    try:
        return int(args._run(args) or 0)
    except DCPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
