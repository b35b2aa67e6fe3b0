"""Corrupt files (issue #39 item 3): a program file (runtime/program/codec.py) or a checkpoint
file (runtime/program/checkpoint.py) that is truncated, bit-flipped, from another version or
forged is a DCPInputError naming the file and what is wrong; never another exception, never
code from the file.

The fuzz mutates the demo program's file as bytes (truncation, bit flips, insertions), its
header (any field), its body with the hash recomputed (a forger's file: torch.load and the
schema must hold), and its decoded structure (a subtree replaced or a key renamed, saved and
hashed again); and a checkpoint's safetensors header (offsets past the file, overlapping
boxes, wrong dtypes and shapes, huge lengths). A slice in the test command, 1,000 inputs
per fuzz behind DCP_CORRUPT_FULL (docs/testing.md: Full runs).
"""

from __future__ import annotations

import functools
import io
import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.program import codec
from dcp_compile.runtime.program.checkpoint import Checkpoint
from dcp_compile.runtime.program.program_file import load_program
from dcp_compile.runtime.serving.engine import StepShapes

from full_runs import full

EXAMPLES = 1000 if full("DCP_CORRUPT_FULL") else 100
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@functools.lru_cache(maxsize=None)
def _program_bytes() -> bytes:
    """The demo program (1 layer, tp=4/dcp=2 decode, one context bucket below the full one)."""
    model = demo_model(DemoConfig(num_layers=1))
    program = dcp_compile.transform(model, tp=4, dcp=2, mode="decode", block_size=4,
                                    shapes=StepShapes(batch=1, context_len=8, max_blocks=2,
                                                      num_blocks=5),
                                    buckets=[8], check=False)
    with tempfile.TemporaryDirectory() as directory:
        program.save(Path(directory) / "p.dcp")
        return (Path(directory) / "p.dcp").read_bytes()


def _split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[len(codec.LEAD):len(codec.LEAD) + 8], "little")
    start = len(codec.LEAD) + 8
    return json.loads(data[start:start + n]), data[start + n:]


@functools.lru_cache(maxsize=None)
def _payload_paths() -> tuple:
    """Every (path of keys) into the body's structure, tensors' insides excluded."""
    payload = torch.load(io.BytesIO(_split(_program_bytes())[1]), weights_only=True)
    paths = []

    def walk(x, path):
        paths.append(path)
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + (k,))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, path + (i,))
    walk(payload, ())
    return tuple(paths)


def _loads_or_refuses(data: bytes, tmp_path: Path) -> str:
    """'loaded' or 'refused' (a DCPInputError naming the file); any other exception fails."""
    path = tmp_path / "fuzzed.dcp"
    path.write_bytes(data)
    try:
        load_program(path)
    except DCPInputError as e:
        assert str(path) in str(e), e
        return "refused"
    return "loaded"


# Values a forger might put anywhere: wrong types, our own encodings misused, injections.
ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["x=__import__('os').system('touch /tmp/dcp-pwned')", "ModelFacts",
                     "decode", "output", "placeholder", "call_module", "__class__"]),
    st.lists(st.integers(-3, 3), max_size=3),
    st.sampled_from([{"dataclass": ["ModelFacts", {}]}, {"dataclass": ["Nope", {}]},
                     {"node": "nowhere"}, {"enum": ["StepKind", "nope"]},
                     {"dict": [[{"dict": []}, 1]]}, {"tensor": [[-1], [1], "float32"]},
                     {"tensor": [[2 ** 40, 2 ** 40], [1, 1], "float32"]},
                     {"dtype": "cat"}, {"device": "cuda:99"}, {"slice": [1]},
                     {"op": ["aten", "add", "Tensor"]}, {"python": "os.system"},
                     {"op": ["__class__", "__init__", "__call__"]},
                     torch.zeros(2), {}, {"a": 1, "b": 2}]))


