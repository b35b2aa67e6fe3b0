"""The model a command runs: the built-in demo model, ``--model PKG.MODULE:FACTORY``,
``--hf-config PATH_OR_DIR`` (a Hugging Face config.json; random weights, never a download) or
``--checkpoint DIR`` (a Hugging Face checkpoint: config.json + *.safetensors).

``load_model(args)`` returns a :class:`LoadedModel`: the model to transform and the
single-device reference the verify commands compare against (an ordinary model's reference
is its own full forward, recomputed every step: dcp_compile.frontends.ordinary.FullForwardReference).
A checkpoint's model is transformed on the meta device (no weights read), its ranks read
their shards from the checkpoint, and its reference is the checkpoint's own model, loaded
whole on one device.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dcp_compile.meta_init import ATTENTION
from dcp_compile.runtime.errors import DCPInputError


def add_model_arguments(p) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", metavar="PKG.MODULE:FACTORY", default=None,
                   help="a function returning the model to transform (default: the "
                        "built-in demo model); an ordinary causal LM forward(input_ids) works")
    g.add_argument("--hf-config", metavar="PATH_OR_DIR", default=None,
                   help="a Hugging Face config.json (or its directory): the causal LM it "
                        "describes, with random weights (seed 0); nothing is downloaded "
                        "(default: none, the demo model or --model)")
    g.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="a Hugging Face checkpoint directory (config.json + *.safetensors): "
                        "compiled on the meta device, each rank reads only its weight shards "
                        "(default: none)")
    p.add_argument("--attn-implementation", choices=ATTENTION, default=None,
                   help="attention of an --hf-config / --checkpoint model (default: sdpa "
                        "where transformers offers it for the model, else eager)")


@dataclass
class LoadedModel:
    model: object
    label: str
    vocab_size: int
    make_reference: Callable[[], object]   # a fresh single-device reference per comparison
    num_kv_heads: int | None = None        # for topology tables, when known up front
    reference_has_cache: bool = True       # False: a full-forward reference (no caches)
    checkpoint: str | None = None          # the ranks read their weights from it


def load_model(args, *, demo_config=None, dtype=None) -> LoadedModel:
    import torch

    if getattr(args, "checkpoint", None):
        return _from_checkpoint(args.checkpoint, getattr(args, "attn_implementation", None),
                                dtype)
    if getattr(args, "model", None):
        model = _from_factory(args.model)
        label = args.model
    elif getattr(args, "hf_config", None):
        model = _from_hf_config(args.hf_config, getattr(args, "attn_implementation", None))
        label = f"{type(model).__name__} from {args.hf_config}"
    else:
        from dcp_compile.models.demo import demo_model
        model = demo_model(demo_config, dtype=dtype or torch.float32)
        return LoadedModel(model, "demo model", model.config.vocab_size, lambda: model,
                           model.config.num_kv_heads)
    if dtype is not None:
        model = model.to(dtype)
    model = model.eval()
    from dcp_compile.frontends import frontend_for
    frontend = frontend_for(model)
    return LoadedModel(model, label, _vocab_size(model), frontend.reference,
                       _config_int(model, "num_key_value_heads", "num_kv_heads"),
                       reference_has_cache=frontend.reference_has_cache)


def _from_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise DCPInputError(f"--model must be PKG.MODULE:FACTORY: got {spec!r}. Name a "
                            f"function returning the model, e.g. mypkg.models:build.")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise DCPInputError(f"--model {spec}: {type(e).__name__}: {e}. Name an importable "
                            f"module and a function in it.") from e
    model = factory()
    import torch
    if not isinstance(model, torch.nn.Module):
        raise DCPInputError(f"--model {spec} returned {type(model).__name__}, not an "
                            f"nn.Module. The factory must return the model.")
    return model


def _from_hf_config(path: str, attn_implementation: str | None = None):
    import torch

    from dcp_compile.meta_init import causal_lm, model_config
    if not Path(path).exists():
        raise DCPInputError(f"--hf-config {path}: no such file or directory. Give a "
                            f"config.json or the directory holding it.")
    config = model_config(path)
    torch.manual_seed(0)
    return causal_lm(config, attn_implementation=attn_implementation)


def _from_checkpoint(directory: str, attn_implementation: str | None, dtype) -> LoadedModel:
    """The checkpoint's model on the meta device (to transform) and, on demand, the same
    model loaded whole with its weights (the reference)."""
    import torch

    from dcp_compile.frontends import frontend_for
    from dcp_compile.meta_init import meta_model
    if not (Path(directory) / "config.json").exists():
        raise DCPInputError(f"--checkpoint {directory}: no config.json there. Give the "
                            f"directory save_pretrained wrote.")
    model = meta_model(directory, dtype=dtype, attn_implementation=attn_implementation)
    impl = model.config._attn_implementation

    def reference():
        import transformers
        real = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=dtype or model.dtype, attn_implementation=impl).eval()
        return frontend_for(real).reference()

    return LoadedModel(model, f"{type(model).__name__} from {directory}", _vocab_size(model),
                       reference, _config_int(model, "num_key_value_heads", "num_kv_heads"),
                       reference_has_cache=frontend_for(model).reference_has_cache,
                       checkpoint=str(directory))


def _config_int(model, *names):
    cfg = getattr(model, "config", None)
    get = getattr(cfg, "get_text_config", None)
    cfg = get() if callable(get) else cfg
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    return None


def _vocab_size(model) -> int:
    v = _config_int(model, "vocab_size")
    if v is not None:
        return v
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is None:
        linears = [m for m in model.modules() if hasattr(m, "out_features")]
        out = linears[-1] if linears else None
    if out is None:
        raise DCPInputError(f"cannot tell {type(model).__name__}'s vocabulary size (no "
                            f"config.vocab_size, no output linear). Give the model a config.")
    return getattr(out, "out_features", None) or out.weight.shape[0]
