"""Reading one rank's weights from a checkpoint: only this rank's slices, never the model.


A program names each weight input by the model's own parameter names
(``DCPProgram.weight_names``: placeholder -> FQNs, the first the primary, the others tied
aliases) and knows how a rank's shard is cut (``ShardSpec.boxes``: boxes of the full
tensor). A Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``, one file
or sharded with ``model.safetensors.index.json``) holds each tensor by name, so a rank reads
the bytes of each box of each weight (the safetensors header says where) and nothing else.

Where a model holds a weight in another form than its checkpoint (transformers 5 stacks the
per-expert tensors of a checkpoint into one fused tensor on load), the program records the
weight's :class:`WeightSource`: the checkpoint tensors (:class:`Piece`) that tile the full
weight. The frontend derives it from the model's own conversion rules at compile time
(dcp_compile/frontends/huggingface.py ``checkpoint_sources``), so this reader needs no
knowledge of any model.

Every piece's presence, shape and dtype kind is checked from the files' headers before any
tensor is read (:meth:`Checkpoint.plan`): a bad checkpoint is a DCPInputError naming the
tensor or file and what was expected, raised before a rank starts serving.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dcp_compile.runtime.errors import DCPInputError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# A load of more files than this shows a progress bar (tqdm) on stderr.
PROGRESS_FILES = 4
# safetensors' dtype names -> torch (the ones a checkpoint of ours may hold).
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}
# The safetensors format's own bound on a header (its reference reader refuses larger ones).
MAX_HEADER = 100_000_000
# One tensor of a safetensors header: its fields and what each must be (rules as data).
HEADER_ENTRY = {
    "dtype": lambda v: type(v) is str,
    "shape": lambda v: type(v) is list and all(type(d) is int and 0 <= d < 2 ** 48 for d in v),
    "data_offsets": lambda v: type(v) is list and len(v) == 2 and
    all(type(o) is int for o in v),
}


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor inside a program weight: it fills the box of the weight that
    starts at ``offset``; ``stacked``: the weight dim the checkpoint tensor has no dim for (an
    expert's index in a stacked expert tensor: size 1 there), else None."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]          # the checkpoint tensor's own shape
    stacked: int | None = None

    def extent(self) -> tuple[int, ...]:
        """The piece's size along every dim of the weight."""
        s = list(self.shape)
        if self.stacked is not None:
            s.insert(self.stacked, 1)
        return tuple(s)


@dataclass(frozen=True)
class WeightSource:
    """The checkpoint tensors that tile one weight (a weight held as its checkpoint holds it
    needs none: it is one piece, its own name)."""

    pieces: tuple[Piece, ...]
    unsupported: str = ""           # why the weight cannot be read piecewise (then no pieces)


@dataclass
class LoadStats:
    """What one rank's load read: bytes of tensor data (in the checkpoint's dtype), tensors
    sliced, files opened, seconds."""

    bytes_read: int = 0
    tensors: int = 0
    files: int = 0
    seconds: float = 0.0
    opened: set = field(default_factory=set, repr=False)


@dataclass(frozen=True)
class _Entry:
    """Where one tensor's bytes are: file, absolute offset, dtype, shape (its header)."""

    path: Path
    start: int
    nbytes: int
    dtype: torch.dtype | str
    shape: tuple[int, ...]


def _entries(path: Path, raw, start: int, size: int) -> dict[str, "_Entry"]:
    """A safetensors header's tensors, each checked against the header's schema
    (:data:`HEADER_ENTRY`), its dtype and shape (its byte count), the file's end and the
    other tensors (no two boxes of bytes overlap); raises ValueError naming what is wrong."""
    if type(raw) is not dict:
        raise ValueError(f"the header is a JSON {type(raw).__name__}, not an object")
    header, spans = {}, []
    for key, e in raw.items():
        if key == "__metadata__":
            continue
        if type(e) is not dict or sorted(e) != sorted(HEADER_ENTRY) or \
                not all(rule(e[k]) for k, rule in HEADER_ENTRY.items()):
            raise ValueError(f"tensor {key}: {str(e)[:80]} is not {{dtype: a name, shape: "
                             f"[non-negative ints], data_offsets: [begin, end]}}")
        begin, end = e["data_offsets"]
        if not 0 <= begin <= end or start + end > size:
            raise ValueError(f"tensor {key} at bytes [{begin}, {end}) of the data, "
                             f"past the end of the file ({size} bytes)")
        dtype, shape = DTYPES.get(e["dtype"], e["dtype"]), tuple(e["shape"])
        if isinstance(dtype, torch.dtype):
            want = math.prod(shape) * dtype.itemsize
            if end - begin != want:
                raise ValueError(f"tensor {key} of shape {list(shape)} and dtype {e['dtype']} "
                                 f"is {want} bytes, and its offsets [{begin}, {end}) hold "
                                 f"{end - begin}")
        header[key] = _Entry(path, start + begin, end - begin, dtype, shape)
        if end > begin:
            spans.append((begin, end, key))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"tensors {a} and {b} overlap (bytes {begin} to {end} of the "
                             f"data belong to both)")
    return header


