"""Tiny random models saved for vLLM, and one in-process vLLM run with or without attnpool.

Used by the vLLM tests and benchmark, which run in their own virtual environment (vLLM's CPU
build pins an older transformers than the main test extra). Each model is built from a config
with transformers' random initialisation (``initializer_range`` 0.3, so greedy tokens vary and
attention errors show), saved in float32 with ``save_pretrained``; nothing is downloaded.

:func:`generate` runs ``LLM.generate`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the ``uni`` executor), so one process can run vLLM's native backend and attnpool's one after the
other: attnpool is switched on the way the plugin does it (:func:`attnpool_backend`), and off by
removing the override again; vLLM caches its backend choice per configuration, so the cache is
cleared at each switch.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

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


@contextlib.contextmanager
def attnpool_backend(on: bool) -> Iterator[None]:
    """vLLM's CPU attention backend is attnpool's (``on``) or vLLM's own, in this process."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends import registry

    from attnpool.integrations import vllm as ap_vllm

    keys = (registry.AttentionBackendEnum.CPU_ATTN, registry.AttentionBackendEnum.CPU_MLA)
    saved = {key: registry._ATTN_OVERRIDES.pop(key, None) for key in keys}
    old = os.environ.get(ap_vllm.SWITCH)
    try:
        os.environ[ap_vllm.SWITCH] = "1" if on else "0"
        ap_vllm.register()
        selector._cached_get_attn_backend.cache_clear()
        yield
    finally:
        for key in keys:
            registry._ATTN_OVERRIDES.pop(key, None)
            if saved[key] is not None:
                registry._ATTN_OVERRIDES[key] = saved[key]
        if old is None:
            os.environ.pop(ap_vllm.SWITCH, None)
        else:
            os.environ[ap_vllm.SWITCH] = old
        selector._cached_get_attn_backend.cache_clear()


@contextlib.contextmanager
def mla_scheduling_kept() -> Iterator[None]:
    """vLLM's CPU platform keeps the engine's chunked prefill, prefix caching and
    ``max_num_batched_tokens`` for MLA models too, in this process (it turns the first two off
    and raises the third for every MLA model on a CPU without AMX; both backends run under
    them)."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.__dict__["check_and_update_config"]

    def keeping(cls: Any, vllm_config: Any) -> None:
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        kept = (sched.enable_chunked_prefill, cache.enable_prefix_caching,
                sched.max_num_batched_tokens)
        check.__func__(cls, vllm_config)
        (sched.enable_chunked_prefill, cache.enable_prefix_caching,
         sched.max_num_batched_tokens) = kept

    CpuPlatform.check_and_update_config = classmethod(keeping)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = check


def engine_args(**kw: Any) -> dict[str, Any]:
    """The engine arguments every comparison shares (float32: vLLM's bfloat16 and compiled
    paths drift even natively), updated with ``kw``."""
    base: dict[str, Any] = {"skip_tokenizer_init": True, "dtype": "float32",
                            "enforce_eager": True, "block_size": 32, "max_model_len": 512,
                            "seed": 0, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                            "enable_chunked_prefill": True, "enable_prefix_caching": True,
                            "distributed_executor_backend": "uni", "disable_log_stats": False}
    return base | kw


def generate(model: Path, attnpool: bool, reqs: list[dict[str, list[int]]], max_tokens: int,
             **kw: Any) -> tuple[list[list[int]], int, Any]:
    """Greedy token ids of ``reqs`` through ``LLM.generate`` in this process, the number of
    preemptions the scheduler made, and the engine's metrics (``engine_args(**kw)``)."""
    from vllm import LLM, SamplingParams

    with attnpool_backend(attnpool):
        llm = LLM(model=str(model), **engine_args(**kw))
        try:
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            outs = llm.generate(reqs, sp, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            metrics = llm.get_metrics()
            preempted = int(sum(getattr(m, "value", 0) for m in metrics
                                if m.name == "vllm:num_preemptions"))
            return tokens, preempted, metrics
        finally:
            del llm
            gc.collect()


def generate_apart(model: Path, attnpool: bool, reqs: list[dict[str, list[int]]],
                   max_tokens: int, **kw: Any) -> tuple[list[list[int]], int]:
    """:func:`generate` in a fresh Python process (token ids and preemptions). For engine
    settings after which vLLM cannot start a second engine in the same process (its n-gram
    proposer's numba objects break the kernel-override scan of the next engine's start)."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from pathlib import Path; "
            "from tests.helpers import vllm_engine as ve; a = json.loads(sys.argv[1]); "
            "t, p, _ = ve.generate(Path(a['model']), a['on'], a['reqs'], a['new'], **a['kw']); "
            "print('RESULT' + json.dumps([t, p]))")
    arg = json.dumps({"model": str(model), "on": attnpool, "reqs": reqs, "new": max_tokens,
                      "kw": kw})
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code, arg], cwd=root, capture_output=True,
                         text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    if out.returncode or not lines:
        raise RuntimeError(f"vLLM run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    tokens, preempted = json.loads(lines[-1][len("RESULT"):])
    return tokens, preempted
