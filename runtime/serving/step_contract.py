"""The step-input contract: what one step accepts, checked on the host before anything runs.

One table of named rules (``RULES``) serves every entry that hands inputs to a step: the
Engine (``dcp_compile.runtime.serving.engine``), a loaded program's ``RankProgram.run`` (and so the threaded
verifiers and the torch.compile backend's runtime step, which call it), and the host slot
mapping ``dcp_compile.runtime.serving.metadata.compute_slot_mapping`` (a subset: ``SLOT_MAPPING_RULES``).
A violation is a ``DCPInputError`` carrying ``rule``, ``field`` and ``index`` whose message
names the element, its value, the rule and the fix, e.g.

    block_table[1, 3] = 7 is also used by row 0: a block belongs to one sequence. Free it
    or give row 1 its own block.

Every rule is a few vectorised torch ops over the host tensors — O(B*M + B*S), the shared-block
rule sorts the B*M entries — and allocates nothing larger than the inputs. Rules run in table
order and the first violation raises, so a rule may rely on the ones above it (types and
shapes first, then block ids, then positions).

A hybrid model's step also hands each row its recurrent-state slot and whether the row starts
its sequence (``state_slot``, ``fresh``; runtime/kernels/recurrent.py). The ``state-*`` rules
keep every row to its own sequence's state: a slot the cache has, one row per slot, no slot
for a padding row and one for every real row, fresh exactly when the row starts at position 0;
a width-K step's per-token snapshot slots (``snapshot_slot``) are slots the cache has, each
named once in the step and by no row as its state slot, and none for a padding token.
They run when the step carries these inputs (``StepInputs.state_slot``); a step of a model
without recurrent layers has none.

What a direct caller still owns (no host check can see it): the cache *history*. A row's
first position must be its sequence's length, and the cache must hold that sequence's KV
for every earlier position; the Engine, which knows each sequence's length, checks the
first part (``continues-sequence``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from dcp_compile.runtime.errors import DCPConfigError, DCPInputError, DCPTransformError
from dcp_compile.runtime.garbage_block import LAST, check_garbage_block, garbage_block_id
from dcp_compile.runtime.names import (BLOCK_TABLE, INPUT_IDS, KV_CACHES, POSITIONS, STATE_FRESH,
                                      STATE_SLOT, STATE_SNAPSHOT_SLOT, STEP_INPUTS, StepKind)
from dcp_compile.runtime.serving.contract_text import _el, _first, _more, _msg
from dcp_compile.runtime.serving.state_contract import (_shared_state_slot, _snapshot_slots,
                                                        _state_fresh, _state_slot_of_rows,
                                                        _state_slot_range)

# Cache rows and positions the layout computes stay below this: `entry * block_size + offset`
# and `position // vblock` never come near int64's 2**63 once the inputs meet the rules.
INT64_SAFE = 2 ** 62


class StepInputs(NamedTuple):
    input_ids: torch.Tensor | None          # None: not checked (host slot mapping)
    positions: torch.Tensor
    block_table: torch.Tensor
    caches: list | None = None              # None: the caller does not hold them (Engine)
    seq_lens: torch.Tensor | None = None    # [batch] tokens each row's sequence holds (Engine)
    state_slot: torch.Tensor | None = None  # [batch] int64 recurrent-state slot (hybrid models)
    fresh: torch.Tensor | None = None       # [batch] bool: the row starts its sequence
    snapshot_slot: torch.Tensor | None = None   # [batch, tokens] int64: width-K state snapshots


@dataclass(frozen=True)
class StepContract:
    """The static facts one step's inputs are checked against; ``None`` skips the rules that
    need the fact (the host slot mapping knows no batch, vocabulary or caches)."""

    kind: str = "step"                      # "context" | "decode" | "prefill" | "step"
    batch: int | None = None
    tokens: int | None = None
    max_blocks: int | None = None
    num_blocks: int | None = None           # cache blocks, one of them the garbage block
    block_size: int = 16
    dcp: int = 1
    vocab_size: int | None = None
    max_model_len: int | None = None        # default: max_blocks * block_size * dcp
    cache_count: int | None = None          # 2 * num_layers
    cache_shape: tuple | None = None        # one cache tensor
    cache_shapes: tuple | None = None       # each cache tensor (per-layer KV layouts)
    cache_dtype: torch.dtype | None = None
    device: torch.device | None = None      # of the caches and the step inputs
    rules: tuple[str, ...] | None = None    # rule names to run; None: all of RULES
    garbage_block: int = LAST               # -1 the last block, 0 the first (vLLM)
    num_state_slots: int | None = None      # recurrent-state slots (the garbage slot excluded)

    def __post_init__(self):
        bad = [f"{k}={getattr(self, k)!r}" for k in ("batch", "tokens", "max_blocks",
                                                       "block_size", "dcp", "vocab_size",
                                                       "max_model_len", "cache_count")
               if getattr(self, k) is not None and not _positive_int(getattr(self, k))]
        if self.num_blocks is not None and not (_positive_int(self.num_blocks)
                                                and self.num_blocks >= 2):
            bad.append(f"num_blocks={self.num_blocks!r} (needs >= 2: one usable block "
                       f"besides the garbage block)")
        check_garbage_block(self.garbage_block)
        unknown = sorted(set(self.rules or ()) - set(RULE_NAMES))
        if unknown:
            bad.append(f"rules={unknown} (not in RULES: {list(RULE_NAMES)})")
        if bad:
            raise DCPConfigError(f"step contract fields must be positive ints and known rules: "
                                 f"{', '.join(bad)}. Pass the program's static shapes.")
        table_len = (self.max_blocks * self.vblock if self.max_blocks is not None else None)
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", table_len)
        elif table_len is not None and self.max_model_len > table_len:
            raise DCPConfigError(
                f"max_model_len exceeds what the block table addresses: max_model_len="
                f"{self.max_model_len}, max_blocks * block_size * dcp = {table_len}. "
                f"Use max_model_len <= {table_len} or a wider block table.")
        # The wrap bound, checked once: every cache row and position fits int64 with room.
        for what, n in (("num_blocks * block_size", (self.num_blocks or 1) * self.block_size),
                        ("max_model_len", self.max_model_len or 0)):
            if n >= INT64_SAFE:
                raise DCPConfigError(f"{what} = {n} reaches 2**62: cache-row arithmetic "
                                     f"could wrap int64. Use a smaller cache or context.")

    @property
    def vblock(self) -> int:
        return self.block_size * self.dcp

    def check(self, input_ids, positions, block_table, caches=None, *, seq_lens=None,
              state_slot=None, fresh=None, snapshot_slot=None) -> None:
        """Raise ``DCPInputError`` for the first broken rule; return None if all hold."""
        step = StepInputs(input_ids, positions, block_table, caches, seq_lens, state_slot,
                          fresh, snapshot_slot)
        for rule in RULES:
            if self.rules is not None and rule.name not in self.rules:
                continue
            found = rule.check(self, step)
            if found is not None:
                index, message = found
                raise DCPInputError(message, rule=rule.name, field=rule.field, index=index)

    # -- building one from a program ---------------------------------------------------------

    @classmethod
    def for_program(cls, program, kind: str, *, device=None,
                    max_model_len: int | None = None) -> "StepContract":
        """The contract of ``program``'s step ``kind``: shapes from the graph's step-input
        placeholders, vocabulary from its logits, caches from ``program.cache_spec()``."""
        gm = program.graphs[kind]
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # graph(*weights, tp_rank, input_ids, positions, block_table, *caches)
        ids, pos, table = (n.meta["val"] for n in
                           placeholders[len(program.weight_inputs) + 1:][:3])
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
        logits = out.meta.get("val")
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise DCPTransformError(
                f"program step {kind!r} returns no [batch, tokens, vocab] logits value to "
                f"read the vocabulary from: {out.name} has meta['val']={logits!r}. Load a "
                f"program built by dcp_compile.transform or the 'dcp' backend.")
        spec = program.cache_spec()
        return cls(kind=kind, batch=int(pos.shape[0]), tokens=int(pos.shape[1]),
                   max_blocks=int(table.shape[1]), num_blocks=spec.num_blocks,
                   block_size=program.config.block_size, dcp=program.config.dcp,
                   vocab_size=int(logits.shape[-1]),
                   max_model_len=max_model_len, cache_count=2 * spec.num_layers,
                   cache_shape=tuple(spec.shape) if spec.uniform else None,
                   cache_shapes=None if spec.uniform else tuple(spec.shapes()),
                   cache_dtype=spec.dtype,
                   device=torch.device(device) if device is not None else None,
                   garbage_block=program.config.garbage_block,
                   num_state_slots=state.num_slots if (state := program.state_spec())
                   else None)


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


# ----------------------------------------------------------------------------------------
# The rules. Each returns None, or (index, message) for its first violation.
# ----------------------------------------------------------------------------------------


def _input_type(c, s):
    for name, t in zip(STEP_INPUTS, s[:3]):
        if t is None and name == INPUT_IDS:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            return (name,), _msg(f"{name} is {got}", "input_ids, positions and block_table "
                                 "are int64 tensors",
                                 f"Pass torch.as_tensor({name}, dtype=torch.int64)")
    return None


def _input_shape(c, s):
    if c.batch is None:
        return None
    want = {INPUT_IDS: (c.batch, c.tokens), POSITIONS: (c.batch, c.tokens),
            BLOCK_TABLE: (c.batch, c.max_blocks)}
    for name, t in zip(STEP_INPUTS, s[:3]):
        if t is not None and tuple(t.shape) != want[name]:
            return (name,), _msg(
                f"{name} has shape {tuple(t.shape)}, the {c.kind} step takes {want[name]}",
                "step inputs have the program's static shapes (input_ids, positions "
                "[batch, tokens]; block_table [batch, max_blocks])",
                "Pad to the static shape: position -1 and block-table entry -1 mark padding")
    return None


def _input_device(c, s):
    if c.device is None:
        return None
    for name, t in zip(STEP_INPUTS, s[:3]):
        if t is not None and t.device != c.device:
            return (name,), _msg(f"{name} is on {t.device}, the program runs on {c.device}",
                                 "step inputs live where the program's caches do",
                                 f"Move it with .to('{c.device}')")
    return None


def _cache_count(c, s):
    if s.caches is None or c.cache_count is None or len(s.caches) == c.cache_count:
        return None
    return (KV_CACHES,), _msg(
        f"kv_caches has {len(s.caches)} tensors, the program takes {c.cache_count} "
        f"({c.cache_count // 2} layers x key, value)",
        "a step takes every layer's key and value cache",
        "Pass the flat list [k_0, v_0, k_1, v_1, ...] of program.cache_spec().allocate()")


def _cache_spec(c, s):
    if s.caches is None or (c.cache_shape is None and c.cache_shapes is None):
        return None
    for i, t in enumerate(s.caches):
        shape = c.cache_shape if c.cache_shapes is None else c.cache_shapes[i]
        want = (c.cache_dtype, tuple(shape), c.device)
        got = ((t.dtype, tuple(t.shape), t.device) if isinstance(t, torch.Tensor)
               else (type(t).__name__, None, None))
        if got[0] != want[0] or got[1] != want[1] or (want[2] is not None
                                                      and got[2] != want[2]):
            def show(x):
                dtype, shape, device = x
                return f"{dtype} {list(shape) if shape is not None else ''} on " \
                       f"{device if device is not None else 'any device'}"
            return (KV_CACHES, i), _msg(
                f"kv_caches[{i}] is {show(got)}, the program's cache is {show(want)}",
                "caches match the program's cache spec exactly: count, shape, dtype and "
                "device (a cache is never converted)",
                "Allocate them with program.cache_spec().allocate()")
    return None


def _block_id_range(c, s):
    t = s.block_table
    bad = (t < -1) if c.num_blocks is None else (t < -1) | (t >= c.num_blocks)
    hit = _first(bad)
    if hit is None:
        return None
    (b, j), n = hit
    where = "below -1" if int(t[b, j]) < -1 else f"outside the cache (num_blocks=" \
                                                  f"{c.num_blocks})"
    ids = _usable_ids(c)
    return (b, j), _msg(f"{_el('block_table', (b, j))} = {int(t[b, j])}{_more(n)} is {where}",
                        f"an entry is a block id in {ids} or -1 (unallocated)",
                        "Allocate blocks with BlockAllocator")


def _usable_ids(c) -> str:
    """The block ids a table may name, as text: [0, n-2] or [1, n-1] (garbage first)."""
    if c.num_blocks is None:
        return "[0, num_blocks - 2]" if c.garbage_block == LAST else "[1, num_blocks - 1]"
    low = 1 if garbage_block_id(c.num_blocks, c.garbage_block) == 0 else 0
    return f"[{low}, {low + c.num_blocks - 2}]"


def _garbage_block(c, s):
    if c.num_blocks is None:
        return None
    garbage = garbage_block_id(c.num_blocks, c.garbage_block)
    hit = _first(s.block_table == garbage)
    if hit is None:
        return None
    (b, j), n = hit
    which = "num_blocks - 1" if garbage == c.num_blocks - 1 else "0"
    return (b, j), _msg(
        f"{_el('block_table', (b, j))} = {garbage}{_more(n)} is the garbage block",
        f"block {which} (garbage_block={c.garbage_block}) receives every masked write "
        f"(padding, positions another rank owns) and no block table names it",
        f"Use blocks {_usable_ids(c)}; BlockAllocator never hands the garbage block out")


def _written_entries(c, s) -> torch.Tensor:
    """[B, M] True where the row writes a position of that block-table entry this step."""
    t, p = s.block_table, s.positions
    entry = p.clamp(min=0) // c.vblock
    hit = (p >= 0) & (entry < t.shape[1])
    written = torch.zeros(t.shape, dtype=torch.int64, device=t.device)
    written.scatter_add_(1, entry.clamp(max=max(t.shape[1] - 1, 0)), hit.to(torch.int64))
    return written > 0


def _shared_block(c, s):
    t = s.block_table
    if t.numel() < 2:
        return None
    flat = t.reshape(-1)
    ids, order = torch.sort(flat, stable=True)
    written = _written_entries(c, s).reshape(-1)[order]
    rows = order // t.shape[1]
    # A block in two rows is a shared prefix (read-only); a write into it, or one block
    # twice in a row, is not allowed.
    same = (ids[1:] == ids[:-1]) & (ids[1:] >= 0)
    dup = same & ((rows[1:] == rows[:-1]) | written[1:] | written[:-1])
    hit = _first(dup)
    if hit is None:
        return None
    (k,), _ = hit
    (b1, j1), (b2, j2) = (divmod(int(order[i]), t.shape[1]) for i in (k, k + 1))
    block = int(ids[k])
    if b1 != b2:
        wb, wj = (b2, j2) if bool(written[k + 1]) else (b1, j1)
        return (wb, wj), _msg(
            f"{_el('block_table', (wb, wj))} = {block} is shared with row "
            f"{b1 if wb == b2 else b2} and row {wb} writes into it in this step",
            "a block in several rows (a shared prefix) is read-only: no request writes "
            "another's KV", f"Free it or give row {wb} its own block for the positions it "
            "writes")
    return (b2, j2), _msg(f"{_el('block_table', (b2, j2))} = {block} is also "
                          f"{_el('block_table', (b1, j1))}",
                          "a block holds one block-table entry of one sequence",
                          f"Give entry {j2} of row {b2} its own block")


def _position_range(c, s):
    p = s.positions
    hit = _first(p < -1)
    if hit is None:
        return None
    (b, t), n = hit
    return (b, t), _msg(f"{_el('positions', (b, t))} = {int(p[b, t])}{_more(n)} is below -1",
                        "positions are >= 0, or -1 for padding", "Fix the positions")


def _padding_at_end(c, s):
    valid = s.positions >= 0
    hit = _first(valid[:, 1:] & ~valid[:, :-1])
    if hit is None:
        return None
    (b, t), n = hit
    return (b, t + 1), _msg(
        f"{_el('positions', (b, t + 1))} = {int(s.positions[b, t + 1])}{_more(n)} follows "
        f"padding ({_el('positions', (b, t))} = -1)",
        "padding (-1) comes only at the end of a row (a row's first position is its "
        "sequence's prior length)", "Left-pack the row: its tokens first, then -1")


def _contiguous(c, s):
    p = s.positions
    both = (p[:, 1:] >= 0) & (p[:, :-1] >= 0)
    hit = _first(both & (p[:, 1:] != p[:, :-1] + 1))
    if hit is None:
        return None
    (b, t), n = hit
    prev, cur = int(p[b, t]), int(p[b, t + 1])
    how = "repeats" if cur == prev else "goes back from" if cur < prev else "skips from"
    return (b, t + 1), _msg(
        f"{_el('positions', (b, t + 1))} = {cur}{_more(n)} {how} "
        f"{_el('positions', (b, t))} = {prev}",
        "a row's positions are consecutive: p, p+1, p+2, ... (no repeats, no gaps)",
        "Send each row one run of consecutive positions; split the rest into later steps")


def _first_chunk(c, s):
    if c.kind != StepKind.CONTEXT:
        return None
    first = s.positions[:, 0]
    hit = _first((first >= 0) & (first != 0))
    if hit is None:
        return None
    (b,), n = hit
    return (b, 0), _msg(
        f"{_el('positions', (b, 0))} = {int(first[b])}{_more(n)} starts a context step past 0",
        "the context step runs a sequence's first chunk (it attends to no prior cache)",
        "Start the row at position 0, or continue it with decode steps (or a prefill-mode "
        "program)")


def _max_model_len(c, s):
    if c.max_model_len is None:
        return None
    p = s.positions
    hit = _first(p >= c.max_model_len)
    if hit is None:
        return None
    (b, t), n = hit
    return (b, t), _msg(
        f"{_el('positions', (b, t))} = {int(p[b, t])}{_more(n)} is >= max_model_len "
        f"{c.max_model_len}",
        f"positions stay below max_model_len (the block table addresses max_blocks * "
        f"block_size * dcp = {c.max_blocks} * {c.block_size} * {c.dcp} positions)"
        if c.max_blocks is not None else "positions stay below max_model_len",
        "Stop the sequence, or build the program with a larger max_blocks")


def _entry_of(c, s):
    """Block-table index of each position (spec: one entry per vblock); 0 on padding."""
    return s.positions.clamp(min=0) // c.vblock


def _allocated_entry(c, s):
    p, t = s.positions, s.block_table
    valid = p >= 0
    entry = _entry_of(c, s)
    width = t.shape[1]
    named = torch.gather(t, 1, entry.clamp(max=max(width - 1, 0))) if width else \
        torch.full_like(p, -1)
    hit = _first(valid & ((entry >= width) | (named < 0)))
    if hit is None:
        return None
    (b, i), n = hit
    e = int(entry[b, i])
    where = (f"{_el('block_table', (b, e))} = -1 is unallocated" if e < width
             else f"its entry {e} is past the {width}-entry table")
    return (b, i), _msg(
        f"{_el('positions', (b, i))} = {int(p[b, i])}{_more(n)} is beyond its block table "
        f"({where})",
        f"a position's entry (position // (block_size * dcp) = position // {c.vblock}) "
        f"holds a block", "Allocate the block first, or mark the token as padding (-1)")


def _allocated_prefix(c, s):
    p, t = s.positions, s.block_table
    last = p.amax(dim=1)                                                # [B]; -1: no tokens
    need = torch.arange(t.shape[1], device=t.device) <= (last.clamp(min=0)
                                                         // c.vblock).unsqueeze(1)
    hit = _first(need & (last >= 0).unsqueeze(1) & (t < 0))
    if hit is None:
        return None
    (b, j), n = hit
    return (b, j), _msg(
        f"{_el('block_table', (b, j))} = -1{_more(n)} is unallocated below row {b}'s "
        f"position {int(last[b])}",
        "every entry covering positions 0..p of a row holds a block (the step attends to "
        "all of them; an unallocated entry has no KV to read)",
        "Allocate the sequence's blocks from position 0 on")


def _continues_sequence(c, s):
    if s.seq_lens is None:
        return None
    first = s.positions[:, 0]
    hit = _first((first >= 0) & (first != s.seq_lens))
    if hit is None:
        return None
    (b,), n = hit
    return (b, 0), _msg(
        f"{_el('positions', (b, 0))} = {int(first[b])}{_more(n)} does not continue row "
        f"{b}'s sequence of {int(s.seq_lens[b])} tokens",
        "a step starts at its sequence's length (a gap would attend to KV never written "
        "for this sequence: a reused block's stale KV)",
        f"Send position {int(s.seq_lens[b])} next")


def _token_range(c, s):
    if c.vocab_size is None or s.input_ids is None:
        return None
    ids = s.input_ids
    hit = _first((ids < 0) | (ids >= c.vocab_size))
    if hit is None:
        return None
    (b, t), n = hit
    return (b, t), _msg(
        f"{_el('input_ids', (b, t))} = {int(ids[b, t])}{_more(n)} is outside the vocabulary "
        f"[0, {c.vocab_size})",
        "every token id, padding included, indexes the embedding (padding is embedded, "
        "then discarded)", "Fix the token ids; pad with 0")


class Rule(NamedTuple):
    name: str
    field: str
    check: Callable[[StepContract, StepInputs], tuple | None]


# In order: a rule may assume the ones above it hold (types, shapes, then values).
RULES: tuple[Rule, ...] = (
    Rule("input-type", "inputs", _input_type),
    Rule("input-shape", "inputs", _input_shape),
    Rule("input-device", "inputs", _input_device),
    Rule("cache-count", KV_CACHES, _cache_count),
    Rule("cache-spec", KV_CACHES, _cache_spec),
    Rule("block-id-range", BLOCK_TABLE, _block_id_range),
    Rule("garbage-block", BLOCK_TABLE, _garbage_block),
    Rule("shared-block", BLOCK_TABLE, _shared_block),
    Rule("position-range", POSITIONS, _position_range),
    Rule("padding-at-end", POSITIONS, _padding_at_end),
    Rule("contiguous", POSITIONS, _contiguous),
    Rule("first-chunk", POSITIONS, _first_chunk),
    Rule("max-model-len", POSITIONS, _max_model_len),
    Rule("allocated-entry", POSITIONS, _allocated_entry),
    Rule("allocated-prefix", BLOCK_TABLE, _allocated_prefix),
    Rule("continues-sequence", POSITIONS, _continues_sequence),
    Rule("token-range", INPUT_IDS, _token_range),
    Rule("state-slot-range", STATE_SLOT, _state_slot_range),
    Rule("state-shared-slot", STATE_SLOT, _shared_state_slot),
    Rule("state-slot-of-rows", STATE_SLOT, _state_slot_of_rows),
    Rule("state-fresh", STATE_FRESH, _state_fresh),
    Rule("state-snapshot-slot", STATE_SNAPSHOT_SLOT, _snapshot_slots),
)
RULE_NAMES = tuple(r.name for r in RULES)

# The host slot mapping maps arbitrary positions (no step structure): block ids and whether
# each position has a block.
SLOT_MAPPING_RULES = ("block-id-range", "garbage-block", "position-range", "allocated-entry")


def check_engine_caches(num_blocks: int, block_size: int, caches) -> None:
    """An Engine's shapes must fit the caches its executor holds: its garbage block
    (num_blocks - 1) and every block it hands out must exist in each cache."""
    sets = caches if caches and isinstance(caches[0], (list, tuple)) else [caches]
    for rank, cs in enumerate(sets):
        for i, t in enumerate(cs or []):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                continue
            blocks, block = int(t.shape[0]), int(t.shape[1])
            if num_blocks > blocks or block != block_size:
                where = f"kv_caches[{i}]" if len(sets) == 1 else f"rank {rank} kv_caches[{i}]"
                raise DCPInputError(
                    f"engine shapes exceed the caches: StepShapes.num_blocks={num_blocks}, "
                    f"block_size={block_size}, {where} has {blocks} blocks of {block}: the "
                    f"engine's blocks (and its garbage block, num_blocks - 1) must exist in "
                    f"the caches. Build the engine with num_blocks <= {blocks} and "
                    f"block_size={block}, or allocate larger caches.",
                    rule="engine-shapes", field="shapes", index=(rank, i))
