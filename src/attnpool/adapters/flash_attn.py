"""flash-attn adapter: ``flash_attn_with_kvcache`` arguments from a view, and the kernel call.

Two kernels share the name and differ in what they take:

* **FA3** (``flash_attn_interface``, Hopper): packed queries with ``cu_seqlens_q`` and
  ``max_seqlen_q``, ``page_table``, ``cache_seqlens``, any page size, and an optional precomputed
  ``scheduler_metadata``. Every :class:`attnpool.PagedView` maps onto it, token-slot expand parts
  included (the cache is read as pages of one token).
* **FA2** (``flash_attn``): queries ``[bs, seqlen_q, H, D]`` (the same count for every row),
  ``block_table``, ``cache_seqlens``; its paged-KV path requires a page size that is a multiple of
  256 (its C++ entry point checks ``page_block_size % 256 == 0``), so other pages are refused here
  with :class:`attnpool.LayoutError` instead of failing inside the extension.

Graph safety: every metadata tensor in the returned keyword arguments *is* the view's tensor (a
slice of the pool's arena), never a copy, so a graph captured on them reads what the next
``update_`` writes; the tests check the ``data_ptr()``s. ``cu_seqlens_k_new`` is not passed: KV of
new tokens is written into the cache by the engine before attention, not by this call.

Outputs are normalised to the adapters' convention: ``out [total_q, H, D]`` and natural-log
``lse [total_q, H]`` (FA3 returns ``lse [H, total_q]``, FA2 ``[bs, H, seqlen_q]``), so tree passes
merge with :func:`attnpool.adapters.sdpa.merge_by_lse`.
"""

from __future__ import annotations

import enum
import importlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..errors import InputError, LayoutError
from ..pool import BufferPool
from ..views import DraftExtendView, DraftStepView, LocalView, PagedView, VerifyView
from .sdpa import Attn, cache_as_pages, check_qkv, merge_by_lse

#: FA2's paged KV cache needs ``page_block_size % FA2_PAGE_MULTIPLE == 0``.
FA2_PAGE_MULTIPLE = 256

Kernel = Callable[..., Any]


class FlashAttnVersion(enum.Enum):
    """Which ``flash_attn_with_kvcache``: FA2 (``flash_attn``) or FA3 (``flash_attn_interface``)."""

    FA2 = "flash_attn"
    FA3 = "flash_attn_interface"


def _module(version: FlashAttnVersion) -> Any:
    """Import the kernel's module lazily (importing attnpool never imports flash-attn)."""
    try:
        return importlib.import_module(version.value)
    except ImportError as e:
        raise ImportError(f"{version.name} needs the '{version.value}' module, which is not "
                          f"importable: {e}") from e


