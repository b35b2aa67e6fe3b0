"""Memory, as the mask reader and the canonical forms see it: which nodes alias their input
(a view) and which write an argument in place (by the ops' schemas). The mask reader follows
values, not memory, so a write it would miss is refused here by name; canonical_ops'
``writes_out_of_place`` turns the writes it can into values first."""

from __future__ import annotations

from torch.fx import Node

from .attention_patterns import Site, fail


def _schema(n: Node):
    return getattr(n.target, "_schema", None) if n.op == "call_function" else None


def is_view(n: Node) -> bool:
    """``n`` aliases its input (a slice, a view, a transpose...; a getitem of a split)."""
    schema = _schema(n)
    if schema is not None:
        return bool(schema.returns) and schema.returns[0].alias_info is not None \
            and not schema.returns[0].alias_info.is_write
    return n.op == "call_function" and n.target.__name__ == "getitem" and \
        isinstance(n.args[0], Node) and is_view(n.args[0])


def _written(n: Node) -> list[Node]:
    """The nodes that write ``n`` in place: an op whose schema marks the argument written
    (``fill_``, ``copy_``, ``masked_fill_``, ``index_put_``, an ``out=``)."""
    out = []
    for u in n.users:
        schema = _schema(u)
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            value = u.args[i] if i < len(u.args) else u.kwargs.get(arg.name)
            if value is n and arg.alias_info is not None and arg.alias_info.is_write:
                out.append(u)
    return out


def refuse_writes_in_place(s: Site, ancestors: list[Node]) -> None:
    """The reader follows values, not memory: a write into a mask tensor (or a view of it)
    after it was made is not among the mask's inputs (litgpt: ``fill_`` into slices of a
    ``full(-inf)``) unless canonical_ops made it a value. Refused, naming the write, rather
    than read without it."""
    for a in ancestors:
        aliases, stack = set(), [a]
        while stack:
            x = stack.pop()
            if x not in aliases:
                aliases.add(x)
                stack.extend(u for u in x.users if is_view(u))
        for x in aliases:
            for w in _written(x):
                fail(w, f"the attention mask of {s.node.name} is written in place: "
                     f"{w.target} writes {x.name} (a view of {a.name}, which the mask is "
                     f"built from) after it was made, not through slices and selects of a "
                     f"tensor the model makes (the writes read as values)", "Build the mask "
                     "out of place (torch.where, masked_fill, triu/tril) so that its value "
                     "is its computation")
