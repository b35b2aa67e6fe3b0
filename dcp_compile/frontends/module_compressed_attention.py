"""DeepSeek-V4's compressed attention, refused by name (docs/moe-mla.md, "DeepSeek-V4").

A DeepSeek-V4 attention layer attends, in one softmax with per-head sinks, over two sets of
keys: the last ``sliding_window`` tokens' own K (= V; a window, served like any window) and
*compressed* entries, each a softmax-gated sum of the K projections of a group of tokens:
``C_w = sum_{j in window w} softmax_j(Z_j + B) * C_j``. Heavily Compressed Attention (HCA)
pools every ``m'`` consecutive tokens into one entry and attends to all of them; Compressed
Sparse Attention (CSA) pools overlapping windows of ``2m`` tokens (stride ``m``) and a
lightning indexer keeps the top-k entries per query.

A compressed entry mixes tokens across positions of the cache, so it is not the per-token K
a paged cache holds: under DCP the tokens of one window sit on different ranks (the
interleave cuts them, and CSA's window reaches into the previous one), the entry exists only
once its window closes (a write at a data-dependent step, from a partial-window buffer the
model keeps beside the cache), and the indexer's top-k runs over the compressed entries, not
over tokens. Nothing of that is a per-token op of the captured graph, so the capture's own
check would refuse it anyway, at a slice of the compressor's forward; this module names it
first, by class and source line, with what serving it would need.

Rules as data: ``RULES`` has one row per compressor class (``module:qualname``), the line of
its forward that pools a window (found by a marker in its source, so the line cited is the
installed code's) and what the row's component is.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from torch import nn

from dcp_compile.runtime.errors import DCPCompressedAttentionError

from .module_experts import rule_of_class


@dataclass(frozen=True)
class CompressorRule:
    """One library's KV compressor: its class, the component's name, how its entries group
    tokens, and a marker of the source line that pools a window."""

    compressor: str
    component: str
    grouping: str
    marker: str = ".softmax(dim=2"


_V4 = "transformers.models.deepseek_v4.modeling_deepseek_v4"
RULES = (
    CompressorRule(
        compressor=f"{_V4}:DeepseekV4HCACompressor",
        component="Heavily Compressed Attention (HCA)",
        grouping="every compress_rate={rate} consecutive tokens pooled into one entry"),
    CompressorRule(
        compressor=f"{_V4}:DeepseekV4CSACompressor",
        component="Compressed Sparse Attention (CSA)",
        grouping="overlapping windows of 2 x compress_rate={rate} tokens (stride {rate}) "
                 "pooled into one entry each, then its lightning indexer's top-k over the "
                 "entries"),
)


def rule_for(module: nn.Module) -> CompressorRule | None:
    return rule_of_class(module, RULES, "compressor")


def pooling_line(rule: CompressorRule) -> str:
    """``File "...", line N`` of the pooling line of the rule's class's forward."""
    module, qualname = rule.compressor.split(":")
    forward = getattr(importlib.import_module(module), qualname).forward
    forward = inspect.unwrap(forward)
    lines, first = inspect.getsourcelines(forward)
    offset = next((i for i, text in enumerate(lines) if rule.marker in text), 0)
    return f'File "{inspect.getsourcefile(forward)}", line {first + offset}'


def refuse_compressed_attention(model: nn.Module) -> None:
    """Raise ``DCPCompressedAttentionError`` naming the first compressor of ``model`` (its
    module name, class, component and source line); return for a model without one."""
    for name, m in model.named_modules():
        rule = rule_for(m)
        if rule is None:
            continue
        rate = getattr(m, "compress_rate", "?")
        raise DCPCompressedAttentionError(
            f"DeepSeek-V4 compressed attention is not served: {name} "
            f"({type(m).__qualname__}, {rule.component}: {rule.grouping.format(rate=rate)}; "
            f"{pooling_line(rule)}) computes KV entries that mix tokens across positions of "
            f"the cache. Under DCP a window's tokens are on different ranks (interleave cuts "
            f"it; CSA's window reaches into the previous one), an entry is written only when "
            f"its window closes, from a partial-window buffer beside the cache, and the "
            f"attention's one softmax (with sinks) spans the sliding-window keys and the "
            f"entries together; a paged cache of per-token K/V holds none of it (at dcp=1 "
            f"neither), so no program is exact. Serving it needs a per-layer cache of compressed entries "
            f"sharded by entry over the DCP group, the partial window as per-sequence state "
            f"replicated over DCP (written by the window's closing token), the pooling as an "
            f"op over a gathered window, CSA's indexer top-k over the entries (the DSA "
            f"selection, docs/moe-mla.md), and the LSE combine over both key sets; not built. "
            f"A DeepSeek-V4 config whose layer_types are all 'sliding_attention' has no "
            f"compressor (docs/moe-mla.md: DeepSeek-V4 says what it meets next)")
