"""A part's buffers, as both update paths and the phases see them.

Every paged part of a phase is the same group of buffers (``specs.paged_specs``): lengths, cumsums
and a page table and/or FlashInfer's CSR. :class:`PagedBuffers` names them once, so the reference
and fused paths take the same argument, and the phases build it from the arena.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    #: the pool's constant ``0, 1, 2, ...`` (int32, longer than any row count or page width):
    #: the reference path's column numbers without a temporary. The fused path never reads it;
    #: None makes the reference path build a temporary instead.
    arange: Tensor | None = None


def table_width(table: Tensor, block_size: int | None = None) -> int:
    """Token positions a request table covers: its columns, times ``block_size`` for a block
    table (see the module docstring)."""
    return table.shape[1] * (block_size or 1)


def window_width(w: PagedBuffers) -> int:
    """Page columns a window part holds: its page table's width, or for a CSR-only part its
    ``kv_indices`` capacity per row (``rows * width + 1`` elements). Window lengths are clamped
    to it on both paths, so no value can list more pages than the part has room for."""
    if w.page_table is not None:
        return int(w.page_table.shape[1])
    assert w.kv_indices is not None and w.kv_last_page_len is not None  # (the CSR triple)
    return (w.kv_indices.shape[0] - 1) // max(1, w.kv_last_page_len.shape[-1])
