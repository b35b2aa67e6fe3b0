"""A fresh batch's prompts over the prefix cache (``Engine(prefix_caching=True)``).

Rows whose first full vblock matches an earlier row's wait for it (the leaders are computed
first and their full vblocks registered), then start on the cached vblocks of their longest
cached prefix (``BlockAllocator.share_prefix``) and compute only the rest. A suffix continues
a prior: a prefill-mode engine runs it as a prompt chunk; a decode engine, whose context step
attends to no prior, runs it through its chunk step (``chunk_len`` tokens at a time: one step
for a suffix that fits) or, in a program without one, its decode steps (``decode_len``).
Shared blocks are never written: reuse is whole vblocks, the suffix goes to the row's own.
"""

from __future__ import annotations

import torch

from dcp_compile.runtime.names import StepKind


def prefill_sharing_prefixes(engine, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of each prompt's last token [n, vocab], reusing cached prefixes."""
    alloc = engine.allocator
    n = len(prompts)
    firsts = [(alloc._hashes(p[:-1]) or [None])[0] for p in prompts]
    # A follower shares its first vblock with an earlier row of this batch.
    follower = [h is not None and h in firsts[:b] for b, h in enumerate(firsts)]
    logits: list[torch.Tensor | None] = [None] * n
    for wave in (False, True):
        rows = [b for b in range(n) if follower[b] == wave]
        if not rows:
            continue
        for b in rows:
            engine.lengths[b] = engine.share_prefix(b, prompts[b])
        chunks = [prompts[b][engine.lengths[b]:] if b in rows else [] for b in range(n)]
        if any(engine.lengths[b] for b in rows) and engine.prompt_kind == StepKind.CONTEXT:
            out = _prompt_in_decode_steps(engine, chunks)
        else:
            out = engine.prompt_step(chunks)
        for b in rows:
            logits[b] = out[b]
            alloc.register_prefix(b, prompts[b])
    return torch.stack(logits)


def _prompt_in_decode_steps(engine, chunks: list[list[int]]) -> torch.Tensor:
    """Feed each row's chunk through chunk steps (decode steps in a program without one);
    logits of each chunk's last token."""
    K, run = (engine.shapes.chunk_len, engine.chunk_rows) if engine.shapes.chunk_len else \
        (engine.shapes.decode_len, engine.decode_rows)
    left = [list(c) for c in chunks]
    last: list[torch.Tensor | None] = [None] * len(chunks)
    while any(left):
        rows = [c[:K] for c in left]
        out = run(rows)
        for b, row in enumerate(rows):
            left[b] = left[b][len(row):]
            if row and not left[b]:
                last[b] = out[b, len(row) - 1]
    vocab = next(x for x in last if x is not None).shape[-1]
    return torch.stack([x if x is not None else torch.zeros(vocab) for x in last])
