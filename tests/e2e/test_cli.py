"""Command line: every option is checked before any work; bad values exit 2 with a message
and no traceback (issue 12: CLI)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_compile import cli
from dcp_compile.commands import options

from suite_path import ROOT  # noqa: E402  (the repository root)

# (argv, what stderr must say). Each one used to crash with a traceback, print an impossible
# layout with exit 0, or start work before failing.
BAD_OPTIONS = [
    (["verify", "--tp", "8", "--dcp", "0"],
     "argument --dcp: must be a positive integer: '0'"),
    (["verify", "--tp", "8", "--dcp", "4", "--lengths", "abc"],
     "argument --lengths: must be a comma-separated list of positive integers: 'abc'"),
    (["verify", "--tp", "8", "--dcp", "4", "--lengths", "1,,2"],
     "argument --lengths: must be a comma-separated list of positive integers: '1,,2'"),
    (["verify", "--tp", "8", "--dcp", "4", "--lengths", "5,-1"],
     "(bad item '-1')"),
    (["verify", "--tp", "8", "--dcp", "4", "--atol", "nan"],
     "argument --atol: must be a finite number >= 0: 'nan'"),
    (["verify", "--tp", "8", "--dcp", "3"], "TP % DCP == 0: tp=8, dcp=3"),
    (["verify", "--tp", "8", "--dcp", "4", "--interleave-size", "3"],
     "block_size must be a multiple of interleave_size"),
    (["topology", "--tp", "8", "--dcp", "4", "--num-kv-heads", "3"],
     "KV heads must split over, or replicate evenly across, full TP: num_kv_heads=3"),
    (["topology", "--tp", "8", "--dcp", "4", "--num-kv-heads", "8"],
     "decode DCP needs tp > num_kv_heads"),
    (["topology", "--tp", "8", "--dcp", "4", "--mode", "prefill", "--num-kv-heads", "3"],
     "dcp_tp_group (TP/DCP): num_kv_heads=3, shard=2"),
    (["topology", "--tp", str(2**40), "--dcp", "1"], "tp is too large: tp=1099511627776"),
    (["topology", "--tp", "4", "--dcp", "x"], "argument --dcp: must be a positive integer"),
    (["demo", "--modes", "decode,foo"], "argument --modes: must be a comma-separated list"),
    (["demo", "--tp", "8", "--dcp", "16"], "TP % DCP == 0: tp=8, dcp=16"),
    (["dump", "--layers", "0"], "argument --layers: must be a positive integer: '0'"),
    (["dump", "--tp", "4", "--dcp", "4", "--mode", "decode"], "dcp <= tp // num_kv_heads"),
    (["lower", "--tp", "8", "--dcp", "4", "--out", "README.md"],
     "argument --out: is an existing file, not a directory: 'README.md'"),
    (["lower", "--tp", "8", "--dcp", "4", "--out", "x", "--batch", "-3"],
     "argument --batch: must be a positive integer: '-3'"),
    (["lower", "--tp", "8", "--dcp", "4", "--out", "x", "--kv-role", "producer"],
     "argument --kv-role: invalid choice"),
    (["prove", "--dcp", "4", "--interleave-size", "3"],
     "block_size must be a multiple of interleave_size"),
    (["prove", "--dcp", "0"], "argument --dcp: must be a positive integer: '0'"),
    (["plan-transfer", "--prefill-tp", "x", "--decode-tp", "2"],
     "argument --prefill-tp: must be a positive integer: 'x'"),
]


@pytest.mark.parametrize("argv,message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_option_exits_2_with_message_before_any_work(argv, message, capsys, monkeypatch,
                                                         tmp_path):
    monkeypatch.chdir(ROOT)

    def no_work(args):
        raise AssertionError("the command started working despite a bad option")

    parser = cli.build_parser()
    for action in parser._subparsers._group_actions[0].choices.values():
        action.set_defaults(_run=no_work)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and f"dcp-compile {argv[0]}: error: " in err
    assert "Traceback" not in err


def test_bad_options_in_a_real_process_exit_2_without_traceback():
    for argv, message in (BAD_OPTIONS[0], BAD_OPTIONS[1], BAD_OPTIONS[7]):
        proc = subprocess.run([sys.executable, "-m", "dcp_compile.cli", *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert proc.stdout == ""


def test_topology_prints_a_valid_layout(capsys):
    assert cli.main(["topology", "--tp", "8", "--dcp", "4", "--num-kv-heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "dcp     (size 4): [0, 1, 2, 3] [4, 5, 6, 7]" in out


@pytest.mark.parametrize("text,value", [("4", 4), (" 7", 7), ("65536", 65536)])
def test_positive_int_accepts(text, value):
    assert options.positive_int(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "abc", "1.5", "", "2**4", "0x10"])
def test_positive_int_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive integer"):
        options.positive_int(text)


def test_lists_and_floats():
    assert options.positive_int_list("1, 15,17") == [1, 15, 17]
    for bad in ("", ",", "1,", "a,b", "0,1"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
            options.positive_int_list(bad)
    modes = options.choice_list("decode", "prefill")
    assert modes("prefill,decode") == ["prefill", "decode"]
    for bad in ("", "decode,decode", "decode,x"):
        with pytest.raises(argparse.ArgumentTypeError, match="distinct values"):
            modes(bad)
    assert options.non_negative_float("0") == 0.0
    for bad in ("-1e-4", "inf", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="finite number >= 0"):
            options.non_negative_float(bad)


def _subcommand_parsers():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub


def test_version_prints_the_package_version(capsys):
    from importlib import metadata

    import dcp_compile
    try:
        expected = metadata.version("dcp-compile")
    except metadata.PackageNotFoundError:
        expected = dcp_compile.__version__
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"dcp-compile {expected}\n"
    # The installed metadata and the source constant come from one definition
    # (pyproject.toml reads dcp_compile._version).
    assert expected == dcp_compile.__version__


def test_version_falls_back_to_the_source_constant_when_not_installed(monkeypatch):
    from importlib import metadata

    from dcp_compile._version import __version__

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", not_installed)
    assert cli.version() == __version__


def test_version_in_a_real_process():
    r = subprocess.run([sys.executable, "-m", "dcp_compile.cli", "--version"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("dcp-compile ") and r.stdout.split()[1][0].isdigit()


def test_every_subcommand_and_option_has_help_showing_its_default():
    """Walks every subcommand's parser: each subcommand has a summary, each option a help
    text; an option with a value default shows it (the formatter appends it, or the help
    says it); an optional option without one (None) says what its absence means."""
    parser, sub = _subcommand_parsers()
    summaries = {a.dest: a.help for a in sub._choices_actions}
    assert set(summaries) == set(sub.choices) == set(cli.SUBCOMMANDS)
    problems = []
    for name, p in [("dcp-compile", parser), *sub.choices.items()]:
        if name != "dcp-compile" and not (summaries[name] or "").strip():
            problems.append(f"{name}: no summary")
        formatter = p._get_formatter()
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            opt = f"{name} {'/'.join(a.option_strings) or a.dest}"
            if not (a.help or "").strip():
                problems.append(f"{opt}: no help text")
                continue
            shown = formatter._get_help_string(a) % {"default": a.default}
            if a.required or isinstance(a, (argparse._StoreTrueAction,
                                            argparse._VersionAction)):
                continue
            if "default" not in shown:
                problems.append(f"{opt}: help does not show its default: {shown!r}")
    assert not problems, "\n".join(problems)


def test_help_of_every_subcommand_renders(capsys):
    _, sub = _subcommand_parsers()
    for name in sub.choices:
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: dcp-compile {name}")
    # A value default is appended by the formatter, e.g. verify's --steps.
    with pytest.raises(SystemExit):
        cli.main(["verify", "--help"])
    assert "decode steps (decode mode) (default: 16)" in " ".join(capsys.readouterr().out.split())
