"""Paged attention over any :class:`attnpool.PagedView` with PyTorch SDPA (CPU and CUDA).

This is the library's CPU backend and the oracle the kernel adapters are checked against, so it
favours being obviously right over being fast, while staying vectorised:

* **One padded batched gather, no loop over rows.** Each row's keys are gathered into a
  ``[bs, Lmax, H_kv, D]`` block (``Lmax = view.max_seqlen_k``) and its queries into
  ``[bs, Qmax, H, D]`` (``Qmax = view.max_seqlen_q``); a boolean mask hides the lanes past a row's
  length (and, when ``view.causal``, keys after each query, aligned to the end of the KV row as in
  flash-attn and FlashInfer). The extents are the view's host ints, so nothing is read back from
  the device: the adapter issues no host sync. Views refilled with
  ``seq_lens_cpu`` carry tight bounds; capture views carry ``max_context_len`` (correct, bigger).
* **Both layouts, read as a kernel reads them.** ``FLASH_ATTN``: a row's length is
  ``cache_seqlens[i]`` and its pages ``page_table[i, :ceil(len / page_size)]``. ``FLASHINFER``: its
  pages are ``kv_indices[kv_indptr[i] : kv_indptr[i+1]]`` and its length
  ``(pages - 1) * page_size + kv_last_page_len[i]`` (0 for a row that owns no pages, as padded
  rows do). Lanes outside a row's pages are masked *before* they are used as indices, so whatever
  the arena holds there (poison included) is never dereferenced.
* **Any page size.** Token slot = ``page * view.page_size + offset`` into the cache flattened to
  ``[tokens, H_kv, D]``: expand parts (``page_size = 1``, ids are raw slots) and page-level parts
  read the same cache.
* **Log-sum-exp.** SDPA's public API does not return it, so it is computed from the same masked
  scores in float32; two passes over disjoint keys merge exactly with :func:`merge_by_lse`.

Padding: the adapter computes every row of the view, padded ones included (as a captured kernel
does), and returns an output shaped like ``q``. The caller keeps the real rows' queries
``[:cu_seqlens_q[n]]`` and discards the rest. Query positions at or past ``q.shape[0]`` are
skipped, so ``q`` may be the whole padded query buffer or just the real rows' queries. A row with
no keys (a FlashInfer padded row, an empty tree prefix) yields output 0 and log-sum-exp ``-inf``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import Layout
from ..errors import InputError, LayoutError
from ..views import DecodeView, DraftStepView, PagedView, VerifyView


class Attn(NamedTuple):
    """Attention result: ``out [total_q, H, D]`` (q's dtype), ``lse [total_q, H]`` float32."""

    out: Tensor
    lse: Tensor


def check_qkv(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int]:
    """Validate packed queries and a paged cache; return ``(H, H_kv, D)``.

    ``q [total_q, H, D]``, ``k_cache [num_pages, P, H_kv, D]``, ``v_cache [num_pages, P, H_kv, Dv]``
    on one device, floating point, ``H % H_kv == 0`` (grouped-query attention: query head ``h``
    reads KV head ``h // (H // H_kv)``, the flash-attn / FlashInfer convention).
    """
    for name, t, nd in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if not isinstance(t, Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != nd:
            raise InputError(f"{name} must have {nd} dims, got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise InputError(f"{name} must be floating point, got {t.dtype}")
        if t.device != q.device:
            raise InputError(f"{name} must be on {q.device} like q, got {t.device}")
    h, d = q.shape[1], q.shape[2]
    h_kv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise InputError(f"k_cache head dim must equal q's ({d}), got {k_cache.shape[3]}")
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise InputError(f"v_cache must match k_cache {tuple(k_cache.shape[:3])} in its first "
                         f"three dims, got {tuple(v_cache.shape[:3])}")
    if h_kv < 1 or h % h_kv:
        raise InputError(f"query heads must be a multiple of KV heads ({h_kv}), got {h}")
    return h, h_kv, d


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
    mergeable = cache.shape[0] <= 1 or cache.stride(0) == cache.shape[1] * cache.stride(1)
    if page_size < 1 or tokens % page_size or not mergeable:
        raise LayoutError(
            f"cannot view a KV cache of shape {tuple(cache.shape)} (strides {cache.stride()}) as "
            f"pages of {page_size} tokens: expected a token count divisible by {page_size} "
            f"(got {tokens}) and page rows laid out back to back"
        )
    return cache.view(tokens // page_size, page_size, cache.shape[2], cache.shape[3])


def pick_layout(view: PagedView, layout: Layout | None) -> Layout:
    """The layout to read: ``layout`` if given (its fields must exist), else FLASH_ATTN when the
    view has a page table, else FLASHINFER."""
    has_fa = view.page_table is not None
    has_fi = view.kv_indptr is not None and view.kv_indices is not None \
        and view.kv_last_page_len is not None
    if layout is None:
        if not (has_fa or has_fi):
            raise LayoutError("view has neither a page_table nor FlashInfer CSR fields")
        return Layout.FLASH_ATTN if has_fa else Layout.FLASHINFER
    if layout not in (Layout.FLASH_ATTN, Layout.FLASHINFER):
        raise InputError(f"layout must be Layout.FLASH_ATTN or Layout.FLASHINFER, got {layout}")
    if (layout is Layout.FLASH_ATTN and not has_fa) or (layout is Layout.FLASHINFER and not has_fi):
        present = [n for n, ok in (("FLASH_ATTN", has_fa), ("FLASHINFER", has_fi)) if ok]
        raise LayoutError(f"view has no {layout} fields; expected one of {present}")
    return layout


def _rows(view: PagedView, layout: Layout, rows: int, lmax: int) -> tuple[Tensor, Tensor]:
    """``(kv_lens [rows] i64, slots [rows, lmax] i64)`` of the view's first ``rows`` rows.

    Slots at or past a row's length are 0 (a valid index; those lanes are masked out of
    attention). Page ids are never range-checked or clamped: lanes outside a row's pages (which
    may hold anything, poison included) are replaced by the final ``where`` before any lookup.
    """
    p, dev = view.page_size, view.cache_seqlens.device
    width = max(1, -(-lmax // p))
    if layout is Layout.FLASH_ATTN:
        assert view.page_table is not None  # guaranteed by pick_layout
        lens = view.cache_seqlens[:rows].to(torch.int64)
        table = view.page_table[:rows, :width]
        if table.shape[1] < width:
            raise LayoutError(f"page_table has {table.shape[1]} columns, max_seqlen_k="
                              f"{view.max_seqlen_k} needs {width} pages of {p}")
        pages = table
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
    t = torch.arange(max(lmax, p), device=dev)
    if p == 1:
        slots = pages[:, :lmax]
    else:  # page * p + offset for every token lane: one product, one broadcast add (int64)
        slots = ((pages * p)[:, :, None] + t[:p]).view(rows, width * p)[:, :lmax]
    return lens, torch.where(t[:lmax] < lens[:, None], slots, 0)


class _Batch(NamedTuple):
    """Padded, head-grouped operands of one pass (see :func:`_prepare`)."""

    q: Tensor  # [b, H_kv, Qmax*g, D]: query (j, head-in-group) pairs of each KV head, grouped
    k: Tensor  # [b, H_kv, L, D] (a permuted view of the gathered keys: no copy per head)
    v: Tensor  # [b, H_kv, L, Dv]
    keys: Tensor  # [b, Qmax] i64: keys each query may see (0: none)
    allowed: Tensor  # [b, 1, Qmax*g or 1, L] bool: key lanes each grouped query reads
    dst: Tensor | None  # [b*Qmax] packed position of each lane (``total`` = discard); None: row i
    #                     is query i (one query per row, the first b rows of q)
    b: int
    qmax: int
    total: int


def _prepare(view: PagedView, q: Tensor, k_cache: Tensor, v_cache: Tensor,
             layout: Layout | None, clamp: bool, k_scale: Tensor | None = None,
             v_scale: Tensor | None = None) -> _Batch:
    """Gather one pass: keys and values of every row, queries grouped per KV head.

    Grouped-query attention without copies of K/V: the ``g = H / H_kv`` query heads that share a
    KV head become ``g`` extra query rows of that head (``[b, H_kv, Qmax*g, D]``), so one batched
    product per KV head serves them all. Only the (small) queries and mask are regrouped.

    ``clamp``: give a query with no key one masked-in lane (key 0, a valid slot) so a softmax
    never divides 0 by 0; the caller zeroes those queries' output (``keys == 0``).
    """
    if not isinstance(view, PagedView):
        raise InputError(f"paged_attention expects a PagedView, got {type(view).__name__}")
    h, h_kv, d = check_qkv(q, k_cache, v_cache)
    if view.cache_seqlens.device != q.device:
        raise InputError(f"view is on {view.cache_seqlens.device}, q on {q.device}")
    lay = pick_layout(view, layout)
    g, total, dev, dv = h // h_kv, q.shape[0], q.device, v_cache.shape[3]
    lmax = max(1, view.max_seqlen_k)
    # A decode view has one query per row at position i (cu_seqlens_q = arange): no query
    # gather or scatter, and only the rows q has are computed.
    decode = isinstance(view, DecodeView)
    b = min(view.bs, total) if decode else view.bs
    qmax = 1 if decode else max(1, view.max_seqlen_q)
    lens, slots = _rows(view, lay, b, lmax)
    k = k_cache.reshape(-1, h_kv, d)[slots]  # [b, L, H_kv, D]
    v = v_cache.reshape(-1, h_kv, dv)[slots]
    if k_scale is not None or v_scale is not None:  # an fp8 cache: stored * scale
        k, v = _dequantize(k_cache.dtype, h_kv, k, v, k_scale, v_scale)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    t = torch.arange(lmax, device=dev)
    dst: Tensor | None = None
    if decode:
        qp = q[:b].reshape(b, 1, h_kv, g, d)
        keys = lens[:, None]
    else:
        cu = view.cu_seqlens_q[: b + 1].to(torch.int64)
        q_lens = cu[1:] - cu[:-1]
        j = torch.arange(qmax, device=dev)
        pos = cu[:-1, None] + j  # [b, Qmax] packed query positions
        q_ok = (j < q_lens[:, None]) & (pos < total)
        dst = torch.where(q_ok, pos, total).view(-1)
        qp = q[pos.clamp(max=max(total - 1, 0))] if total else q.new_zeros(b, qmax, h, d)
        qp = qp.view(b, qmax, h_kv, g, d)
        if view.causal:  # query j of a row with q_len queries sits at position len - q_len + j
            keys = (lens - q_lens)[:, None] + (j + 1)
            keys = torch.minimum(keys.clamp_(min=0), lens[:, None])
        else:
            keys = lens[:, None].expand(b, qmax)
    seen = keys.clamp(min=1) if clamp else keys
    allowed = t < seen[:, :, None]  # [b, Qmax, L]
    if qmax > 1 and g > 1:  # grouped row order is (j, head in group)
        allowed = allowed[:, :, None].expand(b, qmax, g, lmax).reshape(b, 1, qmax * g, lmax)
    else:  # one query per row broadcasts over the group's rows
        allowed = allowed[:, None]
    qg = qp.permute(0, 2, 1, 3, 4).reshape(b, h_kv, qmax * g, d)
    return _Batch(qg, k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), keys, allowed, dst, b, qmax,
                  total)


def _ungroup(x: Tensor, bt: _Batch) -> Tensor:
    """``[b, H_kv, Qmax*g, ...]`` back to ``[b*Qmax, H, ...]`` (packed-lane order)."""
    b, h_kv, rest = x.shape[0], x.shape[1], x.shape[3:]
    x = x.view(b, h_kv, bt.qmax, -1, *rest).transpose(1, 2)
    return x.reshape(b * bt.qmax, -1, *rest)


def _scatter(x: Tensor, bt: _Batch, fill: float) -> Tensor:
    """Lanes ``[b*Qmax, ...]`` to packed query positions ``[total, ...]``; uncovered ones
    ``fill``."""
    if bt.dst is None:  # decode: lane i is query i
        if bt.b == bt.total:
            return x
        out = x.new_full((bt.total, *x.shape[1:]), fill)
        out[: bt.b] = x
        return out
    out = x.new_full((bt.total + 1, *x.shape[1:]), fill)  # the extra row takes discarded lanes
    out.index_copy_(0, bt.dst, x)
    return out[: bt.total]


def paged_attention(
    view: PagedView,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    softmax_scale: float | None = None,
    layout: Layout | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Attn:
    """Attention of the packed queries ``q`` over the KV rows of ``view`` (one pass), with its
    log-sum-exp (for a merge; :func:`paged_attention_out` skips it).

    Args:
        view: any :class:`attnpool.PagedView` (decode, a verify/draft prefix or expand part,
            draft extend, encoder cross or decoder part, local).
        q: ``[total_q, H, D]``; row ``i``'s queries are ``q[cu_seqlens_q[i] : cu_seqlens_q[i+1]]``.
        k_cache, v_cache: ``[num_pages, P, H_kv, D]`` (any ``P``: ids are read in units of
            ``view.page_size``).
        softmax_scale: default ``1 / sqrt(D)``.
        layout: which of the view's layouts to read (default: the page table when present).
        k_scale, v_scale: for an fp8 cache, float32 ``[1]`` or ``[H_kv]`` scales: the gathered rows
            are dequantized (``stored * scale``, :func:`attnpool.kv_quant.dequantize`) first.

    Returns:
        :class:`Attn` ``(out [q.shape[0], H, D], lse [q.shape[0], H])``. Every row of the view is
        computed, padded rows included; positions no row covers hold 0 and ``-inf``.
    """
    bt = _prepare(view, q, k_cache, v_cache, layout, clamp=False, k_scale=k_scale,
                  v_scale=v_scale)
    scale = 1.0 / math.sqrt(q.shape[2]) if softmax_scale is None else float(softmax_scale)
    # float32 at least (float64 stays float64): the log-sum-exp must not be computed in half.
    ct = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(bt.q.to(ct), bt.k.to(ct).transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~bt.allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    # A query with no key has lse = -inf: exp(-inf - 0) = 0 weights, so its output is 0.
    probs = scores.sub_(torch.where(torch.isneginf(lse), 0.0, lse)).exp_()
    o = torch.matmul(probs, bt.v.to(ct)).to(q.dtype)
    out = _scatter(_ungroup(o, bt), bt, 0.0)
    return Attn(out, _scatter(_ungroup(lse, bt)[..., 0].float(), bt, float("-inf")))


def paged_attention_out(
    view: PagedView,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    softmax_scale: float | None = None,
    layout: Layout | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """:func:`paged_attention`'s output alone, through PyTorch SDPA (no log-sum-exp): what a
    single-pass forward needs (decode, chain verify and draft steps, extend)."""
    bt = _prepare(view, q, k_cache, v_cache, layout, clamp=True, k_scale=k_scale, v_scale=v_scale)
    o = F.scaled_dot_product_attention(bt.q, bt.k, bt.v, attn_mask=bt.allowed,
                                       scale=softmax_scale)
    o = _ungroup(o, bt)
    o = torch.where((bt.keys > 0).view(-1, 1, 1), o, 0)  # queries with no key: 0, not key 0
    return _scatter(o, bt, 0.0)


def _dequantize(dtype: torch.dtype, h_kv: int, kp: Tensor, vp: Tensor, k_scale: object,
                v_scale: object) -> tuple[Tensor, Tensor]:
    from ..kv_quant import check_scales, dequantize

    sc = check_scales(dtype, h_kv, kp.device, (("k_scale", k_scale), ("v_scale", v_scale)), False)
    if sc is None:
        return kp, vp
    return dequantize(kp, sc[0]), dequantize(vp, sc[1])


def merge_by_lse(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Attn:
    """Combine two attention passes over disjoint key sets of the same queries.

    With ``lse = log(exp(lse1) + exp(lse2))`` the result is
    ``o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse)``, exactly softmax attention over the union of the
    keys. A pass with no keys contributes nothing; if both are empty the output is 0 with
    ``lse = -inf``. An empty row's log-sum-exp is ``-inf`` here and in FlashInfer, but flash-attn
    (FA2 and FA3, unsplit) reports ``+inf`` for it: ``+inf`` is read as "no keys" too, so a tree
    pass whose expand or prefix part has an empty row merges to the other part, not to NaN.

    Args:
        o1, o2: ``[T, H, D]`` outputs. lse1, lse2: ``[T, H]`` natural-log log-sum-exp.
    """
    if o1.shape != o2.shape or lse1.shape != lse2.shape or tuple(o1.shape[:2]) != tuple(lse1.shape):
        raise InputError(f"merge_by_lse needs o [T, H, D] and lse [T, H] of equal shapes, got "
                         f"{tuple(o1.shape)}, {tuple(lse1.shape)}, {tuple(o2.shape)}, "
                         f"{tuple(lse2.shape)}")
    neg_inf = float("-inf")
    a = torch.where(torch.isposinf(lse1), neg_inf, lse1.float())
    b = torch.where(torch.isposinf(lse2), neg_inf, lse2.float())
    lse = torch.logaddexp(a, b)
    ref = torch.where(torch.isneginf(lse), 0.0, lse)  # keeps exp() finite when both are empty
    w1 = torch.exp(a - ref)[..., None]
    w2 = torch.exp(b - ref)[..., None]
    out = (o1.float() * w1 + o2.float() * w2).to(o1.dtype)
    return Attn(out, lse)


def attention(
    view: object,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    softmax_scale: float | None = None,
    layout: Layout | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Attn:
    """Attention for a whole phase part: a :class:`PagedView`, or a two-pass
    :class:`attnpool.VerifyView` / :class:`attnpool.DraftStepView` (prefix, plus the expand pass
    merged by log-sum-exp when the tree has one).

    Tree prefix and expand passes see the same packed queries (request ``i``'s ``N`` or ``K``
    queries at ``i*N ..``): the prefix pass groups them per request, the expand pass has one row
    per query. Views with parts that are separate attentions (an encoder view's cross and decoder
    parts, a draft round's steps) are called part by part. ``k_scale`` / ``v_scale``: an fp8
    cache's scales (see :func:`paged_attention`).
    """
    sc = {"k_scale": k_scale, "v_scale": v_scale}
    if isinstance(view, PagedView):
        return paged_attention(view, q, k_cache, v_cache, softmax_scale=softmax_scale,
                               layout=layout, **sc)
    if isinstance(view, (VerifyView, DraftStepView)):
        first = paged_attention(view.prefix, q, k_cache, v_cache, softmax_scale=softmax_scale,
                                layout=layout, **sc)
        if view.expand is None:
            return first
        second = paged_attention(view.expand, q, k_cache, v_cache, softmax_scale=softmax_scale,
                                 layout=layout, **sc)
        return merge_by_lse(first.out, first.lse, second.out, second.lse)
    raise InputError(
        f"attention expects a PagedView, VerifyView or DraftStepView, got {type(view).__name__}; "
        "call it on each part of other views (EncoderView.cross / .decoder, DraftView.steps[d])"
    )


def attention_out(
    view: object,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    softmax_scale: float | None = None,
    layout: Layout | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """:func:`attention`'s output alone. A single pass (a :class:`PagedView`, a chain verify or
    draft step) computes no log-sum-exp; a tree view's two passes still do, to merge."""
    kw = {"softmax_scale": softmax_scale, "layout": layout, "k_scale": k_scale, "v_scale": v_scale}
    if isinstance(view, PagedView):
        return paged_attention_out(view, q, k_cache, v_cache, **kw)  # type: ignore[arg-type]
    if isinstance(view, (VerifyView, DraftStepView)) and view.expand is None:
        return paged_attention_out(view.prefix, q, k_cache, v_cache, **kw)  # type: ignore[arg-type]
    return attention(view, q, k_cache, v_cache, **kw).out  # type: ignore[arg-type]
