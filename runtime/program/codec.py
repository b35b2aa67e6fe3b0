"""The program file's codec: a DCPProgram's fields as plain data and back (see
:mod:`.program_file` for the format). It does not import the program class, so the class
can save itself without an import cycle; :func:`.program_file.load_program` builds it.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import os

import torch
from torch.fx import Graph, GraphModule, Node

from dcp_compile.runtime.kernels import moe as _moe_ops  # noqa: F401 - registers the dcp::moe ops a graph may call
from dcp_compile.runtime.kernels import ops as _dcp_ops  # noqa: F401 - registers the dcp:: ops a graph may call
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.program.facts import LatentAttention, MixtureOfExperts, ModelFacts
from dcp_compile.runtime.names import Mode, Role, StepKind
from dcp_compile.runtime.program.checkpoint import Piece, WeightSource
from dcp_compile.runtime.program.shards import ShardSpec
from dcp_compile.runtime.topology import Topology
from dcp_compile.runtime.version import __version__

MAGIC = "dcp_compile program"
FORMAT = 1   # the file layout below; a change of it is a new dcp_compile version as well

# The types a file may name, by name (a file names a class; loading looks it up here only).
DATACLASSES = {cls.__name__: cls for cls in (DCPConfig, Topology, StepShapes, ShardSpec,
                                              ModelFacts, LatentAttention, MixtureOfExperts,
                                              Piece, WeightSource)}
ENUMS = {cls.__name__: cls for cls in (StepKind, Role, Mode)}
# Python callables a graph may call besides torch ops (getitem of a multi-output op).
PYTHON_TARGETS = {f"operator.{f.__name__}": f for f in (operator.getitem,)}
# Node metadata a loaded program keeps: the value (shape, dtype), the source line for error
# messages, torch's "custom" annotations and every key our passes write (runtime/names.py).
KEPT_META = ("val", "stack_trace", "custom")
OURS = "dcp_"
# Fields of the program the file leaves out (the compiler's record, see the docstring).
DROPPED = ("report", "dump_dir")


def save_program(program, path: str | os.PathLike, *, weights: bool = True) -> None:
    """Write ``program`` to ``path`` (atomically: a reader never sees half a file);
    ``weights=False``: its named weights as meta tensors (shape and dtype, no data)."""
    if not weights and not program.weight_names:
        raise DCPInputError(
            f"a weightless program file needs the weights' checkpoint names, and this program "
            f"({program.source}) records none: no rank could load it. Save it with "
            f"weights=True, or compile with dcp_compile.transform, which names every weight.")
    facts = dataclasses.replace(program.facts, mask_theorems=None)
    body = {f.name: getattr(program, f.name) for f in dataclasses.fields(program)
            if f.name not in DROPPED + ("graphs", "bucket_graphs", "facts", "constants")}
    payload = {
        "magic": MAGIC, "format": FORMAT, "dcp_compile": __version__, "torch": str(torch.__version__),
        "fields": _encode({**body, "facts": facts}, "the program"),
        "constants": program.constants if weights else {
            k: v.to("meta") if k in program.weight_names else v
            for k, v in program.constants.items()},
        "graphs": {str(k): _encode_graph(gm, str(k)) for k, gm in program.graphs.items()},
        "bucket_graphs": [[bucket, {str(k): _encode_graph(gm, f"{k} (bucket {bucket})")
                                    for k, gm in graphs.items()}]
                          for bucket, graphs in program.bucket_graphs.items()],
    }
    path = os.fspath(path)
    torch.save(payload, path + ".tmp")
    os.replace(path + ".tmp", path)


def read_program_fields(path: str | os.PathLike) -> dict:
    """The fields of the program ``save_program`` wrote to ``path`` (``DCPProgram(**them)``);
    refuses a file that is not one, or one another dcp_compile or torch version wrote."""
    path = os.fspath(path)
    try:
        payload = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise DCPInputError(f"no program file at {path}. Write one with "
                            "dcp_compile.runtime.program.program_file.save_program.") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same answer
        raise DCPInputError(f"{path} is not a readable program file: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}. Write it with "
                            "save_program (program.save).") from None
    if not isinstance(payload, dict) or payload.get("magic") != MAGIC:
        raise DCPInputError(f"{path} is not a program file (no {MAGIC!r} header). Write it "
                            "with save_program (program.save).")
    wrote = (payload.get("dcp_compile"), payload.get("torch"), payload.get("format"))
    here = (__version__, str(torch.__version__), FORMAT)
    if wrote != here:
        raise DCPInputError(
            f"program file {path} was written by dcp_compile {wrote[0]} with torch "
            f"{wrote[1]} (format {wrote[2]}); this is dcp_compile {here[0]} with torch "
            f"{here[1]} (format {here[2]}). Transform the model again with this version: "
            f"program files are read only by the version that wrote them.")
    fields = _decode(payload["fields"])
    graphs = {StepKind(k): _decode_graph(g) for k, g in payload["graphs"].items()}
    buckets = {bucket: {StepKind(k): _decode_graph(g) for k, g in by_kind.items()}
               for bucket, by_kind in payload["bucket_graphs"]}
    return dict(**fields, graphs=graphs, constants=payload["constants"], bucket_graphs=buckets)


# -- graphs -------------------------------------------------------------------------------


def _encode_graph(gm: GraphModule, step: str) -> dict:
    nodes, attrs = [], {}
    for n in gm.graph.nodes:
        where = f"node {n.name} of step {step!r}"
        if n.op == "call_module":
            raise DCPInputError(f"a program file cannot store {where}: it calls submodule "
                                f"{n.target!r}, and a program's graphs call ops only. Save "
                                "a program built by dcp_compile.transform or the backend.")
        if n.op == "get_attr":
            attrs[n.target] = _attribute(gm, n.target, where)
        nodes.append({"op": n.op, "name": n.name, "target": _encode_target(n, where),
                      "args": _encode(n.args, where), "kwargs": _encode(n.kwargs, where),
                      "meta": {k: _encode(v, f"{where}, meta[{k!r}]")
                               for k, v in n.meta.items()
                               if k in KEPT_META or k.startswith(OURS)}})
    return {"nodes": nodes, "attrs": attrs}


def _decode_graph(data: dict) -> GraphModule:
    graph, env = Graph(), {}
    for d in data["nodes"]:
        args = _decode(d["args"], env)
        kwargs = _decode(d["kwargs"], env)
        if d["op"] == "output":
            node = graph.output(args[0])
        else:
            node = graph.create_node(d["op"], _decode_target(d["op"], d["target"]), args,
                                     kwargs, name=d["name"])
        node.meta.update({k: _decode(v, env) for k, v in d["meta"].items()})
        env[d["name"]] = node
    return GraphModule(dict(data["attrs"]), graph)


def _attribute(gm: GraphModule, target: str, where: str) -> torch.Tensor:
    value = operator.attrgetter(target)(gm)
    if not isinstance(value, torch.Tensor):
        raise DCPInputError(f"a program file cannot store {where}: attribute {target!r} is "
                            f"a {type(value).__name__}, not a tensor. Save a program built "
                            "by dcp_compile.transform or the backend.")
    return value


def _encode_target(n: Node, where: str):
    t = n.target
    if n.op in ("placeholder", "output", "get_attr"):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return {"op": [t.namespace, t._opname, t._overloadname]}
    for name, f in PYTHON_TARGETS.items():
        if f is t:
            return {"python": name}
    name = f"{getattr(t, '__module__', '?')}.{getattr(t, '__name__', type(t).__name__)}"
    raise DCPInputError(f"a program file cannot store {where}: it calls {name}, which is "
                        f"neither a torch op nor one of {sorted(PYTHON_TARGETS)}. Add it to "
                        "codec.PYTHON_TARGETS if the runtime may call it.")


def _decode_target(op: str, target):
    if op in ("placeholder", "output", "get_attr"):
        return target
    if "python" in target:
        return PYTHON_TARGETS[target["python"]]
    namespace, name, overload = target["op"]
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        raise DCPInputError(f"a program file calls op {namespace}::{name}.{overload}, which "
                            "this process does not define. Import the module that registers "
                            "it before loading.") from None


# -- values: plain data a weights-only unpickler accepts ----------------------------------


def _encode(x, where: str):
    if x is None or isinstance(x, (bool, int, float)) or type(x) is str:
        return x
    if isinstance(x, enum.Enum) and ENUMS.get(type(x).__name__) is type(x):
        return {"enum": [type(x).__name__, x.value]}
    if isinstance(x, Node):
        return {"node": x.name}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, (torch.device, torch.layout, torch.memory_format)):
        return {type(x).__name__: str(x).removeprefix("torch.")}
    if isinstance(x, slice):
        return {"slice": [_encode(v, where) for v in (x.start, x.stop, x.step)]}
    if isinstance(x, torch.Tensor):
        if not all(type(d) is int for d in (*x.shape, *x.stride())):
            raise DCPInputError(f"a program file cannot store {where}: a tensor of symbolic "
                                f"shape {tuple(x.shape)}. Program files hold static-shape "
                                "programs (every program transform builds).")
        return {"tensor": [list(x.shape), list(x.stride()), str(x.dtype).removeprefix("torch.")]}
    if isinstance(x, tuple):
        return {"tuple": [_encode(v, where) for v in x]}
    if isinstance(x, list):     # torch.Size is a tuple; FX's immutable_list is a list
        return {"list": [_encode(v, where) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[_encode(k, where), _encode(v, where)] for k, v in x.items()]}
    if dataclasses.is_dataclass(x) and DATACLASSES.get(type(x).__name__) is type(x):
        return {"dataclass": [type(x).__name__,
                              {f.name: _encode(getattr(x, f.name), where)
                               for f in dataclasses.fields(x)}]}
    raise DCPInputError(f"a program file cannot store {where}: a value of type "
                        f"{type(x).__name__} ({str(x)[:60]}). Program files hold numbers, "
                        "strings, dtypes, tensors' shapes and the runtime's own dataclasses.")


def _decode(x, env: dict | None = None):
    if not isinstance(x, dict):
        return x
    (kind, v), = x.items()
    if kind == "node":
        return env[v]
    if kind in ("tuple", "list"):
        items = [_decode(i, env) for i in v]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {_decode(k, env): _decode(i, env) for k, i in v}
    if kind == "dataclass":
        name, fields = v
        return DATACLASSES[name](**{k: _decode(i, env) for k, i in fields.items()})
    if kind == "enum":
        return ENUMS[v[0]](v[1])
    if kind == "slice":
        return slice(*(_decode(i, env) for i in v))
    if kind == "tensor":    # its shape, strides and dtype: on the meta device (no data)
        shape, stride, dtype = v
        return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device="meta")
    return _SCALARS[kind](v)


_SCALARS = {
    "dtype": lambda v: getattr(torch, v),
    "device": torch.device,
    "layout": lambda v: getattr(torch, v),
    "memory_format": lambda v: getattr(torch, v),
}
