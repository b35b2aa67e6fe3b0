"""Meta keys and graph input names are defined once (runtime/names.py): the library spells
none of them inline, and no two constants share a value."""

from __future__ import annotations

import ast
from pathlib import Path

from dcp_compile.runtime import names

from suite_path import ROOT  # noqa: E402  (the repository root)
LIBRARY = ("dcp_compile", "passes", "runtime")

INPUT_NAMES = {names.RANK_INPUT, names.INPUT_IDS, names.POSITIONS, names.BLOCK_TABLE,
               names.KV_CACHES}


def _text(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
        else None


def _is_meta(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "meta"


def inline_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of each meta key or graph input name written as a literal: a "dcp_*"
    key of ``x.meta[...]`` / ``x.meta.get(...)``, a literal placeholder name, a name
    compared with ``.name ==`` or tested with ``.startswith``."""
    found = []
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Subscript) and _is_meta(node.value):
            text = _text(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            first, owner, attr = _text(node.args[0]), node.func.value, node.func.attr
            if attr in ("get", "pop", "setdefault") and _is_meta(owner):
                text = first
            elif attr == "placeholder" or (attr == "startswith" and first in INPUT_NAMES):
                text = first or None
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) \
                and node.left.attr == "name":
            text = next((t for t in map(_text, node.comparators) if t in INPUT_NAMES), None)
        if text and (text.startswith("dcp_") or text in INPUT_NAMES
                     or text.startswith(names.KV_CACHES)):
            found.append((node.lineno, text))
    return found


def library_files():
    """The library's sources, but runtime/names.py (where the names are defined)."""
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path != ROOT / "runtime" / "names.py":
                yield path


def test_the_library_spells_no_meta_key_or_input_name_inline():
    found = [f"{path.relative_to(ROOT)}:{line}: {text!r}" for path in library_files()
             for line, text in inline_names(ast.parse(path.read_text()))]
    assert not found, "\n".join(found)


def test_the_scan_finds_what_it_looks_for():
    tree = ast.parse('n.meta["dcp_layer"] = 1\nn.meta.get("dcp_kind")\n'
                     'g.placeholder("tp_rank")\nn.name == "positions"\n'
                     'x.startswith("kv_caches")\nn.meta["val"]\nd["tp_rank"]\n')
    assert sorted(t for _, t in inline_names(tree)) == [
        "dcp_kind", "dcp_layer", "kv_caches", "positions", "tp_rank"]


def test_every_name_is_distinct():
    values = {k: v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}
    meta = {k: v for k, v in values.items() if k != "SCOPE_MODEL"}
    assert len(set(meta.values())) == len(meta), meta
    assert names.cache_input(3) == "kv_caches_3" and names.is_cache_input("kv_caches_3")
    assert names.STEP_INPUTS == (names.INPUT_IDS, names.POSITIONS, names.BLOCK_TABLE)
