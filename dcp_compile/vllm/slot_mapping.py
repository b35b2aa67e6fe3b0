"""vLLM's CP slot-mapping kernel on CPU, written with dcp_compile's layout formula.

vLLM's CPU build replaces the Triton kernel ``ComputeSlotMappingKernel.kernel`` with a C++
one that refuses context parallelism ("Context Parallelism is not supported on CPU"). The
program computes its own slot mapping inside the graph; vLLM still computes one every step
(for its KV connectors and metadata), so this override gives it the right one: the same
``layout.slot_mapping`` the program runs and the proofs prove. It must be registered after
the platform's overrides (a worker registers those after loading the plugins), hence from
the model's constructor.
"""

from __future__ import annotations

import torch

from dcp_compile.runtime import layout

KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"


def compute_slot_mapping(num_tokens, max_num_tokens, query_start_loc, positions, block_table,
                         block_table_stride, slot_mapping, KV_CACHE_BLOCK_SIZE,
                         TOTAL_CP_WORLD_SIZE=1, TOTAL_CP_RANK=0,
                         CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=-1, BLOCK_SIZE=1024) -> None:
    """The kernel's contract: slot_mapping[t] for every token t of every request, PAD_ID for
    tokens another rank owns and for the padding up to ``max_num_tokens``."""
    kw = dict(dcp=TOTAL_CP_WORLD_SIZE, interleave=CP_KV_CACHE_INTERLEAVE_SIZE,
              block=KV_CACHE_BLOCK_SIZE)
    starts = query_start_loc.to(torch.int64)
    n = int(starts[-1])
    request = torch.searchsorted(starts[1:], torch.arange(n), right=True)
    pos = positions[:n].to(torch.int64)
    entry = block_table[request, layout.local_slot(pos, **kw) // KV_CACHE_BLOCK_SIZE]
    slots = layout.slot_mapping(pos, TOTAL_CP_RANK, entry.to(torch.int64), **kw)
    slot_mapping[:n] = torch.where(slots >= 0, slots, PAD_ID)
    slot_mapping[n:max_num_tokens] = PAD_ID


def register_slot_mapping() -> None:
    from vllm.triton_utils.dispatcher import register_kernels
    register_kernels({KERNEL: compute_slot_mapping})
