"""The SDPA adapter's argument checks, shared with the kernel adapters: the packed queries and
paged cache every adapter takes (:func:`check_qkv`, which names the likely HND/NHD mix-up), the
softmax scale as kernels take it, and which of a view's layouts a pass reads."""

from __future__ import annotations

import math

from torch import Tensor

from ...config import Layout
from ...errors import InputError, LayoutError
from ...views import PagedView


def check_qkv(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int]:
    """Validate packed queries and a paged cache; return ``(H, H_kv, D)``.

    ``q [total_q, H, D]``, ``k_cache [num_pages, P, H_kv, D]``, ``v_cache [num_pages, P, H_kv, Dv]``
    on one device, floating point, ``H % H_kv == 0`` (grouped-query attention: query head ``h``
    reads KV head ``h // (H // H_kv)``, the flash-attn / FlashInfer convention).
    """
    for name, t, nd in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if not isinstance(t, Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != nd:
            raise InputError(f"{name} must have {nd} dims, got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise InputError(f"{name} must be floating point, got {t.dtype}")
        if t.device != q.device:
            raise InputError(f"{name} must be on {q.device} like q, got {t.device}")
    h, d = q.shape[1], q.shape[2]
    h_kv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise InputError(f"k_cache head dim must equal q's ({d}), got {k_cache.shape[3]}")
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise InputError(f"v_cache must match k_cache {tuple(k_cache.shape[:3])} in its first "
                         f"three dims, got {tuple(v_cache.shape[:3])}")
    if h_kv < 1 or h % h_kv:
        raise InputError(f"query heads ({h}) must be a multiple of KV heads, read from dim 2 "
                         f"of k_cache [num_pages, page_size, H_kv, D] = {tuple(k_cache.shape)}: "
                         f"{h_kv}{_hnd_hint(h, k_cache)}")
    return h, h_kv, d


def _hnd_hint(h: int, k_cache: Tensor) -> str:
    """The likely mix-up behind a head-count mismatch: an HND cache ``[num_pages, H_kv, P, D]``
    (FlashInfer's other order, ``KVLayout.HND``) read as NHD, so the page size lands where the
    KV heads are expected."""
    hkv, p = k_cache.shape[1], k_cache.shape[2]
    if hkv >= 1 and h % hkv == 0 and hkv != p:
        return (f". The cache looks HND [num_pages, H_kv={hkv}, page_size={p}, D]; this "
                f"adapter expects NHD [num_pages, page_size, H_kv, D] (KVCachePool with "
                f"KVLayout.NHD, or a cache allocated in that order)")
    return ""


def softmax_scale_of(softmax_scale: float | None, head_dim: int) -> float:
    """The softmax scale as every adapter passes it: ``softmax_scale``, else the kernels' default
    ``1 / sqrt(head_dim)``, as a Python float (kernels take a host float)."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def pick_layout(view: PagedView, layout: Layout | None) -> Layout:
    """The layout to read: ``layout`` if given (its fields must exist), else FLASH_ATTN when the
    view has a page table, else FLASHINFER."""
    has_fa = view.page_table is not None
    has_fi = view.kv_indptr is not None and view.kv_indices is not None \
        and view.kv_last_page_len is not None
    if layout is None:
        if not (has_fa or has_fi):
            raise LayoutError("view has neither a page_table nor FlashInfer CSR fields")
        return Layout.FLASH_ATTN if has_fa else Layout.FLASHINFER
    if layout not in (Layout.FLASH_ATTN, Layout.FLASHINFER):
        raise InputError(f"layout must be Layout.FLASH_ATTN or Layout.FLASHINFER, got {layout}")
    if (layout is Layout.FLASH_ATTN and not has_fa) or (layout is Layout.FLASHINFER and not has_fi):
        present = [n for n, ok in (("FLASH_ATTN", has_fa), ("FLASHINFER", has_fi)) if ok]
        raise LayoutError(f"view has no {layout} fields; expected one of {present}")
    return layout
