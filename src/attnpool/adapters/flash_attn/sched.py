"""What FA3 plans from a part, and the planner: the page table it reads, the KV bound it
derives, the window it is given, and :func:`scheduler_metadata_`, planned per part into the
pool's own buffers (all re-exported by :mod:`attnpool.adapters.flash_attn`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...errors import InputError, LayoutError
from ...pool import BufferPool
from ...views import PagedView
from ..variants import check_softcap
from .load import FlashAttnVersion, FlashKernel, Kernel, load_fa3, pick_kernel


def _paged(view: PagedView) -> Tensor:
    if not isinstance(view, PagedView):
        raise InputError(f"expected a PagedView part, got {type(view).__name__}")
    if view.page_table is None:
        raise LayoutError("flash-attn reads a page table: expected a view with page_table "
                          "(Layout.FLASH_ATTN), got one without")
    return view.page_table


def kernel_seqlen_k(view: PagedView) -> int:
    """The KV bound FA3 derives for ``view``: page-table width × page size.

    flash-attn takes no ``max_seqlen_k`` with a page table; it plans its splits for
    ``page_table.shape[1] * page_size`` keys, so :func:`scheduler_metadata_` plans for the same
    bound (``view.max_seqlen_k`` may be tighter, and a different bound is a different split plan).
    """
    return _paged(view).shape[1] * view.page_size


def window_kwargs(view: PagedView) -> dict[str, Any]:
    """``window_size=(window_left, 0)`` for a sliding-window part (flash-attn's left bound is
    inclusive: a query sees itself and ``window_left`` keys before it), nothing otherwise: the
    full parts' calls stay exactly as they were."""
    return {"window_size": (view.window_left, 0)} if view.window_left >= 0 else {}


def scheduler_metadata_(
    pool: BufferPool,
    view: PagedView,
    *,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    qkv_dtype: torch.dtype,
    fn: Kernel | None = None,
    kernel: FlashKernel | None = None,
    softcap: float = 0.0,
    head_dim_v: int | None = None,
) -> Tensor:
    """Plan FA3's scheduler for ``view`` into the pool's ``scheduler_metadata`` buffer.

    Call it after the view's update and before each replay, outside the graph (FA3 computes the
    plan on the device from ``cache_seqlens`` and ``cu_seqlens_q``). A plan holds for one window
    setting only (FA3 plans a sliding window as a "local" part, with other vectors), so a
    sliding-window part (``view.window_left >= 0``) is planned with its ``window_size`` into
    the pool's own ``window_scheduler_metadata`` buffer, never into the full parts'.
    ``qkv_dtype`` is the dtype the kernel runs in: ``torch.float8_e4m3fn`` over an fp8 cache (q
    is cast to it). The planner gets exactly what the kernel will see: the view's ``causal``,
    ``page_size``, ``max_seqlen_q``, ``window_size`` and the KV bound the kernel derives from
    the page table (:func:`kernel_seqlen_k`).

    Returns:
        The head of the pool's buffer holding FA3's result, *exactly* as many int32 elements as
        FA3 returned: FA3 checks that length (``int(needs_semaphore) + round_up(bs, 4) *
        vectors``, where the vector count depends on the part being causal, so it differs between
        parts and batch sizes). The address is fixed for the pool's life, and the length is the
        same at every call for one part and ``bs``, so a graph may bake the slice.

    Args:
        fn: ``get_scheduler_metadata`` to use (default: the loaded FA3 module's).
        kernel: the FA3 entry point (default :func:`load_fa3`).
        head_dim_v: V's head size when it differs from ``head_dim`` (K / V of different sizes),
            passed as FA3's ``headdim_v``: FA3 picks its tiles, hence its splits, from both, so
            a plan made without it does not fit the kernel's call. ``None`` or ``head_dim``:
            not passed.

    Raises:
        LayoutError: the pool was built without ``fa3_scheduler_metadata=True``, the module has
            no planner, or FA3's result is larger than the buffer (parts of more than ``max_bs``
            rows, such as tree expand parts, need their own buffer).
    """
    name = "window_scheduler_metadata" if view.window_left >= 0 else "scheduler_metadata"
    buf = pool.arena.maybe(None, name)
    if buf is None:
        raise LayoutError(f"this pool has no {name} buffer; build it with "
                          "PoolConfig(fa3_scheduler_metadata=True)" + (
                              " and sliding_window" if view.window_left >= 0 else ""))
    if fn is None:
        fn = pick_kernel(FlashAttnVersion.FA3, None, kernel).get_scheduler_metadata
        if fn is None:
            name = (kernel or load_fa3()).name
            raise LayoutError(f"{name} has no get_scheduler_metadata; run without "
                              "scheduler_metadata")
    md = fn(
        batch_size=view.bs, max_seqlen_q=view.max_seqlen_q, max_seqlen_k=kernel_seqlen_k(view),
        num_heads_q=num_heads_q, num_heads_kv=num_heads_kv, headdim=head_dim,
        cache_seqlens=view.cache_seqlens, qkv_dtype=qkv_dtype, cu_seqlens_q=view.cu_seqlens_q,
        page_size=view.page_size, causal=view.causal, **window_kwargs(view),
        **({"has_softcap": True} if check_softcap(softcap) else {}),
        **({} if head_dim_v in (None, head_dim) else {"headdim_v": head_dim_v}),
    )
    if not isinstance(md, Tensor) or md.dim() != 1 or md.dtype != torch.int32:
        got = (tuple(md.shape), md.dtype) if isinstance(md, Tensor) else type(md).__name__
        raise LayoutError(f"get_scheduler_metadata must return a 1-D int32 tensor, got {got}")
    if md.numel() > buf.numel():
        raise LayoutError(f"FA3 scheduler_metadata has {md.numel()} elements for bs={view.bs}; "
                          f"the pool's buffer holds {buf.numel()} (enough for parts of up to "
                          f"max_bs={pool.cfg.max_bs} rows)")
    dst = buf[: md.numel()]
    dst.copy_(md)
    return dst
