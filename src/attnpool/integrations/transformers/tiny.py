"""Tiny random transformers models and prompts for the demo and the end-to-end benchmark.

Built from a config with seeded random weights: nothing is downloaded. ``initializer_range=0.3``
(instead of transformers' 0.02) spreads the logits, so greedy outputs vary from token to token
rather than settling into a repeated one, which would hide attention errors. Importing this
module imports transformers (this package's ``__init__`` registers the attention function), so
the tools import it inside the functions that build a model.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def tiny_llama(*, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
               vocab: int, max_positions: int, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """A random ``LlamaForCausalLM`` in eval mode, without an end-of-sequence token (greedy
    generation then always runs to ``max_new_tokens``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      initializer_range=0.3, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of uniform lengths in ``[lo, hi]`` and uniform token ids in
    ``[1, vocab)``."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
