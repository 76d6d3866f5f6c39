"""Typed views: frozen, slotted dataclasses of slices of the pool's arena.

A view never owns memory and never aliases a caller's tensor: every tensor field is a slice of the
arena, so its ``data_ptr()`` is the same for the pool's life and a CUDA graph captured on it reads
whatever the next ``update_`` wrote. Host ints (``max_seqlen_*``) are frozen into a graph at capture:
views handed out by ``view(bs)`` carry the static bounds, and kernels must bound their reads by the
tensors, not by these ints.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True, slots=True)
class PagedView:
    """One batch of paged-attention metadata: the shape every phase part shares.

    Row ``i < bs`` reads KV tokens ``0 .. cache_seqlens[i]-1`` through its pages. Rows at or past the
    caller's real count ``n`` are padding: ``cache_seqlens = pad_seq_len``, pages = ``pad_page``,
    FlashInfer rows empty, so kernels run on valid, in-range data and their outputs are discarded.

    Attributes:
        bs: rows in the view (the captured batch size, or its multiple for expand parts).
        cache_seqlens: ``[bs] int32``, KV length of each row.
        cu_seqlens_q: ``[bs+1] int32``, query offsets: ``[0, cumsum(query lengths)]``.
        cu_seqlens_k: ``[bs+1] int32``, ``[0, cumsum(cache_seqlens)]``; element 0 is written by
            every update, never assumed zero.
        page_table: ``[bs, width] int32`` page ids (``Layout.FLASH_ATTN``), else None. Row ``i``
            is read up to column ``ceil(cache_seqlens[i] / page_size)``.
        kv_indptr: ``[bs+1] int32`` CSR row pointers (``Layout.FLASHINFER``), else None.
        kv_indices: ``[capacity] int32`` CSR page ids, the whole buffer (FlashInfer's graph
            wrappers take it at full size); read up to ``kv_indptr[bs]``. Else None.
        kv_last_page_len: ``[bs] int32`` in ``[1, page_size]`` (``Layout.FLASHINFER``), else None.
        max_seqlen_q: host int, upper bound of any row's query length.
        max_seqlen_k: host int, upper bound of any ``cache_seqlens`` (the static
            ``max_context_len`` unless the update was given host lengths).
        page_size: tokens per page.
        causal: whether queries use a causal mask (aligned to the end of the KV row).
    """

    bs: int
    cache_seqlens: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    page_table: Tensor | None
    kv_indptr: Tensor | None
    kv_indices: Tensor | None
    kv_last_page_len: Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    page_size: int
    causal: bool


@dataclass(frozen=True, slots=True)
class DecodeView(PagedView):
    """Decode: one query per row (``cu_seqlens_q = arange(bs+1)``, ``max_seqlen_q = 1``).

    Same fields as :class:`PagedView`; ``cache_seqlens[i]`` is request ``i``'s sequence length
    including the token being decoded.
    """
