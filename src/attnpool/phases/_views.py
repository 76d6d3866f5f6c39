"""Views of a phase's parts: frozen slices of the part's full-size buffers."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import Tensor

from ..update.reference import PagedBuffers
from ..views import PagedView, Stamp

V = TypeVar("V", bound=PagedView)


def part_view(
    b: PagedBuffers,
    rows: int,
    cu_seqlens_q: Tensor,
    *,
    max_q: int,
    max_k: int,
    page_size: int,
    causal: bool,
    stamp: Stamp,
    cls: type[V] = PagedView,  # type: ignore[assignment]
    **extra: Any,
) -> V:
    """A view (``cls``, a :class:`PagedView`) of the first ``rows`` rows of a part's buffers."""
    return cls(
        bs=rows,
        cache_seqlens=b.cache_seqlens[:rows],
        cu_seqlens_q=cu_seqlens_q[: rows + 1],
        cu_seqlens_k=b.cu_seqlens_k[: rows + 1],
        page_table=None if b.page_table is None else b.page_table[:rows],
        kv_indptr=None if b.kv_indptr is None else b.kv_indptr[: rows + 1],
        kv_indices=b.kv_indices,
        kv_last_page_len=None if b.kv_last_page_len is None else b.kv_last_page_len[:rows],
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        page_size=page_size,
        causal=causal,
        stamp=stamp,
        **extra,
    )
