"""The one comparator of a program's logits with the model's: per token, the largest
absolute difference over the vocabulary (check, verify and verify_prefill aggregate it)."""

from __future__ import annotations

import torch


def token_errors(got: torch.Tensor, exp: torch.Tensor,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """``max |got - exp|`` over the last (vocabulary) dim, per token: ``inf`` where ``got``
    is not finite (a NaN never passes), 0 on padding (``positions < 0``) when given."""
    diff = (got.float() - exp.float()).abs().amax(-1)
    diff = torch.where(torch.isfinite(got).all(-1), diff, torch.full_like(diff, float("inf")))
    if positions is None:
        return diff
    return torch.where(positions >= 0, diff, torch.zeros_like(diff))
