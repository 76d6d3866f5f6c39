"""Reference update path: vectorised torch on any device, no loop over rows, no host sync.

Each function writes the *whole read region* of its buffers for ``bs`` rows (padded rows included)
and nothing the caller has not validated. Writes go in place into arena slices (``out=``, ``copy_``,
``fill_``); the few temporaries are ``[n, width]`` page blocks. The gather from the caller's
``req_to_token`` happens before any write, so an indexing error leaves the pool untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class PagedBuffers:
    """Full-size buffers of one paged part (see ``specs.paged_specs``); layout-less ones are None."""

    cache_seqlens: Tensor
    cu_seqlens_k: Tensor
    page_table: Tensor | None
    kv_indptr: Tensor | None
    kv_indices: Tensor | None
    kv_last_page_len: Tensor | None


def gather_pages(
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    page_size: int,
    width: int,
    token_offset: Tensor | None = None,
) -> Tensor:
    """Page ids ``[n, width]`` of pages ``0..width-1`` of each request (a temporary).

    Page ``p`` of request ``r`` is ``req_to_token[r, off + p*P] // P``. Columns past a row's live
    pages hold whatever the table holds there; they are outside every read region and the writers
    below never copy them into one. ``token_offset [n]`` shifts each row (decoder rows after their
    encoder tokens); shifted columns are clamped into the table.
    """
    if token_offset is None:
        cols = req_to_token[:, : width * page_size : page_size]
        tok = cols.index_select(0, req_pool_indices)
    else:
        idx = torch.arange(width, device=req_to_token.device) * page_size
        idx = (idx[None, :] + token_offset[:, None]).clamp_(max=req_to_token.shape[1] - 1)
        tok = req_to_token[req_pool_indices[:, None], idx]
    return tok if page_size == 1 else torch.div(tok, page_size, rounding_mode="floor")


def lengths_(dst: Tensor, src: Tensor, add: int, bs: int, pad: int) -> None:
    """``dst[:n] = src + add``; ``dst[n:bs] = pad`` (the declared padded length)."""
    n = src.shape[0]
    if add:
        torch.add(src, add, out=dst[:n])
    else:
        dst[:n].copy_(src)
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
    ``kv_last_page_len = 1``; padded page-table rows read ``pad_page`` in their first
    ``pad_pages`` columns.
    """
    n, width = pages.shape
    lens = b.cache_seqlens[:bs]
    cumsum_(b.cu_seqlens_k, lens)
    if b.page_table is not None:
        b.page_table[:n, :width].copy_(pages)
        b.page_table[n:bs, :pad_pages].fill_(pad_page)
    if b.kv_indptr is not None and b.kv_indices is not None and b.kv_last_page_len is not None:
        real = lens[:n]
        npages = torch.div(real + (page_size - 1), page_size, rounding_mode="floor")
        cumsum_(b.kv_indptr, npages)
        b.kv_indptr[n + 1 : bs + 1].copy_(b.kv_indptr[n : n + 1].expand(bs - n))
        cols = arange[:width]
        pos = b.kv_indptr[:n, None] + cols[None, :]
        # Lanes past a row's live pages go to the scratch slot at the end of kv_indices, so the
        # scatter needs no host-side compaction.
        pos = torch.where(cols[None, :] < npages[:, None], pos, b.kv_indices.shape[0] - 1)
        b.kv_indices.scatter_(0, pos.reshape(-1).long(), pages.reshape(-1).to(b.kv_indices.dtype))
        torch.remainder(real - 1, page_size, out=b.kv_last_page_len[:n])
        b.kv_last_page_len[:n].add_(1)
        b.kv_last_page_len[n:bs].fill_(1)
