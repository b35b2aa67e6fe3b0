"""The program file's codec: a DCPProgram's fields as plain data and back (see
:mod:`.program_file` for the format). It does not import the program class, so the class
can save itself without an import cycle; :func:`.program_file.load_program` builds it.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import json
import operator
import os
import shutil

import torch
from torch.fx import Graph, GraphModule, Node

from dcp_compile.runtime.kernels import moe as _moe_ops  # noqa: F401 - registers the dcp::moe ops a graph may call
from dcp_compile.runtime.kernels import ops as _dcp_ops  # noqa: F401 - registers the dcp:: ops a graph may call
from dcp_compile.runtime.kernels import recurrent as _recurrent_ops  # noqa: F401 - a hybrid's dcp:: recurrent ops
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.serving.state_cache import StateCacheSpec, StateLayer
from dcp_compile.runtime.errors import DCPError, DCPInputError
from dcp_compile.runtime.program.facts import LatentAttention, MixtureOfExperts, ModelFacts
from dcp_compile.runtime.names import Mode, Role, StepKind
from dcp_compile.runtime.program.checkpoint import Piece, WeightSource
from dcp_compile.runtime.program.schema import SchemaError, check_encoded, check_type, identifier
from dcp_compile.runtime.program.shards import ShardSpec
from dcp_compile.runtime.topology import Topology
from dcp_compile.runtime.version import __version__

MAGIC = "dcp_compile program"
# The file layout below; a change of it is a new dcp_compile version as well. Format 2: a
# header (versions, the body's length and SHA-256) before the torch.save body; format 1 was
# the body alone.
FORMAT = 2
# The first bytes of every file: the header follows (8-byte little-endian length, JSON).
LEAD = b"DCPPROG\n"
MAX_HEADER = 1 << 16
# The header's fields and their types (schema.check_type), as data.
HEADER = {"magic": str, "format": int, "dcp_compile": str, "torch": str, "body_bytes": int,
          "sha256": str}
HASH_CHUNK = 1 << 22

# The types a file may name, by name (a file names a class; loading looks it up here only).
DATACLASSES = {cls.__name__: cls for cls in (DCPConfig, Topology, StepShapes, ShardSpec,
                                              ModelFacts, LatentAttention, MixtureOfExperts,
                                              Piece, WeightSource, StateCacheSpec,
                                              StateLayer)}
ENUMS = {cls.__name__: cls for cls in (StepKind, Role, Mode)}
# Python callables a graph may call besides torch ops (getitem of a multi-output op).
PYTHON_TARGETS = {f"operator.{f.__name__}": f for f in (operator.getitem,)}
# Node metadata a loaded program keeps: the value (shape, dtype), the source line for error
# messages, torch's "custom" annotations and every key our passes write (runtime/names.py).
KEPT_META = ("val", "stack_trace", "custom")
OURS = "dcp_"
# Fields of the program the file leaves out (the compiler's record, see the docstring).
DROPPED = ("report", "dump_dir")
# The program fields a file holds, and their types once decoded (schema.check_type): graphs
# and constants are checked apart (GRAPH_NODE, the body's tensors).
FIELDS = {"config": DCPConfig, "topology": Topology, "shapes": StepShapes,
          "shards": dict[str, ShardSpec], "weight_inputs": list[str], "facts": ModelFacts,
          "source": str, "weight_names": dict[str, tuple[str, ...]],
          "weight_sources": dict[str, WeightSource],
          # a hybrid's recurrent-state caches of one rank (program.state_spec()), else None
          "state_cache": StateCacheSpec | None}
# The body's top level and one encoded graph node (schema.check_type; values inside a node
# are checked by schema.check_encoded).
BODY = {"fields": dict, "constants": dict[str, torch.Tensor], "graphs": dict[str, dict],
        "bucket_graphs": list[list]}
GRAPH = {"nodes": list[dict], "attrs": dict[str, torch.Tensor]}
NODE = {"op": str, "name": str, "target": object, "args": object, "kwargs": object,
        "meta": dict[str, object]}
NODE_OPS = ("placeholder", "get_attr", "call_function", "output")


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
    # The body goes to disk first and is hashed from there (a program with weights is not
    # held twice in memory), then the file is the header and the body, renamed into place.
    torch.save(payload, path + ".body.tmp")
    try:
        digest, size = hashlib.sha256(), 0
        with open(path + ".body.tmp", "rb") as body:
            while chunk := body.read(HASH_CHUNK):
                digest.update(chunk)
                size += len(chunk)
            body.seek(0)
            with open(path + ".tmp", "wb") as f:
                f.write(_lead(size, digest.hexdigest()))
                shutil.copyfileobj(body, f, HASH_CHUNK)
    finally:
        os.remove(path + ".body.tmp")
    os.replace(path + ".tmp", path)


def _lead(size: int, digest: str, **header) -> bytes:
    head = {"magic": MAGIC, "format": FORMAT, "dcp_compile": __version__,
            "torch": str(torch.__version__), "body_bytes": size, "sha256": digest, **header}
    text = json.dumps(head, sort_keys=True).encode()
    return LEAD + len(text).to_bytes(8, "little") + text


def pack(body: bytes, **header) -> bytes:
    """A program file's bytes: the lead, the header (this version's, with ``header``'s
    fields replaced) and ``body`` (a torch.save payload); what tests forge files with."""
    return _lead(len(body), hashlib.sha256(body).hexdigest(), **header) + bytes(body)


def read_program_fields(path: str | os.PathLike) -> dict:
    """The fields of the program ``save_program`` wrote to ``path`` (``DCPProgram(**them)``);
    refuses a file that is not one, one another dcp_compile or torch version wrote, and one
    that is truncated, corrupt or forged: a DCPInputError naming the file and what is wrong,
    never another exception and never code from the file."""
    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise DCPInputError(f"no program file at {path}. Write one with "
                            "dcp_compile.runtime.program.program_file.save_program.") from None
    except OSError as e:
        raise DCPInputError(f"program file {path} cannot be opened: {e}.") from None
    with f:
        start, header = _read_header(f, path)
        payload = _read_body(f, path, start, header)
    return _rebuild(payload, path)


def _refuse(path: str, what: str) -> DCPInputError:
    return DCPInputError(f"program file {path} {what}. Write it again with save_program "
                         "(program.save) of this dcp_compile version.")


def _read_header(f, path: str) -> tuple[int, dict]:
    lead = f.read(len(LEAD))
    if lead != LEAD:
        if lead.startswith(b"PK"):   # a zip: format 1 wrote the torch.save body alone
            raise DCPInputError(
                f"program file {path} was written by an older dcp_compile (format 1, no "
                f"header); this is dcp_compile {__version__} (format {FORMAT}). Transform "
                f"the model again with this version: program files are read only by the "
                f"version that wrote them.")
        raise DCPInputError(f"{path} is not a program file (it does not start with "
                            f"{LEAD!r}, the {MAGIC!r} header). Write it with save_program "
                            "(program.save).")
    n = int.from_bytes(f.read(8), "little")
    if not 0 < n <= MAX_HEADER:
        raise _refuse(path, f"has a header length of {n} bytes (at most {MAX_HEADER}): "
                            "its header is corrupt")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise _refuse(path, f"has a header that is not JSON ({raw[:40]!r}...): it is "
                            "corrupt or truncated") from None
    try:
        check_type(header, dict, "the header")
        if header.get("magic") != MAGIC:
            raise DCPInputError(f"{path} is not a program file (its header's magic is "
                                f"{str(header.get('magic'))[:40]!r}, not {MAGIC!r}). Write "
                                "it with save_program (program.save).")
        for name, hint in HEADER.items():
            if name in ("magic", "format", "dcp_compile", "torch") and name not in header:
                continue   # named below, as another version's file
            check_type(header.get(name), hint, f"the header's {name!r}")
    except SchemaError as e:
        raise _refuse(path, f"has a forged or corrupt header ({e})") from None
    wrote = (header.get("dcp_compile"), header.get("torch"), header.get("format"))
    here = (__version__, str(torch.__version__), FORMAT)
    if wrote != here:
        raise DCPInputError(
            f"program file {path} was written by dcp_compile {wrote[0]} with torch "
            f"{wrote[1]} (format {wrote[2]}); this is dcp_compile {here[0]} with torch "
            f"{here[1]} (format {here[2]}). Transform the model again with this version: "
            f"program files are read only by the version that wrote them.")
    return len(LEAD) + 8 + n, header


def _read_body(f, path: str, start: int, header: dict) -> dict:
    size = os.fstat(f.fileno()).st_size
    if size - start != header["body_bytes"]:
        raise _refuse(path, f"holds {size - start} bytes after its header, which says "
                            f"{header['body_bytes']}: it is truncated or was edited")
    digest = hashlib.sha256()
    while chunk := f.read(HASH_CHUNK):
        digest.update(chunk)
    if digest.hexdigest() != header["sha256"]:
        raise _refuse(path, f"has a body whose SHA-256 is {digest.hexdigest()[:16]}..., not "
                            f"the {header['sha256'][:16]}... its header says: it is corrupt "
                            "(a flipped or changed byte)")
    try:
        payload = torch.load(io.BufferedReader(_Window(f, start, header["body_bytes"])),
                             weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable body gets the same answer
        raise _refuse(path, f"has a body torch.load(weights_only=True) cannot read "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                      ) from None
    return payload


class _Window(io.RawIOBase):
    """Bytes [start, start + size) of an open file, as a file (torch.load's reader seeks)."""

    def __init__(self, f, start: int, size: int):
        self.f, self.start, self.size = f, start, size
        f.seek(start)

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.f.tell() - self.start

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.tell(), io.SEEK_END: self.size}[whence]
        self.f.seek(self.start + max(base + offset, 0))
        return self.tell()

    def readinto(self, buffer):
        n = max(min(len(buffer), self.size - self.tell()), 0)
        data = self.f.read(n)
        buffer[:len(data)] = data
        return len(data)


