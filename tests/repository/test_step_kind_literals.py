"""Step kinds and modes are spelled through their enums (runtime/names.py: ``StepKind``,
``Mode``), never as string literals in the library, so they cannot drift apart again.

A literal "context" / "decode" / "prefill" counts where it stands for a step kind or a mode:
compared with, or assigned to, something named ``kind`` / ``step`` / ``mode``; passed as
such a keyword or parameter default; a key of a program's ``graphs``; a tuple of kinds
looped over. Docs and comments are text, and command-line strings (argparse choices and
defaults: what the user types) and the disaggregated engines' side names (``"prefill"`` /
``"decode"`` sides of a transfer, JSON keys of a spec file) are other words that happen to
be spelled the same; none of those is matched by the rules below.
"""

from __future__ import annotations

import ast

from dcp_compile.runtime.names import Mode, StepKind

from test_names import ROOT, library_files

WORDS = {k.value for k in StepKind} | {m.value for m in Mode}
NAMES = ("kind", "step", "mode")          # a variable, attribute or keyword meant as one


def _word(node) -> ast.Constant | None:
    return node if isinstance(node, ast.Constant) and node.value in WORDS else None


def _is_named(node) -> bool:
    """A name / attribute (or subscript of one) whose last part says kind, step or mode."""
    if isinstance(node, ast.Subscript):
        node = node.value
    last = node.id if isinstance(node, ast.Name) else \
        node.attr if isinstance(node, ast.Attribute) else ""
    return any(last == n or last.endswith("_" + n) for n in NAMES)


def _graphs(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "graphs" or \
        isinstance(node, ast.Name) and node.id == "graphs"


def step_kind_literals(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        hits = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_named(s) or _graphs(s) for s in sides):
                hits = [_word(s) for s in sides]
            if any(isinstance(s, (ast.Tuple, ast.List, ast.Set)) for s in sides) and \
                    any(_is_named(s) for s in sides):
                hits += [_word(e) for s in sides if isinstance(s, (ast.Tuple, ast.List,
                                                                    ast.Set))
                         for e in s.elts]
        elif isinstance(node, ast.Subscript) and _graphs(node.value):
            hits = [_word(node.slice)]
        elif isinstance(node, ast.keyword) and node.arg and \
                any(node.arg == n or node.arg.endswith("_" + n) for n in NAMES):
            hits = [_word(node.value)]
        elif isinstance(node, ast.arguments):
            args = node.posonlyargs + node.args
            pairs = list(zip(args[len(args) - len(node.defaults):], node.defaults)) + \
                [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
            hits = [_word(d) for a, d in pairs
                    if any(a.arg == n or a.arg.endswith("_" + n) for n in NAMES)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and any(_is_named(t) for t in targets):
                hits = [_word(node.value)]
        elif isinstance(node, (ast.For, ast.comprehension)) and _is_named(node.target) and \
                isinstance(node.iter, (ast.Tuple, ast.List)):
            hits = [_word(e) for e in node.iter.elts]
        elif isinstance(node, ast.IfExp) and isinstance(node.test, ast.Compare) and \
                any(_is_named(s) for s in [node.test.left, *node.test.comparators]):
            hits = [_word(node.body), _word(node.orelse)]
        found += [(h.lineno, h.value) for h in hits if h]
    return found


def test_the_library_spells_no_step_kind_or_mode_literal():
    found = [f"{path.relative_to(ROOT)}:{line}: {text!r}" for path in library_files()
             for line, text in step_kind_literals(ast.parse(path.read_text()))]
    assert not found, ("step kinds / modes spelled as literals (use StepKind / Mode from "
                       "dcp_compile.runtime.names):\n" + "\n".join(found))


def test_the_check_finds_each_form():
    """The rules catch every form they are meant for (and no docstring or CLI string)."""
    src = '''
"""Docs may say "decode" and "prefill"."""
def f(kind="decode", *, mode="prefill"):
    if kind == "context": pass
    if "prefill" in program.graphs: pass
    g = program.graphs["decode"]
    run(prompt_kind="prefill")
    for kind in ("context", "decode"): pass
    step = "decode" if mode == "decode" else "prefill"
    self.mode: str = "decode"
    p.add_argument("--mode", choices=["decode", "prefill"], default="decode")
    side = "prefill"
'''
    got = [line for line, _ in step_kind_literals(ast.parse(src))]
    assert sorted(got) == [3, 3, 4, 5, 6, 7, 8, 8, 9, 9, 9, 10]
