"""vLLM's own CPU attention kernel, fed from the pool's buffers: the default attention on a CPU.

vLLM's CPU build ships a C++ paged-attention kernel (``torch.ops._C.cpu_attention_with_kv_cache``)
that reads the cache blocks in place, for prefill chunks and decode rows alike, with windows,
softcap and sinks, after a per-step work split (``get_scheduler_metadata``) computed from the
step's lengths. Fed the pool's refilled buffers instead of vLLM's (the view's ``cu_seqlens_q``
as ``query_start_loc``, ``cache_seqlens`` as ``seq_lens``, ``page_table`` as ``block_table``),
it is attnpool's metadata read by the kernel engines already trust on a CPU; attnpool's own
torch paths (:mod:`.decode_cpu` for decode steps, the SDPA adapter for mixed ones) stay the
fallback and a switch away (:data:`attnpool.integrations.vllm.CPU_KERNEL`).

Measured on SmolLM2 float32 (BENCHMARKS.md, "vLLM: speed"): the torch paths copy every row's
blocks per layer before attending (tiny batched matrix products besides), which left attnpool
6-10% behind vLLM's kernel at 8 requests; with the kernel only the per-step refill differs.

The kernel reads the cache in the byte layout of one *ISA* that vLLM picks from the dtype, the
block size, the head size and the cache dtype (:func:`kernel_isa`), and its companion store op
writes that layout, so with the kernel attending every ISA vLLM picks is served, fp8 caches
(with the layer's K/V scales) and ALiBi slopes included, as vLLM's own backend serves them.
attnpool's own store (:mod:`.cache`) writes the ``vec`` layout, which its torch paths read.

With the kernel attending, the K/V store is its companion op too (``cpu_attn_reshape_and_cache``,
one call per layer for K and V; attnpool's store writes the same bytes with two ``index_put_``
and serves the torch paths). Nothing here runs at import time beyond torch: the kernels and
vLLM's ISA rule are looked up when a group is built (:class:`CPUKernel`), which only happens
inside a vLLM process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...errors import LayoutError
from ...views import PagedView

#: the ISA whose cache layout attnpool's store writes (see the module docstring)
STORE_ISA = "vec"


def kernel_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> str:
    """The ISA vLLM's CPU backend would pick for this group (vLLM's own rule, called: what it
    cannot serve, an fp8 cache on a CPU without AVX-512 say, raises vLLM's own error)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_size, kv_cache_dtype))


#: One step's kernel inputs for a group, ``(query_start_loc, seq_lens, block_table,
#: scheduler_metadata)``: the view's ``cu_seqlens_q`` (``[n + 1] int32``), ``cache_seqlens``
#: (``[n] int32``) and ``page_table`` rows (``[n, max_pages] int32``), pool buffers all, and
#: the kernel's work split of this step (vLLM's ``get_scheduler_metadata`` over the first two).
#: A plain tuple, not a named one: it is made once per step and group, in the engine's
#: metadata build, right after a forward has evicted the caches, and a tuple display is the one
#: way to make it that runs no call (a named tuple's ``tuple.__new__`` cost a microsecond
#: there, 3% of the build).
KernelStep = tuple[Tensor, Tensor, Tensor, Tensor]


