"""One in-process vLLM run with or without attnpool, over the tiny models of
:mod:`tests.helpers.tiny_models` (re-exported here).

Used by the vLLM tests and benchmark, which run in their own virtual environment (vLLM's CPU
build pins an older transformers than the main test extra).

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tests.helpers.tiny_models import WINDOW, prompts, save_tiny

__all__ = ["WINDOW", "attnpool_backend", "engine_args", "generate", "mla_scheduling_kept",
           "prompts", "save_tiny"]


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


def config_stub(backends: list[Any], device: str, *, mode: Any = None,
                speculative_tokens: int | None = None) -> Any:
    """The few fields of a ``VllmConfig`` attnpool's metadata builder reads to declare its graph
    support, without an engine: one attention layer per entry of ``backends`` (an
    ``AttnpoolImpl`` attending with it) in the forward context, the device, the graph mode and
    speculative decoding's ``num_speculative_tokens`` (None: no speculation)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.attention import Attention

    from attnpool.integrations.vllm.backend import AttnpoolImpl

    layers = {}
    for i, backend in enumerate(backends):
        impl = object.__new__(AttnpoolImpl)
        impl.backend = backend
        layer = object.__new__(Attention)
        object.__setattr__(layer, "impl", impl)
        layers[f"model.layers.{i}.attn"] = layer
    spec = (None if speculative_tokens is None
            else SimpleNamespace(num_speculative_tokens=speculative_tokens))
    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers, cudagraph_mode=mode),
        device_config=SimpleNamespace(device=device), speculative_config=spec)
