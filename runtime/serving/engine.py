"""Host side of serving: sequences, block tables, padded static-shape step inputs, greedy loop.

The engine is the same for the single-device model and for every transformed program: it
builds ``(input_ids, positions, block_table)`` — identical on every rank — and hands them to
an *executor*, which owns the caches (one set, or one per rank) and runs the step.

Packing. A step is a padded batch ``[batch, tokens]``: row b holds sequence b's new tokens at
positions ``prior_b, prior_b + 1, ...`` and -1 after them; unused rows are all -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from dcp_compile.runtime.errors import DCPConfigError, DCPInputError
from dcp_compile.runtime.garbage_block import LAST

from dcp_compile.runtime.serving.kv_cache import BlockAllocator
from dcp_compile.runtime.names import StepKind
from dcp_compile.runtime.serving.state_cache import state_rows
from dcp_compile.runtime.serving.step_contract import StepContract, check_engine_caches


@dataclass(frozen=True)
class StepShapes:
    """The static shapes a program is built for."""

    batch: int = 4
    context_len: int = 64      # tokens per sequence in a prompt (context/prefill) step
    max_blocks: int = 8        # block-table entries per sequence
    num_blocks: int = 40       # cache blocks per rank, including the garbage block
    decode_len: int = 1        # tokens per row in a decode step (K > 1: speculative verify)
    # tokens per row of the chunk step (a prompt chunk after prior context, run as a decode
    # step of this width: every query over the prior cache and causally within the chunk);
    # 0: the decode program has no chunk step
    chunk_len: int = 0
    # a hybrid decode program's recurrent-state checkpoint slots for prefix caching: its
    # context step keeps the state at each full vblock of a prompt in one (docs/hybrid.md);
    # 0: none (prefix caching of a hybrid is refused)
    state_checkpoints: int = 0

    def tokens(self, kind: str) -> int:
        """Tokens per row of step ``kind`` (0: the program has no such step)."""
        return {StepKind.DECODE: self.decode_len,
                StepKind.CHUNK: self.chunk_len}.get(kind, self.context_len)

    def __post_init__(self):
        # Typed and O(1): a bad shape is a config error here, not a raw torch error later.
        bad = [f"{name}={getattr(self, name)!r}" for name, least in _SHAPE_MINIMA
               if not (isinstance(getattr(self, name), int)
                       and not isinstance(getattr(self, name), bool)
                       and getattr(self, name) >= least)]
        if bad:
            raise DCPConfigError(
                f"StepShapes fields must be ints with batch, context_len, max_blocks, "
                f"decode_len >= 1, chunk_len, state_checkpoints >= 0 "
                f"and num_blocks >= 2 (one usable block besides the garbage block): "
                f"{', '.join(bad)}. Pass positive ints.")

    @classmethod
    def fitting(cls, batch: int, context_len: int, max_tokens: int, *, block_size: int,
                dcp: int, spare_blocks: int = 0, decode_len: int = 1) -> "StepShapes":
        """Shapes for ``batch`` sequences of up to ``max_tokens`` tokens each (prompt +
        generated), prompt chunks of ``context_len``: one block-table entry per vblock
        (``block_size * dcp`` positions), blocks for every sequence, ``spare_blocks`` more,
        and the garbage block. A decode step of width ``decode_len`` may write up to
        ``decode_len - 1`` positions past ``max_tokens`` (drafts later rejected)."""
        max_blocks = -(-(max_tokens + decode_len - 1) // (block_size * dcp))
        return cls(batch=batch, context_len=context_len, max_blocks=max_blocks,
                   num_blocks=batch * max_blocks + spare_blocks + 1, decode_len=decode_len)


_SHAPE_MINIMA = (("batch", 1), ("context_len", 1), ("max_blocks", 1), ("num_blocks", 2),
                 ("decode_len", 1), ("chunk_len", 0), ("state_checkpoints", 0))


class Executor(Protocol):
    def step(self, kind: str, input_ids: torch.Tensor, positions: torch.Tensor,
             block_table: torch.Tensor, state_slot: torch.Tensor | None = None,
             snapshot_slot: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step of ``kind`` ("context" | "decode" | "prefill"); return logits.
        ``state_slot`` [B]: each row's recurrent-state slot (a hybrid program's engine only
        passes it); ``snapshot_slot`` [B, tokens]: where the step also keeps the state
        after each token, -1: none (a hybrid program's width-K decode step and, with
        ``state_checkpoints``, its context step)."""

    # A hybrid program's executor with prefix caching also has
    # copy_state(src: int, dst: int): a state slot's every cache row into another.


