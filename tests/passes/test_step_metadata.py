"""Per-step layout metadata is computed once per step graph, not once per layer.

The DCP passes emit the step's slot mapping, prior bound, active mask / current key
positions, query bounds and interleave indices once, right after cp_rank, and every layer
reads those nodes (passes/dcp_decode.py ``build_step_metadata``, dcp_prefill.py
``_chunk_metadata``). No later stage deduplicates them: the eager loader and the lowering
only swap or decompose what they are given. Asserted here on transformed programs of several
layers for the context, decode (one token and width K) and prefill steps of GQA, MLA and
sliding-window models; the loaded (eager) graphs keep the same counts.

Windows need no metadata of their own: a layer's window is a keyword of its
``dcp.partial_attention`` (applied on the positions inside the kernel), so a model with
windowed and full layers still has one slot mapping and one prior bound per step.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.models.mla import MLAConfig, plain_mla
from dcp_compile.models.plain import plain_llama
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.kernels.op_defs import op_of

dcp_ops = torch.ops.dcp
LAYERS = 2
SHAPES = StepShapes(batch=2, context_len=8, max_blocks=4, num_blocks=9)

# Ops that compute the step's layout metadata from positions / block table / cp_rank.
METADATA_OPS = (dcp_ops.slot_mapping.default, dcp_ops.local_filled.default,
                dcp_ops.active_mask.default, dcp_ops.query_bound.default,
                dcp_ops.interleave_slice_index.default, dcp_ops.q_unshuffle_index.default)

# step kind -> metadata op -> how many a step graph holds (whatever the number of layers).
EXPECTED = {
    "context": {"slot_mapping": 1},
    "decode": {"slot_mapping": 1, "local_filled": 1, "active_mask": 1},
    "prefill": {"slot_mapping": 1, "local_filled": 1, "interleave_slice_index": 1,
                "q_unshuffle_index": 1},
}
WIDTH_K = {"slot_mapping": 1, "query_bound": 1}     # decode_len > 1 (speculative verify)

CFG = DemoConfig(vocab_size=128, hidden_size=64, num_layers=LAYERS, num_q_heads=8,
                 num_kv_heads=2, head_dim=8, intermediate_size=96)
MODELS = {
    "gqa": lambda: demo_model(CFG),
    "mla": lambda: plain_mla(MLAConfig(num_layers=LAYERS)),
    # every layer windowed (window 4 < the chunk): the window is a kernel keyword
    "window": lambda: plain_llama(CFG, attention="eager", window=4, softcap=3.0),
}


@functools.lru_cache(maxsize=None)
def program(model: str, mode: str, decode_len: int = 1):
    shapes = StepShapes(**{**SHAPES.__dict__, "decode_len": decode_len})
    return dcp_compile.transform(MODELS[model](), tp=4, dcp=2, mode=mode, block_size=4,
                                 shapes=shapes, check=False)


def metadata_counts(gm) -> dict[str, int]:
    # A loaded eager graph calls the ops' Python functions (op_of: the op each stands for).
    return dict(Counter(op_of(n.target)._opname for n in gm.graph.nodes
                        if n.op == "call_function" and op_of(n.target) in METADATA_OPS))


def attention_layers(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and n.target == dcp_ops.partial_attention.default)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_each_metadata_op_appears_once_per_step_graph(model, mode):
    prog = program(model, mode)
    for kind, gm in prog.graphs.items():
        assert attention_layers(gm) == LAYERS, kind          # L layers, one metadata set
        assert metadata_counts(gm) == EXPECTED[kind], kind
        readers = [n for n in gm.graph.nodes if n.target == dcp_ops.slot_mapping.default]
        writes = [u for u in readers[0].users] if kind != "prefill" else \
            [n for n in gm.graph.nodes if n.target == dcp_ops.cache_write.default]
        assert len(writes) == LAYERS, f"{kind}: every layer's cache write reads the one " \
                                      f"slot mapping"


def test_width_k_decode_has_one_query_bound_per_step():
    prog = program("gqa", "decode", decode_len=3)
    assert attention_layers(prog.graphs["decode"]) == LAYERS
    assert metadata_counts(prog.graphs["decode"]) == WIDTH_K


def test_the_metadata_sits_at_the_input_side_before_the_first_layer():
    """Built once after cp_rank, before any layer's attention reads it."""
    gm = program("gqa", "decode").graphs["decode"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first_layer = min(order[n] for n in gm.graph.nodes
                      if n.target in (dcp_ops.cache_write.default,
                                      dcp_ops.partial_attention.default))
    assert all(order[n] < first_layer for n in gm.graph.nodes if n.target in METADATA_OPS)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_loaded_eager_graphs_keep_one_metadata_set(mode):
    """The eager loader swaps kernels and deduplicates nothing: its graphs hold exactly what
    the program holds."""
    prog = program("gqa", mode)
    loaded = prog.load(0, {role: f"group_{role}" for role in prog.topology.groups})
    for kind, gm in loaded.graphs.items():
        assert metadata_counts(gm) == EXPECTED[kind]
        assert "shared_metadata" not in loaded.eager_kernels[kind]
