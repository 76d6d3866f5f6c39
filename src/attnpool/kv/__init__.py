"""The paged KV cache: every layer's K/V pages and the slot mapping in one allocation.

``KVCachePool`` (:mod:`.cache`) is what an engine holds; ``KVCacheConfig`` (:mod:`.config`) sizes
it. fp8 quantisation rules live in :mod:`.quant` (the adapters read them to dequantise), the fused
store kernel in :mod:`.store_kernels` (imported on the first fused store, never at import time),
the per-step store in :mod:`.step`, and :class:`~attnpool.kv.paging.PageAllocator`, the page
allocator the transformers integration uses, in :mod:`.paging`.

This package sits above the pool (it reuses the core's sentinel, checker and input checks) and
below the adapters and integrations; it never imports a phase or the pool.
"""

from __future__ import annotations

from .cache import KVCachePool
from .config import KVCacheConfig, KVKind, KVLayout

__all__ = ["KVCacheConfig", "KVCachePool", "KVKind", "KVLayout"]
