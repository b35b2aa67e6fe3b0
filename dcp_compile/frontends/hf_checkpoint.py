"""Where each weight of a transformers model lives in the checkpoint its class writes.

``checkpoint_sources`` (DCPProgram.weight_sources), from transformers' own conversion rules."""

from __future__ import annotations

import torch
from torch import nn

from dcp_compile.runtime.errors import DCPTransformError

from .hf_config import is_hf


def checkpoint_sources(model: nn.Module) -> dict:
    """FQN -> WeightSource of every parameter ``model`` holds in another form than its
    checkpoint (runtime/program/checkpoint.py), derived from transformers' own conversion
    rules, not guessed: the checkpoint's keys are what ``save_pretrained`` writes
    (``revert_weight_conversion``, run here on meta tensors), and each key's parameter is what
    loading makes of it (``rename_source_key``). transformers 5 stacks per-expert tensors
    (``MergeModulelist``) and fuses gate and up (``Concatenate``); a weight built by any other
    conversion gets a source that says so (the loader refuses it naming the op). Not a
    transformers model, or none converted: {}. Where transformers' rules themselves fail on
    the model, every weight gets a source naming that failure: the transform goes on (the
    program runs on the model's own weights), a checkpoint load is refused."""
    if not is_hf(model):
        return {}
    try:
        return _checkpoint_sources(model)
    except Exception as e:  # noqa: BLE001 - any failure of transformers' rules: same answer
        from dcp_compile.runtime.program.checkpoint import WeightSource
        why = (f"transformers' conversion rules failed on {type(model).__name__} "
               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return {fqn: WeightSource((), unsupported=why) for fqn in model.state_dict()}


def _checkpoint_sources(model: nn.Module) -> dict:
    from collections import defaultdict

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                 rename_source_key, revert_weight_conversion)
    params = model.state_dict(keep_vars=True)       # parameters and persistent buffers
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in params.items()}
    saved = revert_weight_conversion(model, meta)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    groups: dict[str, list] = defaultdict(list)
    for key, tensor in saved.items():
        target, pattern = rename_source_key(key, renamings, converters)
        if (target != key or pattern is not None) and target in params:
            groups[target].append((pattern, key, tuple(tensor.shape)))
    out = {}
    for target, items in groups.items():
        converter = next((c for c in converters if items[0][0] in c.source_patterns), None)
        out[target] = _source_of(target, items, converter, tuple(params[target].shape))
    return out


def _source_of(target: str, items: list, converter, shape: tuple):
    from dcp_compile.runtime.program.checkpoint import Piece, WeightSource
    if converter is None:               # a renaming: one tensor under another name
        (_, key, src_shape), = items
        return WeightSource((Piece(key, (0,) * len(shape), src_shape),))
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if not ops or ops[0][0] != "MergeModulelist" or \
            any(name != "Concatenate" for name, _ in ops[1:2]) or len(ops) > 2:
        return WeightSource((), unsupported=f"transformers converts it with {ops}")
    stack = ops[0][1]
    cat = ops[1][1] if len(ops) > 1 else None
    pieces, at = [], 0
    for pattern in converter.source_patterns:
        members = sorted((_expert_index(pattern, key), key, s) for p, key, s in items
                         if p == pattern)
        for e, key, s in members:
            offset = [0] * len(shape)
            offset[stack] = e
            if cat is not None:
                offset[cat] = at
            pieces.append(Piece(key, tuple(offset), s, stacked=stack))
        if cat is not None and members:
            at += members[0][2][cat - (cat > stack)]
    return WeightSource(tuple(pieces))


def _expert_index(pattern: str, key: str) -> int:
    """The number a converter pattern's ``*`` stands for in ``key`` (the expert)."""
    import re
    found = re.search(r"\.".join(re.escape(part) for part in pattern.split(".")
                                 ).replace(r"\*", r"(\d+)"), key)
    if found is None:
        raise DCPTransformError(f"checkpoint key {key} does not match its conversion pattern "
                                f"{pattern}. Report this model to dcp_compile.")
    return int(found.group(1))
