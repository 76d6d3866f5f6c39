"""The layer-independent half of an SDPA pass: where each row's keys and queries are.

A forward runs the same view through every attention layer, and everything the SDPA adapter
derives from the view (each row's token slots, the key mask, where each query lane comes from and
goes back to) is the same for all of them. :class:`Plan` holds it, computed once per forward
(:func:`attnpool.adapters.sdpa.plan`), so a layer only gathers its K/V, runs SDPA and scatters:
what FlashInfer's ``plan``/``run`` split does for its kernels.

Grouped-query attention without copies of K/V: the ``g = H / H_kv`` query heads sharing a KV head
become ``g`` query rows of that head (``[b, H_kv, Qmax*g, D]``, row order (query, head in group)),
so one batched product per KV head serves them all; only the (small) queries and mask are
regrouped, never the keys. A decode view (one query per row at position ``i``) needs neither a
query gather nor a scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...config import Layout, ceil_div
from ...errors import InputError, LayoutError
from ...views import DecodeView, PagedView
from .gather import Gather, plan_gather


@dataclass(frozen=True, slots=True)
class Plan:
    """Where one pass reads: shapes are per the view's host bounds (``L = max_seqlen_k``).

    Attributes:
        b: rows computed (a decode view: only those ``q`` has; else the view's ``bs``).
        qmax: query lanes per row. lmax: key lanes per row (``L``).
        total: packed query rows of ``q`` (``q.shape[0]``).
        num_heads, num_kv_heads: ``H`` and ``H_kv`` the plan was grouped for.
        gather: where every key lane is in the cache (:class:`~attnpool.adapters.sdpa.gather.
            Gather`); lanes past a row's length read zeros or slot 0 (valid memory; masked out).
        keys: ``[b, Qmax] int64`` keys each query lane may see (0: none).
        allowed: ``[b, 1, Qmax*g or 1, L]`` key lanes each grouped query row reads: bool, or
            (when the plan was built for a dtype) the additive mask SDPA would otherwise build
            from the bool one in every layer (0 where allowed, ``-inf`` elsewhere). None for a
            prefix-free causal plan: SDPA's own causal mask is exact there (see :func:`build`).
        keyed: ``[b*Qmax, 1, 1] bool`` whether a lane has a key (outputs of the others are
            zeroed), or None when no lane can lack one or the plan does not clamp (the
            log-sum-exp path handles empty rows itself). A decode row read through its page
            table always has one: ``cache_seqlens >= 1`` for real rows (seq_lens >= 1) and
            padded rows (``pad_seq_len >= 1``) alike.
        q_idx: ``[b*Qmax] int64`` packed query row of each lane, or None (decode: lane i is
            query i).
        dst: ``[b*Qmax] int64`` packed row each lane's output goes to (``total``: discarded),
            or None (decode).
    """

    b: int
    qmax: int
    lmax: int
    total: int
    num_heads: int
    num_kv_heads: int
    gather: Gather
    keys: Tensor
    allowed: Tensor | None
    keyed: Tensor | None
    q_idx: Tensor | None
    dst: Tensor | None


def row_slots(view: PagedView, layout: Layout, rows: int, lmax: int
              ) -> tuple[Tensor, Tensor, Tensor, Gather]:
    """``(kv_lens [rows], live [rows, lmax] bool, arange [>= lmax], gather)`` of the view's
    first ``rows`` rows: ``live`` marks the lanes below each row's length (the key mask of a
    one-query row), the arange is returned for reuse, ``gather`` says where a layer copies the
    key lanes from (:func:`~attnpool.adapters.sdpa.gather.plan_gather`: token slots, and pages).

    Slots at or past a row's length are 0 (a valid index; those lanes are masked out of
    attention). Page ids are never range-checked or clamped: lanes outside a row's pages (which
    may hold anything, poison included) are replaced by the final ``where`` before any lookup.
    """
    p, dev = view.page_size, view.cache_seqlens.device
    width = max(1, ceil_div(lmax, p))
    if layout is Layout.FLASH_ATTN:
        assert view.page_table is not None  # guaranteed by pick_layout
        lens = view.cache_seqlens[:rows]
        pages = view.page_table[:rows, :width]
        if pages.shape[1] < width:
            raise LayoutError(f"page_table has {pages.shape[1]} columns, max_seqlen_k="
                              f"{view.max_seqlen_k} needs {width} pages of {p}")
    else:
        assert view.kv_indptr is not None and view.kv_indices is not None
        assert view.kv_last_page_len is not None
        indptr = view.kv_indptr[: rows + 1].to(torch.int64)
        npages = indptr[1:] - indptr[:-1]
        last = view.kv_last_page_len[:rows].to(torch.int64)
        lens = torch.where(npages > 0, (npages - 1) * p + last, 0)
        col = torch.arange(width, device=dev)
        live = col[None, :] < npages[:, None]
        idx = torch.where(live, indptr[:-1, None] + col[None, :], 0)
        idx = idx.clamp_(max=view.kv_indices.shape[0] - 1)
        pages = view.kv_indices.to(torch.int64)[idx]
    t = torch.arange(max(lmax, width * p), device=dev)
    col_lens = lens[:, None]
    live = t[:lmax] < col_lens
    return lens, live, t, plan_gather(pages, col_lens, live, t, p, lmax)


def build(view: PagedView, layout: Layout, total: int, num_heads: int, num_kv_heads: int,
          clamp: bool, dtype: torch.dtype | None = None, prefix_free: bool = False) -> Plan:
    """The plan of ``view`` for ``total`` packed query rows of ``num_heads`` heads.

    ``clamp``: give a query with no key one masked-in lane (key 0, a valid slot) so a softmax
    never divides 0 by 0, and record ``keyed`` so the caller zeroes those queries' output.
    ``dtype``: build ``allowed`` as an additive mask of that dtype (else bool).
    ``prefix_free``: the caller promises every real row's queries start at position 0 (a
    causal prefill with nothing cached: ``cache_seqlens == query count``). Query lane ``j`` of a
    row then sees exactly keys ``0 .. j``, SDPA's own (top-left) causal mask: no mask is built,
    and lanes past a row's length only feed query lanes that are discarded. A sliding-window
    view (``window_left >= 0``) ignores it: SDPA has no window argument, so the explicit mask
    (keys ``p - window_left .. p`` of a query at position ``p``) is built either way.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise InputError(f"query heads must be a multiple of KV heads ({num_kv_heads}), got "
                         f"{num_heads}")
    g, dev = num_heads // num_kv_heads, view.cache_seqlens.device
    lmax = max(1, view.max_seqlen_k)
    decode = isinstance(view, DecodeView)
    if prefix_free and (decode or not view.causal):
        raise InputError(f"prefix_free needs a causal multi-query view, got a "
                         f"{type(view).__name__} (causal={view.causal})")
    wl = view.window_left
    if wl >= 0 and not view.causal:
        raise LayoutError(f"a sliding window (window_left={wl}) needs a causal view, got a "
                          f"non-causal {type(view).__name__}")
    prefix_free = prefix_free and wl < 0  # SDPA's causal mask has no window: build the mask
    b = min(view.bs, total) if decode else view.bs
    qmax = 1 if decode else max(1, view.max_seqlen_q)
    lens, live, t, gat = row_slots(view, layout, b, lmax)
    q_idx = dst = None
    # A decode row read through its page table has a key: no clamp, and its key mask is `live`.
    always = decode and layout is Layout.FLASH_ATTN
    if decode:
        keys = lens[:, None]
    else:
        cu = view.cu_seqlens_q[: b + 1].to(torch.int64)
        q_lens = cu[1:] - cu[:-1]
        j = torch.arange(qmax, device=dev)
        pos = cu[:-1, None] + j  # [b, Qmax] packed query positions
        q_ok = (j < q_lens[:, None]) & (pos < total)
        dst = torch.where(q_ok, pos, total).view(-1)
        q_idx = pos.clamp(max=max(total - 1, 0)).view(-1)
        if view.causal:  # query j of a row with q_len queries sits at position len - q_len + j
            keys = (lens - q_lens)[:, None] + (j + 1)
            keys = torch.minimum(keys.clamp_(min=0), lens[:, None])
        else:
            keys = lens[:, None].expand(b, qmax)
    if prefix_free:
        return Plan(b, qmax, lmax, total, num_heads, num_kv_heads, gat, keys, None, None,
                    q_idx, dst)
    if always:
        allowed = live[:, None]  # [b, 1, L]
    else:
        seen = keys.clamp(min=1) if clamp else keys
        allowed = t[:lmax] < seen[:, :, None]  # [b, Qmax, L]
    if wl >= 0:  # a query at key position p = keys - 1 sees p - wl .. p (W keys, itself included)
        allowed = allowed & (t[:lmax] >= (keys - 1 - wl)[:, :, None])
    if qmax > 1 and g > 1:  # grouped row order is (query, head in group)
        allowed = allowed[:, :, None].expand(b, qmax, g, lmax).reshape(b, 1, qmax * g, lmax)
    else:  # one query per row broadcasts over the group's rows
        allowed = allowed[:, None]
    if dtype is not None:
        allowed = torch.full(allowed.shape, float("-inf"), dtype=dtype,
                             device=dev).masked_fill_(allowed, 0.0)
    keyed = (keys > 0).view(-1, 1, 1) if clamp and not always else None
    return Plan(b, qmax, lmax, total, num_heads, num_kv_heads, gat, keys, allowed, keyed,
                q_idx, dst)


