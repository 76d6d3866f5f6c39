"""Read-region checker: the test-side half of the ``torch.empty`` contract.

:func:`check_view` copies a view's read region to the host and raises :class:`ReadRegionError` if
any element holds the poison sentinel (it was never written) or a value a kernel could not use
(a length past its bound, a non-monotonic cumsum, a negative or too-large page id). It syncs with
the device, so it is a debugging and testing tool, not something to call per step in production.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import Tensor

from .arena import sentinel
from .config import SchedLayout, ceil_div
from .errors import PoolError
from .views import ExtendView, PagedView


class ReadRegionError(PoolError):
    """A view's read region holds a poison sentinel or an out-of-range value."""


def _host(t: Tensor) -> list[int]:
    return [int(x) for x in t.detach().cpu().tolist()]


def _fail(where: str, what: str) -> None:
    raise ReadRegionError(f"{where}: {what}")


def _check_pages(where: str, ids: list[int], num_pages: int | None) -> None:
    hi = num_pages if num_pages is not None else int(sentinel(torch.int32))
    for j, p in enumerate(ids):
        if not 0 <= p < hi:
            _fail(where, f"page id at {j} is {p}, expected in [0, {hi})")


def _check_cumsum(where: str, cu: list[int], steps: list[int] | None, bound: int) -> None:
    if cu[0] != 0:
        _fail(where, f"element 0 is {cu[0]}, expected 0")
    for i in range(len(cu) - 1):
        d = cu[i + 1] - cu[i]
        if steps is not None and d != steps[i]:
            _fail(where, f"row {i} spans {d}, expected {steps[i]}")
        if not 0 <= d <= bound:
            _fail(where, f"row {i} spans {d}, expected in [0, {bound}]")


def _check_flashmla(v: PagedView, name: str) -> None:
    """FlashMLA's metadata of a part: no sentinel; ``num_splits`` starts at 0 and never
    decreases; each part is idle (``begin_req >= bs``: every build of the kernel skips it) or
    spans requests ``begin <= end < bs`` with block bounds inside their lengths' 64-token
    blocks, its begin split below the total. A begin request of -1 is refused: only vLLM's
    build of the kernel skips it."""
    f = v.flashmla
    if f is None:
        return
    md = [_host(r) for r in f.tile_scheduler_metadata.detach().cpu()]
    if f.config.layout is SchedLayout.DECODING_SCHED_META:  # to the argument layout's order
        md = [[r[0], r[2], r[1], *r[3:]] for r in md]
    ns = _host(f.num_splits[: v.bs + 1])
    top = v.bs + len(md)  # every row's first split, plus at most one more per part
    if ns[0] != 0 or ns[-1] > top or any(b < a for a, b in itertools.pairwise(ns)):
        _fail(f"{name}.flashmla.num_splits", f"{ns[:16]}... must start at 0, not decrease and "
              f"end <= {top}")
    blocks = [ceil_div(max(x, 1), 64) for x in _host(v.cache_seqlens[: v.bs])]
    for p, (br, bb, er, eb, sp, *_) in enumerate(md):
        where = f"{name}.flashmla.tile_scheduler_metadata[{p}]"
        if any(x == int(sentinel(torch.int32)) for x in md[p]):
            _fail(where, f"{md[p]} holds the poison sentinel (never written)")
        if br >= v.bs:  # idle (the sentinel was refused above)
            continue
        if not (0 <= br <= er < v.bs and 0 <= bb <= blocks[br] and 0 <= eb <= blocks[er]
                and 0 <= sp < max(ns[-1], 1)):
            _fail(where, f"{[br, bb, er, eb, sp]}: expected an idle part (begin >= {v.bs}) or "
                  f"requests 0 <= begin <= end < {v.bs} with blocks inside their lengths")