class Checkpoint:
    """A checkpoint directory's tensors by name: the safetensors headers read on open, a
    tensor's bytes on demand, box by box, with positioned reads (``os.preadv`` into the
    result), so that a rank's memory holds its shard only: a memory map would keep every
    page it touched resident, and a column slice of a row-major tensor touches them all."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise DCPInputError(f"no checkpoint directory at {self.directory}. Pass the "
                                f"directory save_pretrained wrote (config.json + *.safetensors).")
        self._headers: dict[Path, dict[str, _Entry]] = {}
        self._fds: dict[Path, int] = {}
        self.files = self._key_files()
        self.stats = LoadStats()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _key_files(self) -> dict[str, Path]:
        index = self.directory / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise DCPInputError(f"checkpoint index {index} is not a safetensors index "
                                    f"(no readable 'weight_map': {e}). Write the checkpoint "
                                    f"again with save_pretrained.") from None
            files = {key: self.directory / name for key, name in weight_map.items()}
            for name in sorted({p.name for p in files.values()}):
                if not (self.directory / name).exists():
                    raise DCPInputError(
                        f"checkpoint index {index} names file {name}, which is not in "
                        f"{self.directory}. Copy the missing file, or write the checkpoint "
                        f"again.")
            return files
        single = sorted(self.directory.glob("*.safetensors"))
        if not single:
            raise DCPInputError(f"checkpoint directory {self.directory} has no {INDEX} and no "
                                f"*.safetensors file. Save the model with "
                                f"save_pretrained(dir, safe_serialization=True).")
        if len(single) > 1:
            raise DCPInputError(f"checkpoint directory {self.directory} has "
                                f"{len(single)} safetensors files and no {INDEX} to say "
                                f"which holds which tensor. Add the index (save_pretrained "
                                f"writes it).")
        return {key: single[0] for key in self._header(single[0])}

    def _header(self, path: Path) -> dict[str, _Entry]:
        """The safetensors header of ``path`` (8-byte little-endian length, JSON), checked
        against the file's size: a truncated or corrupt file is refused here."""
        header = self._headers.get(path)
        if header is not None:
            return header
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n <= min(size - 8, MAX_HEADER):
                    raise ValueError(f"header length {n} in a file of {size} bytes (at most "
                                     f"{MAX_HEADER})")
                raw = json.loads(f.read(n))
            header = _entries(path, raw, 8 + n, size)
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise DCPInputError(f"checkpoint file {path} is not a readable safetensors file "
                                f"({type(e).__name__}: {e}); it may be truncated or corrupt "
                                f"(or forged). Copy or write it again.") from None
        self._headers[path] = header
        return header

    def _entry(self, key: str) -> _Entry:
        entry = self._header(self.files[key]).get(key)
        if entry is None:
            raise DCPInputError(f"checkpoint index names {key} in {self.files[key].name}, "
                                f"whose header has no such tensor. Write the checkpoint again.")
        return entry

    def has(self, key: str) -> bool:
        return key in self.files

    def header(self, key: str) -> tuple[tuple[int, ...], torch.dtype | str]:
        e = self._entry(key)
        return e.shape, e.dtype

    def read(self, key: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The ``box`` of tensor ``key`` (per dim ``(start, stop)``), in its own dtype: one
        positioned read per contiguous run of the box."""
        e = self._entry(key)
        if not isinstance(e.dtype, torch.dtype):
            raise DCPInputError(f"checkpoint tensor {key} in {e.path} is of dtype {e.dtype}, "
                                f"which dcp_compile does not read (one of {sorted(DTYPES)}). "
                                f"Pass an unquantized checkpoint of this model.")
        if len(box) != len(e.shape) or not all(0 <= a <= b <= n for (a, b), n in
                                               zip(box, e.shape)):
            raise DCPInputError(f"box {box} is not inside checkpoint tensor {key} of shape "
                                f"{list(e.shape)} ({e.path}): the checkpoint does not match "
                                f"the program. Compile the program from this checkpoint's "
                                f"config.")
        out = torch.empty([b - a for a, b in box], dtype=e.dtype)
        if out.numel() == 0:
            return out
        item = out.element_size()
        strides = [math.prod(e.shape[d + 1:]) for d in range(len(e.shape))]
        # The last dim the box cuts: every run is contiguous from there on.
        cut = max((d for d, (a, b) in enumerate(box) if (a, b) != (0, e.shape[d])),
                  default=0)
        run = (box[cut][1] - box[cut][0]) * strides[cut] * item if e.shape else item
        raw = out.view(torch.uint8).reshape(-1).numpy()
        fd = self._fd(e.path)
        at = 0
        for idx in itertools.product(*(range(a, b) for a, b in box[:cut])):
            first = sum(i * s for i, s in zip(idx, strides)) + \
                (box[cut][0] * strides[cut] if e.shape else 0)
            got = os.preadv(fd, [raw[at:at + run]], e.start + first * item)
            if got != run:
                raise DCPInputError(f"reading tensor {key} from checkpoint file {e.path} "
                                    f"gave {got} of {run} bytes: the file is truncated. Copy "
                                    f"or write it again.")
            at += run
        self.stats.bytes_read += at
        self.stats.tensors += 1
        self.stats.opened.add(e.path)
        return out

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    # -- one program weight --------------------------------------------------------------

    def source_of(self, names: tuple[str, ...], source: WeightSource | None,
                  full: torch.Tensor) -> WeightSource:
        """Where weight ``names`` (primary, aliases) of ``full``'s shape and dtype lives in
        this checkpoint, checked against the headers (raises naming what is wrong)."""
        if source is None:
            key = next((n for n in names if self.has(n)), None)
            if key is None:
                raise DCPInputError(
                    f"checkpoint {self.directory} has no tensor {names[0]}"
                    f"{' (nor its aliases ' + ', '.join(names[1:]) + ')' if names[1:] else ''}"
                    f". Pass the checkpoint of the model this program was compiled from.")
            source = WeightSource((Piece(key, (0,) * full.dim(), tuple(full.shape)),))
        if source.unsupported:
            raise DCPInputError(f"weight {names[0]} cannot be read from a checkpoint slice by "
                                f"slice: {source.unsupported}. Transform the model with its "
                                f"real weights instead, or report this model to dcp_compile.")
        for p in source.pieces:
            if not self.has(p.key):
                raise DCPInputError(f"checkpoint {self.directory} has no tensor {p.key} (part "
                                    f"of weight {names[0]}). Pass the checkpoint of the model "
                                    f"this program was compiled from.")
            shape, dtype = self.header(p.key)
            if shape != p.shape:
                raise DCPInputError(
                    f"checkpoint tensor {p.key} has shape {list(shape)}; the program expects "
                    f"{list(p.shape)} (weight {names[0]}). The checkpoint's config does not "
                    f"match the program: compile the program from this checkpoint's config.")
            if not isinstance(dtype, torch.dtype) or \
                    dtype.is_floating_point != full.dtype.is_floating_point:
                raise DCPInputError(
                    f"checkpoint tensor {p.key} is of dtype {dtype}; weight {names[0]} is "
                    f"{full.dtype} (a checkpoint weight is cast only between floating "
                    f"types). Pass an unquantized checkpoint of this model.")
        return source

    def read_shard(self, source: WeightSource, full: torch.Tensor,
                   boxes: list[tuple[tuple[int, int], ...]], dim: int) -> torch.Tensor:
        """The shard made of ``boxes`` of the full weight (concatenated along ``dim``), read
        piece by piece into one tensor of the program's dtype (``full``'s)."""
        shape = list(full.shape)
        shape[dim] = sum(b[dim][1] - b[dim][0] for b in boxes)
        out = torch.empty(shape, dtype=full.dtype)
        at = 0
        for box in boxes:
            width = box[dim][1] - box[dim][0]
            target = out.narrow(dim, at, width)
            filled = 0
            for p in source.pieces:
                inter, src = piece_box(box, p)
                if inter is None:
                    continue
                part = self.read(p.key, src)
                if p.stacked is not None:
                    part = part.unsqueeze(p.stacked)
                target[tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in
                             zip(inter, box))].copy_(part)
                filled += part.numel()
            if filled != target.numel():
                raise DCPInputError(f"the checkpoint pieces of a weight cover {filled} of the "
                                    f"{target.numel()} elements of box {box} "
                                    f"({[p.key for p in source.pieces][:3]}...). Report this "
                                    f"model to dcp_compile.")
            at += width
        return out


def piece_box(box, piece: Piece):
    """(the part of weight box ``box`` that checkpoint tensor ``piece`` fills, in the
    weight's coordinates; that part in the piece's own coordinates), or (None, None)."""
    inter = _intersect(box, piece.offset, piece.extent())
    if inter is None:
        return None, None
    return inter, tuple((lo - o, hi - o) for d, ((lo, hi), o) in
                        enumerate(zip(inter, piece.offset)) if d != piece.stacked)


def _intersect(box, offset, extent):
    out = []
    for (lo, hi), o, n in zip(box, offset, extent):
        a, b = max(lo, o), min(hi, o + n)
        if a >= b:
            return None
        out.append((a, b))
    return tuple(out)


def rank_boxes(names: dict[str, tuple[str, ...]], sources: dict[str, WeightSource],
               shards: dict, fulls: dict, rank: int) -> dict[str, set]:
    """Checkpoint key -> the boxes of it (its own coordinates) rank ``rank`` reads: what
    :func:`read_rank_weights` will ask of a checkpoint, for every alias of a weight (which
    alias a checkpoint holds is known only from it)."""
    out: dict[str, set] = {}
    for name, fqns in names.items():
        full, spec = fulls[name], shards.get(name)
        boxes = spec.boxes(full.shape, rank) if spec is not None else \
            [tuple((0, s) for s in full.shape)]
        source = sources.get(fqns[0])
        pieces = source.pieces if source is not None else \
            tuple(Piece(key, (0,) * full.dim(), tuple(full.shape)) for key in fqns)
        for box in boxes:
            for piece in pieces:
                _, src = piece_box(box, piece)
                if src is not None:
                    out.setdefault(piece.key, set()).add(src)
    return out


class StreamedCheckpoint:
    """A checkpoint given as a stream of ``(name, tensor)`` (vLLM's weight iterator), with
    :class:`Checkpoint`'s reading interface: each tensor is cut as it streams by into the
    boxes a rank reads (``wanted``: :func:`rank_boxes`), which are kept as copies, and the
    tensor is dropped, so the rank holds its shard only (never the whole model)."""

    def __init__(self, weights, wanted: dict[str, set], *, name: str = "a weight stream"):
        self.directory = name               # for the messages Checkpoint's checks raise
        self.files: dict = {}
        self.stats = LoadStats()
        self._headers: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._boxes: dict[tuple[str, tuple], torch.Tensor] = {}
        start = time.perf_counter()
        for key, tensor in weights:
            self._headers[key] = (tuple(tensor.shape), tensor.dtype)
            for box in wanted.get(key, ()):
                part = tensor[tuple(slice(a, b) for a, b in box)].clone()
                self._boxes[key, box] = part
                self.stats.bytes_read += part.numel() * part.element_size()
        self.stats.seconds = time.perf_counter() - start

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def has(self, key: str) -> bool:
        return key in self._headers

    def header(self, key: str):
        return self._headers[key]

    def read(self, key: str, box) -> torch.Tensor:
        part = self._boxes.get((key, tuple(box)))
        if part is None:
            raise DCPInputError(f"{self.directory} kept no box {box} of tensor {key}: the "
                                f"reader was planned for another program or rank. Stream "
                                f"the weights for this rank's program (rank_boxes).")
        self.stats.tensors += 1
        return part

    source_of = Checkpoint.source_of
    read_shard = Checkpoint.read_shard


def read_rank_weights(directory, names: dict[str, tuple[str, ...]],
                      sources: dict[str, WeightSource], shards: dict, fulls: dict,
                      rank: int, *, progress: bool | None = None
                      ) -> tuple[dict[str, torch.Tensor], LoadStats]:
    """Rank ``rank``'s weights ``names`` (placeholder -> FQNs) from checkpoint ``directory``:
    each placeholder's shard (``shards``: ShardSpec or None = whole) of its full weight
    (``fulls``: shape and dtype, any device), cast to that dtype. Every weight is checked
    against the headers before any is read. ``directory`` may be a
    :class:`StreamedCheckpoint` instead (the weights vLLM's loader streamed)."""
    start = time.perf_counter()
    with (directory if isinstance(directory, StreamedCheckpoint) else
          Checkpoint(directory)) as ckpt:
        return _read_rank_weights(ckpt, names, sources, shards, fulls, rank, progress, start)


def _read_rank_weights(ckpt, names, sources, shards, fulls, rank, progress, start):
    planned = {name: ckpt.source_of(fqns, sources.get(fqns[0]), fulls[name])
               for name, fqns in names.items()}
    files = {p for p in ckpt.files.values()}
    from tqdm import tqdm
    show = progress if progress is not None else len(files) > PROGRESS_FILES
    out = {}
    for name, source in tqdm(planned.items(), desc=f"rank {rank} weights", unit="tensor",
                             disable=not show):
        full, spec = fulls[name], shards.get(name)
        boxes = spec.boxes(full.shape, rank) if spec is not None else \
            [tuple((0, s) for s in full.shape)]
        out[name] = ckpt.read_shard(source, full, boxes, spec.dim if spec is not None else 0)
    ckpt.stats.files = len(ckpt.stats.opened)
    ckpt.stats.seconds = time.perf_counter() - start
    return out, ckpt.stats