def _rebuild(payload, path: str) -> dict:
    """The program's fields from a body torch.load read: checked against the schema first,
    then decoded; what does not fit is refused naming where."""
    try:
        check_type(payload, dict[str, object], "the body")
        if sorted(payload) != sorted(BODY):
            raise SchemaError("the body", f"the keys {sorted(BODY)}", sorted(payload))
        for name, hint in BODY.items():
            check_type(payload[name], hint, f"the body's {name!r}")
        ctx = {"dataclasses": DATACLASSES, "enums": ENUMS, "nodes": frozenset()}
        check_encoded(payload["fields"], "the program's fields", ctx)
        graphs = {_step(k, "graph"): _decode_graph(g, f"graph {k!r}")
                  for k, g in payload["graphs"].items()}
        buckets = {}
        for i, entry in enumerate(payload["bucket_graphs"]):
            check_type(tuple(entry), tuple[int, dict[str, dict]], f"bucket entry {i}")
            bucket, by_kind = entry
            buckets[bucket] = {_step(k, f"bucket {bucket}"):
                               _decode_graph(g, f"graph {k!r} of bucket {bucket}")
                               for k, g in by_kind.items()}
        fields = _decode(payload["fields"])
        check_type(fields, dict[str, object], "the program's fields")
        if sorted(fields) != sorted(FIELDS):
            raise SchemaError("the program's fields", f"the names {sorted(FIELDS)}",
                              sorted(fields))
        for name, hint in FIELDS.items():
            check_type(fields[name], hint, f"the program's {name!r}")
    except SchemaError as e:
        raise _refuse(path, f"does not hold a program: {e}") from None
    except DCPError as e:
        raise _refuse(path, f"holds a program that cannot be rebuilt: {e}") from None
    except Exception as e:  # noqa: BLE001 - past the schema, still the file's fault
        raise _refuse(path, f"holds a program that cannot be rebuilt ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return dict(**fields, graphs=graphs, constants=payload["constants"], bucket_graphs=buckets)


def _step(name, where: str) -> StepKind:
    if name not in {k.value for k in StepKind}:
        raise SchemaError(where, f"a step kind ({[k.value for k in StepKind]})", name)
    return StepKind(name)


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


def _decode_graph(data, where: str) -> GraphModule:
    """The GraphModule of an encoded graph, each node checked (schema) before it is made:
    FX writes placeholder targets and keyword names into generated code verbatim, so they
    must be identifiers, or loading would run the file's text."""
    check_type(data, dict[str, object], where)
    if sorted(data) != sorted(GRAPH):
        raise SchemaError(where, f"the keys {sorted(GRAPH)}", sorted(data))
    for name, hint in GRAPH.items():
        check_type(data[name], hint, f"{where}'s {name!r}")
    for name in data["attrs"]:
        _dotted(name, f"{where}'s attribute")
    graph, env = Graph(), {}
    nodes = data["nodes"]
    for i, d in enumerate(nodes):
        at = f"{where}, node {i}"
        check_type(d, dict[str, object], at)
        if sorted(d) != sorted(NODE):
            raise SchemaError(at, f"the keys {sorted(NODE)}", sorted(d))
        for name, hint in NODE.items():
            check_type(d[name], hint, f"{at}'s {name!r}")
        op, name = d["op"], d["name"]
        at = f"{where}, node {name!r}"
        identifier(name, at + " (its name)")
        if op not in NODE_OPS:
            raise SchemaError(at, f"an op among {NODE_OPS}", op)
        if name in env:
            raise SchemaError(at, "a name no node before it has", name)
        if (op == "output") != (i == len(nodes) - 1):
            raise SchemaError(at, "one output node, the last", op)
        ctx = {"dataclasses": DATACLASSES, "enums": ENUMS, "nodes": env}
        for part in ("args", "kwargs"):
            check_encoded(d[part], f"{at}'s {part}", ctx)
        _check_call(d, at)
        for k, v in d["meta"].items():
            if k not in KEPT_META and not k.startswith(OURS):
                raise SchemaError(f"{at}'s meta", f"a key among {KEPT_META} or {OURS}*", k)
            check_encoded(v, f"{at}'s meta[{k!r}]", ctx)
        args = _decode(d["args"], env)
        kwargs = _decode(d["kwargs"], env)
        if op == "output":
            node = graph.output(args[0])
        else:
            node = graph.create_node(op, _decode_target(op, d["target"]), args, kwargs,
                                     name=name)
        node.meta.update({k: _decode(v, env) for k, v in d["meta"].items()})
        env[name] = node
    if not nodes:
        raise SchemaError(where, "a graph with an output node", "no nodes")
    return GraphModule(dict(data["attrs"]), graph)


def _check_call(d: dict, at: str) -> None:
    """A node's target and argument containers: what codec._encode_graph writes for its op."""
    op, target = d["op"], d["target"]
    if type(d["args"]) is not dict or list(d["args"]) != ["tuple"]:
        raise SchemaError(f"{at}'s args", "an encoded tuple", d["args"])
    if type(d["kwargs"]) is not dict or list(d["kwargs"]) != ["dict"]:
        raise SchemaError(f"{at}'s kwargs", "an encoded dict", d["kwargs"])
    for i, (key, _) in enumerate(d["kwargs"]["dict"]):
        identifier(key, f"{at}'s keyword argument {i}")
    if op == "placeholder":
        identifier(target, f"{at}'s target")
    elif op == "get_attr":
        _dotted(target, f"{at}'s target")
    elif op == "output":
        if target != "output" or len(d["args"]["tuple"]) != 1:
            raise SchemaError(at, "target 'output' and one argument", (target, d["args"]))
    elif type(target) is dict and list(target) == ["python"]:
        if target["python"] not in PYTHON_TARGETS:
            raise SchemaError(f"{at}'s target", f"one of {sorted(PYTHON_TARGETS)}", target)
    elif type(target) is dict and list(target) == ["op"]:
        parts = target["op"]
        if type(parts) is not list or len(parts) != 3:
            raise SchemaError(f"{at}'s target", "[namespace, op, overload]", parts)
        for part in parts:
            identifier(part, f"{at}'s target")
    else:
        raise SchemaError(f"{at}'s target", "{'op': [namespace, op, overload]} or "
                                            "{'python': name}", target)


def _dotted(name, where: str) -> str:
    if type(name) is not str:
        raise SchemaError(where, "a dotted name of identifiers", name)
    for part in name.split("."):
        identifier(part, where)
    return name


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
        found = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        found = None
    if not isinstance(found, torch._ops.OpOverload):
        raise DCPInputError(f"a program file calls op {namespace}::{name}.{overload}, which "
                            "this process does not define. Import the module that registers "
                            "it before loading.") from None
    return found


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
