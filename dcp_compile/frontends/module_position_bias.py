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

x-transformers' ``RelativePositionBias`` (T5's bucketed bias, ``rel_pos_bias=True``) and
``DynamicPositionBias`` (an MLP of the distance, ``dynamic_pos_bias=True``) compute a bias
that is a function of the key-query distance through ops that are no formula (a bucket by
``log``, an embedding, an MLP). Their swap computes the bias once, at transform time, from
the module's own forward over the distances ``0 .. max_model_len - 1`` (one query at the
last position against every key: :func:`distance_table`), checks on the module's own
forward that it depends on the distance only (every query of a prompt, and the last queries
of the longest one), and refuses the module by name otherwise. The table ``[H,
max_model_len]`` is a buffer of the step module named ``DISTANCE_TABLE``; the swapped
forward reads it at ``|q_pos - k_pos|`` of two ``arange``s, which the mask reader reads as
``table(h, i - j)`` at every key a causal mask keeps (passes/score_bias.distance_table_of),
and the paged op adds ``table[h, q_pos - k_pos]`` on global positions.

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
from dcp_compile.runtime.names import DISTANCE_TABLE

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


# ---------------------------------------------------------------------------- distance tables

# The distance check reads the module's own forward over prompts of up to this many tokens
# (every query, every causal key) and the last queries of the longest one.
CHECK_TOKENS = 64
# An MLP of the distance (DynamicPositionBias) evaluates every distance in one batch: a
# batch of another size may round its rows differently, by far less than this.
DISTANCE_ATOL = 1e-5


@dataclass
class Tables:
    """Where the swaps' distance tables live (the step module's ``holder``, non-persistent
    buffers, kept after the capture: the program's constants read them) and the program's
    ``max_model_len`` (None: not known, a table is refused)."""

    holder: nn.Module
    max_model_len: int | None = None


def distance_table(name: str, own: Callable[[int, int], Tensor], length: int) -> Tensor:
    """``[H, length]``: the bias ``own(i, j)`` (the module's own ``forward(queries, keys)``,
    ``[H, queries, keys]``, queries at the last positions) gives a key ``d`` positions
    before its query, for d in 0 .. length - 1; refused naming the module unless ``own``
    gives that bias at every causal key of every query tried (it depends on the distance
    only)."""
    with torch.no_grad():
        table = own(1, length)[:, 0].flip(-1).float()           # [H, length] by distance
        n = min(length, CHECK_TOKENS)
        for queries, keys in ((n, n), (n, length)):
            bias = own(queries, keys).float()
            q_pos = torch.arange(keys - queries, keys)[:, None]
            back = q_pos - torch.arange(keys)[None, :]
            causal = back >= 0
            want = table[:, back.clamp(min=0)]
            if bias.shape != want.shape or not torch.allclose(
                    bias[:, causal], want[:, causal], rtol=0, atol=DISTANCE_ATOL):
                worst = (bias[:, causal] - want[:, causal]).abs().max() \
                    if bias.shape == want.shape else bias.shape
                raise DCPTransformError(
                    f"{name}: its score bias is not a function of the key-query distance "
                    f"only: at {queries} queries over {keys} keys it differs from the bias "
                    f"of the same distance at the last query by {worst} (a distance table "
                    f"[heads, max_model_len] is what the paged op adds). Compute the bias "
                    f"from k_pos - q_pos only.")
    return table


def _table_key(name: str, length: int | None) -> str:
    """The buffer of ``name``'s table over ``length`` positions: one per length, so a
    program captured at other shapes (a bucket) keeps reading its own."""
    return f"{DISTANCE_TABLE}_{name.replace('.', '_')}_{length}"


