"""The tiny Llama every Hugging Face workload of the suite builds: one factory, so that a test's model differs from
another's only where the test says so (its vocabulary, its MLP width, its positions, its attention heads). Seeded
where it is built: the same seed gives every rank, and the one-process reference, the same weights."""
from __future__ import annotations

import torch


def tiny_llama_config(vocab: int, *, intermediate: int = 64, kv_heads: int = 2, max_positions: int = 64, **more):
    """A 2-layer Llama of width 32 and 4 heads; ``more``: any other LlamaConfig field (e.g. attn_implementation,
    tie_word_embeddings, pad_token_id)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                       **more)


def tiny_llama(vocab: int, seed: int, **config):
    """A ``LlamaForCausalLM`` of :func:`tiny_llama_config` (``config``: its arguments), its weights drawn after
    ``torch.manual_seed(seed)``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(vocab, **config))
