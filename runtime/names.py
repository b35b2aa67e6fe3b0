"""Names shared across the packages, defined once: the graph inputs a program binds by name,
and the ``meta`` keys passes write on nodes and graphs and later passes, the lowering and the
program read.

Here, in the lowest package, because the runtime binds inputs by name; ``passes`` and
``dcp_compile`` import them from here.
"""

from __future__ import annotations

from enum import Enum


class _Word(str, Enum):
    """A str-valued name: equal to, hashed and printed as its value, so a dict keyed by
    the enum answers the plain string too (files, the command line, old callers)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(self.value)


class StepKind(_Word):
    """The kinds of step a program holds a graph for."""

    CONTEXT = "context"           # the decode engine's prompt step
    DECODE = "decode"             # one token per sequence
    PREFILL = "prefill"           # the prefill engine's chunk (sequence parallel)
    CHUNK = "chunk"               # a decode program's prompt chunk after prior context: a
                                  # decode step of width chunk_len (StepShapes.chunk_len > 0)


class Role(_Word):
    """A collective's group role (docs/runtime.md: the program on a rank); bound to real groups when a rank loads
    the program (dcp_compile.runtime.distributed.roles)."""

    WORLD = "world"               # every rank
    TP = "tp"                     # decode: the tensor-parallel group (every rank)
    DCP = "dcp"                   # decode: the DCP group of a KV replica set
    DCP_TP = "dcp_tp"             # prefill: consecutive TP/DCP ranks
    CP_KV = "cp_kv"               # prefill: the ranks holding one KV head's positions


class Mode(_Word):
    """What a program serves: decode (context + decode steps) or prefill."""

    DECODE = "decode"
    PREFILL = "prefill"


# -- Graph inputs (placeholder names) ---------------------------------------------------------
# A program's calling convention: weights..., RANK_INPUT, INPUT_IDS, POSITIONS, BLOCK_TABLE,
# then one input per KV cache (cache_input(0), cache_input(1), ...: K and V of each layer).

RANK_INPUT = "tp_rank"            # 0-d int64: this rank (insert_rank adds it)
INPUT_IDS = "input_ids"
POSITIONS = "positions"
BLOCK_TABLE = "block_table"
KV_CACHES = "kv_caches"           # the forward argument; its inputs are kv_caches_<i>
STEP_INPUTS = (INPUT_IDS, POSITIONS, BLOCK_TABLE)
STATE_SLOT = "state_slot"        # [B] int64: each row's recurrent-state slot (-1: padding row)
STATE_FRESH = "state_fresh"      # [B] bool: the row starts its sequence (reads a zero state)
STATE_LENGTHS = "state_lengths"  # [B] int64: the row's real tokens (left-packed)
STATE_SNAPSHOT_SLOT = "state_snapshot_slot"  # [B, K] int64: where each draft's state is kept
STATE_CACHES = "state_caches"    # the hybrid forward's argument; its inputs are state_caches_<i>


def cache_input(i: int) -> str:
    """The name of the ``i``-th KV cache input (K of layer i // 2 when i is even, else V)."""
    return f"{KV_CACHES}_{i}"


def is_cache_input(name: str) -> bool:
    return name.startswith(KV_CACHES)


def is_state_cache_input(name: str) -> bool:
    """A hybrid program's recurrent-state cache input (``state_caches_<i>``)."""
    return name.startswith(STATE_CACHES)


# -- node.meta keys ---------------------------------------------------------------------------

META_KIND = "dcp_kind"            # an inserted node's kind (dcp_compile.passes.infra KIND_*)
META_PASS = "dcp_pass"            # the pass that inserted the node
META_LAYER = "dcp_layer"          # the attention layer the node belongs to
META_SCOPE = "dcp_scope"          # "model" (SCOPE_MODEL): a collective once per model, not layer
SCOPE_MODEL = "model"
META_FULL_SHAPE = "dcp_full_shape"    # a sharded placeholder's unsharded shape
META_NORM_REDUCE = "dcp_norm_reduce"  # an all-reduce of a norm over sharded heads, not TP's sum
ROLE_META = "dcp_tp_role"             # a linear's tensor-parallel role (q_proj, mlp_row, ...)
PROJECTIONS_META = "dcp_projections"  # an attention's q/k/v/o linear names
META_WEIGHT_PERM = "dcp_weight_perm"  # a weight input read with its indices along a dim
                                      # reordered: (dim, perm) (passes/untile_kv_heads.py)
SP_SLICE = "dcp_sp_slice"             # this rank's sequence-parallel slice after the O proj.
SP_GATHER = "dcp_sp_gather"           # full-sequence tensor after a sequence-parallel gather
MOE_ROLE_META = "dcp_moe_role"        # a linear of a MoE block run whole on every rank
                                      # (MOE_ROUTER, MOE_SHARED_GATE)
MOE_ROUTER = "router"
MOE_SHARED_GATE = "shared_expert_gate"
SPEC_STEP = "dcp_spec_step"           # the specification's prefill Compute Pattern step (1..9)

# In torch's meta["custom"] (make_fx copies it onto the nodes a node decomposes into): the
# lowering's provenance of a node, META_NODE (its FX node's name) and META_PASS.
META_NODE = "dcp_node"

# -- Collective group names -------------------------------------------------------------------

ROLE_PREFIX = "dcp_role:"         # a collective's group in a graph: ROLE_PREFIX + role name

# -- gm.meta keys -----------------------------------------------------------------------------

META_CERTIFICATE = "dcp_certificate"  # the layout proof certificate (validate_and_prove)
SP_META = "dcp_sequence_parallel"     # the sequence-parallel layout (tokens, padding, per rank)

# dcp.attention's per-head position-bias arguments, whole [q_heads, ...] constants of the
# model: ALiBi's slopes [q_heads] and a key-query distance table [q_heads, max_model_len]
# (runtime/kernels/live_attention.distance_bias). Each rank takes its q heads' rows
# (shard_tensor_parallel) and decode DCP gathers them with the query heads (dcp_decode).
POSITION_BIAS_KWARGS = ("alibi_slopes", "distance_table")
# The name every distance-table buffer of a capture holds (frontends/module_position_bias.py
# registers them; passes/mask_predicate.py reads a placeholder so named as table(h, d)).
DISTANCE_TABLE = "dcp_distance_table"
# dcp.attention's memory key/values (x-transformers' attn_num_mem_kv), [1, M, kv_heads, D]:
# cut by heads like k, added by cp rank 0 only (runtime/kernels/live_attention.join_memory).
MEMORY_KWARGS = ("mem_k", "mem_v")
