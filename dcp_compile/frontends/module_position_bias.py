"""Position biases of the model libraries that cache their bias in a buffer, recomputed as
formulas of positions while ``transform()`` captures the model.

x-transformers' ``AlibiPositionalBias.forward(i, j)`` builds ALiBi's bias
``-|j - i| * slope_h`` from two ``arange``s on its first call and stores it in a buffer
(``self.bias``), which every later call slices (``self.bias[..., -i:, -j:]``) while it is long
enough. In a capture, a call that finds the buffer reads a constant table of the length some
earlier forward ran at: no formula of positions, refused by the mask reader (and a program
could not follow it past that length). Its heads beyond ``alibi_num_heads`` get no bias: the
bias is padded with zeros along the heads after the product with the slopes.

So, for the capture only, each listed bias module computes the same bias fresh at every call
(:func:`alibi_bias`): the slopes padded to every head first (a per-head constant, which the
mask reader takes as an uninterpreted table of the head), times ``-|j - i|`` of the two
``arange``s. The cache insertion then proves it ALiBi (passes/score_bias.py) and gives the
paged op the slopes, as for Bloom's and MPT's.

No guessing: a rule (``RULES``, one row per library class) names the class, and the source of
every function whose meaning the swap relies on is pinned by its hash (the library version of
requirements/corpus.txt), as module_experts and module_windows pin theirs; a module of a
listed class whose code differs is refused, naming what changed. The swap is on the instance
and undone after the capture; the reference runs the library's own code.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dcp_compile.runtime.errors import DCPTransformError

from .module_experts import changed_pins, rule_of_class, swap_sites


def alibi_bias(slopes: Tensor, heads: int, queries: int, keys: int) -> Tensor:
    """ALiBi's bias ``[heads, queries, keys]``: ``-|j - i| * slope_h`` for query i at
    position ``keys - queries + i`` and key j at position j, ``slopes`` (``[h, 1, 1]``,
    ``h <= heads``) padded with zero slopes to every head."""
    slopes = F.pad(slopes, (0, 0, 0, 0, 0, heads - slopes.shape[-3]))
    query_pos = torch.arange(keys - queries, keys, device=slopes.device)
    key_pos = torch.arange(keys, device=slopes.device)
    distance = (key_pos[None, :] - query_pos[:, None]).abs()
    return -distance[None] * slopes


# ---------------------------------------------------------------------------- x-transformers

@contextlib.contextmanager
def _x_transformers_alibi(name: str, module: nn.Module):
    """``AlibiPositionalBias.forward(i, j)`` (x-transformers 2.31.10) without its buffer."""
    def forward(i: int, j: int) -> Tensor:
        return alibi_bias(module.slopes, module.total_heads, i, j)

    module.forward = forward
    try:
        yield
    finally:
        del module.forward


# ------------------------------------------------------------------------------------- rules

@dataclass(frozen=True)
class BiasRule:
    """One library's position-bias class: the class (``module:qualname``), the functions
    whose meaning the swap relies on (``module:qualname`` -> accepted source hashes), and
    the swap."""

    bias: str
    library: str
    pinned: dict[str, set[str]]
    swap: Callable[[str, nn.Module], contextlib.AbstractContextManager]
    how: str                                     # what the library's code does


_X = "x_transformers.x_transformers"
RULES = (
    BiasRule(
        bias=f"{_X}:AlibiPositionalBias", library="x-transformers 2.31.10",
        pinned={f"{_X}:AlibiPositionalBias.forward": {"7ad19162d27d"}},
        swap=_x_transformers_alibi,
        how="builds ALiBi's bias once and reads it from a buffer at every later call"),
)


def rule_for(module: nn.Module) -> BiasRule | None:
    """The rule whose class ``module`` is (or derives from); None: not listed."""
    return rule_of_class(module, RULES, "bias")


def check_pins(name: str, module: nn.Module, rule: BiasRule) -> None:
    """Refuse a bias module whose code is not the code the rule was written from."""
    changed = changed_pins([module], rule.pinned)
    if changed:
        raise DCPTransformError(
            f"{name} ({type(module).__qualname__}) is {rule.library}'s position bias, which "
            f"{rule.how}; dcp_compile recomputes it as a formula of positions from that "
            f"version's code, and here the code differs: {changed} (source hashes). Use "
            f"{rule.library}, or compute the bias from torch.arange or position_ids at every "
            f"call.")


def bias_sites(model: nn.Module) -> list[tuple[str, nn.Module, BiasRule]]:
    """Every position-bias module of a listed class in ``model``: (name, module, rule), code
    checked."""
    return swap_sites(model, rule_for, check_pins)


@contextlib.contextmanager
def module_position_bias_enabled(sites: list):
    """Within: every site of :func:`bias_sites` computes its bias fresh as a formula of
    positions (swapped on the instance, the class untouched, undone on exit)."""
    with contextlib.ExitStack() as stack:
        for name, m, rule in sites:
            stack.enter_context(rule.swap(name, m))
        yield len(sites)
