"""Shape propagation, a service of the pass manager: every node's ``meta['val']`` (a fake
tensor) recomputed after a pass, from the nodes the pass changed only.

:func:`repropagate` recomputes a whole graph; :func:`snapshot`, :func:`changed_nodes` and
:func:`propagate_changed` do it incrementally (the pass manager runs them after each pass);
:func:`propagation_mismatches` checks the incremental result against a full one
(``DCP_COMPILE_FULL_PROPAGATION=1``). Passes do not call it: the pass manager does, between
passes (a pass that needs fake values for nodes it made computes them itself).
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx import GraphModule, Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dcp_compile.runtime.errors import DCPTransformError

FULL_PROPAGATION_ENV = "DCP_COMPILE_FULL_PROPAGATION"
_MISSING = object()


def fake_mode(gm: GraphModule):
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(inputs)
    if mode is None:
        raise DCPTransformError("graph inputs carry no fake tensors; capture with "
                                "torch.export so that every node has meta['val'].")
    return mode


def repropagate(gm: GraphModule) -> None:
    """Recompute every node's meta['val'] from the placeholders' fake values."""
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, fake_mode(gm)).propagate_dont_convert_inputs(*inputs)


# ------------------------------------------------------------------------------------------
# Incremental propagation: only the nodes a pass touched, and users whose inputs changed
# ------------------------------------------------------------------------------------------


def snapshot(gm: GraphModule) -> dict:
    """What a pass may change about each node: op, target, args, kwargs, meta['val']."""
    return {n: (n.op, n.target, n.args, n.kwargs, n.meta.get("val", _MISSING))
            for n in gm.graph.nodes}


def changed_nodes(gm: GraphModule, before: dict) -> list[Node]:
    """Nodes inserted since ``before``, or with another op/target/args/kwargs, or whose
    meta['val'] a pass replaced (placeholders of sharded weights and caches) or that have
    none yet (export leaves the output node without one). get_attr nodes always count: a
    pass may swap the module attribute they read."""
    out = []
    for n in gm.graph.nodes:
        old = before.get(n)
        val = n.meta.get("val", _MISSING)
        if (old is None or val is not old[4] or val is _MISSING or n.op == "get_attr"
                or (n.op, n.target, n.args, n.kwargs) != old[:4]):
            out.append(n)
    return out


def propagate_changed(gm: GraphModule, changed: list[Node], before: dict | None = None
                      ) -> int:
    """Re-run fake propagation on ``changed`` nodes and, in graph order, on every node one
    of whose inputs got a different value (shape, dtype, stride, device) than before the
    pass (``before``: its ``snapshot``; without it every changed node counts as different).
    Returns how many nodes were recomputed. A placeholder keeps the value its pass gave it."""
    changed = set(changed)
    if not changed:
        return 0
    mode = fake_mode(gm)
    interp = FakeTensorProp(gm, mode)
    dirty: set[Node] = set()
    count = 0
    memo = _call_results()
    with mode:
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                if n in changed:
                    dirty.add(n)
                continue
            inputs = n.all_input_nodes
            if n not in changed and not any(a in dirty for a in inputs):
                continue
            for a in inputs:
                if "val" not in a.meta:
                    raise DCPTransformError(
                        f"node {a.name} ({a.op} {a.target}) has no meta['val'] to propagate "
                        f"from. A pass that adds a placeholder must give it a fake value.")
                interp.env[a] = a.meta["val"]
            # Users saw the value from before the pass (a pass may have replaced it).
            old = before[n][4] if before is not None and n in before else _MISSING
            if n not in changed:
                old = n.meta.get("val", _MISSING)
            key = call_key(n)
            reused = memo.get(key) if key is not None else None
            if reused is not None:
                n.meta["val"] = fresh_fake(reused, mode)
            else:
                interp.run_node(n)
                if key is not None:
                    memo[key] = fake_metadata(n.meta.get("val", _MISSING))
            count += 1
            if not same_value(old, n.meta.get("val", _MISSING)):
                dirty.add(n)
    interp.env.clear()
    return count


# Layers repeat the same op calls on values of the same shapes, and so do the passes, the
# step kinds and the models of one process (the same hidden sizes, heads and token counts):
# the second and later calls of an ATen/dcp op on inputs with the same metadata (and the
# same other arguments) take the first one's result metadata instead of dispatching again (a
# fake tensor has no data, so its result depends on nothing else). The results are kept per
# process (metadata only, no tensors), bounded by _MAX_CALL_RESULTS. Exact: the full
# re-propagation check (DCP_COMPILE_FULL_PROPAGATION=1) compares them.
_MAX_CALL_RESULTS = 50_000
_CALL_RESULTS: dict = {}


def _call_results() -> dict:
    """The process's call key -> result metadata table (emptied when it reaches its bound)."""
    if len(_CALL_RESULTS) >= _MAX_CALL_RESULTS:
        _CALL_RESULTS.clear()
    return _CALL_RESULTS


