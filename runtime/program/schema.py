"""Types as data: the check a program file's contents pass before anything is built from them.

A file that is read is data from outside: its hash says it is the file that was written, not
that a writer was honest. So every value read is checked against a type before use:
``check_type(value, hint)`` against a Python type hint (the dataclasses' own annotations, the
program's field table), and the codec's encoded values against :data:`ENCODED` (one row per
kind). A mismatch is a :class:`SchemaError` naming where it is, what was expected and what
was found; the codec turns it into a DCPInputError naming the file.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import keyword
import types
import typing

import torch


class SchemaError(Exception):
    """A value read from a file does not have its type: ``where``, expected, found."""

    def __init__(self, where: str, expected: str, value):
        self.where = where
        super().__init__(f"{where}: expected {expected}, found {_show(value)}")


def _show(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def identifier(value, where: str) -> str:
    """``value`` if it is a Python identifier (not a keyword): what FX writes into generated
    code verbatim (placeholder targets, keyword-argument names) must be one, or loading a
    file would run its text."""
    if type(value) is not str or not value.isidentifier() or keyword.iskeyword(value):
        raise SchemaError(where, "a Python identifier", value)
    return value


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def check_type(value, hint, where: str) -> None:
    """Raise SchemaError unless ``value`` is of type ``hint`` (a class, ``X | None``,
    ``tuple[X, ...]``, ``tuple[X, Y]``, ``list[X]``, ``dict[K, V]``, a dataclass checked
    field by field against its annotations)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any or hint is object:
        return
    if hint is None or hint is type(None):
        if value is not None:
            raise SchemaError(where, "None", value)
        return
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                check_type(value, option, where)
                return
            except SchemaError:
                pass
        raise SchemaError(where, " or ".join(_name(a) for a in args), value)
    if origin is tuple or hint is tuple:
        if type(value) is not tuple:
            raise SchemaError(where, _name(hint), value)
        if len(args) == 2 and args[1] is Ellipsis:
            for i, v in enumerate(value):
                check_type(v, args[0], f"{where}[{i}]")
        elif args:
            if len(value) != len(args):
                raise SchemaError(where, _name(hint), value)
            for i, (v, a) in enumerate(zip(value, args)):
                check_type(v, a, f"{where}[{i}]")
        return
    if origin is list or hint is list:
        if type(value) is not list:
            raise SchemaError(where, _name(hint), value)
        for i, v in enumerate(value):
            check_type(v, args[0] if args else typing.Any, f"{where}[{i}]")
        return
    if origin is dict or hint is dict:
        if type(value) is not dict:
            raise SchemaError(where, _name(hint), value)
        k, v = args if args else (typing.Any, typing.Any)
        for key, item in value.items():
            check_type(key, k, f"{where} key")
            check_type(item, v, f"{where}[{key!r}]")
        return
    if hint is float:
        if type(value) not in (float, int):
            raise SchemaError(where, "float", value)
        return
    if hint is int:
        if type(value) is not int:       # bool is an int subclass; a count is not a flag
            raise SchemaError(where, "int", value)
        return
    if hint is str:      # our vocabulary enums are StrEnums (runtime/names.py)
        if type(value) is not str and not (isinstance(value, str) and
                                           isinstance(value, enum.Enum)):
            raise SchemaError(where, "str", value)
        return
    if hint is bool:
        if type(value) is not hint:
            raise SchemaError(where, hint.__name__, value)
        return
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if type(value) is not hint:
            raise SchemaError(where, hint.__name__, value)
        for name, field_hint in _hints(hint).items():
            check_type(getattr(value, name), field_hint, f"{where}.{name}")
        return
    if isinstance(hint, type) and (issubclass(hint, enum.Enum) or hint is torch.dtype):
        if type(value) is not hint:
            raise SchemaError(where, hint.__name__, value)
        return
    if hint is torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise SchemaError(where, "a tensor", value)
        return
    raise TypeError(f"schema.check_type has no rule for type hint {hint!r} (at {where})")


def _name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


# -- the codec's encoded values (runtime/program/codec.py ``_encode``) ---------------------


def _scalar(x) -> bool:
    return x is None or type(x) in (bool, int, float, str)


def _sub(x, where, ctx, key=False):
    check_encoded(x, where, ctx, key=key, depth=ctx["depth"] + 1)


def _pair(v, where, ctx):
    if type(v) is not list or len(v) != 2:
        raise SchemaError(where, "a [key, value] pair", v)
    _sub(v[0], where + " key", ctx, key=True)
    _sub(v[1], where, ctx)


