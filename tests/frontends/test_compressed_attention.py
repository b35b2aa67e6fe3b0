"""DeepSeek-V4's compressed attention is refused by name (docs/moe-mla.md, "DeepSeek-V4:
compressed attention, refused by name"): ``transform()`` of the model itself and
``hf.prepare`` raise ``DCPCompressedAttentionError`` naming the first compressor's module,
class, component and the source line of its forward that pools a window, before the capture
would meet it (as a slice of the compressor's forward, without a name)."""

from __future__ import annotations

import linecache
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import dcp_compile  # noqa: E402
from dcp_compile.runtime.errors import DCPCompressedAttentionError  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402

SHAPES = StepShapes(batch=1, context_len=8, max_blocks=4, num_blocks=6)
COMPONENTS = {"heavily_compressed_attention": ("DeepseekV4HCACompressor",
                                               "Heavily Compressed Attention"),
              "compressed_sparse_attention": ("DeepseekV4CSACompressor",
                                              "Compressed Sparse Attention")}


def _model(first: str, attention: str = "eager"):
    """The corpus's tiny DeepSeek-V4 with layer 0 of kind ``first``."""
    from hf_corpus import build
    other = next(k for k in COMPONENTS if k != first)
    return build("deepseek_v4", attention, layer_types=[first, other])


def _transform(model):
    return dcp_compile.transform(model, tp=4, dcp=2, mode="decode", block_size=4,
                                 shapes=SHAPES, check=False)


@pytest.mark.parametrize("first", list(COMPONENTS))
def test_transform_names_the_first_compressor_and_its_pooling_line(first):
    cls, component = COMPONENTS[first]
    with pytest.raises(DCPCompressedAttentionError) as info:
        _transform(_model(first))
    message = str(info.value)
    assert f"model.layers.0.self_attn.compressor ({cls}, {component}" in message
    assert "mix tokens across positions of the cache" in message
    assert "Serving it needs a per-layer cache of compressed entries" in message
    # The cited line is the installed code's window pooling (a softmax over the window dim).
    path, line = re.search(r'File "([^"]+)", line (\d+)', message).groups()
    assert path.endswith("modeling_deepseek_v4.py")
    assert ".softmax(dim=2" in linecache.getline(path, int(line))


def test_hf_prepare_names_it_too_not_dsa():
    """hf.prepare met DeepSeek-V4's index_topk field first and sent the model to transform()
    as DSA (which does not serve it): it names the compressor now."""
    from dcp_compile import hf
    with pytest.raises(DCPCompressedAttentionError, match=r"DeepseekV4HCACompressor"):
        hf.prepare(_model("heavily_compressed_attention", None))


def test_the_corpus_reads_it_as_compressed_attention():
    """The corpus table's reason for the refusal (its REASONS row), not "attention sinks"
    (the message mentions the sinks) nor DSA."""
    from hf_corpus import reason_of
    with pytest.raises(DCPCompressedAttentionError) as info:
        _transform(_model("compressed_sparse_attention"))
    assert reason_of(str(info.value)) == "compressed attention (DeepSeek-V4 HCA / CSA)"
