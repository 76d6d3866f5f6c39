"""The paged KV cache: every layer's K/V pages and the slot mapping in one allocation.

``KVCachePool`` (:mod:`.cache`) is what an engine holds; ``KVCacheConfig`` (:mod:`.config`) sizes
it. fp8 quantisation rules live in :mod:`.quant` (the adapters read them to dequantise), the fused
store kernel in :mod:`.store_kernels` (imported on the first fused store, never at import time),
and the per-step store in :mod:`.step`. The host-side page allocators live with their one user,
the transformers integration (:mod:`attnpool.integrations.transformers.paging`,
:mod:`attnpool.integrations.transformers.window_paging`).

This package sits above the pool (it reuses the core's sentinel, checker and input checks) and
below the adapters and integrations; it never imports a phase or the pool.
"""

from __future__ import annotations

from .cache import KVCachePool
from .config import KVCacheConfig, KVKind, KVLayout

__all__ = ["KVCacheConfig", "KVCachePool", "KVKind", "KVLayout"]
