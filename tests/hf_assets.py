"""Small Hugging Face assets the tests write themselves (nothing is downloaded)."""

from __future__ import annotations

import torch


def write_tiny_llama(path, *, seed: int = 0, vocab_size: int = 256) -> None:
    """A 4-layer Llama (dim 64, GQA 4/2 heads, ffn 172) with random weights, saved as transformers saves models."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
