"""A tiny Llama checkpoint with a tokenizer, written offline: what the vLLM tests, docs and
benchmark serve (nothing may download weights at run time).

One KV head, so that tp=2/dcp=2 meets the DCP rule tp > num_kv_heads that both vLLM and
dcp_compile enforce. The tokenizer is word-level (``w0 w1 ...``), built with ``tokenizers``
and saved with ``save_pretrained``; token ids are what the tests compare.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["[UNK]", "<s>", "</s>"]


def write_tiny_llama(path, *, vocab_size: int = 128, hidden_size: int = 64,
                     num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 1,
                     max_len: int = 512, seed: int = 0) -> Path:
    """Write config, seeded random weights (safetensors) and a tokenizer to ``path``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_len,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        dtype="float32")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    words = SPECIAL + [f"w{i}" for i in range(vocab_size - len(SPECIAL))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                                bos_token="<s>", eos_token="</s>",
                                                pad_token="[UNK]")
    fast.save_pretrained(path)
    return path