class LocalExecutor:
    """Runs ``fn(input_ids, positions, block_table, caches) -> (logits, caches)`` in-process.

    ``fn`` is one callable for every step kind (the single-device model) or a mapping
    kind -> callable (a loaded program). ``before_step(caches)`` is a test hook.
    """

    def __init__(self, fn, caches: list[torch.Tensor], *, before_step=None, states=None):
        self.fns = fn if isinstance(fn, dict) else None
        self.fn = fn
        self.caches = caches
        self.before_step = before_step
        # A hybrid program's recurrent-state caches (program.state_spec()), or None
        self.states = states

    @torch.no_grad()
    def step(self, kind, input_ids, positions, block_table, state_slot=None,
             snapshot_slot=None):
        if self.fns is not None and kind not in self.fns:
            raise DCPInputError(f"this program has no {kind!r} step: it has "
                                f"{sorted(self.fns)}.")
        fn = self.fns[kind] if self.fns is not None else self.fn
        if self.before_step is not None:
            self.before_step(self.caches)
        if self.states is not None:
            snap = {} if snapshot_slot is None else {"snapshot_slot": snapshot_slot}
            logits, caches, self.states = fn(input_ids, positions, block_table, self.caches,
                                             state_slot=state_slot, states=self.states, **snap)
        else:
            logits, caches = fn(input_ids, positions, block_table, self.caches)
        self.caches = list(caches)
        return logits

    @torch.no_grad()
    def copy_state(self, src: int, dst: int) -> None:
        """A hybrid program's recurrent state of slot ``src`` into slot ``dst`` (every state
        cache): a prefix-cache hit resumes from a checkpoint."""
        for cache in self.states:
            cache[dst] = cache[src]


@dataclass
class GenerateResult:
    tokens: list[list[int]]                 # generated tokens per sequence
    logits: list[torch.Tensor] = field(default_factory=list)   # per step: [n, vocab]


