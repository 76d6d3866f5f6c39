"""Tiny random models saved with ``save_pretrained``, and token-id prompts, for the engine tests
(vLLM's and SGLang's, each in its own virtual environment) and their benchmarks.

Each model is built from a config with transformers' random initialisation
(``initializer_range`` 0.3, so greedy tokens vary and attention errors show), saved in float32;
nothing is downloaded.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

#: hidden 128, 4 query heads of 32 (a head size vLLM's CPU kernel compiles), 2 KV heads
_COMMON: dict[str, Any] = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                           "num_hidden_layers": 2, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 32,
                           "max_position_embeddings": 1024, "initializer_range": 0.3}
WINDOW = 48


def _configs() -> dict[str, Any]:
    import transformers as tf

    c = dict(_COMMON)
    return {
        "llama": tf.LlamaConfig(**c, tie_word_embeddings=False),
        "qwen3": tf.Qwen3Config(**c, tie_word_embeddings=False),
        "mistral": tf.MistralConfig(**c, sliding_window=WINDOW, tie_word_embeddings=False),
        "gemma2": tf.Gemma2Config(**c, sliding_window=WINDOW, attn_logit_softcapping=20.0,
                                  final_logit_softcapping=30.0, query_pre_attn_scalar=32,
                                  tie_word_embeddings=True),
        "gemma3": tf.Gemma3TextConfig(**(c | {"num_hidden_layers": 3}), sliding_window=WINDOW,
                                      layer_types=["sliding_attention", "sliding_attention",
                                                   "full_attention"],
                                      query_pre_attn_scalar=32, tie_word_embeddings=True),
        # ALiBi instead of rotary positions (vLLM passes the slopes to the attention layer)
        "bloom": tf.BloomConfig(vocab_size=512, hidden_size=128, n_layer=2, n_head=4,
                                initializer_range=0.3, tie_word_embeddings=True),
        "gpt_oss": tf.GptOssConfig(**(c | {"intermediate_size": 128}), sliding_window=WINDOW,
                                   num_local_experts=4, num_experts_per_tok=2,
                                   layer_types=["sliding_attention", "full_attention"],
                                   tie_word_embeddings=False),
    }


#: DeepSeek (multi-head latent attention): vLLM's CPU MLA backend compiles only the 576-wide
#: latent row (kv_lora_rank 512 + rope 64); the per-head sizes stay tiny (4 heads, nope 32,
#: v 32). ``first_k_dense_replace`` = the layer count makes every layer dense; the ``_moe``
#: variant routes its second layer's MLP over 4 experts (top 2, one shared expert; V3's
#: ``noaux_tc`` routing, whose correction bias vLLM loads only under that name).
_MLA: dict[str, Any] = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                        "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                        "qk_nope_head_dim": 32, "v_head_dim": 32,
                        "max_position_embeddings": 1024, "initializer_range": 0.3,
                        "first_k_dense_replace": 2, "tie_word_embeddings": False}
_MOE: dict[str, Any] = {"first_k_dense_replace": 1, "n_routed_experts": 4,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                        "n_shared_experts": 1, "n_group": 1, "topk_group": 1}


def _mla_configs() -> dict[str, Any]:
    import transformers as tf

    return {
        "deepseek_v2": tf.DeepseekV2Config(**_MLA, q_lora_rank=None),
        "deepseek_v3": tf.DeepseekV3Config(**_MLA, q_lora_rank=64),
        "deepseek_v3_moe": tf.DeepseekV3Config(**(_MLA | _MOE), q_lora_rank=64,
                                               topk_method="noaux_tc"),
    }


def save_tiny(name: str, root: Path) -> Path:
    """Model ``name`` (a key of the configs above) saved under ``root`` (once)."""
    import torch
    import transformers as tf

    path = root / name
    if (path / "config.json").exists():
        return path
    cfg = (_mla_configs() if name.startswith("deepseek") else _configs())[name]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    if name == "gpt_oss":  # sinks start at zero: random ones make the variant show
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return path


def prompts(seed: int = 1, lengths: tuple[int, ...] = (1, 5, 33, 77, 130, 200, 3, 64),
            shared_prefix: int = 100, shared: int = 3) -> list[dict[str, list[int]]]:
    """Token-id prompts of mixed lengths, the last ``shared`` of them extending one common
    prefix of ``shared_prefix`` tokens (prefix caching reuses its blocks)."""
    rng = random.Random(seed)
    out = [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]
    prefix = [rng.randrange(1, 500) for _ in range(shared_prefix)]
    out += [prefix + [rng.randrange(1, 500) for _ in range(k + 1)] for k in range(shared)]
    return [{"prompt_token_ids": p} for p in out]