def group_q(pl: Plan, q: Tensor) -> Tensor:
    """Packed ``q [total, H, D]`` as ``[b, H_kv, Qmax*g, D]`` (a view for decode rows)."""
    b, hk, d = pl.b, pl.num_kv_heads, q.shape[2]
    if pl.q_idx is None:
        if q.shape[0] == b and q.is_contiguous():  # one query per row: already grouped
            return q.view(b, hk, -1, d)
        qp = q[:b].reshape(b, 1, hk, -1, d)
    elif pl.total:
        qp = q.index_select(0, pl.q_idx).view(b, pl.qmax, hk, -1, d)
    else:
        qp = q.new_zeros(b, pl.qmax, hk, pl.num_heads // hk, d)
    return qp.permute(0, 2, 1, 3, 4).reshape(b, hk, -1, d)


def packed_heads_q(pl: Plan, q: Tensor) -> Tensor:
    """Packed ``q [total, H, D]`` as ``[b, H, Qmax, D]`` (heads not grouped: prefix-free
    causal plans, whose query lanes must keep their positions)."""
    b, d = pl.b, q.shape[2]
    assert pl.q_idx is not None  # prefix-free plans are never decode plans
    if not pl.total:
        return q.new_zeros(b, pl.num_heads, pl.qmax, d)
    return q.index_select(0, pl.q_idx).view(b, pl.qmax, pl.num_heads, d).transpose(1, 2)


def ungroup(x: Tensor, pl: Plan) -> Tensor:
    """``[b, H_kv, Qmax*g, ...]`` back to ``[b*Qmax, H, ...]`` (packed-lane order)."""
    b, h_kv, rest = x.shape[0], x.shape[1], x.shape[3:]
    if pl.qmax == 1 and x.is_contiguous():  # one query per row: heads are already in order
        return x.view(b, -1, *rest)
    x = x.view(b, h_kv, pl.qmax, -1, *rest).transpose(1, 2)
    return x.reshape(b * pl.qmax, -1, *rest)


def scatter(x: Tensor, pl: Plan, fill: float) -> Tensor:
    """Lanes ``[b*Qmax, ...]`` to packed query rows ``[total, ...]``; uncovered rows ``fill``."""
    if pl.dst is None:  # decode: lane i is query i
        if pl.b == pl.total:
            return x
        out = x.new_full((pl.total, *x.shape[1:]), fill)
        out[: pl.b] = x
        return out
    out = x.new_full((pl.total + 1, *x.shape[1:]), fill)  # the extra row takes discarded lanes
    out.index_copy_(0, pl.dst, x)
    return out[: pl.total]