# How a file is mutated; the forgeries that pass the hash (tree, body) weigh more: they reach
# torch.load and the schema, where a loader can still fail.
HOW = ["tree"] * 4 + ["body"] * 2 + ["header", "flip", "insert", "truncate"]
KEYS = st.one_of(st.text(max_size=8), st.integers(-2, 5),
                 st.sampled_from(["ModelFacts", "decode", "graphs", "fields", "dict", "op"]))


@FUZZ
@given(data=st.data())
def test_program_file_bytes_are_loaded_or_refused(data, tmp_path_factory):
    original = _program_bytes()
    header, body = _split(original)
    how = data.draw(st.sampled_from(HOW),
                    label="how")
    if how == "truncate":
        mutated = original[:data.draw(st.integers(0, len(original) - 1))]
    elif how == "flip":
        mutated = bytearray(original)
        for at in data.draw(st.lists(st.integers(0, len(original) - 1), min_size=1,
                                     max_size=4)):
            mutated[at] ^= 1 << data.draw(st.integers(0, 7))
        mutated = bytes(mutated)
    elif how == "insert":
        at = data.draw(st.integers(0, len(original)))
        mutated = original[:at] + data.draw(st.binary(min_size=1, max_size=8)) + original[at:]
    elif how == "header":
        field = data.draw(st.sampled_from(sorted(codec.HEADER) + ["extra"]))
        mutated = codec.pack(body, **{**header, field: data.draw(ODD.filter(
            lambda v: not isinstance(v, torch.Tensor)))})
    elif how == "body":      # a forger's bytes: the hash recomputed over them
        mutated = bytearray(body)
        for at in data.draw(st.lists(st.integers(0, len(body) - 1), min_size=1, max_size=4)):
            mutated[at] ^= 1 << data.draw(st.integers(0, 7))
        mutated = codec.pack(bytes(mutated))
    else:                    # a forger's structure, saved and hashed again
        payload = torch.load(io.BytesIO(body), weights_only=True)
        path = data.draw(st.sampled_from(_payload_paths()[1:]))
        parent = payload
        for k in path[:-1]:
            parent = parent[k]
        if isinstance(parent, dict) and data.draw(st.booleans(), label="rename key"):
            parent[data.draw(KEYS)] = \
                parent.pop(path[-1])
        else:
            parent[path[-1]] = data.draw(ODD)
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        mutated = codec.pack(buffer.getvalue())
    outcome = _loads_or_refuses(mutated, tmp_path_factory.mktemp("fuzz"))
    event(f"{how}: {outcome}")
    if mutated != original and how in ("truncate", "flip", "insert"):
        assert outcome == "refused"
    assert not Path("/tmp/dcp-pwned").exists()


def test_a_forged_placeholder_target_is_refused_not_run(tmp_path):
    """FX writes placeholder targets into the graph's code: a forged one must not run."""
    payload = torch.load(io.BytesIO(_split(_program_bytes())[1]), weights_only=True)
    marker = tmp_path / "ran"
    # The last placeholder: a default argument there is valid Python, run when FX defines
    # forward (format 1 loaded this file and created the marker).
    node = [n for n in payload["graphs"]["decode"]["nodes"] if n["op"] == "placeholder"][-1]
    node["target"] = f"x=open({str(marker)!r}, 'w')"
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    (tmp_path / "p.dcp").write_bytes(codec.pack(buffer.getvalue()))
    with pytest.raises(DCPInputError, match=r"p\.dcp does not hold a program: graph 'decode', "
                                            r"node .*'s target: expected a Python identifier"):
        load_program(tmp_path / "p.dcp")
    assert not marker.exists()


@pytest.mark.parametrize("how, match", [
    ("truncate", r"holds \d+ bytes after its header, which says \d+: it is truncated"),
    ("flip", r"SHA-256 is .*not the .* its header says: it is corrupt"),
    ("format1", r"written by an older dcp_compile \(format 1, no header\)"),
    ("huge-header", r"header length of \d+ bytes \(at most 65536\)"),
])
def test_each_corruption_is_named(how, match, tmp_path):
    data = _program_bytes()
    header, body = _split(data)
    mutated = {"truncate": data[:-10],
               "flip": data[:-100] + bytes([data[-100] ^ 4]) + data[-99:],
               "format1": body,
               "huge-header": codec.LEAD + (2 ** 40).to_bytes(8, "little") + data[16:]}[how]
    (tmp_path / "p.dcp").write_bytes(mutated)
    with pytest.raises(DCPInputError, match=match):
        load_program(tmp_path / "p.dcp")


