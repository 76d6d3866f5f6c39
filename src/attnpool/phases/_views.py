"""Views of a phase's parts: frozen slices of the part's full-size buffers."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from torch import Tensor

from ..update.buffers import PagedBuffers
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


def window_view(b: PagedBuffers, rows: int, cu_seqlens_q: Tensor, *, max_q: int, max_k: int,
                window: int, page_size: int, pages: int, stamp: Stamp,
                cls: type[V] = PagedView, **extra: Any) -> V:  # type: ignore[assignment]
    """A window part's view (``b``: its buffers, ``pages`` wide) of ``rows`` rows: causal with
    ``window_left = W - 1``; its key bound is the full part's ``max_k``, capped by the window
    table's width in tokens. ``cls`` (and its ``extra`` fields) is the full part's class, so an
    adapter that tells parts apart by class (FA2 refuses rows of varying query counts) treats
    both parts alike."""
    return part_view(b, rows, cu_seqlens_q, max_q=max_q, max_k=min(max_k, pages * page_size),
                     page_size=page_size, causal=True, stamp=stamp, cls=cls,
                     window_left=window - 1, **extra)


#: each view class's field names, read once
_FIELDS: dict[type, tuple[str, ...]] = {}


def rebound(view: V, max_q: int, max_k: int, window_k: int) -> V:
    """``view`` with new host bounds (``max_seqlen_q``, ``max_seqlen_k``; its window part's
    ``max_seqlen_k`` capped at ``window_k``, the window table's width in tokens) and the same
    tensors: a step whose longest row grew by one token needs a view of its own, not a fresh set
    of slices (a decode step's bound changes nearly every step; the slices are what cost).
    Built field by field: the view classes are frozen and check nothing at construction."""
    cls = type(view)
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    new: V = object.__new__(cls)
    for name in names:
        object.__setattr__(new, name, getattr(view, name))
    object.__setattr__(new, "max_seqlen_q", max_q)
    object.__setattr__(new, "max_seqlen_k", max_k)
    window = view.window
    if window is not None:
        object.__setattr__(new, "window", rebound(window, max_q, min(max_k, window_k), window_k))
    return new
