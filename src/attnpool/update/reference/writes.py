"""The reference path's writers: each writes the *whole read region* of its buffers for ``bs``
rows (padded rows included) in place into arena slices (``out=``, ``copy_``, ``fill_``), from
values the caller has computed and checked (the row layouts of :mod:`.rows`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..buffers import PagedBuffers


def lengths_(dst: Tensor, src: Tensor, add: int, bs: int, pad: int, max_len: int = 2**31 - 1
             ) -> None:
    """``dst[:n] = clamp(src + add, 0, max_len)`` (int32); ``dst[n:bs] = pad`` (the padded length).

    The clamp never changes an in-contract length. It bounds an out-of-contract device value
    (which only a sync could detect) so the rest of the update, and every kernel reading the
    view, stays inside the part's buffers: wrong metadata, never a stray index.
    """
    n = src.shape[0]
    real = dst[:n]
    if not add and src.dtype == dst.dtype:
        torch.clamp(src, 0, max_len, out=real)  # one op for int32 inputs
    else:
        if add:
            torch.add(src, add, out=real)
        else:
            real.copy_(src)
        real.clamp_(0, max_len)  # (a value past int32 has wrapped by now; the clamp bounds it)
    if n < bs:  # (an empty fill is still a dispatched op)
        dst[n:bs].fill_(pad)


def cumsum_(dst: Tensor, lens: Tensor) -> None:
    """``dst[0] = 0``, ``dst[1:len+1] = cumsum(lens)`` in place (int32)."""
    dst[:1].zero_()
    torch.cumsum(lens, 0, dtype=dst.dtype, out=dst[1 : lens.shape[0] + 1])


def paged_(
    b: PagedBuffers,
    *,
    bs: int,
    pages: Tensor,
    page_size: int,
    pad_page: int,
    pad_pages: int,
    arange: Tensor,
) -> None:
    """Write ``cu_seqlens_k`` and the page layouts of ``bs`` rows from ``cache_seqlens[:bs]``.

    ``pages [n, W]`` are the real rows' page ids (``W`` covers every real row's live pages); rows
    ``n..bs`` are padding. ``arange`` is the pool's constant ``0, 1, 2, ...`` (no temporary needed
    for column numbers). Padded FlashInfer rows own no pages (``kv_indptr`` repeats) and have
    ``kv_last_page_len = 0``, as has any row that owns no pages: FlashInfer's prefill plan takes a
    row's length as ``max(pages - 1, 0) * P + kv_last_page_len`` on the host, so a 1 there makes its
    Hopper kernels read a page the row does not own (an illegal address when that entry was never
    written); padded page-table rows read ``pad_page`` in their first
    ``pad_pages`` columns.
    """
    n, width = pages.shape
    if arange.shape[0] < max(width, bs) + 1:
        raise RuntimeError(f"arange constant too short: {arange.shape[0]} < {max(width, bs) + 1}")
    lens = b.cache_seqlens[:bs]
    cumsum_(b.cu_seqlens_k, lens)
    if b.page_table is not None:
        if pages.data_ptr() != b.page_table.data_ptr():  # (not gathered in place)
            b.page_table[:n, :width].copy_(pages)
        if n < bs:
            b.page_table[n:bs, :pad_pages].fill_(pad_page)
    if b.kv_indptr is not None and b.kv_indices is not None and b.kv_last_page_len is not None:
        real = lens[:n]
        npages = torch.div(real + (page_size - 1), page_size, rounding_mode="floor")
        cumsum_(b.kv_indptr, npages)
        if n < bs:
            b.kv_indptr[n + 1 : bs + 1].copy_(b.kv_indptr[n : n + 1].expand(bs - n))
        cols = arange[:width]
        pos = b.kv_indptr[:n, None] + cols[None, :]
        # Lanes past a row's live pages go to the scratch slot at the end of kv_indices, so the
        # scatter needs no host-side compaction; so do lanes past the CSR's capacity, which only
        # out-of-contract lengths reach (as the fused kernels mask them: wrong metadata, never
        # an indexing error half-way through the update).
        scratch = b.kv_indices.shape[0] - 1
        pos = torch.where((cols[None, :] < npages[:, None]) & (pos < scratch), pos, scratch)
        b.kv_indices.scatter_(0, pos.reshape(-1).long(), pages.reshape(-1).to(b.kv_indices.dtype))
        # (len - 1) % P + 1, and 0 for a row that owns no pages (an empty row: a draft tree
        # prefix shorter than a page)
        torch.remainder((real - 1).clamp_(min=0), page_size, out=b.kv_last_page_len[:n])
        b.kv_last_page_len[:n].add_(1).mul_(npages > 0)
        if n < bs:
            b.kv_last_page_len[n:bs].fill_(0)