def scheduler_metadata_size(bs: int) -> int:
    """Elements of FA3's ``scheduler_metadata`` for ``bs`` rows: ``round_up(bs, 4) * 4 + 1``."""
    return -(-bs // 4) * 4 * 4 + 1


def _paged(view: PagedView) -> Tensor:
    if not isinstance(view, PagedView):
        raise InputError(f"expected a PagedView part, got {type(view).__name__}")
    if view.page_table is None:
        raise LayoutError("flash-attn reads a page table: expected a view with page_table "
                          "(Layout.FLASH_ATTN), got one without")
    return view.page_table


def _scale(softmax_scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)


def fa3_kwargs(
    view: PagedView,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    softmax_scale: float | None = None,
    return_softmax_lse: bool = True,
    scheduler_metadata: Tensor | None = None,
) -> dict[str, Any]:
    """Keyword arguments of FA3 ``flash_attn_with_kvcache`` for one paged part.

    Args:
        view: the part (its ``page_size`` may differ from the cache's: token-slot parts read the
            cache as pages of ``view.page_size`` tokens, see :func:`cache_as_pages`).
        q: packed ``[total_q, H, D]`` holding at least ``cu_seqlens_q[bs]`` rows (the padded
            query buffer a graph reads), last dim contiguous.
        k_cache, v_cache: ``[num_pages, P, H_kv, D]``.
        scheduler_metadata: the pool's buffer as filled by :func:`scheduler_metadata_` for this
            view's ``bs`` (omitted when None).
    """
    table = _paged(view)
    _, _, d = check_qkv(q, k_cache, v_cache)
    if q.stride(-1) != 1:
        raise InputError(f"q must have a contiguous last dim, got strides {q.stride()}")
    kw: dict[str, Any] = {
        "q": q,
        "k_cache": cache_as_pages(k_cache, view.page_size),
        "v_cache": cache_as_pages(v_cache, view.page_size),
        "cache_seqlens": view.cache_seqlens,
        "page_table": table,
        "cu_seqlens_q": view.cu_seqlens_q,
        "max_seqlen_q": view.max_seqlen_q,
        "softmax_scale": _scale(softmax_scale, d),
        "causal": view.causal,
        "return_softmax_lse": return_softmax_lse,
    }
    if scheduler_metadata is not None:
        kw["scheduler_metadata"] = scheduler_metadata
    return kw


def fa2_kwargs(
    view: PagedView,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    softmax_scale: float | None = None,
    return_softmax_lse: bool = True,
) -> dict[str, Any]:
    """Keyword arguments of FA2 ``flash_attn_with_kvcache`` for one paged part.

    FA2 takes ``q [bs, seqlen_q, H, D]``: every row has ``seqlen_q = view.max_seqlen_q`` queries,
    so ``q`` must hold exactly ``bs * max_seqlen_q`` packed rows (it is reshaped, not copied).
    Views whose rows have varying query counts (draft extend, local verify) are refused.

    Raises:
        LayoutError: page size not a multiple of 256, no page table, or varying queries per row.
        InputError: ``q`` rows do not match ``bs * max_seqlen_q``.
    """
    table = _paged(view)
    if view.page_size % FA2_PAGE_MULTIPLE:
        raise LayoutError(f"flash-attn 2 paged KV needs page_size a multiple of "
                          f"{FA2_PAGE_MULTIPLE}, got {view.page_size}; use FA3 or the sdpa adapter")
    if isinstance(view, DraftExtendView) or (isinstance(view, LocalView)
                                             and view.rows_per_request > 1):
        raise LayoutError(f"flash-attn 2 needs the same query count in every row; "
                          f"{type(view).__name__} rows vary, use FA3 or the sdpa adapter")
    h, _, d = check_qkv(q, k_cache, v_cache)
    sq = view.max_seqlen_q
    if q.shape[0] != view.bs * sq:
        raise InputError(f"q must have bs * max_seqlen_q = {view.bs * sq} rows, got {q.shape[0]}")
    if k_cache.shape[1] != view.page_size:
        raise LayoutError(f"k_cache page size must equal the view's ({view.page_size}), got "
                          f"{k_cache.shape[1]}")
    return {
        "q": q.view(view.bs, sq, h, d),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "cache_seqlens": view.cache_seqlens,
        "block_table": table,
        "softmax_scale": _scale(softmax_scale, d),
        "causal": view.causal,
        "return_softmax_lse": return_softmax_lse,
    }


def scheduler_metadata_(
    pool: BufferPool,
    view: PagedView,
    *,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    qkv_dtype: torch.dtype,
    fn: Kernel | None = None,
) -> Tensor:
    """Fill the pool's FA3 ``scheduler_metadata`` for ``view`` and return its ``bs``-sized slice.

    Call it before each replay, after the view's update, outside the graph (FA3 computes the
    metadata on the device from ``cache_seqlens``). The slice is ``round_up(bs, 4) * 4 + 1`` int32
    at a fixed address (the graph bakes it); FA3's result is copied to its head and the rest is
    zeroed every step, so no stale entry from a larger batch survives.

    Args:
        fn: ``get_scheduler_metadata`` (default: FA3's, imported lazily); tests pass a fake.

    Raises:
        LayoutError: the pool was built without ``fa3_scheduler_metadata=True``, or FA3's result
            is larger than the slice.
    """
    buf = pool.arena.maybe(None, "scheduler_metadata")
    if buf is None:
        raise LayoutError("this pool has no scheduler_metadata buffer; build it with "
                          "PoolConfig(fa3_scheduler_metadata=True)")
    size = scheduler_metadata_size(view.bs)
    if size > buf.shape[0]:
        raise LayoutError(f"scheduler_metadata holds {buf.shape[0]} elements, bs={view.bs} "
                          f"needs {size}")
    get = fn if fn is not None else _module(FlashAttnVersion.FA3).get_scheduler_metadata
    md = get(
        batch_size=view.bs, max_seqlen_q=view.max_seqlen_q, max_seqlen_k=view.max_seqlen_k,
        num_heads_q=num_heads_q, num_heads_kv=num_heads_kv, headdim=head_dim,
        cache_seqlens=view.cache_seqlens, qkv_dtype=qkv_dtype, cu_seqlens_q=view.cu_seqlens_q,
        page_size=view.page_size, causal=view.causal,
    )
    flat = md.reshape(-1)
    if flat.numel() > size:
        raise LayoutError(f"FA3 scheduler_metadata has {flat.numel()} elements, expected at most "
                          f"round_up(bs, 4) * 4 + 1 = {size}")
    dst = buf[:size]
    dst[: flat.numel()].copy_(flat)
    dst[flat.numel():].zero_()
    return dst


def run(
    view: PagedView,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    version: FlashAttnVersion = FlashAttnVersion.FA3,
    softmax_scale: float | None = None,
    scheduler_metadata: Tensor | None = None,
    fn: Kernel | None = None,
) -> Attn:
    """Call ``flash_attn_with_kvcache`` on one paged part; return ``(out, lse)`` in the adapters'
    convention (``[total_q, H, D]``, ``[total_q, H]``).

    Args:
        fn: the kernel (default: the ``version``'s ``flash_attn_with_kvcache``, imported lazily).
    """
    kernel = fn if fn is not None else _module(version).flash_attn_with_kvcache
    if version is FlashAttnVersion.FA3:
        kw = fa3_kwargs(view, q, k_cache, v_cache, softmax_scale=softmax_scale,
                        scheduler_metadata=scheduler_metadata)
        out, lse, *_ = kernel(**kw)
        return Attn(out, lse.transpose(0, 1))
    if scheduler_metadata is not None:
        raise InputError("scheduler_metadata is an FA3 argument, got one with FA2")
    kw = fa2_kwargs(view, q, k_cache, v_cache, softmax_scale=softmax_scale)
    out, lse = kernel(**kw)[:2]
    bs, sq, h = out.shape[0], out.shape[1], out.shape[2]
    return Attn(out.reshape(bs * sq, h, out.shape[3]), lse.transpose(1, 2).reshape(bs * sq, h))


def attention(
    view: object,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    version: FlashAttnVersion = FlashAttnVersion.FA3,
    softmax_scale: float | None = None,
    scheduler_metadata: Tensor | None = None,
    fn: Kernel | None = None,
) -> Attn:
    """:func:`run` for a :class:`PagedView`, or both passes of a tree
    :class:`attnpool.VerifyView` / :class:`attnpool.DraftStepView` merged by log-sum-exp.

    ``scheduler_metadata`` applies to the first pass only (it is computed per part).
    """
    kw: dict[str, Any] = {"version": version, "softmax_scale": softmax_scale, "fn": fn}
    if isinstance(view, PagedView):
        return run(view, q, k_cache, v_cache, scheduler_metadata=scheduler_metadata, **kw)
    if isinstance(view, (VerifyView, DraftStepView)):
        a = run(view.prefix, q, k_cache, v_cache, scheduler_metadata=scheduler_metadata, **kw)
        if view.expand is None:
            return a
        b = run(view.expand, q, k_cache, v_cache, **kw)
        return merge_by_lse(a.out, a.lse, b.out, b.lse)
    raise InputError(f"attention expects a PagedView, VerifyView or DraftStepView, got "
                     f"{type(view).__name__}")
