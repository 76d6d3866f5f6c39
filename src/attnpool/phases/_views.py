"""Views of a phase's parts: frozen slices of the part's full-size buffers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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


#: each view class's rebinder (:func:`_rebinder`), made once
_REBINDERS: dict[type, Callable[[Any, int, int, int], Any]] = {}


def rebound(view: V, max_q: int, max_k: int, window_k: int) -> V:
    """``view`` with new host bounds (``max_seqlen_q``, ``max_seqlen_k``; its window part's
    ``max_seqlen_k`` capped at ``window_k``, the window table's width in tokens) and the same
    tensors: a step whose longest row grew by one token needs a view of its own, not a fresh set
    of slices (a decode step's bound changes nearly every step; the slices are what cost)."""
    cls = type(view)
    make = _REBINDERS.get(cls)
    if make is None:
        make = _REBINDERS[cls] = _rebinder(cls)
    return make(view, max_q, max_k, window_k)  # type: ignore[no-any-return]


def _rebinder(cls: type) -> Callable[[Any, int, int, int], Any]:
    """The function :func:`rebound` runs for views of ``cls``: one straight line that sets
    each slot of a new object through its slot descriptor, copied from the old view except the
    bounds (and the window part, rebound itself). A decode step makes one such view per step,
    in the engine's per-step metadata build, where every Python call is paid on cold caches:
    this line costs about a fifth of a loop of ``object.__setattr__`` calls over the fields
    (the view classes are frozen, so a plain assignment is refused; they check nothing at
    construction). Generated once per class, as :mod:`dataclasses` generates ``__init__``."""
    env: dict[str, Any] = {"_new": object.__new__, "_cls": cls, "_rebound": rebound}
    body = ["def rebind(view, max_q, max_k, window_k):", "    new = _new(_cls)"]
    for i, f in enumerate(dataclasses.fields(cls)):
        env[f"_set{i}"] = getattr(cls, f.name).__set__  # (the slot's member descriptor)
        value = {"max_seqlen_q": "max_q", "max_seqlen_k": "max_k",
                 "window": "None if (w := view.window) is None else "
                           "_rebound(w, max_q, min(max_k, window_k), window_k)"
                 }.get(f.name, f"view.{f.name}")
        body.append(f"    _set{i}(new, {value})")
    body.append("    return new")
    exec("\n".join(body), env)  # (generated from the class's own field names)
    return env["rebind"]  # type: ignore[no-any-return]
