"""Adapters: turn a pool's views into attention kernel calls.

* :mod:`attnpool.adapters.sdpa`: paged attention with PyTorch's ``scaled_dot_product_attention``
  for every :class:`attnpool.PagedView` and both layouts; runs on CPU and CUDA. The library's CPU
  backend and the oracle the kernel adapters are checked against.
* :mod:`attnpool.adapters.flash_attn`: arguments of flash-attn's paged kernels (FA2, and FA3 from
  whichever of flash-attention's Hopper build, sgl-kernel or vLLM is importable) built from a
  view, FA3's scheduler metadata in the pool, and the kernel call.
* :mod:`attnpool.adapters.flashinfer`: FlashInfer CUDA-graph wrappers on the pool's FLASHINFER
  buffers, and planning from a view before replay.

Every adapter returns the same convention: the output ``[total_q, H, Dv]`` (V's head size, which
may differ from the queries' ``D``: each adapter's docstring says where its library allows it)
packed like the queries
(``cu_seqlens_q``) and the natural-log log-sum-exp ``[total_q, H]`` float32, so two passes of a
tree view merge with :func:`merge_by_lse` whatever kernel produced them (an empty row's
log-sum-exp is ``-inf``, or ``+inf`` from flash-attn; both read as "no keys").

Query rows: ``q`` may be the padded query buffer of a captured batch (``bs * r`` rows) with every
adapter. SDPA and FlashInfer compute the rows of ``cu_seqlens_q[:bs+1]`` and return 0 and ``-inf``
past them (FlashInfer's wrappers get exactly the rows they require); FA3 leaves rows past
``cu_seqlens_q[bs]`` as allocated; FA2 takes exactly ``bs * max_seqlen_q`` rows.

fp8 KV caches (:meth:`attnpool.KVCachePool.store_kv_` with scales) are read by every adapter but
FA2, each the way its kernel takes them (:mod:`attnpool.adapters.fp8` has the table): SDPA
dequantizes the rows it gathers (``k_scale`` / ``v_scale`` device tensors, per tensor or per KV
head, e4m3fn and e5m2); FA3 gets e4m3fn caches with the scales as ``k_descale`` / ``v_descale``
views (per tensor or per head) and ``q`` cast to e4m3fn; FlashInfer gets ``kv_dtype`` at plan and
per-tensor scales as Python floats at run, read from the device once
(:func:`attnpool.adapters.fp8.host_scales`); FA2 refuses fp8 caches with a
:class:`attnpool.LayoutError`.

This package imports only torch: flash-attn and FlashInfer are imported inside the functions that
call them, so ``import attnpool.adapters`` works (and initialises no CUDA) without them.
"""

from __future__ import annotations

from .sdpa import Attn, attention, cache_as_pages, check_qkv, merge_by_lse, paged_attention

__all__ = ["Attn", "attention", "cache_as_pages", "check_qkv", "merge_by_lse", "paged_attention"]