def _items(v, where, ctx):
    if type(v) is not list:
        raise SchemaError(where, "a list", v)
    for i, item in enumerate(v):
        _sub(item, f"{where}[{i}]", ctx)


def _dict(v, where, ctx):
    if type(v) is not list:
        raise SchemaError(where, "a list of [key, value] pairs", v)
    for i, pair in enumerate(v):
        _pair(pair, f"{where}[{i}]", ctx)


def _dataclass(v, where, ctx):
    if type(v) is not list or len(v) != 2 or v[0] not in ctx["dataclasses"] \
            or type(v[1]) is not dict:
        raise SchemaError(where, f"[one of {sorted(ctx['dataclasses'])}, {{field: value}}]", v)
    names = {f.name for f in dataclasses.fields(ctx["dataclasses"][v[0]])}
    for k, item in v[1].items():
        if k not in names:
            raise SchemaError(where, f"a field of {v[0]} ({sorted(names)})", k)
        _sub(item, f"{where}.{k}", ctx)


def _enum(v, where, ctx):
    if type(v) is not list or len(v) != 2 or v[0] not in ctx["enums"]:
        raise SchemaError(where, f"[one of {sorted(ctx['enums'])}, value]", v)
    if v[1] not in {m.value for m in ctx["enums"][v[0]]}:
        raise SchemaError(where, f"a value of {v[0]}", v[1])


def _slice(v, where, ctx):
    if type(v) is not list or len(v) != 3:
        raise SchemaError(where, "[start, stop, step]", v)
    _items(v, where, ctx)


def _tensor(v, where, ctx):
    if type(v) is not list or len(v) != 3 or type(v[0]) is not list or type(v[1]) is not list \
            or len(v[0]) != len(v[1]) \
            or not all(type(d) is int and 0 <= d < 2 ** 48 for d in v[0]) \
            or not all(type(s) is int and 0 <= s < 2 ** 48 for s in v[1]):
        raise SchemaError(where, "[shape, strides, dtype] (non-negative ints, as many strides "
                                 "as dims)", v)
    _dtype(v[2], where, ctx)


def _dtype(v, where, ctx):
    if type(v) is not str or not isinstance(getattr(torch, v, None), torch.dtype):
        raise SchemaError(where, "a torch dtype's name", v)


def _named(cls):
    def check(v, where, ctx):
        if type(v) is not str or not isinstance(getattr(torch, v, None), cls):
            raise SchemaError(where, f"a torch {cls.__name__}'s name", v)
    return check


def _device(v, where, ctx):
    if type(v) is not str or v.split(":")[0] not in ("cpu", "meta", "cuda"):
        raise SchemaError(where, "a device name (cpu, meta, cuda[:N])", v)


def _node(v, where, ctx):
    if type(v) is not str or v not in ctx["nodes"]:
        raise SchemaError(where, "the name of a node defined before this one", v)


# kind -> the check of its value (codec._encode writes one single-key dict per kind).
ENCODED = {
    "node": _node,
    "tuple": _items,
    "list": _items,
    "dict": _dict,
    "dataclass": _dataclass,
    "enum": _enum,
    "slice": _slice,
    "tensor": _tensor,
    "dtype": _dtype,
    "device": _device,
    "layout": _named(torch.layout),
    "memory_format": _named(torch.memory_format),
}
# The kinds a dict key may be (it must be hashable once decoded).
KEY_KINDS = ("enum", "dtype")
MAX_DEPTH = 64


def check_encoded(x, where: str, ctx: dict, *, key: bool = False, depth: int = 0) -> None:
    """Raise SchemaError unless ``x`` is a value codec._encode could have written.
    ``ctx``: ``dataclasses`` and ``enums`` (name -> class), ``nodes`` (names defined)."""
    if depth > MAX_DEPTH:
        raise SchemaError(where, f"values nested at most {MAX_DEPTH} deep", "deeper")
    if _scalar(x):
        return
    if type(x) is not dict or len(x) != 1:
        raise SchemaError(where, "a number, a string, None or a single-key {kind: value}", x)
    (kind, v), = x.items()
    if kind not in ENCODED or (key and kind not in KEY_KINDS):
        raise SchemaError(where, f"a value kind among {sorted(KEY_KINDS if key else ENCODED)}",
                          kind)
    ctx = {**ctx, "depth": depth}
    ENCODED[kind](v, where, ctx)
