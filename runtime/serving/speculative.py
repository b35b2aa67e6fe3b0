"""Greedy speculative decoding over width-K decode steps (``StepShapes.decode_len = K``).

Each step, row b is ``[last, d_1, ..., d_j]`` (j <= K - 1 drafts) at the sequence's next
positions. The target's argmax at offset i is its greedy token after ``d_1..d_i``; the
longest prefix of drafts equal to those argmaxes is accepted, plus the argmax after it (the
bonus token), so a step yields 1..j+1 tokens and the output is token for token plain greedy
decoding. Rejected positions are not rolled back: the sequence length falls back to the
accepted count (``Engine.rewind``) and later steps overwrite their KV.

Drafters propose from each sequence's full history (prompt + generated):

* :class:`NgramDrafter` — prompt lookup: the tokens that followed the latest earlier
  occurrence of the history's last n-gram (model-free);
* :class:`ModelDrafter` — greedy tokens of a draft model run by its own Engine (any program
  ``transform()`` builds, or a single-device model), whose KV follows its own layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dcp_compile.runtime.errors import DCPInputError


class Drafter(Protocol):
    def propose(self, histories: list[list[int]], counts: list[int]) -> list[list[int]]:
        """Up to ``counts[b]`` draft tokens continuing ``histories[b]``."""

    def accepted(self, seq: int, length: int) -> None:
        """Sequence ``seq`` now holds ``length`` verified tokens (history[:length])."""


@dataclass
class SpecStats:
    steps: int = 0                      # verification steps
    row_steps: int = 0                  # (row, step) pairs that verified something
    drafted: int = 0
    accepted: int = 0                   # drafts accepted
    emitted: int = 0                    # tokens produced (accepted + bonus)
    per_step: list = field(default_factory=list)   # drafts accepted per row; -1: sat out

    @property
    def mean_accepted(self) -> float:
        """Tokens per row per verification step (1.0: no draft ever accepted)."""
        return self.emitted / self.row_steps if self.row_steps else 0.0

    def to_json(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "emitted": self.emitted, "mean_accepted": round(self.mean_accepted, 4),
                "accepted_per_step": self.per_step}


@dataclass
class SpecResult:
    tokens: list[list[int]]                      # generated tokens per sequence
    logits: list[list[torch.Tensor]] = field(default_factory=list)  # per sequence, per token
    stats: SpecStats = field(default_factory=SpecStats)


def accept_greedy(drafts: list[int], argmax: list[int]) -> int:
    """Drafts accepted: the longest prefix with drafts[i] == argmax[i] (argmax[i] is the
    target's token after the row's first i + 1 tokens)."""
    n = 0
    while n < len(drafts) and drafts[n] == argmax[n]:
        n += 1
    return n


def speculative_generate(engine, first_logits: torch.Tensor, steps: int, drafter: Drafter,
                         histories: list[list[int]]) -> SpecResult:
    """Greedy-decode ``steps`` tokens per sequence from the prompt's last logits, verifying
    drafts in width-K steps of ``engine`` (see module docstring)."""
    K = engine.shapes.decode_len
    if K < 2:
        raise DCPInputError(f"speculative decoding verifies drafts in a decode step of width "
                            f"K >= 2: the program's decode_len is {K}. Build it with "
                            f"StepShapes(decode_len=K).")
    n = first_logits.shape[0]
    result = SpecResult(tokens=[[] for _ in range(n)], logits=[[] for _ in range(n)])
    hist = [list(h) for h in histories]
    for b in range(n):
        tok = int(first_logits[b].argmax())
        result.tokens[b].append(tok)
        result.logits[b].append(first_logits[b])
        hist[b].append(tok)
    stats = result.stats
    while True:
        left = [steps - len(t) for t in result.tokens]
        if max(left) <= 0:
            break
        # A row verifying j drafts yields up to j + 1 tokens: never more than it needs.
        counts = [max(0, min(K - 1, r - 1)) for r in left]
        drafts = drafter.propose(hist, counts)
        rows = [[h[-1]] + list(d[:c]) if r > 0 else []
                for h, d, c, r in zip(hist, drafts, counts, left)]
        before = list(engine.lengths)
        logits = engine.decode_rows(rows)                               # [n, K, vocab]
        stats.steps += 1
        stats.per_step.append([-1] * n)
        for b, row in enumerate(rows):
            if not row:
                continue
            argmax = logits[b, :len(row)].argmax(-1).tolist()
            a = accept_greedy(row[1:], argmax)
            new = argmax[:a + 1]                     # the accepted drafts, then the bonus
            result.tokens[b] += new
            result.logits[b] += list(logits[b, :a + 1])
            hist[b] += new
            engine.rewind(b, before[b] + a + 1)      # KV of last, d_1..d_a is verified
            drafter.accepted(b, before[b] + a + 1)
            stats.row_steps += 1
            stats.drafted += len(row) - 1
            stats.accepted += a
            stats.per_step[-1][b] = a
            stats.emitted += a + 1
    return result


# ----------------------------------------------------------------------------------------
# Drafters
# ----------------------------------------------------------------------------------------


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the history's last n tokens
    (n from ``max_n`` down to ``min_n``) and propose the tokens that followed it."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise DCPInputError(f"n-gram sizes must satisfy 1 <= min_n <= max_n: min_n="
                                f"{min_n}, max_n={max_n}. Pass e.g. max_n=3, min_n=1.")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, histories, counts):
        return [self._one(h, c) for h, c in zip(histories, counts)]

    def _one(self, h: list[int], count: int) -> list[int]:
        if count <= 0:
            return []
        for n in range(min(self.max_n, len(h) - 1), self.min_n - 1, -1):
            tail = h[-n:]
            for start in range(len(h) - n - 1, -1, -1):
                if h[start:start + n] == tail:
                    return h[start + n:start + n + count]
        return []

    def accepted(self, seq, length):
        pass


class ModelDrafter:
    """Greedy drafts of a draft model run by its own ``Engine`` (same batch; any decode_len:
    pending tokens are fed in steps of its width). Its KV follows its own program's layout;
    after verification it keeps only the verified tokens (rewind) and catches up next time.
    """

    def __init__(self, engine):
        self.engine = engine

    def start(self, prompts: list[list[int]]) -> None:
        """Prefill the draft engine with everything but each prompt's last token (which the
        first ``propose`` feeds, together with what the target generated)."""
        self.engine.prefill([p[:-1] for p in prompts])

    def propose(self, histories, counts):
        e = self.engine
        n = len(histories)
        if not e.lengths:
            raise DCPInputError("the draft engine holds no sequences: call "
                                "ModelDrafter.start(prompts) before generating.")
        drafts: list[list[int]] = [[] for _ in range(n)]
        pending = [h[e.lengths[b]:] if counts[b] > 0 else [] for b, h in enumerate(histories)]
        last = [None] * n
        width = e.shapes.decode_len
        while any(pending):                  # catch up: the verified tokens not yet fed
            rows = [p[:width] for p in pending]
            logits = e.decode_rows(rows)
            for b, row in enumerate(rows):
                if row:
                    pending[b] = pending[b][len(row):]
                    if not pending[b]:
                        last[b] = int(logits[b, len(row) - 1].argmax())
        for b in range(n):
            if last[b] is not None:
                drafts[b].append(last[b])
        for i in range(1, max(counts, default=0)):       # then one draft token per step
            rows = [[drafts[b][-1]] if counts[b] > i and drafts[b] else []
                    for b in range(n)]
            if not any(rows):
                break
            logits = e.decode_rows(rows)
            for b, row in enumerate(rows):
                if row:
                    drafts[b].append(int(logits[b, 0].argmax()))
        return [d[:c] for d, c in zip(drafts, counts)]

    def accepted(self, seq, length):
        if self.engine.lengths[seq] > length:
            self.engine.rewind(seq, length)