# -- checkpoints: forged safetensors headers ----------------------------------------------

TENSORS = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
           "b": torch.ones(5, dtype=torch.bfloat16), "c": torch.zeros(0, 2)}


@functools.lru_cache(maxsize=None)
def _safetensors() -> tuple[dict, bytes]:
    from safetensors.torch import save
    data = save(TENSORS)
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _read_all(directory: Path) -> str:
    try:
        with Checkpoint(directory) as ckpt:
            for key in ckpt.files:
                shape, _ = ckpt.header(key)
                ckpt.read(key, tuple((0, s) for s in shape))
    except DCPInputError as e:
        assert str(directory) in str(e) or "checkpoint tensor" in str(e), e
        return "refused"
    return "read"


ENTRY_FIELDS = st.sampled_from(["dtype", "shape", "data_offsets", "extra"])
FORGED = st.one_of(
    ODD.filter(lambda v: not isinstance(v, torch.Tensor)),
    st.sampled_from(["F32", "BF16", "I64", "F8_E8M0", "BOOL", "U8"]),
    st.lists(st.integers(-2, 2 ** 40), max_size=3),
    st.tuples(st.integers(-8, 200), st.integers(-8, 200)).map(list))


@FUZZ
@given(data=st.data())
def test_safetensors_header_forgeries_are_read_or_refused(data, tmp_path_factory):
    header, body = _safetensors()
    header = json.loads(json.dumps(header))
    how = data.draw(st.sampled_from(["entry", "overlap", "length", "not-a-dict", "truncate"]))
    length = None
    if how == "entry":
        key = data.draw(st.sampled_from(sorted(TENSORS)))
        header[key][data.draw(ENTRY_FIELDS)] = data.draw(FORGED)
    elif how == "overlap":
        a, b = data.draw(st.permutations(sorted(TENSORS)))[:2]
        header[b]["data_offsets"] = list(header[a]["data_offsets"])
    elif how == "length":
        length = data.draw(st.sampled_from([0, 1, 2 ** 31, 2 ** 63, 2 ** 64 - 1]))
    elif how == "not-a-dict":
        header = data.draw(st.sampled_from([[], 3, "x", None, [[1, 2]]]))
    text = json.dumps(header).encode()
    raw = struct.pack("<Q", len(text) if length is None else length) + text + body
    if how == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    directory = tmp_path_factory.mktemp("ckpt")
    (directory / "model.safetensors").write_bytes(raw)
    outcome = _read_all(directory)
    event(f"{how}: {outcome}")
    if how in ("overlap", "length", "not-a-dict", "truncate"):
        assert outcome == "refused", how


@pytest.mark.parametrize("forge, match", [
    (lambda h: h["a"].update(data_offsets=[0, 10 ** 9]), r"past the end of the file"),
    (lambda h: h["b"].update(data_offsets=h["a"]["data_offsets"], dtype="F32",
                             shape=[3, 4]), r"tensors a and b overlap"),
    (lambda h: h["a"].update(shape=[4, 4]), r"tensor a of shape \[4, 4\] and dtype F32 is 64 "
                                             r"bytes, and its offsets \[0, 48\) hold 48"),
    (lambda h: h["a"].update(dtype={"F32": 1}), r"tensor a: .* is not \{dtype"),
])
def test_each_checkpoint_forgery_is_named(forge, match, tmp_path):
    header, body = _safetensors()
    header = json.loads(json.dumps(header))
    forge(header)
    text = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + body)
    with pytest.raises(DCPInputError, match=rf"model\.safetensors is not a readable safetensors "
                                            rf"file .*{match}"):
        with Checkpoint(tmp_path) as ckpt:
            for key in ckpt.files:
                ckpt.header(key)