def check_paged(v: PagedView, name: str = "view", num_pages: int | None = None) -> None:
    """Check one :class:`PagedView`'s read region (see the module docstring)."""
    bs, page = v.bs, v.page_size
    lens = _host(v.cache_seqlens[:bs])
    for i, x in enumerate(lens):
        if not 0 <= x <= v.max_seqlen_k:
            _fail(f"{name}.cache_seqlens", f"row {i} is {x}, expected in [0, {v.max_seqlen_k}]")
    _check_cumsum(f"{name}.cu_seqlens_q", _host(v.cu_seqlens_q[: bs + 1]), None, v.max_seqlen_q)
    _check_cumsum(f"{name}.cu_seqlens_k", _host(v.cu_seqlens_k[: bs + 1]), lens, v.max_seqlen_k)
    npages = [ceil_div(x, page) for x in lens]
    if v.page_table is not None:
        rows = v.page_table[:bs].detach().cpu()
        if rows.shape[1] < max(npages, default=0):
            _fail(f"{name}.page_table", f"width {rows.shape[1]} < pages needed {max(npages)}")
        for i, k in enumerate(npages):
            _check_pages(f"{name}.page_table[{i}]", _host(rows[i, :k]), num_pages)
    if v.kv_indptr is not None and v.kv_indices is not None and v.kv_last_page_len is not None:
        indptr = _host(v.kv_indptr[: bs + 1])
        if indptr[0] != 0:
            _fail(f"{name}.kv_indptr", f"element 0 is {indptr[0]}, expected 0")
        last = _host(v.kv_last_page_len[:bs])
        for i in range(bs):
            got = indptr[i + 1] - indptr[i]
            if got not in (0, npages[i]):  # 0: a padded row, which owns no pages
                _fail(f"{name}.kv_indptr", f"row {i} has {got} pages, expected {npages[i]} or 0")
            want = (lens[i] - 1) % page + 1 if got else 0  # FlashInfer: 0 pages, 0 tokens
            if last[i] != want:
                _fail(f"{name}.kv_last_page_len", f"row {i} is {last[i]}, expected {want}")
        if indptr[bs] > v.kv_indices.shape[0] - 1:
            _fail(f"{name}.kv_indptr", f"total {indptr[bs]} > capacity {v.kv_indices.shape[0] - 1}")
        _check_pages(f"{name}.kv_indices", _host(v.kv_indices[: indptr[bs]]), num_pages)
    _check_flashmla(v, name)


def _check_positions(v: ExtendView) -> None:
    """Every position (a graph reads all ``T``) lies in ``[0, max_seqlen_k)``, and each real
    row's queries sit at the end of its KV row: ``len - q + j`` (a padded row's are all 0)."""
    pos = _host(v.positions)
    hi = max(v.max_seqlen_k, 1)
    for t, x in enumerate(pos):
        if not 0 <= x < hi:
            _fail("ExtendView.positions", f"token {t} is {x}, expected in [0, {hi})")
    cu, lens = _host(v.cu_seqlens_q[: v.bs + 1]), _host(v.cache_seqlens[: v.bs])
    for i in range(v.bs):
        row = pos[cu[i] : cu[i + 1]]
        q = len(row)
        want = list(range(lens[i] - q, lens[i])) if q <= lens[i] else None
        if row != want and any(row):
            _fail("ExtendView.positions", f"row {i} holds {row[:8]}..., expected "
                  f"{lens[i] - q}..{lens[i] - 1} (or zeros for a padded row)")


def _limit(part: PagedView, num_pages: int | None, page_size: int | None) -> int | None:
    """Id bound of a part: pages, or token slots for ``page_size = 1`` parts of a paged cache."""
    if num_pages is None or page_size is None or part.page_size == page_size:
        return num_pages
    return num_pages * page_size // part.page_size


def check_view(view: object, num_pages: int | None = None, page_size: int | None = None) -> None:
    """Check every paged part of a phase view (a :class:`PagedView` or a view holding some).

    ``num_pages`` bounds page ids when given; with the cache's ``page_size`` it also bounds the
    raw token slots of ``page_size = 1`` parts (``num_pages * page_size``).
    """
    if isinstance(view, PagedView):
        check_paged(view, type(view).__name__, _limit(view, num_pages, page_size))
        if isinstance(view, ExtendView):
            _check_positions(view)
        if view.window is not None:  # a phase view's sliding-window part
            check_paged(view.window, f"{type(view).__name__}.window",
                        _limit(view.window, num_pages, page_size))
        return
    if not dataclasses.is_dataclass(view):
        raise PoolError(f"check_view expects an attnpool view, got {type(view).__name__}")
    found = False
    for f in dataclasses.fields(view):
        part = getattr(view, f.name)
        parts = part if isinstance(part, tuple) else (part,)
        for k, p in enumerate(parts):
            if isinstance(p, PagedView):
                found = True
                label = f"{type(view).__name__}.{f.name}" + (f"[{k}]" if len(parts) > 1 else "")
                check_paged(p, label, _limit(p, num_pages, page_size))
            elif dataclasses.is_dataclass(p) and not isinstance(p, type):
                found = True
                check_view(p, num_pages, page_size)
    if not found:
        raise PoolError(f"{type(view).__name__} has no paged part to check")
