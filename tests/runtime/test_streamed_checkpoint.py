"""A checkpoint given as a stream of (name, tensor) — vLLM's weight iterator — read through
``StreamedCheckpoint``: each rank keeps only its boxes as the tensors stream by, and its
state is bit-equal to what the checkpoint-directory reader gives (the plugin's
``load_weights``, dcp_compile/vllm/model.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import dcp_compile
from dcp_compile.meta_init import meta_model
from dcp_compile.models.tiny_llama import write_tiny_llama
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.program.checkpoint import StreamedCheckpoint
from dcp_compile.runtime.serving.engine import StepShapes


@pytest.mark.parametrize("tp,dcp,kv", [(2, 2, 1), (4, 2, 2)])
def test_streamed_state_is_bit_equal_to_the_directory_reader(tmp_path, tp, dcp, kv):
    ckpt = write_tiny_llama(tmp_path / "ckpt", num_kv_heads=kv)
    program = dcp_compile.transform(
        meta_model(ckpt), tp=tp, dcp=dcp, block_size=16, check=False, garbage_block=0,
        shapes=StepShapes(batch=2, context_len=16, max_blocks=4, num_blocks=6))
    tensors = load_file(next(ckpt.glob("*.safetensors")))
    full_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    for rank in range(tp):
        stream = StreamedCheckpoint(iter(tensors.items()), program.checkpoint_boxes(rank))
        got, stats = program.read_checkpoint(rank, stream)
        want = program.read_checkpoint(rank, ckpt)[0]
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), \
                name
        # The rank kept its shards only: the sharded matrices are cut tp ways.
        assert stats.bytes_read < 0.75 * full_bytes


def test_a_stream_missing_a_tensor_is_refused_by_name(tmp_path):
    ckpt = write_tiny_llama(tmp_path / "ckpt")
    program = dcp_compile.transform(
        meta_model(ckpt), tp=2, dcp=2, block_size=16, check=False,
        shapes=StepShapes(batch=2, context_len=16, max_blocks=4, num_blocks=6))
    tensors = load_file(next(ckpt.glob("*.safetensors")))
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    stream = StreamedCheckpoint(iter(tensors.items()), program.checkpoint_boxes(0),
                                name="vLLM's weight iterator")
    with pytest.raises(DCPInputError, match=r"vLLM's weight iterator has no tensor "
                                            r"model.layers.1.mlp.down_proj.weight"):
        program.read_checkpoint(0, stream)
