"""What a Hugging Face config says about attention, read once for the frontends: per-layer
sliding windows and attention chunks it declares (applied by the model's own mask only, so
the paged op is told; the ordinary path checks them against its proven masks), and the
config fields the paged op cannot compute (refused)."""

from __future__ import annotations

from dcp_compile.runtime.errors import DCPTransformError


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def is_hf(model) -> bool:
    """A transformers model (its class lives in ``transformers.``, it has a config)."""
    return type(model).__module__.startswith("transformers.") and hasattr(model, "config")


# Hugging Face config fields that change attention in ways the paged op does not compute
# (none now: attention_chunk_size, Llama 4's chunks, is proven from the mask, passes/prove/
# masks.py, and computed by the op's attention_chunk).
_HF_REFUSED: tuple[tuple[str, str], ...] = ()


def check_hf_config(model) -> None:
    cfg = _text_config(model.config)
    for key, what in _HF_REFUSED:
        value = getattr(cfg, key, None)
        if value is not None:
            raise DCPTransformError(
                f"{type(model).__name__} has {what} ({key}={value}): the paged attention op "
                f"does not compute it, so the program would differ from the model. Use a "
                f"model without {key}.")


def declared_windows(model) -> list[int] | None:
    """Per-layer sliding windows a Hugging Face config declares (0: full attention); None
    for other models. The graph shows a window only when it is shorter than the captured
    chunk, so the config is read too (insert_paged_cache checks the two agree)."""
    if not is_hf(model):
        return None
    cfg = _text_config(model.config)
    layers = getattr(cfg, "num_hidden_layers", None)
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(layers, int):
        return None
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return [0] * layers
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return [int(window)] * layers
    return [int(window) if t == "sliding_attention" else 0 for t in types]


def attention_windows(model) -> list[int] | None:
    """``declared_windows`` for the attention layers only, in layer order: the index the
    captured graph's attention sites have (InsertPagedCache). A hybrid model's recurrent
    layers (Gated DeltaNet / Mamba2 / short-conv mixers, module_recurrent.recurrent_layers)
    are in the config's ``num_hidden_layers`` / ``layer_types`` but attend nothing.
    ``declared_windows`` itself stays indexed by ``layer_idx`` (the attention call's)."""
    windows = declared_windows(model)
    if windows is None:
        return None
    from .module_recurrent import attention_layer_ids, recurrent_layers
    attending = attention_layer_ids(model)
    if attending is not None:
        return [w for layer, w in enumerate(windows) if layer in attending]
    recurrent = {m.layer_idx for _, m, _ in recurrent_layers(model)}
    return [w for layer, w in enumerate(windows) if layer not in recurrent]


def declared_chunks(model) -> list[int] | None:
    """Per-layer attention chunks a Hugging Face config declares (Llama 4's
    ``attention_chunk_size`` on its ``"chunked_attention"`` layers; 0: not chunked), or None.
    The model applies them only through the mask it builds (create_chunked_causal_mask),
    which the paged attention function does not receive: the op is told instead."""
    if not is_hf(model):
        return None
    cfg = _text_config(model.config)
    chunk = getattr(cfg, "attention_chunk_size", None)
    layers = getattr(cfg, "num_hidden_layers", None)
    if not chunk or not isinstance(layers, int):
        return None
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return [int(chunk)] * layers
    return [int(chunk) if t == "chunked_attention" else 0 for t in types[:layers]]


def attention_chunks(model) -> list[int] | None:
    """``declared_chunks`` for the attention layers only, in layer order (as
    ``attention_windows``)."""
    chunks = declared_chunks(model)
    if chunks is None:
        return None
    from .module_recurrent import recurrent_layers
    recurrent = {m.layer_idx for _, m, _ in recurrent_layers(model)}
    return [c for layer, c in enumerate(chunks) if layer not in recurrent]


def config_field(cfg, name: str):
    """A config field, or None. transformers' configs may raise on a field their layout does
    not define (Gemma-4's head_dim is per layer type), not only AttributeError."""
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001  (any config error means: not given this way)
        return None


def kv_layouts(cfg) -> str:
    """What makes the KV layout differ by layer (Gemma 4's ``per_layer_config`` head_dim /
    KV heads, ``num_kv_shared_layers``), for a message; "" when it is one layout."""
    per_layer = config_field(cfg, "per_layer_config")
    if isinstance(per_layer, dict):
        layers = list(per_layer.values())
    elif hasattr(per_layer, "__len__") and hasattr(per_layer, "__getitem__"):
        layers = [per_layer[i] for i in range(len(per_layer))]     # transformers' view
    else:
        layers = []
    seen = {(config_field(c, "num_key_value_heads"), config_field(c, "head_dim"))
            for c in layers}
    out = [f"(kv heads, head_dim) by layer: {sorted(seen, key=str)}"] if len(seen) > 1 else []
    shared = config_field(cfg, "num_kv_shared_layers")
    if isinstance(shared, int) and shared > 0:
        out.append(f"num_kv_shared_layers={shared}")
    return ", ".join(out)
