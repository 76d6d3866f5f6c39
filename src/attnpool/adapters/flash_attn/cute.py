"""flash-attn 4 (``flash_attn.cute``, the ``flash-attn-4`` package): paged-kernel arguments from
a view.

FA4 is FlashAttention written in CuTe DSL; its kernels are JIT-compiled on first use per variant
(head sizes, dtype, causal / window / softcap / sink flags, page size) and cached for the process,
so the first call of each variant takes seconds and belongs in warm-up, before any graph capture.
Its ``flash_attn_varlen_func`` takes a paged batch as::

    flash_attn_varlen_func(q, k, v, cu_seqlens_q=, seqused_k=, page_table=, max_seqlen_q=,
                           softmax_scale=, causal=, window_size=(left, right), softcap=,
                           learnable_sink=, return_lse=True)

Facts from its ``interface.py`` (4.0.0b36) that shape the arguments here:

* ``k`` / ``v`` are ``[num_pages, P, H_kv, D]`` / ``[.., Dv]`` with ``cu_seqlens_k`` absent and
  ``seqused_k`` the per-row key counts; ``page_table [bs, pages]`` int32, its row count the
  batch ``cu_seqlens_q.shape[0] - 1``. Every metadata tensor passed is the view's own (a slice of
  the pool's arena): a graph captured on them reads what the next ``update_`` writes.
* ``max_seqlen_q`` is the view's host int, a static bound on a capture view (FA4 requires integer
  bounds to cover every replay). ``max_seqlen_k`` is not passed: FA4 bounds it by the page-table
  row (``pages × P``), the same for every replay.
* On Hopper, ``8 <= D, Dv <= 256`` and multiples of 8 (16 bytes of bf16), K and V head sizes may
  differ within that range; fp8 runs on Blackwell only (and takes descales this adapter does not
  plumb), so an fp8 cache is refused here with :class:`attnpool.LayoutError`.
* A page of exactly one key tile (``P`` = 128 for ``D <= 128`` on Hopper) is loaded whole by TMA,
  rows past ``seqused_k`` included: those rows are masked, but a NaN there still poisons ``0 × V``.
  A cache allocated with ``torch.empty`` must then hold finite values in the unwritten rows of a
  row's last page (write zeros once at allocation). Other page sizes load row by row.
* ``window_size=(left, 0)`` with ``causal`` is FA4's "local" mask (left bound inclusive, as FA3);
  ``softcap`` 0 is off; ``learnable_sink [H]`` (float32, bfloat16 or float16) is the sink logit of
  each query head.
* ``num_splits`` (split-KV, partials merged by a combine kernel) is FA4's own default here, 1:
  one CTA per (row, head group) over the whole KV. On Hopper 4.0.0b36 has no split-KV at all
  (its SM 9.0 path asserts ``not is_split_kv``, seen on an H100), so a decode batch of a few long
  rows runs on a few SMs there (measured: 1.6 ms for one 128K row against 0.19 ms for
  FlashInfer's split decode); ``num_splits != 1`` on an SM 9.x device is refused before the
  call. Elsewhere ``num_splits=0`` asks for FA4's heuristic, sized from the page-table bound
  (``pages × P``, static for a capture view, so every replay runs its captured split count).
* It returns ``(out [total_q, H, Dv], lse [H, total_q])``; ``lse`` is transposed to the adapters'
  ``[total_q, H]`` (a view, no copy). Output rows past ``cu_seqlens_q[bs]`` are left as allocated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...errors import InputError, LayoutError
from ...kv.quant import is_fp8
from ...views import PagedView
from ..sdpa.checks import check_qkv, softmax_scale_of
from ..sdpa.gather import cache_as_pages
from ..variants import check_sinks, check_softcap
from .sched import _paged, window_kwargs

#: FA4's head sizes on Hopper: ``FA4_MIN_HEAD <= D, Dv <= FA4_MAX_HEAD``, multiples of
#: ``FA4_HEAD_MULTIPLE`` (16 bytes of a 2-byte dtype).
FA4_MIN_HEAD, FA4_MAX_HEAD, FA4_HEAD_MULTIPLE = 8, 256, 8


def check_fa4_head_dims(d: int, dv: int) -> None:
    """Refuse head sizes FA4 has no Hopper kernel for, before the call (FA4's own check is an
    ``assert`` inside its interface).

    Raises:
        LayoutError: naming the sizes and the range FA4 takes.
    """
    for name, size in (("D", d), ("Dv", dv)):
        if not FA4_MIN_HEAD <= size <= FA4_MAX_HEAD or size % FA4_HEAD_MULTIPLE:
            raise LayoutError(f"flash-attn 4 takes head sizes in [{FA4_MIN_HEAD}, {FA4_MAX_HEAD}]"
                              f" that are multiples of {FA4_HEAD_MULTIPLE}, got {name}={size} "
                              f"(D={d}, Dv={dv}); use FlashInfer or the sdpa adapter")


def fa4_kwargs(
    view: PagedView,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    num_splits: int = 1,
) -> dict[str, Any]:
    """Keyword arguments of FA4's ``flash_attn_varlen_func`` for one paged part.

    Args:
        view: the part (token-slot parts read the cache as pages of ``view.page_size`` tokens,
            see :func:`cache_as_pages`).
        q: packed ``[total_q, H, D]`` with at least ``cu_seqlens_q[bs]`` rows, last dim contiguous.
        k_cache, v_cache: ``[num_pages, P, H_kv, D]`` / ``[.., Dv]``, float16 or bfloat16 like q.
        softcap: logit softcapping (0: off, not passed).
        sinks: per-query-head sink logits ``[H]`` (float32, bfloat16 or float16), passed as
            ``learnable_sink``; the caller casts them once at load (a per-call cast would give a
            captured graph a temporary's address).
        num_splits: FA4's split-KV count (default 1: no split; 0: its heuristic), not on Hopper.

    Raises:
        LayoutError: no page table, an fp8 cache, head sizes FA4 has no kernel for.
        InputError: ``q``'s last dim not contiguous, bad sinks.
    """
    table = _paged(view)
    if is_fp8(k_cache.dtype) or is_fp8(v_cache.dtype):
        raise LayoutError(f"flash-attn 4 reads fp8 caches on Blackwell only, with descales this "
                          f"adapter does not pass; got {k_cache.dtype}: use FA3 (float8_e4m3fn), "
                          "FlashInfer or the sdpa adapter")
    h, _, d = check_qkv(q, k_cache, v_cache)
    check_fa4_head_dims(d, v_cache.shape[3])
    if q.stride(-1) != 1:
        raise InputError(f"q must have a contiguous last dim, got strides {q.stride()}")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise InputError(f"num_splits must be an int >= 0 (0: FA4's heuristic), got "
                         f"{num_splits!r}")
    if num_splits != 1 and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9:
        raise LayoutError(f"flash-attn 4 has no split-KV on Hopper (SM 9.x); got "
                          f"num_splits={num_splits}, use 1")
    kw: dict[str, Any] = {
        "q": q,
        "k": cache_as_pages(k_cache, view.page_size),
        "v": cache_as_pages(v_cache, view.page_size),
        "cu_seqlens_q": view.cu_seqlens_q,
        "seqused_k": view.cache_seqlens,
        "page_table": table,
        "max_seqlen_q": view.max_seqlen_q,
        "softmax_scale": softmax_scale_of(softmax_scale, d),
        "causal": view.causal,
        "return_lse": True,
        "num_splits": num_splits,
        **window_kwargs(view),
    }
    cap = check_softcap(softcap)
    if cap:
        kw["softcap"] = cap
    sink = check_sinks(sinks, h, q.device, None)
    if sink is not None:
        kw["learnable_sink"] = sink
    return kw
