"""vLLM's flat, ragged batch as program calls (no vLLM import: unit-tested on its own).

A vLLM step holds, per request, a run of consecutive positions: a whole prompt, a prompt
chunk, the rest of a prompt after a prefix-cache hit, or one decode token. The program's
step kinds cut a request's run into:

* a **context** piece: the first ``context_len`` tokens of a run that starts at position 0
  (the program's prompt step attends to no prior cache);
* **chunk** pieces of up to ``chunk_len`` tokens for what follows prior context when it is
  longer than ``decode_len`` (a later prefill chunk, the rest of a prompt after a
  prefix-cache hit): the program's chunk step, a width-``chunk_len`` decode step whose
  queries read the prior's cached KV and attend causally within the chunk;
* **decode** pieces of up to ``decode_len`` tokens for the rest (generated tokens): width-K
  decode steps.

Calls run in order: the context calls, then round j (piece j of every request; its chunk
pieces, then its decode pieces), each in batches of the program's ``batch`` rows. So a chunk
after prior context of up to ``chunk_len`` tokens is one call (shared with up to ``batch``
other requests' chunks); a program without a chunk step (``chunk_len`` 0) runs it as
ceil(len / decode_len) decode calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.names import StepKind


@dataclass(frozen=True)
class Piece:
    request: int
    start: int          # index of the piece's first token in vLLM's flat batch
    length: int
    kind: StepKind = StepKind.DECODE


@dataclass
class Call:
    kind: StepKind
    input_ids: torch.Tensor     # [batch, tokens]
    positions: torch.Tensor     # [batch, tokens]; -1 pads
    block_table: torch.Tensor   # [batch, max_blocks]; -1 unallocated
    rows: list[Piece]           # row b's piece (rows past len(rows) are empty)


@dataclass(frozen=True)
class ProgramShapes:
    batch: int
    context_len: int
    decode_len: int
    max_blocks: int
    vblock: int                 # block_size * dcp: positions per block-table entry
    chunk_len: int = 0          # 0: no chunk step (chunks after prior context as decode)

    def tokens(self, kind: StepKind) -> int:
        return {StepKind.CONTEXT: self.context_len, StepKind.CHUNK: self.chunk_len,
                StepKind.DECODE: self.decode_len}[kind]


def pieces_of(query_start: list[int], positions: torch.Tensor,
              shapes: ProgramShapes) -> tuple[list[Piece], list[list[Piece]]]:
    """(context pieces, decode rounds): each request's run cut as the module doc says."""
    context, rounds = [], []
    for r in range(len(query_start) - 1):
        start, end = query_start[r], query_start[r + 1]
        if end <= start:
            continue
        at = start
        if int(positions[start]) == 0:
            n = min(end - start, shapes.context_len)
            context.append(Piece(r, start, n, StepKind.CONTEXT))
            at += n
        j = 0
        while at < end:
            kind = StepKind.CHUNK if shapes.chunk_len and end - at > shapes.decode_len \
                else StepKind.DECODE
            n = min(end - at, shapes.tokens(kind))
            if j == len(rounds):
                rounds.append([])
            rounds[j].append(Piece(r, at, n, kind))
            at, j = at + n, j + 1
    return context, rounds


def table_rows(block_table: torch.Tensor, seq_lens: list[int],
               shapes: ProgramShapes) -> torch.Tensor:
    """vLLM's block table [requests, width] as the program's [requests, max_blocks]: the
    entries a request's length reaches, -1 after them (vLLM leaves 0 there, its null
    block, which is the program's garbage block and never a table entry)."""
    rows = torch.full((len(seq_lens), shapes.max_blocks), -1, dtype=torch.int64)
    for r, n in enumerate(seq_lens):
        used = -(-n // shapes.vblock)
        if used > shapes.max_blocks or used > block_table.shape[1]:
            raise DCPInputError(
                f"request {r} holds {n} tokens = {used} block-table entries, but the program "
                f"addresses {shapes.max_blocks} (vLLM's table has {block_table.shape[1]}). "
                f"Lower max_model_len to <= {shapes.max_blocks * shapes.vblock}.")
        rows[r, :used] = block_table[r, :used].to(torch.int64)
    return rows


def calls_of(input_ids: torch.Tensor, positions: torch.Tensor, query_start: list[int],
             table: torch.Tensor, shapes: ProgramShapes) -> list[Call]:
    """Every program call of one vLLM step, in the order they must run."""
    context, rounds = pieces_of(query_start, positions, shapes)
    groups = [(StepKind.CONTEXT, context)] + \
        [(kind, [p for p in r if p.kind == kind]) for r in rounds
         for kind in (StepKind.CHUNK, StepKind.DECODE)]
    out = []
    for kind, group in groups:
        for i in range(0, len(group), shapes.batch):
            out.append(_call(kind, shapes.tokens(kind), group[i:i + shapes.batch], input_ids,
                             positions, table, shapes))
    return out


def _call(kind, width, rows, input_ids, positions, table, shapes) -> Call:
    ids = torch.zeros(shapes.batch, width, dtype=torch.int64)
    pos = torch.full((shapes.batch, width), -1, dtype=torch.int64)
    bt = torch.full((shapes.batch, shapes.max_blocks), -1, dtype=torch.int64)
    for b, piece in enumerate(rows):
        span = slice(piece.start, piece.start + piece.length)
        ids[b, :piece.length] = input_ids[span]
        pos[b, :piece.length] = positions[span]
        bt[b] = table[piece.request]
    return Call(kind, ids, pos, bt, list(rows))


def at_bucket(call: Call, buckets, shapes: ProgramShapes) -> Call:
    """``call`` with the block table of the smallest context bucket (tokens, ascending; the
    program's, runtime/program/buckets.py) holding every row's positions: the program runs
    that bucket's graph, which reads no more table entries than it has."""
    from dcp_compile.runtime.program.buckets import smallest_bucket
    reach = int(call.positions.max()) + 1
    width = smallest_bucket(buckets, reach) // shapes.vblock
    if width == call.block_table.shape[1]:
        return call
    return Call(call.kind, call.input_ids, call.positions,
                call.block_table[:, :width].contiguous(), call.rows)


def scatter_logits(calls_and_logits, num_tokens: int, vocab: int,
                   dtype=torch.float32) -> torch.Tensor:
    """[num_tokens, vocab]: each piece's logits at its tokens' places in vLLM's batch
    (tokens no piece holds — vLLM's padding — stay 0)."""
    out = torch.zeros(num_tokens, vocab, dtype=dtype)
    for call, logits in calls_and_logits:
        for b, piece in enumerate(call.rows):
            out[piece.start:piece.start + piece.length] = logits[b, :piece.length]
    return out