class Engine:
    """Greedy serving loop over an executor, with static-shape padded steps.

    ``prompt_kind`` is the step kind prompt chunks run as: "prefill" (the single-device model,
    prefill-mode programs; later chunks continue a sequence) or "context" (a decode-mode
    program's own first-chunk-only prompt step).

    ``buckets`` (context lengths in tokens, ascending; default: the shapes' full capacity) are
    the program's context buckets: each step's block table has the width of the smallest
    bucket holding every sequence after the step (runtime/program/buckets.py), and the executor runs
    that bucket's graph.

    Every step it builds is checked against the step contract (``dcp_compile.runtime.serving.step_contract``),
    plus what only the engine knows: each row continues its sequence. ``vocab_size`` adds
    the token-id rule (a loaded program checks it itself). ``garbage_block``: the program's
    (``program.config.garbage_block``; runtime/garbage_block.py).
    """

    def __init__(self, executor: Executor, shapes: StepShapes, *, block_size: int,
                 dcp: int = 1, prompt_kind: str = StepKind.PREFILL, vocab_size: int | None = None,
                 prefix_caching: bool = False, buckets=None, garbage_block: int = LAST,
                 state_slots: int | None = None):
        from dcp_compile.runtime.program.buckets import bucket_width, check_buckets
        self.executor = executor
        self.shapes = shapes
        self.block_size = block_size
        self.dcp = dcp
        self.prompt_kind = prompt_kind
        # An executor that shows its caches must hold every block the shapes promise.
        check_engine_caches(shapes.num_blocks, block_size, getattr(executor, "caches", None))
        self.buckets = check_buckets(buckets, block_size=block_size, dcp=dcp,
                                     max_blocks=shapes.max_blocks)
        self.contracts = {(kind, width): StepContract(
            kind=kind, batch=shapes.batch,
            tokens=shapes.tokens(kind),
            max_blocks=width, num_blocks=shapes.num_blocks, block_size=block_size,
            dcp=dcp, vocab_size=vocab_size, garbage_block=garbage_block) for kind in StepKind
            if shapes.tokens(kind) for width in (bucket_width(b, block_size=block_size, dcp=dcp)
                          for b in self.buckets)}
        self.allocator = BlockAllocator(shapes.num_blocks, block_size * dcp,
                                        prefix_caching=prefix_caching,
                                        garbage_block=garbage_block)
        self.lengths: list[int] = []
        # A hybrid program's recurrent-state slots (docs/hybrid.md): one per live sequence
        self.state_slots = None
        # A hybrid decode program's prefix-cache state checkpoints (StepShapes.state_checkpoints)
        self.checkpoints = None
        if state_slots is not None:
            from dcp_compile.runtime.serving.state_cache import StateCheckpoints, StateSlots
            kept = shapes.state_checkpoints
            if prefix_caching and not kept:
                from dcp_compile.runtime.errors import DCPHybridError
                raise DCPHybridError(
                    "prefix caching with a hybrid program: the recurrent state must be "
                    "checkpointed at vblock boundaries (a cached prefix's KV alone cannot "
                    "restore it), and this program keeps no checkpoints "
                    "(StepShapes.state_checkpoints=0). Build the decode program with "
                    "StepShapes(state_checkpoints=N), or turn prefix caching off.")
            # K slots per sequence for a width-K decode step: the live one and K-1 spares
            # for the state snapshots a rejected draft rolls back to; then the checkpoints
            self.state_slots = StateSlots(state_slots - kept, width=shapes.decode_len)
            if prefix_caching:
                self.checkpoints = StateCheckpoints(state_slots - kept, kept)
            self.contracts = {key: replace(c, num_state_slots=state_slots)
                              for key, c in self.contracts.items()}

    # -- steps -----------------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Run prompt chunks for sequences 0..n-1; returns logits of each chunk's last token.

        The first call starts the sequences; later calls continue them (chunked prefill —
        only program kinds that attend to a prior cache accept a non-empty prior).
        """
        n = len(prompts)
        if not self.lengths:
            self.lengths = [0] * n
        self._check_batch(n)
        if self.allocator.prefix_caching and not any(self.lengths):
            from dcp_compile.runtime.serving.prefix_cache import prefill_sharing_prefixes
            return prefill_sharing_prefixes(self, prompts)
        return self.prompt_step(prompts)

    def prompt_step(self, prompts: list[list[int]]) -> torch.Tensor:
        """One prompt step of ``prompt_kind`` (``prefill`` without the prefix cache)."""
        n = len(prompts)
        if self.prompt_kind == StepKind.CONTEXT and any(self.lengths):
            raise DCPInputError(
                f"the decode engine's context step runs a first prompt chunk only (no prior "
                f"context): sequences already hold {self.lengths} tokens. Send the whole "
                f"prompt in one chunk, or prefill on a prefill-mode program.")
        S = self.shapes.context_len
        if any(len(p) > S for p in prompts):
            raise DCPInputError(
                f"prompt chunk longer than the program's context_len: lengths="
                f"{[len(p) for p in prompts]}, context_len={S}. Split it into chunks of at "
                f"most {S} tokens or build the program with a larger context_len.")
        input_ids, positions = self._pack(prompts, S)
        logits = self._run(self.prompt_kind, input_ids, positions,
                           [len(c) for c in prompts])
        last = torch.tensor([max(len(c) - 1, 0) for c in prompts])
        return logits[torch.arange(n), last]

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One new token per sequence; returns its logits [n, vocab]."""
        return self.decode_rows([[t] for t in tokens])[:, 0]

    def decode_rows(self, rows: list[list[int]]) -> torch.Tensor:
        """Up to ``decode_len`` new tokens per sequence at its next positions (padded with
        -1; an empty row sits the step out); returns their logits [n, decode_len, vocab]
        and advances each length by its row's tokens (``rewind`` takes back what a
        verification rejects)."""
        return self._rows_step(StepKind.DECODE, rows)

    def chunk_rows(self, rows: list[list[int]]) -> torch.Tensor:
        """A prompt chunk of up to ``chunk_len`` tokens per sequence after its prior context,
        in one chunk step (a decode program's width-``chunk_len`` decode step); returns
        their logits [n, chunk_len, vocab] and advances each length."""
        return self._rows_step(StepKind.CHUNK, rows)

    def _rows_step(self, kind: StepKind, rows: list[list[int]]) -> torch.Tensor:
        n, K = len(rows), self.shapes.tokens(kind)
        self._check_batch(n)
        if not K:
            raise DCPInputError(
                f"this program has no {kind} step (StepShapes.chunk_len = 0). Build it with "
                f"StepShapes(chunk_len=N) to run chunks after prior context in one step.")
        if any(not 0 <= len(r) <= K for r in rows):
            field = "decode_len" if kind == StepKind.DECODE else "chunk_len"
            raise DCPInputError(
                f"{kind} rows must hold 0..{field}={K} tokens: lengths "
                f"{[len(r) for r in rows]}. Split longer rows over steps or build the "
                f"program with a larger StepShapes.{field}.")
        input_ids, positions = self._pack(rows, K)
        return self._run(kind, input_ids, positions, [len(r) for r in rows])[:n]

    def share_prefix(self, seq: int, prompt: list[int]) -> int:
        """Start ``seq`` on the cached vblocks of ``prompt``'s longest cached prefix
        (``BlockAllocator.share_prefix``); returns the tokens reused. A hybrid program's
        engine reuses only a prefix whose last vblock has a state checkpoint and resumes the
        sequence from it (copied into its live slot: its first step is not fresh)."""
        alloc = self.allocator
        if self.checkpoints is None:
            return alloc.share_prefix(seq, prompt)
        self.checkpoints.sync(alloc._by_hash)
        hashes = alloc._hashes(prompt[:-1])
        m = self.checkpoints.longest(hashes, alloc._by_hash)
        reused = alloc.share_prefix(seq, prompt[:m * alloc.tokens_per_block + 1])
        if reused:
            self.executor.copy_state(self.checkpoints.of_hash[hashes[m - 1]],
                                     self.state_slots.slot(seq))
            self.checkpoints.used += 1
        return reused

    def finish(self, seq: int) -> None:
        """Sequence ``seq``'s request is done: its cache blocks and its recurrent-state slot
        (a hybrid program's) go back; its length is 0 again."""
        self.allocator.free(seq)
        if self.state_slots is not None:
            self.state_slots.free(seq)
        self.lengths[seq] = 0

    def rewind(self, seq: int, length: int) -> None:
        """Keep only sequence ``seq``'s first ``length`` tokens: later positions' KV is
        simply overwritten by later steps (no copy), blocks past it are returned."""
        if not 0 <= length <= self.lengths[seq]:
            raise DCPInputError(f"cannot rewind sequence {seq} to {length} tokens: it holds "
                                f"{self.lengths[seq]}. Pass a length in [0, "
                                f"{self.lengths[seq]}].")
        if self.state_slots is not None and length < self.lengths[seq] and \
                not self.state_slots.roll_back(seq, length):
            from dcp_compile.runtime.errors import DCPHybridError
            kept = sorted(self.state_slots.snapshots.get(seq, {}))
            raise DCPHybridError(
                f"rewinding sequence {seq} of a hybrid program from {self.lengths[seq]} to "
                f"{length} tokens: its recurrent state has already taken the later tokens "
                f"in, and its last width-K step kept snapshots of lengths {kept} only. "
                f"Rewind right after a width-K decode step, to one of its tokens.")
        self.lengths[seq] = length
        self.allocator.shrink(seq, length)

    def generate(self, prompts: list[list[int]], steps: int, *, drafter=None):
        """Prefill the prompts, then greedy-decode ``steps`` tokens.

        With a ``drafter`` (dcp_compile.runtime.serving.speculative), drafts are verified in decode
        steps of width ``decode_len``: same tokens, a ``SpecResult`` (logits per sequence
        per token, acceptance statistics) instead of a ``GenerateResult``.
        """
        logits = self.prefill(prompts)
        if drafter is None:
            result = self.continue_generate(logits, steps)
        else:
            from dcp_compile.runtime.serving.speculative import speculative_generate
            if hasattr(drafter, "start"):
                drafter.start(prompts)
            result = speculative_generate(self, logits, steps, drafter, prompts)
        self._register_written(prompts, result.tokens)
        return result

    def _register_written(self, prompts: list[list[int]], tokens: list[list[int]]) -> None:
        """With the prefix cache on, make the full vblocks of every token whose KV is now in
        the cache shareable, the generated ones too (a later request that continues this
        conversation starts on them, as in vLLM). Positions ``[0, lengths[b])`` hold the KV
        of the prompt and the accepted tokens (rejected drafts were rewound away)."""
        if not self.allocator.prefix_caching:
            return
        for b, prompt in enumerate(prompts):
            self.allocator.register_prefix(b, (list(prompt) + list(tokens[b]))[:self.lengths[b]])

    def continue_generate(self, logits: torch.Tensor, steps: int) -> GenerateResult:
        """Greedy-decode ``steps`` tokens from the logits of each sequence's last token."""
        result = GenerateResult(tokens=[[] for _ in range(logits.shape[0])], logits=[logits])
        for step in range(steps):
            nxt = logits.argmax(-1).tolist()
            for b, t in enumerate(nxt):
                result.tokens[b].append(t)
            if step == steps - 1:
                break
            logits = self.decode(nxt)
            result.logits.append(logits)
        return result

    # -- internals -------------------------------------------------------------------------

    def _pack(self, rows: list[list[int]], width: int):
        """[batch, width] input_ids and positions: row b's tokens at its next positions,
        then -1 (ids 0); unused rows all padding."""
        input_ids = torch.zeros(self.shapes.batch, width, dtype=torch.int64)
        positions = torch.full((self.shapes.batch, width), -1, dtype=torch.int64)
        for b, row in enumerate(rows):
            start = self.lengths[b]
            input_ids[b, :len(row)] = torch.tensor(row, dtype=torch.int64)
            positions[b, :len(row)] = torch.arange(start, start + len(row))
        return input_ids, positions

    def _check_batch(self, n: int) -> None:
        if n > self.shapes.batch:
            raise DCPInputError(f"batch of {n} sequences exceeds the program's batch size "
                                f"{self.shapes.batch}. Build it with batch >= {n}.")
        if self.lengths and n != len(self.lengths):
            raise DCPInputError(f"step has {n} sequences, engine holds {len(self.lengths)}. "
                                f"Pass one entry per sequence.")

    def bucket_width(self, lengths: list[int]) -> int:
        """Block-table width of the smallest bucket holding sequences of ``lengths`` tokens."""
        from dcp_compile.runtime.program.buckets import bucket_width, smallest_bucket
        tokens = max(lengths, default=0)
        # Past the capacity: the full width, where the allocator names the overflow.
        bucket = smallest_bucket(self.buckets, min(tokens, self.buckets[-1]))
        return bucket_width(bucket, block_size=self.block_size, dcp=self.dcp)

    def _run(self, kind, input_ids, positions, new_tokens: list[int]) -> torch.Tensor:
        seqs = list(range(len(new_tokens)))
        for b, k in enumerate(new_tokens):
            self.allocator.ensure(b, self.lengths[b] + k)
        seq_ids = seqs + [None] * (self.shapes.batch - len(seqs))
        width = self.bucket_width([self.lengths[b] + k for b, k in enumerate(new_tokens)])
        block_table = self.allocator.table(seq_ids, width)
        # The step contract, plus the engine's own knowledge: each row continues its sequence.
        seq_lens = torch.full((self.shapes.batch,), -1, dtype=torch.int64)
        seq_lens[:len(seqs)] = torch.tensor(self.lengths[:len(seqs)], dtype=torch.int64)
        if self.state_slots is None:
            self.contracts[kind, width].check(input_ids, positions, block_table,
                                              seq_lens=seq_lens)
            logits = self.executor.step(kind, input_ids, positions, block_table)
        else:
            counts = new_tokens + [0] * (self.shapes.batch - len(seqs))
            slots = self.state_slots.step_slots(seq_ids, counts)
            snap, kept = {}, {}
            if kind == StepKind.DECODE and self.shapes.decode_len > 1:   # speculative
                snap["snapshot_slot"] = self.state_slots.snapshot_slots(
                    seq_ids, self.lengths + [0] * (self.shapes.batch - len(seqs)), counts,
                    self.shapes.decode_len)
            elif kind == StepKind.CONTEXT and self.shapes.state_checkpoints:
                # the state at each full vblock of a prompt, for the prefix cache
                alloc = self.allocator
                hashes = [alloc._hashes(input_ids[b, :k - 1].tolist())
                          if self.checkpoints is not None and k else []
                          for b, k in enumerate(counts)]
                if self.checkpoints is not None:
                    self.checkpoints.sync(alloc._by_hash)
                    snap["snapshot_slot"], kept = self.checkpoints.plan(
                        hashes, alloc.tokens_per_block, input_ids.shape[1])
                else:
                    snap["snapshot_slot"] = torch.full_like(positions, -1)
            self.contracts[kind, width].check(input_ids, positions, block_table,
                                              seq_lens=seq_lens, state_slot=slots,
                                              fresh=state_rows(positions)[0], **snap)
            logits = self.executor.step(kind, input_ids, positions, block_table,
                                        state_slot=slots, **snap)
            if kept:
                self.checkpoints.keep(kept)
        for b, k in enumerate(new_tokens):
            self.lengths[b] += k
        return logits
