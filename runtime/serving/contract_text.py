"""The step contract's message text: the first offending element of a mask, and the
``<what is wrong>: <the rule>. <how to fix it>.`` format every rule's message follows
(runtime/serving/step_contract.py, runtime/serving/state_contract.py)."""

from __future__ import annotations

import torch


def _first(mask: torch.Tensor):
    """(index tuple, count) of the first True element in row-major order, or None."""
    flat = mask.reshape(-1)
    if flat.numel() == 0 or not bool(flat.any()):
        return None
    i = int(flat.to(torch.uint8).argmax())
    index = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), mask.shape))
    return index, int(flat.sum())


def _el(name: str, index) -> str:
    return f"{name}[{', '.join(map(str, index))}]"


def _more(count: int) -> str:
    return f" (and {count - 1} more)" if count > 1 else ""


def _msg(what: str, rule: str, fix: str) -> str:
    """`<what is wrong>: <the rule>. <how to fix it>.`"""
    return f"{what}: {rule}. {fix}."
