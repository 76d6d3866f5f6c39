"""How the SDPA adapter copies each layer's key lanes out of the paged cache.

SDPA takes keys as one strided block ``[b, H_kv, L, D]``, so every layer copies its rows' K and
V lanes out of the pages (:func:`gather_kv`, :func:`gather_pair`); a :class:`Gather`, computed
once per forward with the plan (:mod:`attnpool.adapters.sdpa.planning`), says where they are. The
copy is most of a decode layer's cost on a CPU besides SDPA itself, so two things make it cheap:

* **Whole pages, on a CPU.** ``index_select`` copies one index at a time: a page of ``P``
  tokens is one ``P``-times-longer copy instead of ``P`` short ones, which a CPU streams from
  memory much faster (the cache of a decode step is read from DRAM: the weights between two
  layers evict it). Lanes of a row's last page past its length hold whatever the page held
  (stale or never written: poison, NaN), so they are zeroed after the copy (``tail``); pages
  past a row's length read page 0, like the token lanes of the token-level copy read slot 0.
  Finding those lanes reads a mask back to the host, free on a CPU; other devices keep the
  token-level copy (no host sync, graph-safe). Pages are only used where they add at most
  half a row of extra lanes (short rows in big pages copy token lanes).
* **K and V in one copy** when they are one run of rows (a :class:`attnpool.KVCachePool`
  layer keeps its V pages after its K pages): one ``index_select`` over both instead of two.
* **No copy at all, on a CPU, when the cache already holds the block.** When every row of a
  pass is ``L`` tokens long (a batch of equal prompts, a single request) and each row's pages
  are one run of consecutive page ids, the rows starting a fixed number of pages apart (what
  an allocator that hands out fresh pages in order gives requests admitted together), the
  ``[b, H_kv, L, D]`` block SDPA takes is a strided view of the cache itself (``Gather.run``):
  a layer reads K and V where they lie, with no copy and no tail to zero. Only written lanes
  are read (every lane below ``L`` is below its row's length), so ``torch.empty`` memory and
  poison stay out of reach: nothing else in the pass changes (the same mask, the same SDPA
  call over the same values at the same lanes, bit for bit). A cache whose token rows are
  not one run, a dtype to convert or fp8 scales take the copy.

Either way the same values reach SDPA at the same lanes: the results are bit-identical to the
token-level copy of separate caches. (:func:`cache_as_pages`, the regrouping of a cache into
pages of another size, is how the kernel adapters read the same cache.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from ...errors import InputError, LayoutError
from ...kv.quant import dequantize


class Lanes(Protocol):
    """What a copy needs of a plan (:class:`attnpool.adapters.sdpa.planning.Plan` is one; named
    here so that this module does not import the plan module, which imports it)."""

    @property
    def b(self) -> int: ...

    @property
    def lmax(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def gather(self) -> Gather: ...


@dataclass(slots=True)
class Gather:
    """Where a plan's key lanes are, in the cache's token rows.

    Attributes:
        pages: ``[b*W]`` page ids (units of ``page`` tokens) of every row's ``W`` pages, those
            past its length 0; None: copy token lanes (not a CPU, or pages too big).
        page: the view's page size. span: lanes per row of a page copy (``W * page``).
        tail: ``[n] int64`` lanes (row ``i``'s lane ``j`` is ``i * span + j``) of a page copy
            to zero: a row's last page past its length, below ``L``; None when there are none.
        slots: ``[b*L] int64`` token slot of every key lane (lanes past a row's length: 0):
            for a token copy; a page plan builds them only for a cache it cannot read by pages
            (:meth:`token_slots`).
        raw: ``(pages [b, W] as the view holds them, live [b, L], arange)``, for those slots;
            None when ``slots`` was given whole (a tree's one-pass plan: :mod:`.tree`).
        pair: per K-to-V distance (token rows), :func:`gather_pair`'s index, its tail and the
            page size used: derived once per forward, not per layer.
        run: ``(first, stride, end)`` in token rows when the rows can be read in place (see the
            module docstring): row ``i``'s lanes are token rows ``first + i * stride ..``, and
            ``end`` is one past the last token row read; None otherwise.
    """

    pages: Tensor | None
    page: int
    span: int
    tail: Tensor | None
    slots: Tensor | None
    raw: tuple[Tensor, Tensor, Tensor] | None
    pair: dict[int, tuple[Tensor, Tensor | None, int]] = field(default_factory=dict)
    run: tuple[int, int, int] | None = None

    def token_slots(self) -> Tensor:
        """:attr:`slots`, built on first use: ``page * P + offset`` of every lane (int64),
        lanes at or past a row's length 0. Page ids are never range-checked: lanes outside a
        row's pages (poison included) are replaced by the ``where`` before any lookup."""
        if self.slots is None:
            if self.raw is None:
                raise LayoutError("a gather without slots needs the view's pages (raw)")
            pages, live, t = self.raw
            rows, lmax, p = live.shape[0], live.shape[1], self.page
            if p == 1:
                slots = pages[:, :lmax].to(torch.int64)
            else:  # one product, one broadcast add (int64)
                slots = ((pages * p)[:, :, None] + t[:p]).view(rows, -1)[:, :lmax]
            self.slots = torch.where(live, slots, 0).view(-1)
        return self.slots


def plan_gather(pages: Tensor, lens: Tensor, live: Tensor, t: Tensor, page: int, lmax: int
                ) -> Gather:
    """The :class:`Gather` of rows with ``pages [rows, W]`` (raw: columns past a row's length
    may hold anything) of ``page`` tokens, lengths ``lens [rows, 1]``, ``live [rows, L]`` (lanes
    below each length) and ``t``, an arange of at least ``W * page`` and ``L`` lanes.

    On a CPU the copy is by pages, unless whole pages would add more than ``L / 2`` lanes per
    row past ``L`` (short rows in big pages); the tail lanes are found on the host from the
    lengths (reading them is free on a CPU; a few host ints per row, no tensor op per lane)."""
    span = pages.shape[1] * page
    g = Gather(None, page, span, None, None, (pages, live, t))
    if pages.device.type != "cpu":
        g.token_slots()
        return g
    each = lens.view(-1).tolist()
    if each and min(each) == lmax:  # every lane is written: maybe one strided view
        g.run = _run_of(pages, page, lmax, t)
    if page == 1 or 2 * (span - lmax) > lmax:
        g.token_slots()
        return g
    g.pages = torch.where(t[:span:page] < lens, pages, 0).view(-1)
    tail: list[int] = []
    for i, n in enumerate(each):
        if n % page:  # lanes n .. the end of its page (below L) hold what the page held
            tail.extend(range(i * span + n, i * span + min(n - n % page + page, lmax)))
    if tail:
        g.tail = torch.tensor(tail, dtype=torch.int64, device=pages.device)
    return g


def _run_of(pages: Tensor, page: int, lmax: int, t: Tensor) -> tuple[int, int, int] | None:
    """``Gather.run`` of rows whose first ``ceil(L / page)`` page ids are ``pages [b, >= W]``
    (host memory), or None: each row's pages consecutive, row ``i``'s first page
    ``first + i * stride`` (``stride >= 0``: rows may share pages), no page id negative."""
    w = -(-lmax // page)
    ids = pages[:, :w].to(torch.int64)
    first = ids[:, :1]
    if int(first[0]) < 0 or not bool((ids == first + t[:w]).all()):
        return None
    steps = first[1:] - first[:-1]
    stride = int(steps[0]) if steps.numel() else 0
    if stride < 0 or (steps.numel() and not bool((steps == stride).all())):
        return None
    rows = ids.shape[0]
    start = int(first[0]) * page
    return start, stride * page, start + (rows - 1) * stride * page + lmax


def _in_place(pl: Lanes, cache: Tensor, dtype: torch.dtype, scale: Tensor | None
              ) -> Tensor | None:
    """``cache``'s key lanes as ``[b, H_kv, L, D]``, a strided view of the cache itself
    (``Gather.run``), or None when this cache cannot be read so: its token rows are not one run,
    it needs converting or dequantizing, or the rows reach past its end (ids out of range: the
    copy then raises the index error)."""
    run = pl.gather.run
    if (run is None or scale is not None or cache.dtype != dtype or cache.dim() != 4
            or not token_rows(cache) or run[2] > cache.shape[0] * cache.shape[1]):
        return None
    return read_in_place(pl.b, pl.lmax, run, cache)


def read_in_place(b: int, lmax: int, run: tuple[int, int, int], cache: Tensor) -> Tensor:
    """``[b, H_kv, L, D]``: the ``run``'s rows of ``cache`` (token rows one run, the run inside
    it: the caller checked both) as a strided view, nothing copied."""
    first, stride, _ = run
    tok = cache.stride(1)
    return cache.as_strided((b, cache.shape[2], lmax, cache.shape[3]),
                            (stride * tok, cache.stride(2), tok, cache.stride(3)),
                            cache.storage_offset() + first * tok)


def _lanes(pl: Lanes, x: Tensor, d: int, lead: tuple[int, ...], span: int, tail: Tensor | None,
           dtype: torch.dtype, scale: Tensor | None = None) -> Tensor:
    """A copy of ``span`` lanes per row (its own memory: zeroed in place) as
    ``[*lead, H_kv, L, D]`` in ``dtype``, the ``tail`` lanes zeroed after the conversion (so it
    holds for every cache dtype); ``d``: the head size. As few ops as the case needs: a decode
    layer is a handful of them around SDPA."""
    hk = pl.num_kv_heads
    if scale is not None or tail is not None:
        x = x.view(-1, hk, d)
        if scale is not None:
            x = dequantize(x, scale, dtype)
        elif x.dtype != dtype:
            x = x.to(dtype)
        if tail is not None:
            x.index_fill_(0, tail, 0)
    elif x.dtype != dtype:
        x = x.to(dtype)
    x = x.view(*lead, span, hk, d)
    if span != pl.lmax:
        x = x.narrow(-3, 0, pl.lmax)
    return x.transpose(-3, -2)


def gather_kv(pl: Lanes, cache: Tensor, dtype: torch.dtype, scale: Tensor | None = None
              ) -> Tensor:
    """``cache [num_pages, P, H_kv, D]``'s key lanes as ``[b, H_kv, L, D]`` (a transposed view
    of one ``index_select`` copy: contiguous rows, much cheaper than advanced indexing).

    ``scale`` (an fp8 cache's ``[1]`` or ``[H_kv]`` float32 scale): only the gathered lanes are
    dequantized (``stored * scale`` in float32, then ``dtype``), never the whole cache."""
    g, hk, d = pl.gather, pl.num_kv_heads, cache.shape[-1]
    if g.run is not None and (lanes := _in_place(pl, cache, dtype, scale)) is not None:
        return lanes
    if g.pages is not None and not (cache.shape[0] * cache.shape[1]) % g.page:
        if cache.is_contiguous():
            x = cache.view(-1, g.page * hk * d).index_select(0, g.pages)
            return _lanes(pl, x, d, (pl.b,), g.span, g.tail, dtype, scale)
        if cache.shape[1] == g.page:  # pages of an engine's own strided layout: copied whole
            x = cache.index_select(0, g.pages).view(-1, g.page * hk * d)
            return _lanes(pl, x, d, (pl.b,), g.span, g.tail, dtype, scale)
    slots = g.token_slots()
    if token_rows(cache):
        x = cache.reshape(-1, hk, d).index_select(0, slots)
    else:  # an engine's layout whose token rows are not one run (vLLM's CPU cache): the
        # lanes are gathered where they lie; a reshape would copy the whole cache per layer
        p = cache.shape[1]
        x = cache[torch.div(slots, p, rounding_mode="floor"), slots % p]
    return _lanes(pl, x, d, (pl.b,), pl.lmax, None, dtype, scale)


def token_rows(cache: Tensor) -> bool:
    """Whether ``cache [num_pages, P, H_kv, D]``'s token rows are one run, so that it views as
    ``[num_pages * P, H_kv, D]`` without a copy (pages back to back, whatever the inner
    strides). An engine may hand the adapters a strided view of its own layout instead: vLLM's
    CPU cache keeps each page head-major with K and V halves, read as NHD-shaped views."""
    return cache.shape[0] <= 1 or cache.stride(0) == cache.shape[1] * cache.stride(1)


def gather_pair(pl: Lanes, k_cache: Tensor, v_cache: Tensor, dtype: torch.dtype,
                k_scale: Tensor | None = None, v_scale: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """``(k, v)`` as :func:`gather_kv` gives them, with one ``index_select`` for both when the
    two caches are one strided run of token rows (a :class:`attnpool.KVCachePool` layer: its V
    pages follow its K pages in the same allocation, rows of the same size): the index and the
    index shifted by the K-to-V distance. When ``v_cache`` is ``k_cache``'s first columns (an MLA
    latent cache: the values are the keys' latent part), K is copied once and V is a view of that
    copy. Anything else (fp8 scales, K and V of different head
    sizes or dtypes, separate tensors) takes two copies."""
    if _is_prefix(k_cache, v_cache) and _same_scale(k_scale, v_scale):
        # V is K's first Dv columns (an MLA latent row: values = the latent part of the key):
        # one copy of K serves both, V is a view of it
        k = gather_kv(pl, k_cache, dtype, k_scale)
        return k, k[..., : v_cache.shape[-1]]
    if pl.gather.run is not None:
        kl, vl = _in_place(pl, k_cache, dtype, k_scale), _in_place(pl, v_cache, dtype, v_scale)
        if kl is not None and vl is not None:
            return kl, vl
    dist = None if k_scale is not None or v_scale is not None else _kv_gap(k_cache, v_cache)
    if dist is None:
        return gather_kv(pl, k_cache, dtype, k_scale), gather_kv(pl, v_cache, dtype, v_scale)
    g, tokens = pl.gather, k_cache.shape[0] * k_cache.shape[1]
    memo = g.pair.get(dist)
    if memo is None:
        memo = g.pair[dist] = _pair_index(pl, dist, dist + tokens)
    idx, tail, page = memo
    hk, d = k_cache.shape[2], k_cache.shape[3]
    # K's first row to V's last as rows of `page` tokens (the rows between are never read)
    src = k_cache.as_strided(((dist + tokens) // page, page * hk * d), (page * hk * d, 1))
    span = g.span if page > 1 else pl.lmax
    k, v = _lanes(pl, src.index_select(0, idx), d, (2, pl.b), span, tail, dtype).unbind(0)
    return k, v


def _is_prefix(k: Tensor, v: Tensor) -> bool:
    """Whether ``v`` is ``k[..., :Dv]``: the same first element, dtype, strides and leading
    dims, fewer columns (a :meth:`attnpool.KVCachePool.kv_cache` row's latent part)."""
    return (v.dim() == 4 and k.dim() == 4 and v.data_ptr() == k.data_ptr()
            and v.dtype == k.dtype and v.device == k.device and v.shape[:3] == k.shape[:3]
            and v.shape[3] < k.shape[3] and v.stride() == k.stride())


def _same_scale(a: Tensor | None, b: Tensor | None) -> bool:
    """Both None, or one scale (the same memory and shape): K and V dequantize alike."""
    if a is None or b is None:
        return a is None and b is None
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def _pair_index(pl: Lanes, dist: int, rows: int) -> tuple[Tensor, Tensor | None, int]:
    """``(index, tail, page)`` of one copy of K's then V's lanes, ``dist`` token rows apart in
    a run of ``rows`` token rows."""
    g = pl.gather
    if g.pages is not None and not (dist % g.page or rows % g.page):
        tail = None if g.tail is None else torch.cat((g.tail, g.tail + pl.b * g.span))
        return torch.cat((g.pages, g.pages + dist // g.page)), tail, g.page
    slots = g.token_slots()
    return torch.cat((slots, slots + dist)), None, 1


def _kv_gap(k: Tensor, v: Tensor) -> int | None:
    """The token rows from ``k``'s first row to ``v``'s, when ``k`` and ``v`` are contiguous
    ``[pages, P, H_kv, D]`` of one dtype and shape in one storage with ``v`` after ``k`` (one
    run of equal rows, whatever lies between); else None."""
    if (k.dtype != v.dtype or k.shape != v.shape or not k.is_contiguous()
            or not v.is_contiguous() or k.device != v.device):
        return None
    row = k.shape[2] * k.shape[3] * k.element_size()
    gap = v.data_ptr() - k.data_ptr()
    if row == 0 or gap <= 0 or gap % row \
            or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None
    return gap // row


def cache_as_pages(cache: Tensor, page_size: int) -> Tensor:
    """``cache [num_pages, P, H_kv, D]`` seen as pages of ``page_size`` tokens, never copied.

    Token slot ``s`` is page ``s // P``, offset ``s % P`` in both views. Tree expand parts address
    raw token slots (``page_size = 1``), so paged kernels read the cache as
    ``[num_pages * P, 1, H_kv, D]``. A copy would be wrong, not just slow: the engine writes new
    KV into the original memory and a CUDA graph bakes its address.

    Raises:
        LayoutError: the first two dims cannot be regrouped by ``page_size`` as a view.
    """
    if cache.dim() != 4:
        raise InputError(f"KV cache must be [num_pages, page_size, H_kv, D], got "
                         f"{tuple(cache.shape)}")
    if cache.shape[1] == page_size:
        return cache
    tokens = cache.shape[0] * cache.shape[1]
    if page_size < 1 or tokens % page_size or not token_rows(cache):
        raise LayoutError(
            f"cannot view a KV cache of shape {tuple(cache.shape)} (strides {cache.stride()}) as "
            f"pages of {page_size} tokens: expected a token count divisible by {page_size} "
            f"(got {tokens}) and page rows laid out back to back"
        )
    return cache.view(tokens // page_size, page_size, cache.shape[2], cache.shape[3])
