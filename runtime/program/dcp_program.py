"""DCPProgram: the SPMD result of a transform, and its per-rank loading.

One GraphModule per step kind, shared by every rank (and, with context buckets, one more per
(step kind, smaller bucket): ``bucket_graphs``, runtime/program/buckets.py). Per-rank state is only (a) the weight
shards (``state_dict_for(rank)``, which includes the ``tp_rank`` input) and (b) the binding of
collective roles to this rank's process groups (``load(rank, group_names)``).

Program calling convention (every step kind):
    graph(*weights_and_buffers, tp_rank, input_ids, positions, block_table, *kv_caches)
        -> (logits, *new_kv_caches)
and, for a hybrid model (docs/hybrid.md; ``state_spec()`` lists the state caches):
    graph(..., *kv_caches, state_slot, state_fresh, state_lengths, *state_caches)
        -> (logits, *new_kv_caches, *new_state_caches)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule

from dcp_compile.runtime.names import META_SCOPE, SCOPE_MODEL

from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.program.facts import ModelFacts
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.names import RANK_INPUT
from dcp_compile.runtime.distributed.roles import role_of
from dcp_compile.runtime.program.checkpoint import LoadStats, WeightSource
from dcp_compile.runtime.program.shards import ShardSpec
from dcp_compile.runtime.topology import Topology

if TYPE_CHECKING:
    from dcp_compile.runtime.serving.engine import StepShapes


@dataclass
class DCPProgram:
    """A compiled program: its graphs, weights and layout; built by dcp_compile.driver."""

    config: DCPConfig
    topology: Topology
    graphs: dict[str, GraphModule]              # step kind -> graph (StepKind values)
    shapes: "StepShapes"
    constants: dict[str, torch.Tensor]          # placeholder -> full weight/buffer
    shards: dict[str, ShardSpec]                # placeholder -> how a rank's shard is cut
    weight_inputs: list[str]                    # placeholder names, in graph order
    facts: ModelFacts                           # layers, cache dtype, windows, MLA
    source: str = "transform"                   # the frontend: transform, torch.compile
    dump_dir: str | None = None
    # The compiler's record (dcp_compile.report.CompileReport: history, certificate,
    # check); the runtime passes it on and never reads it.
    report: object = None
    # Context buckets below the full capacity: tokens -> step kind -> graph (same weights).
    bucket_graphs: dict[int, dict[str, GraphModule]] = field(default_factory=dict)
    # Weights by name (runtime/program/checkpoint.py): placeholder -> the model's parameter
    # names (fully qualified; the first its own, the others tied aliases), and, for weights
    # the model holds in another form than its checkpoint, FQN -> the checkpoint tensors
    # that tile it. A weightless program's named constants are meta tensors (shape, dtype).
    weight_names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    weight_sources: dict[str, WeightSource] = field(default_factory=dict)
    # A hybrid model's recurrent-state caches of one rank (runtime/serving/state_cache.py),
    # in the graphs' input order after the KV caches; None: no recurrent layer.
    state_cache: object | None = None

    @property
    def num_layers(self) -> int:
        return self.facts.num_layers

    @property
    def history(self) -> list:
        """Every pass of every step (dcp_compile.passes.manager.PassRecord)."""
        return self.report.history

    @property
    def certificate(self):
        """The layout's proof certificate (dcp_compile.passes.prove)."""
        return self.report.certificate

    # -- context buckets -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Context tokens the full-width graphs (``graphs``) hold: the largest bucket."""
        from dcp_compile.runtime.program.buckets import bucket_of_width
        return bucket_of_width(self.shapes.max_blocks, block_size=self.config.block_size,
                               dcp=self.config.dcp)

    @property
    def buckets(self) -> tuple[int, ...]:
        """Every context bucket in tokens, ascending; the last is ``capacity``."""
        return tuple(sorted(self.bucket_graphs)) + (self.capacity,)

    def for_bucket(self, bucket: int) -> "DCPProgram":
        """The one-bucket program of ``bucket`` (its graphs, its block-table width), sharing
        this program's weights: what loading, lowering and contracts take per bucket."""
        import dataclasses

        from dcp_compile.runtime.program.buckets import bucket_width
        if bucket == self.capacity:
            graphs = self.graphs
        elif bucket in self.bucket_graphs:
            graphs = self.bucket_graphs[bucket]
        else:
            raise DCPInputError(f"this program has no context bucket of {bucket} tokens: it "
                                f"has {list(self.buckets)}. Pick one of those.")
        width = bucket_width(bucket, block_size=self.config.block_size, dcp=self.config.dcp)
        return dataclasses.replace(self, graphs=graphs, bucket_graphs={},
                                   shapes=dataclasses.replace(self.shapes, max_blocks=width))

    # -- per-rank state --------------------------------------------------------------------

    @property
    def weightless(self) -> bool:
        """Whether the program holds no values for its named weights (compiled from a meta
        model, or saved with ``weights=False``): a rank reads them from a checkpoint."""
        return any(self.constants[n].is_meta for n in self.weight_names if n in self.constants)

    def state_dict_for(self, rank: int, checkpoint: str | os.PathLike | None = None, *,
                       progress: bool | None = None) -> dict[str, torch.Tensor]:
        """This rank's weight shards (replicated weights as is) plus its ``tp_rank``.

        ``checkpoint``: a Hugging Face checkpoint directory (``config.json`` +
        ``*.safetensors``) to read the named weights from, only this rank's slices, cast to
        the program's dtypes (:meth:`read_checkpoint`); else they are cut from the program's
        own weights, which a weightless program has not."""
        if checkpoint is not None:
            return self.read_checkpoint(rank, checkpoint, progress=progress)[0]
        self.topology._check_rank(rank)
        out = {}
        for name in self.weight_inputs:
            full = self._constant(name, checkpoint_named=True)
            spec = self.shards.get(name)
            out[name] = spec.shard(full, rank) if spec is not None else full
        out[RANK_INPUT] = torch.tensor(rank, dtype=torch.int64)
        return out

    def read_checkpoint(self, rank: int, checkpoint: str | os.PathLike, *,
                        progress: bool | None = None) -> tuple[dict[str, torch.Tensor], LoadStats]:
        """``state_dict_for(rank, checkpoint)`` and what the read cost (LoadStats). Every
        named weight comes from the checkpoint (bad tensors are refused before any is
        read); buffers the checkpoint does not hold (RoPE tables) from the program.
        ``checkpoint`` may be a ``StreamedCheckpoint`` (runtime/program/checkpoint.py) of
        the boxes :meth:`checkpoint_boxes` named."""
        from dcp_compile.runtime.program.checkpoint import read_rank_weights
        self.topology._check_rank(rank)
        named = self._checkpoint_named()
        if not named:
            raise DCPInputError(
                f"this program ({self.source}) records no checkpoint names for its weights, "
                f"so it cannot read them from a checkpoint. Compile it with "
                f"dcp_compile.transform (of the model or its meta-device twin), which names "
                f"every weight by its parameter name.")
        state, stats = read_rank_weights(checkpoint, named, self.weight_sources, self.shards,
                                         self.constants, rank, progress=progress)
        for name in self.weight_inputs:
            if name not in state:
                full = self._constant(name, checkpoint_named=False)
                spec = self.shards.get(name)
                state[name] = spec.shard(full, rank) if spec is not None else full
        state = {n: state[n] for n in self.weight_inputs}
        state[RANK_INPUT] = torch.tensor(rank, dtype=torch.int64)
        return state, stats

    def checkpoint_boxes(self, rank: int) -> dict[str, set]:
        """Checkpoint key -> the boxes of it ``rank`` reads (checkpoint.rank_boxes): what a
        ``StreamedCheckpoint`` keeps of a stream of the checkpoint's tensors."""
        from dcp_compile.runtime.program.checkpoint import rank_boxes
        self.topology._check_rank(rank)
        return rank_boxes(self._checkpoint_named(), self.weight_sources, self.shards,
                          self.constants, rank)

    def _checkpoint_named(self) -> dict[str, tuple[str, ...]]:
        return {n: self.weight_names[n] for n in self.weight_inputs if n in self.weight_names}

    def _constant(self, name: str, *, checkpoint_named: bool) -> torch.Tensor:
        full = self.constants[name]
        if not full.is_meta:
            return full
        if name in self.weight_names:
            raise DCPInputError(
                f"this program holds no weights (compiled from a meta-device model or saved "
                f"with weights=False): weight {self.weight_names[name][0]} has no value. "
                f"Pass the model's checkpoint: state_dict_for(rank, checkpoint=DIR), "
                f"rank_engine(program, rank, checkpoint=DIR).")
        raise DCPInputError(
            f"program input {name} (a buffer the checkpoint does not hold) is on the meta "
            f"device: the model was built with its buffers on meta too. Build it with "
            f"dcp_compile.meta_init.empty_weights() (parameters on meta, buffers real) or "
            f"dcp_compile.meta_init.meta_model(config).")

    def cache_spec(self, dtype: torch.dtype | None = None, *, num_blocks: int | None = None,
                   single_device: bool = False):
        """Shape of one rank's KV caches (KV heads after TP sharding/replication): one
        layout, or one per layer group (``facts.kv_layers``: per-layer KV layouts, KV shared
        across layers; docs/models.md). ``single_device``: the unsharded model's caches
        (every KV head), ``num_blocks`` of them (default: the program's)."""
        from dcp_compile.runtime.serving.kv_cache import KVCacheGroup, KVCacheSpec
        c, kv = self.config, self.facts.kv_layers
        dtype = dtype or self.facts.cache_dtype or torch.float32
        blocks = self.shapes.num_blocks if num_blocks is None else num_blocks

        def heads(n):
            return n if single_device else c.kv_heads_per_layout(n)
        if kv is None:
            return KVCacheSpec(self.num_layers, blocks, c.block_size, heads(c.num_kv_heads),
                               c.head_dim, dtype, garbage=c.garbage_block)
        layouts = list(dict.fromkeys(kv.caches))
        groups = tuple(KVCacheGroup(heads(lay.kv_heads), lay.head_dim,
                                    tuple(i for i, x in enumerate(kv.caches) if x == lay))
                       for lay in layouts)
        return KVCacheSpec(len(kv.caches), blocks, c.block_size, groups[0].kv_heads,
                           groups[0].head_dim, dtype, garbage=c.garbage_block, groups=groups,
                           reads=kv.reads)

    def state_spec(self):
        """One rank's recurrent-state caches (a StateCacheSpec: layers, slots, tp), or None
        for a model without recurrent layers. Replicated over the DCP group."""
        return self.state_cache

    def load(self, rank: int, group_names: dict[str, str], *, compile: str = "eager",
             checkpoint: str | os.PathLike | None = None):
        """This rank's runnable program: roles bound to real process-group names;
        ``compile="inductor"`` compiles each graph with Inductor (rank_program.COMPILERS);
        ``checkpoint``: read the rank's weights from it (``state_dict_for``)."""
        from dcp_compile.runtime.serving.rank_program import RankProgram
        return RankProgram(self, rank, group_names, compile=compile, checkpoint=checkpoint)

    def save(self, path, *, weights: bool = True) -> None:
        """Write this program to a program file every rank of a launch can load
        (``dcp_compile.runtime.program.program_file.load_program``): one transform per launch.
        ``weights=False`` leaves the named weights out (their shapes and dtypes stay): a few
        MB for any model, each rank then reads its shard from the checkpoint."""
        from dcp_compile.runtime.program.codec import save_program
        save_program(self, path, weights=weights)

    # -- reports ---------------------------------------------------------------------------

    def collectives_per_layer(self, step: str) -> dict[str, float]:
        """'<op>@<role>' -> how many per decoder layer in ``step``'s graph (collectives of
        the embedding and LM head, once per model, are in ``model_collectives``)."""
        counts = self._collective_counts(step, per_model=False)
        return {k: v / self.num_layers for k, v in counts.items()}

    def model_collectives(self, step: str) -> dict[str, int]:
        return self._collective_counts(step, per_model=True)

    def _collective_counts(self, step: str, *, per_model: bool) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.graphs[step].graph.nodes:
            role = role_of(n)
            if role is not None and (n.meta.get(META_SCOPE) == SCOPE_MODEL) == per_model:
                key = f"{n.target._opname}@{role}"
                counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items()))

    def summary(self) -> str:
        c = self.config
        return json.dumps({"tp": c.tp, "dcp": c.dcp, "mode": c.mode,
                           "block_size": c.block_size, "interleave_size": c.interleave_size,
                           "steps": list(self.graphs),
                           "buckets": list(self.buckets)},
                          indent=None)