def call_key(n: Node):
    """(op, argument signature) of a call_function of an OpOverload whose tensor inputs
    have plain static metadata; None when the result cannot be reused."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return None
    if torch.Tag.nondeterministic_seeded in n.target.tags:
        return None
    try:
        return n.target, _signature(n.args), _signature(n.kwargs)
    except _NotReusable:
        return None


class _NotReusable(Exception):
    """An argument whose value the reuse does not handle (see fake_metadata)."""


def _signature(x):
    """Arguments as a hashable value: nested containers keep their type and order, nodes
    become their value's metadata, anything else its type and repr."""
    if isinstance(x, Node):
        meta = fake_metadata(x.meta.get("val", _MISSING))
        if meta is None:
            raise _NotReusable
        return meta
    if isinstance(x, (list, tuple)):
        return type(x).__name__, tuple(_signature(a) for a in x)
    if isinstance(x, dict):
        return "dict", tuple((k, _signature(v)) for k, v in x.items())
    return type(x).__name__, repr(x)


def fake_metadata(v):
    """Everything a fake tensor's value is (shape, stride, offset, dtype, device), or None
    for values this reuse does not handle (symbolic sizes, constants, non-tensors)."""
    if isinstance(v, (list, tuple)):
        parts = [fake_metadata(x) for x in v]
        return None if any(p is None for p in parts) else (type(v).__name__, tuple(parts))
    if not isinstance(v, torch.Tensor) or v.requires_grad or \
            getattr(v, "constant", None) is not None or \
            not all(isinstance(d, int) for d in (*v.shape, *v.stride())):
        return None     # a fake carrying a real constant computes from its data
    return ("tensor", tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype,
            v.device)


def fresh_fake(meta, mode=None):
    """A new fake tensor of ``mode`` (default: the active fake mode) with that metadata.

    Built from a meta tensor (storage of the extent the strides reach, then the view) and
    wrapped directly: no fake-mode dispatch, a tenth of the cost of creating it by ops."""
    mode = mode or detect_fake_mode()
    if meta[0] != "tensor":
        parts = [fresh_fake(m, mode) for m in meta[1]]
        return tuple(parts) if meta[0] == "tuple" else parts
    _, shape, stride, offset, dtype, device = meta
    extent = 1 + sum((d - 1) * st for d, st in zip(shape, stride)) if all(shape) else 0
    with unset_fake_temporarily():
        base = torch.empty(offset + extent, dtype=dtype, device="meta")
        if offset or shape != (offset + extent,):
            base = base.as_strided(shape, stride, offset)
    return FakeTensor(mode, base, device)


def same_value(a, b) -> bool:
    """Equal fake metadata: shape, dtype, stride and device of tensors; == otherwise."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                and a.stride() == b.stride())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a is _MISSING \
            or b is _MISSING:
        return False
    return type(a) is type(b) and a == b


def propagation_mismatches(gm: GraphModule) -> list[str]:
    """Re-propagate the whole graph and list the nodes whose meta['val'] differed from the
    incremental result (the incremental values are replaced by the full ones)."""
    before = {n: n.meta.get("val", _MISSING) for n in gm.graph.nodes}
    repropagate(gm)
    return [f"{n.name} ({n.target}): incremental {_describe(before[n])} vs full "
            f"{_describe(n.meta.get('val', _MISSING))}"
            for n in gm.graph.nodes if not same_value(before[n], n.meta.get("val", _MISSING))]


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)}/{v.dtype}/stride {v.stride()}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_describe(x) for x in v) + ")"
    return "missing" if v is _MISSING else repr(v)