class CPUKernel:
    """vLLM's CPU kernel for one KV-cache group (see the module docstring).

    Args:
        num_heads, num_kv_heads, head_size, dtype: the group's attention shape.
        window: the sliding window every layer of the group shares, else None (the work split
            then covers whole rows; each layer passes its own window to the kernel).
        isa: :func:`kernel_isa` of the group: the cache layout the kernel reads, which its own
            store op (:meth:`store`) writes.
        split_kv: vLLM's ``VLLM_CPU_ATTN_SPLIT_KV`` (split long rows across threads).
        kv_cache_dtype: vLLM's ``cache_config.cache_dtype`` (``auto``, or an fp8 spelling:
            the kernel and its store quantize with the layer's scales).
        causal: False for encoder-only layers (each token sees its whole request).
    """

    # (slots: :meth:`step` reads ten of these per step, right after a forward, where each
    # read of an instance dict is a cache miss more)
    __slots__ = ("_attend", "_halves", "_ops", "_split", "_store", "causal", "dtype",
                 "head_size", "isa", "kv_cache_dtype", "num_heads", "num_kv_heads", "split_kv",
                 "window")

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                 window: int | None, isa: str, split_kv: bool,
                 kv_cache_dtype: str = "auto", causal: bool = True) -> None:
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.dtype, self.isa, self.split_kv = dtype, isa, split_kv
        self.window = -1 if window is None else window
        self.kv_cache_dtype, self.causal = kv_cache_dtype, causal
        self._ops: Any = torch.ops._C
        #: the work split op, called per step: its overload's own callable when torch exposes
        #: it (``OpOverload._op``: the dispatcher call without the overload's Python frame,
        #: about 1 us of a build that costs vLLM 10 warm), else the overload
        split = self._ops.get_scheduler_metadata.default
        self._split = getattr(split, "_op", split)
        #: the attention and store ops, called once per layer: the same direct call
        attn, store = (self._ops.cpu_attention_with_kv_cache.default,
                       self._ops.cpu_attn_reshape_and_cache.default)
        self._attend, self._store = getattr(attn, "_op", attn), getattr(store, "_op", store)
        #: (data_ptr, shape) of a layer's cache -> its K and V halves (see :meth:`halves`)
        self._halves: dict[tuple[int, torch.Size], tuple[Tensor, Tensor]] = {}

    def halves(self, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        """The K and V views ``[num_blocks, H_kv, block_size, D]``-sized of one layer's cache
        ``[num_blocks, H_kv, block_size, 2 * D]`` (per block and head: the keys' bytes, then
        the values'), made once per cache: vLLM allocates each layer's cache once, and three
        view ops per layer and call cost about what the store op itself does on a decode
        step."""
        key = (kv_cache.data_ptr(), kv_cache.shape)
        got = self._halves.get(key)
        if got is None:
            blocks, heads, page, two_d = kv_cache.shape
            both = kv_cache.view(blocks, heads, 2 * page, two_d // 2)
            got = self._halves[key] = (both[:, :, :page], both[:, :, page:])
        return got

    def step(self, view: PagedView, n: int) -> KernelStep:
        """The kernel inputs of a refilled view's first ``n`` rows (once per step and group:
        the work split is shared by every layer, as vLLM's builder shares it)."""
        if view.page_table is None:
            raise LayoutError("vLLM's CPU kernel reads page tables (Layout.FLASH_ATTN)")
        qsl, lens, table = view.cu_seqlens_q, view.cache_seqlens, view.page_table
        if view.bs != n:  # (a view of the step's own rows needs no slicing; its bs, an int,
            # is read where a tensor's shape would be a call into torch)
            qsl, lens, table = qsl[: n + 1], lens[:n], table[:n]
        sched = self._split(
            n, self.num_heads, self.num_kv_heads, self.head_size, lens, self.dtype, qsl,
            self.causal,
            self.window, self.isa, self.split_kv, None, self.kv_cache_dtype)
        return qsl, lens, table, sched

    def attend(self, step: KernelStep, query: Tensor, kv_cache: Tensor, output: Tensor,
               scale: float, window: int | None, softcap: float, sinks: Tensor | None,
               alibi_slopes: Tensor | None = None, scales: tuple[float, float] = (1.0, 1.0)
               ) -> None:
        """Attention (causal unless the group's is not) of ``query [T, H, D]`` into ``output
        [T, H, D]`` over one layer's
        cache ``[num_blocks, H_kv, block_size, 2 * D]`` (K then V per block and head).
        ``alibi_slopes``: ``[H]`` float32 ALiBi slopes, else None; ``scales``: the layer's
        K and V scales of an fp8 cache (vLLM's ``layer._k_scale_float``, ``_v_scale_float``)."""
        k_cache, v_cache = self.halves(kv_cache)
        qsl, lens, table, sched = step
        self._attend(
            query, k_cache, v_cache, output, qsl, lens, scale, self.causal, alibi_slopes,
            -1 if window is None else window, table, softcap, sched, sinks, None, scales[0],
            scales[1], self.kv_cache_dtype)

    def store(self, key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
              scales: tuple[float, float] = (1.0, 1.0)) -> None:
        """Store ``key`` / ``value`` ``[T, H_kv, D]`` at ``slot_mapping [T]`` (-1: skipped) into
        one layer's cache, in the layout the kernel reads: vLLM's store op for it, one call
        (attnpool's own store, :func:`.cache.store_`, writes the same bytes of the ``vec``
        layout with two ``index_put_``). An fp8 cache is quantized with ``scales``."""
        k_cache, v_cache = self.halves(kv_cache)
        t = slot_mapping.shape[0]
        if key.shape[0] != t:  # (vLLM's padded tokens past the slots)
            key, value = key[:t], value[:t]
        self._store(key, value, k_cache, v_cache, slot_mapping, self.isa, scales[0], scales[1],
                    self.kv_cache_dtype)
