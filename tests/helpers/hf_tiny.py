"""Tiny random transformers models and greedy references for the integration tests.

Built from configs (no download). ``initializer_range=0.3`` spreads the logits so greedy outputs
do not settle into a repeated token, which would hide attention errors; float64 makes the
argmax of two correct computations agree (ties are far below float64 rounding).
"""

from __future__ import annotations

import random
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96
#: prompt lengths: 1 and 2, both sides of page boundaries (pages of 4 and 16), up to 100
LENGTHS = (1, 2, 15, 16, 17, 31, 33, 47, 64, 100)
NEW = 24
CONTEXT = 128


#: no end-of-sequence token by default: generate would stop at the config's eos otherwise
NO_EOS = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": None}


def _init(model: Any, dtype: torch.dtype) -> Any:
    return model.to(dtype).eval()


def llama(seed: int = 0, dtype: torch.dtype = torch.float64, layers: int = 2, **kw: Any) -> Any:
    """GQA: 4 query heads, 2 KV heads, head dim 16."""
    torch.manual_seed(seed)
    args = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "initializer_range": 0.3, **NO_EOS}
    cfg = LlamaConfig(**(args | kw))
    return _init(LlamaForCausalLM(cfg), dtype)


def qwen2(seed: int = 1, dtype: torch.dtype = torch.float64, **kw: Any) -> Any:
    """MQA with q/k/v biases: 3 query heads, 1 KV head, head dim 24 (not a power of two)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=72, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                      max_position_embeddings=256, initializer_range=0.3, **(NO_EOS | kw))
    return _init(Qwen2ForCausalLM(cfg), dtype)


def draft_llama(seed: int = 2, dtype: torch.dtype = torch.float64) -> Any:
    """A different, smaller model with the same vocabulary (1 layer, 2 heads, 1 KV head)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, initializer_range=0.3, **NO_EOS)
    return _init(LlamaForCausalLM(cfg), dtype)


def prompts(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def greedy(model: Any, ps: list[list[int]], new: int = NEW, eos: int | None = None
           ) -> list[list[int]]:
    """``model.generate(do_sample=False)`` run per prompt: the reference outputs.

    The attention mask is passed explicitly: without it, transformers would treat prompt tokens
    equal to the pad id as padding.
    """
    out = []
    with torch.no_grad():
        for p in ps:
            ids = torch.tensor([p], device=model.device)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               do_sample=False, pad_token_id=0, eos_token_id=eos)
            out.append(g[0, len(p):].tolist())
    return out
