"""fp8 KV cache store: a quantizing store into an fp8 cache against the float16 store, one run.

One layer of a Llama-3-8B-like cache (8 KV heads, head dim 128, page 16). ``float16`` stores float16
K/V into a float16 cache (the baseline: a plain copy); ``fp8 e4m3fn`` stores the same float16 K/V
into an ``float8_e4m3fn`` cache with per-head scales (divide, clamp, cast), ``check_scales=False``
as an engine's hot path would call it; ``fp8 e4m3fn checked`` is the default call, which also reads
the scales to the host once to refuse bad values. Cases: a decode step (64 tokens) and a prefill
chunk (2048 tokens). ``bytes_per_token`` (all layers of the config) is recorded in ``extra_info``.
On CUDA ``Impl.AUTO`` picks the fused Triton store; on the CPU the torch reference is timed, with
one intra-op thread (as the LoRA benchmark, and for the same reason: on a shared 2-core machine a
second thread's wake-up times the machine's load, not the store).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnpool.kv import KVCacheConfig, KVCachePool

CASES = {"decode-64": 64, "prefill-2048": 2048}
IMPLS = {"float16": (torch.float16, False), "fp8 e4m3fn": (torch.float8_e4m3fn, False),
         "fp8 e4m3fn checked": (torch.float8_e4m3fn, True)}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", list(CASES))
def test_kv_store(benchmark: Any, machine: dict[str, Any], timed: Callable[..., None],
                  device: torch.device, case: str, impl: str) -> None:
    n = CASES[case]
    dtype, check = IMPLS[impl]
    cfg = KVCacheConfig(num_pages=n // 16 + 2, page_size=16, max_tokens=n, num_kv_heads=8,
                        head_dim=128, dtype=dtype, device=device)
    pool = KVCachePool(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(n, 8, 128, generator=g, device=device, dtype=torch.float16)
    v = torch.randn(n, 8, 128, generator=g, device=device, dtype=torch.float16)
    slots = torch.randperm(n, device=device) + 16
    benchmark.group = f"kv-store {case}"
    benchmark.extra_info.update(machine)
    benchmark.extra_info.update({"group_name": "kv-store", "case": case, "impl": impl,
                                 "baseline": impl == "float16", "tokens": n,
                                 "bytes_per_token": cfg.bytes_per_token})
    if dtype == torch.float16:
        def store() -> None:
            pool.store_kv_(0, k, v, slots)
    else:
        ks = torch.full((8,), 0.02, device=device)
        vs = torch.full((8,), 0.01, device=device)

        def store() -> None:
            pool.store_kv_(0, k, v, slots, k_scale=ks, v_scale=vs, check_scales=check)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        store()
        timed(store)
    finally:
        torch.set_num_threads(threads)