@dataclass(frozen=True)
class TableRule:
    """How to build a distance-table swap's table: the module's heads."""

    heads_of: Callable[[nn.Module], int]

    def prepare(self, name: str, module: nn.Module, tables: Tables) -> None:
        """The table of ``module`` over ``tables.max_model_len``, registered on the holder
        (outside any capture: the module's own forward runs on real tensors)."""
        length, key = tables.max_model_len, _table_key(name, tables.max_model_len)
        if length is None or getattr(tables.holder, key, None) is not None:
            return
        table = distance_table(name, module.forward, length)
        if table.shape[0] != self.heads_of(module):
            raise DCPTransformError(
                f"{name}: its bias has {table.shape[0]} heads, its module "
                f"{self.heads_of(module)}. Use the library's code as pinned.")
        tables.holder.register_buffer(key, table.to(_dtype_of(module)), persistent=False)

    @contextlib.contextmanager
    def __call__(self, name: str, module: nn.Module, tables: Tables):
        """The swap: ``forward(i, j)`` reads the table at ``|q_pos - k_pos|``."""
        key = _table_key(name, tables.max_model_len)
        stored = getattr(tables.holder, key, None)
        if stored is None or tables.max_model_len is None:
            raise DCPTransformError(
                f"{name} ({type(module).__qualname__}) adds a bias of the key-query "
                f"distance, which a program reads from a table over its max_model_len; "
                f"this frontend does not know it. Use dcp_compile.transform on the model.")
        length = tables.max_model_len

        def forward(i: int, j: int) -> Tensor:
            if j > length:
                raise DCPTransformError(
                    f"{name}: a bias over {j} keys, past max_model_len={length}")
            held = getattr(tables.holder, key)
            q_pos = torch.arange(j - i, j, device=held.device)
            k_pos = torch.arange(j, device=held.device)
            return held[:, (q_pos[:, None] - k_pos[None, :]).abs()]

        module.forward = forward
        try:
            yield
        finally:
            del module.forward


def prepare_distance_tables(sites: list, tables: Tables) -> int:
    """Build the distance table of every site whose swap reads one (before the capture)."""
    built = [rule.swap.prepare(name, m, tables) for name, m, rule in sites
             if isinstance(rule.swap, TableRule)]
    return len(built)


def _dtype_of(module: nn.Module) -> torch.dtype:
    p = next(module.parameters(), None)
    return p.dtype if p is not None else torch.float32


# ---------------------------------------------------------------------------- x-transformers

@contextlib.contextmanager
def _x_transformers_alibi(name: str, module: nn.Module, tables: Tables):
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
    swap: Callable[[str, nn.Module, Tables], contextlib.AbstractContextManager]
    how: str                                     # what the library's code does


_X = "x_transformers.x_transformers"
RULES = (
    BiasRule(
        bias=f"{_X}:AlibiPositionalBias", library="x-transformers 2.31.10",
        pinned={f"{_X}:AlibiPositionalBias.forward": {"7ad19162d27d"}},
        swap=_x_transformers_alibi,
        how="builds ALiBi's bias once and reads it from a buffer at every later call"),
    BiasRule(
        bias=f"{_X}:RelativePositionBias", library="x-transformers 2.31.10",
        pinned={f"{_X}:RelativePositionBias.forward": {"1d706a351d8a"},
                f"{_X}:RelativePositionBias._relative_position_bucket": {"a50cd9ebc00f"}},
        swap=TableRule(lambda m: m.relative_attention_bias.embedding_dim),
        how="buckets the key-query distance by a log (T5) and reads an embedding of the "
            "bucket"),
    BiasRule(
        bias=f"{_X}:DynamicPositionBias", library="x-transformers 2.31.10",
        pinned={f"{_X}:DynamicPositionBias.forward": {"75af78bcbbb7"}},
        swap=TableRule(lambda m: m.mlp[-1].out_features),
        how="computes the bias of each key-query distance by an MLP"),
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
def module_position_bias_enabled(sites: list, tables: Tables | None = None):
    """Within: every site of :func:`bias_sites` computes its bias fresh as a formula of
    positions, or reads it from a distance table in ``tables`` (swapped on the instance,
    the class untouched, undone on exit; the tables stay)."""
    tables = tables if tables is not None else Tables(nn.Module())
    with contextlib.ExitStack() as stack:
        for name, m, rule in sites:
            stack.enter_context(rule.swap(name, m, tables))
        yield len(sites)
