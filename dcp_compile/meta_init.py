"""A model without its weights (parameters and persistent buffers on the meta device).

Non-persistent buffers stay real (see below).

The way to compile a large model (DESIGN "Weights by name"): build it here, transform it,
save the weightless program (``program.save(path, weights=False)``, or any program of a
meta model), and let every rank read its own shard from the checkpoint
(``program.state_dict_for(rank, checkpoint=DIR)``).

Non-persistent buffers stay real because a checkpoint does not hold them (a model computes
them in its constructor: RoPE's ``inv_freq``), and they are small; ``with
torch.device("meta")`` puts them on meta too, and such a program can then not run (its
state_dict_for says so). Persistent buffers (a router's score-correction bias) are in the
checkpoint, so they are weights like the parameters.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from dcp_compile.runtime.errors import DCPInputError

# Attention implementations a meta model may be built with, in the order tried by default.
ATTENTION = ("sdpa", "eager")


@contextlib.contextmanager
def empty_weights():
    """Within: every parameter and persistent buffer a module registers is created on the
    meta device (its shape and dtype only); non-persistent buffers where they would be."""
    register = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def buffer_on_meta(module, name, tensor, persistent=True):
        if persistent and tensor is not None:
            tensor = tensor.to("meta")
        register_buffer(module, name, tensor, persistent)

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = {**param.__dict__, "requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = on_meta
    nn.Module.register_buffer = buffer_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        nn.Module.register_buffer = register_buffer


def meta_model(config, *, dtype: torch.dtype | None = None,
               attn_implementation: str | None = None) -> nn.Module:
    """A transformers causal LM of ``config`` (a PretrainedConfig, or a checkpoint directory
    or config.json path) with no weights (:func:`empty_weights`), in eval mode. ``dtype``:
    the parameters' dtype (default: the config's ``dtype``, else float32);
    ``attn_implementation``: as for :func:`causal_lm`."""
    with empty_weights():
        return causal_lm(config, dtype=dtype, attn_implementation=attn_implementation)


def causal_lm(config, *, dtype: torch.dtype | None = None,
              attn_implementation: str | None = None) -> nn.Module:
    """The transformers causal LM of ``config`` (as for :func:`meta_model`), in eval mode,
    its weights as its constructor initialises them (within :func:`empty_weights`: none).
    ``attn_implementation``: "sdpa" or "eager"; default: sdpa where transformers offers it
    for the model, else eager (Gemma-2, gpt-oss) — never transformers' own refusal."""
    from transformers import AutoModelForCausalLM
    config = model_config(config)
    if attn_implementation is not None and attn_implementation not in ATTENTION:
        raise DCPInputError(f"unknown attention implementation {attn_implementation!r}. Use "
                            f"one of {list(ATTENTION)}.")
    dtype = dtype or _config_dtype(config)
    errors = []
    for impl in (attn_implementation,) if attn_implementation else ATTENTION:
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     attn_implementation=impl)
        except (ValueError, ImportError) as e:
            errors.append(f"{impl}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            continue
        return model.eval()
    raise DCPInputError(f"transformers builds {type(config).__name__} with none of "
                        f"{[e.split(':')[0] for e in errors]}: {'; '.join(errors)}. Pick "
                        f"another attn_implementation, or another model.")


def model_config(config):
    """``config`` as a transformers PretrainedConfig: itself, or read from a checkpoint
    directory or a config.json path (never a download)."""
    if not isinstance(config, (str, os.PathLike)):
        return config
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig
    path = Path(config)
    if not path.exists():
        raise DCPInputError(f"no model config at {path}. Pass a checkpoint directory "
                            f"(config.json inside) or a config.json path.")
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise DCPInputError(f"{file} is not a readable config.json ({e}). Pass a "
                            f"transformers config.json or its directory.") from None
    if "model_type" not in data:
        raise DCPInputError(f"{file} has no model_type. Use a transformers config.json.")
    return AutoConfig.for_model(**data)


def _config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
