"""flash-attn 4's absorbed-MLA path (``qv``) over a latent cache, from a view's page table.

flash-attn 4 (``flash_attn.cute``, package ``flash-attn-4``) writes absorbed MLA as
``softmax(scale · (q k^T + qv v^T)) v`` with ``q = q_pe [T, H, 64]``, ``k = k_pe``,
``v = c_kv [.., 512]`` and ``qv`` the latent query ``[T, H, 512]``: its
``flash_attn_varlen_func(q, k, v, qv=, cu_seqlens_q=, seqused_k=, page_table=, max_seqlen_q=,
max_seqlen_k=, softmax_scale=, causal=, return_lse=True)``. Facts from 4.0.0b36's
``interface.py`` that shape this adapter:

* ``qv`` runs on Blackwell (SM 10.x / 11.x) only, with ``head_dim == 64`` and ``head_dim_v ==
  512`` (DeepSeek's rope and latent), fp16 / bf16 / fp8, no window and no softcap;
* paged KV: ``k [num_pages, P, 1, 64]`` and ``v [num_pages, P, 1, 512]`` are here the two column
  ranges of ``KVCachePool.kv_cache(layer)``: strided views, which flash-attn keeps without a copy
  when their pointer and strides are 16-byte aligned (a 576-wide bf16 row is); ``page_table [b,
  pages]`` int32 with ``cu_seqlens_k`` absent, ``seqused_k = cache_seqlens``;
* its default scale with ``qv`` is ``(64 + 512) ** -0.5``, not the unabsorbed head's: the
  adapter always passes ``softmax_scale`` (``MLAShape.softmax_scale`` by default);
* the log-sum-exp is natural-log ``[total_q, H]`` (heads last with ``qv``), ``-inf`` for a row
  with no keys; output rows past ``cu_seqlens_q[bs]`` are left as allocated.

``max_seqlen_q`` / ``max_seqlen_k`` are the view's host ints (static bounds on a capture view);
flash-attn requires integer bounds to cover every replay, which the capture view's do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from ...errors import InputError, LayoutError
from ...kv.mla_shape import MLAShape
from ...views import PagedView
from ..merge import Attn, run_passes
from ..sdpa.gather import cache_as_pages
from .sdpa import check_shape, latent_kv, split_q


def fa4_kwargs(view: PagedView, q: Tensor, kv_cache: Tensor, shape: MLAShape, *,
               q_pe: Tensor | None = None, softmax_scale: float | None = None) -> dict[str, Any]:
    """Keyword arguments of flash-attn 4's ``flash_attn_varlen_func`` for one paged part: the
    view's tensors themselves (graph-safe) and column views of the cache (no copy)."""
    if not isinstance(view, PagedView):
        raise InputError(f"expected a PagedView part, got {type(view).__name__}")
    if view.page_table is None:
        raise LayoutError("flash-attn reads a page table: expected a view with page_table "
                          "(Layout.FLASH_ATTN)")
    if view.window_left >= 0:
        raise LayoutError(f"flash-attn 4's qv path has no sliding window; this part has "
                          f"window_left={view.window_left}")
    s = check_shape(shape)
    q_lat, q_rope = split_q(q, s, q_pe)
    kv, _ = latent_kv(kv_cache, s)
    pages = cache_as_pages(kv, view.page_size)
    lat = s.kv_lora_rank
    return {"q": q_rope, "k": pages[..., lat:], "v": pages[..., :lat], "qv": q_lat,
            "cu_seqlens_q": view.cu_seqlens_q, "seqused_k": view.cache_seqlens,
            "page_table": view.page_table, "max_seqlen_q": view.max_seqlen_q,
            "max_seqlen_k": view.max_seqlen_k,
            "softmax_scale": s.softmax_scale if softmax_scale is None else float(softmax_scale),
            "causal": view.causal, "return_lse": True}


def _default_fn() -> Callable[..., Any]:
    from flash_attn.cute import flash_attn_varlen_func  # lazy: never at import time

    return flash_attn_varlen_func  # type: ignore[no-any-return]


def attention(view: object, q: Tensor, kv_cache: Tensor, shape: MLAShape, *,
              q_pe: Tensor | None = None, softmax_scale: float | None = None,
              fn: Callable[..., Any] | None = None) -> Attn:
    """flash-attn 4 over every pass of ``view`` (a tree's two merged by log-sum-exp):
    ``Attn(out [T, H, L], lse [T, H])``. ``fn``: the kernel entry point (default
    ``flash_attn.cute.flash_attn_varlen_func``)."""
    call = fn or _default_fn()

    def one(part: PagedView, first: bool, sinks: Tensor | None) -> Attn:
        out, lse = call(**fa4_kwargs(part, q, kv_cache, shape, q_pe=q_pe,
                                     softmax_scale=softmax_scale))
        return Attn(out, lse)

    return run_passes(view, one)
