"""Op classes are defined once, in passes/op_classes.py: no other module of the package keeps a
module-level set, tuple, list or frozenset of aten ops (named, or inside a rule table's
construction), nor a rule table whose keys share one value, so two passes never hold drifting
copies of one class. A rule table keyed by single ops (op -> rule) is rules as data and stays
where its rules are; a group of ops that share a row is a class and is imported from
op_classes (``dict.fromkeys(CLASS, rule)``)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import torch

from dcp_compile.passes import op_classes as O

from suite_path import ROOT  # noqa: E402  (the repository root)

PACKAGES = ("dcp_compile", "passes", "runtime")     # the distribution's three import packages
HOME = ROOT / "passes" / "op_classes.py"
COLLECTIONS = (ast.Set, ast.Tuple, ast.List)
SHARED_RULES = (ast.Name, ast.Attribute, ast.Lambda)
aten = torch.ops.aten


def _dotted(e: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(e, ast.Attribute):
        parts.append(e.attr)
        e = e.value
    return [e.id, *reversed(parts)] if isinstance(e, ast.Name) else None


def _module_level(tree: ast.Module):
    """Every node of the module's own statements (class bodies included), not those inside a
    function or lambda: they run when the module is imported."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def module_level_op_sets(source: str) -> list[tuple[int, str]]:
    """(line, source) of each module-level collection literal holding an aten op: an attribute
    of ``torch.ops.aten`` (or of a module-level alias of it), or a module-level name bound to
    one op."""
    tree = ast.parse(source)
    aliases = {"aten"}
    ops: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                and isinstance(stmt.targets[0], ast.Name):
            path = _dotted(stmt.value)
            if path == ["torch", "ops", "aten"]:
                aliases.add(stmt.targets[0].id)
            elif path and (path[0] in aliases and len(path) > 1 or path[:3] ==
                           ["torch", "ops", "aten"] and len(path) > 3):
                ops.add(stmt.targets[0].id)

    def is_op(e: ast.expr) -> bool:
        if isinstance(e, ast.Name):
            return e.id in ops
        path = _dotted(e)
        return bool(path) and (path[0] in aliases and len(path) > 1
                               or path[:3] == ["torch", "ops", "aten"] and len(path) > 3)

    found = []
    for n in _module_level(tree):
        if isinstance(n, COLLECTIONS) and any(is_op(e) for e in n.elts):
            found.append((n.lineno, ast.unparse(n)))
        elif isinstance(n, ast.Dict):
            # A rule table's rows that share one rule (a name, or a lambda written out again)
            # are a set in disguise; rows sharing a constant or a rule built per row are not.
            rows: dict[str, list[ast.expr]] = {}
            for k, v in zip(n.keys, n.values):
                if k is not None and is_op(k) and isinstance(v, SHARED_RULES):
                    rows.setdefault(ast.dump(v), []).append(k)
            found += [(keys[0].lineno, ", ".join(ast.unparse(k) for k in keys))
                      for keys in rows.values() if len(keys) > 1]
    return sorted(found)


def package_modules():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_no_module_level_op_set_outside_op_classes():
    found = [f"{path.relative_to(ROOT)}:{line}: {text[:100]}"
             for path in package_modules() if path != HOME
             for line, text in module_level_op_sets(path.read_text())]
    assert not found, (
        "module-level sets of aten ops outside passes/op_classes.py (op classes are defined "
        "once): " + "; ".join(found) + ". Move each into op_classes.py under a name that says "
        "what it means (or import the class it copies) and import it from there.")


def test_the_scan_reads_every_package_and_finds_the_home():
    modules = list(package_modules())
    assert HOME in modules and len(modules) > 50
    assert module_level_op_sets(HOME.read_text()), "op_classes.py itself must be found"


def test_the_scan_catches_each_spelling_of_an_op_set():
    source = textwrap.dedent("""
        import torch
        aten = torch.ops.aten
        A = torch.ops.aten
        LINEAR = aten.linear.default
        SPLITS = (aten.split.Tensor, aten.chunk.default)
        VIEWS = frozenset({A.view.default})
        MORE = RESHAPES | {torch.ops.aten.expand.default}
        PACKETS = [aten.softmax]
        TABLE = {**{t: 1 for t in (LINEAR, aten.bmm.default)}}
        for _op in (aten.cat.default,):
            pass
        class Rules:
            KINDS = {aten.mm.default}
        SHARED = {aten.where.self: rule, aten.mm.default: other, aten.where.Scalar: rule}
        COPIED = {aten.view.default: lambda n: n.args, aten.reshape.default: lambda n: n.args}
    """)
    assert [line for line, _ in module_level_op_sets(source)] == [6, 7, 8, 9, 10, 11, 14, 15, 16]


def test_the_scan_leaves_rule_tables_functions_and_other_sets_alone():
    source = textwrap.dedent("""
        import operator, torch
        aten = torch.ops.aten
        SDPA = aten.scaled_dot_product_attention.default
        RULES = {aten.add.Tensor: 1, aten.mul.Tensor: 2}
        ARGS = {aten.flip.default: 1, aten.cumsum.default: 1, aten.full.default: f(1),
                aten.full_like.default: f(1)}
        NAMES = {"linear", "embedding"}
        PY = (operator.getitem, operator.add)
        def f(n):
            return n.target in {aten.mul.Tensor, aten.div.Tensor}
        G = lambda n: n.target in (aten.mm.default,)
    """)
    assert module_level_op_sets(source) == []


def test_drifted_copies_are_fixed():
    # The copies that had drifted from op_classes (issue #34): each now reads the one class.
    from dcp_compile.passes import mask_predicate, shard_tensor_parallel
    from dcp_compile.passes.placement import rules
    assert aten.unbind.int in O.SPLITS and shard_tensor_parallel.SPLITS is O.SPLITS
    assert all(mask_predicate.RULES[op] is mask_predicate.RULES[aten.to.dtype]
               for op in O.CASTS)
    assert aten.to.device in mask_predicate.RULES
    assert all(op in rules.RULES for op in O.SOFTMAX | O.LOG_SOFTMAX)
