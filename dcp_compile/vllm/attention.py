"""The stub attention backend: vLLM sizes, allocates and block-tables the KV cache for it,
and hands each step's metadata to the model; the DCP program does the attention.

Its layers' ``forward`` is never called (the model runs the whole step as one program), so
the impl refuses to run. The layout is LBNHC: one layer's cache is ``[blocks, heads, tokens,
2 * head_dim]`` logically and ``[blocks, tokens, heads, 2 * head_dim]`` in memory, so the
K and V halves are exactly the program's ``[num_blocks, block_size, kv_heads, head_dim]``
caches, as views (kv_views).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl,
                                       AttentionMetadataBuilder, CommonAttentionMetadata)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.registry import register_backend as vllm_register_backend
from vllm.v1.kv_cache_layout import KVCacheLayout

from dcp_compile.runtime.errors import DCPInputError

NAME = "CUSTOM"


class DcpMetadataBuilder(AttentionMetadataBuilder[CommonAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CommonAttentionMetadata:
        # vLLM's common metadata as it is: the model reads the block table, the query
        # starts and the sequence lengths from it.
        return common_attn_metadata


class DcpStubImpl(AttentionImpl):
    # The program combines the ranks' partial attention with its own LSEs, so DCP holds.
    supports_dcp = True
    can_return_lse_for_decode = True

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None,
                 sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                 attn_type="decoder", kv_sharing_target_layer_name=None, **extra):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        raise DCPInputError(
            f"the dcp_compile stub attention layer {layer.layer_name} was called: the DCP "
            f"program runs the whole model step. Serve it through DcpCompiledForCausalLM "
            f"(hf_overrides={{'architectures': ['DcpCompiledForCausalLM']}}).")


class DcpStubBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16,
                                                    torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float32", "bfloat16", "float16"]
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls():
        return DcpStubImpl

    @staticmethod
    def get_builder_cls():
        return DcpMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBNHC,)


def register_backend() -> None:
    vllm_register_backend(AttentionBackendEnum.CUSTOM,
                          f"{DcpStubBackend.__module__}.{DcpStubBackend.__qualname__}")


def kv_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's vLLM cache as the program's (key, value) caches, each ``[num_blocks,
    block_size, kv_heads, head_dim]``: views of the same memory, never copies."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_dim:
        raise DCPInputError(
            f"vLLM's KV cache of a layer is {list(kv_cache.shape)}: expected [blocks, heads, "
            f"tokens, 2 * head_dim={2 * head_dim}] (the LBNHC layout of DcpStubBackend). "
            f"Leave VLLM_KV_CACHE_LAYOUT unset or set it to LBNHC.")
    tokens_major = kv_cache.transpose(1, 2)               # [blocks, tokens, heads, 2 * d]
    k, v = tokens_major[..., :head_dim], tokens_major[..., head_dim:]
    for half in (k, v):
        if half.untyped_storage().data_ptr() != kv_cache.untyped_storage().data_ptr():
            raise AssertionError("a K/V view of vLLM's cache is not the cache's memory")
    return k, v
