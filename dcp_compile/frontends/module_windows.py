"""Sliding-window masks of the model libraries, rewritten as formulas of positions while
``transform()`` captures the model.

litgpt (``CausalSelfAttention.forward``, no KV cache) writes its sliding-window mask row by
row in a Python loop over the sequence length: ``mask = full((T, T), -inf)`` then
``mask[i, max(0, i - W + 1):i + 1] = 0.0`` for each ``i < T``. torch.export runs the loop at
the captured length, so the graph holds T writes at fixed positions: the mask is exact at
that length and, past it, is the ``full(-inf)`` before the writes. The cache insertion reads
a mask as a predicate of positions and proves it for every position
(passes/mask_predicate.py, passes/prove/masks.py), so it refused these models with a true
counterexample at i = T.

The window the loop writes is a formula: key j is visible to query i iff ``i - W < j <= i``.
So, for the capture only, each sliding-window attention module of a listed class computes its
scores with that formula (``window_mask``: ``full(-inf).triu(1) + full(-inf).tril(-W)``, the
form the cache insertion reads and proves as a window W) in place of the loop's mask; the
cache insertion then proves it and gives ``dcp.attention`` its ``window``, as for any
model whose mask is a tensor expression of positions.

No guessing: a rule (``RULES``, one row per library attention class) names the class, and
the source of every function whose meaning the swap relies on is pinned by its hash (the
library version of requirements/corpus.txt), as module_experts pins the MoE blocks. A
sliding-window module of a listed class whose code differs (another version, a subclass,
an override) is refused, naming what changed. The model itself is untouched: the swap is on
the instance and undone after the capture; the reference runs the library's own loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from dcp_compile.runtime.errors import DCPTransformError

from .module_experts import changed_pins, rule_of_class


def window_mask(tokens: int, window: int, *, dtype: torch.dtype, device) -> Tensor:
    """The additive mask ``[1, 1, T, T]`` keeping key j for query i iff ``i - window < j <=
    i`` (0 kept, -inf hidden): a tensor expression of positions, the same code at every
    length."""
    causal = torch.full((tokens, tokens), float("-inf"), dtype=dtype, device=device).triu(1)
    too_old = torch.full((tokens, tokens), float("-inf"), dtype=dtype,
                         device=device).tril(-window)
    return (causal + too_old).view(1, 1, tokens, tokens)


# ------------------------------------------------------------------------------------ litgpt

def _litgpt_window(attn: nn.Module) -> int | None:
    """The window litgpt's forward writes for this layer (None: a global layer)."""
    if not attn.apply_sliding_window_attention:
        return None
    return attn.config.sliding_window_size


@contextlib.contextmanager
def _litgpt_swap(name: str, attn: nn.Module, window: int):
    """``CausalSelfAttention`` (litgpt 0.5.13) with its sliding-window loop off
    (``apply_sliding_window_attention = False``: without a KV cache that flag only guards the
    loop; the mask passed on is then None, "defaults to causal") and its own
    ``scaled_dot_product_attention`` given :func:`window_mask` in place of None."""
    cls = type(attn)

    def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor,
                                     mask: Tensor | None = None) -> Tensor:
        if mask is not None or q.size(2) != k.size(2):
            raise DCPTransformError(
                f"{name} ({cls.__qualname__}), litgpt's attention with a sliding window of "
                f"{window}: it was called with a KV cache or a mask (input_pos given), which "
                f"the window's rewrite does not read. Call the model as forward(input_ids).")
        return cls.scaled_dot_product_attention(
            attn, q, k, v, window_mask(q.size(2), window, dtype=q.dtype, device=q.device))

    attn.apply_sliding_window_attention = False
    attn.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        del attn.scaled_dot_product_attention
        attn.apply_sliding_window_attention = True


# ------------------------------------------------------------------------------------- rules

@dataclass(frozen=True)
class WindowRule:
    """One library's attention class that writes its window in place: the class
    (``module:qualname``), the functions whose meaning the swap relies on (``module:qualname``
    -> accepted source hashes), the window a module writes (None: none), and the swap."""

    attention: str
    library: str
    pinned: dict[str, set[str]]
    window: Callable[[nn.Module], int | None]
    swap: Callable[[str, nn.Module, int], contextlib.AbstractContextManager]
    how: str                                     # how the library writes the mask


RULES = (
    WindowRule(
        attention="litgpt.model:CausalSelfAttention", library="litgpt 0.5.13",
        pinned={"litgpt.model:CausalSelfAttention.forward": {"71b001eb30a4"},
                "litgpt.model:CausalSelfAttention.scaled_dot_product_attention":
                    {"93c7b49e0ab8"}},
        window=_litgpt_window, swap=_litgpt_swap,
        how="row by row in a Python loop over the sequence length (mask[i, a:b] = 0.0 into "
            "a full(-inf))"),
)


def rule_for(module: nn.Module) -> WindowRule | None:
    """The rule whose attention class ``module`` is (or derives from); None: not listed."""
    return rule_of_class(module, RULES, "attention")


def check_pins(name: str, attn: nn.Module, rule: WindowRule, window: int) -> None:
    """Refuse a sliding-window module whose code is not the code the rule was written from."""
    changed = changed_pins([attn], rule.pinned)
    if changed:
        raise DCPTransformError(
            f"{name} ({type(attn).__qualname__}) is {rule.library}'s attention with a sliding "
            f"window of {window}, whose mask it writes {rule.how}; dcp_compile reads that "
            f"window as a formula of positions from that version's code, and here the code "
            f"differs: {changed} (source hashes). Use {rule.library}, or build the mask as a "
            f"tensor expression of positions (e.g. full(-inf).triu(1) + "
            f"full(-inf).tril(-window)).")


def window_sites(model: nn.Module) -> list[tuple[str, nn.Module, WindowRule, int]]:
    """Every sliding-window attention module of a listed class in ``model``: (name, module,
    rule, window), code checked."""
    found = []
    for name, m in model.named_modules():
        rule = rule_for(m)
        window = rule.window(m) if rule is not None else None
        if window is not None:
            check_pins(name or type(m).__name__, m, rule, window)
            found.append((name, m, rule, window))
    return found


@contextlib.contextmanager
def module_windows_enabled(sites: list):
    """Within: every site of :func:`window_sites` computes its scores with
    :func:`window_mask` in place of its library's in-place mask (swapped on the instance, the
    class untouched, undone on exit)."""
    with contextlib.ExitStack() as stack:
        for name, m, rule, window in sites:
            stack.enter_context(rule.swap(name, m, window))
        yield len(sites)
