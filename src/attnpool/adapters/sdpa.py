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
from ..views import DraftStepView, PagedView, VerifyView


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


def _rows(view: PagedView, layout: Layout, lmax: int) -> tuple[Tensor, Tensor]:
    """``(kv_lens [bs] i64, slots [bs, lmax] i64)``: each row's length and flat token slots.

    Slots past a row's length are 0 (a valid index; those lanes are masked out of attention).
    """
    bs, p = view.bs, view.page_size
    dev = view.cache_seqlens.device
    width = max(1, -(-lmax // p))
    col = torch.arange(width, device=dev)
    if layout is Layout.FLASH_ATTN:
        assert view.page_table is not None  # guaranteed by pick_layout
        lens = view.cache_seqlens[:bs].to(torch.int64)
        npages = torch.div(lens + (p - 1), p, rounding_mode="floor")
        table = view.page_table[:bs, :width].to(torch.int64)
        if table.shape[1] < width:
            raise LayoutError(f"page_table has {table.shape[1]} columns, max_seqlen_k="
                              f"{view.max_seqlen_k} needs {width} pages of {p}")
        live = col[None, :] < npages[:, None]
        pages = torch.where(live, table, 0)
    else:
        assert view.kv_indptr is not None and view.kv_indices is not None
        assert view.kv_last_page_len is not None
        indptr = view.kv_indptr[: bs + 1].to(torch.int64)
        npages = indptr[1:] - indptr[:-1]
        last = view.kv_last_page_len[:bs].to(torch.int64)
        lens = torch.where(npages > 0, (npages - 1) * p + last, 0)
        live = col[None, :] < npages[:, None]
        idx = torch.where(live, indptr[:-1, None] + col[None, :], 0)
        idx = idx.clamp_(max=view.kv_indices.shape[0] - 1)
        pages = torch.where(live, view.kv_indices.to(torch.int64)[idx], 0)
    t = torch.arange(lmax, device=dev)
    slots = pages[:, t // p] * p + (t % p)[None, :]
    slots = torch.where(t[None, :] < lens[:, None], slots, 0)
    return lens, slots


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
    """Attention of the packed queries ``q`` over the KV rows of ``view`` (one pass).

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
    if not isinstance(view, PagedView):
        raise InputError(f"paged_attention expects a PagedView, got {type(view).__name__}")
    h, h_kv, d = check_qkv(q, k_cache, v_cache)
    if view.cache_seqlens.device != q.device:
        raise InputError(f"view is on {view.cache_seqlens.device}, q on {q.device}")
    lay = pick_layout(view, layout)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    bs, total, dev = view.bs, q.shape[0], q.device
    qmax, lmax = max(1, view.max_seqlen_q), max(1, view.max_seqlen_k)

    lens, slots = _rows(view, lay, lmax)
    k_flat = k_cache.reshape(-1, h_kv, d)
    v_flat = v_cache.reshape(-1, h_kv, v_cache.shape[3])
    grp = h // h_kv
    # [bs, L, H_kv, D] -> [bs, H, L, D]; query head h reads KV head h // grp.
    kp, vp = k_flat[slots], v_flat[slots]
    if k_scale is not None or v_scale is not None:
        kp, vp = _dequantize(k_flat.dtype, h_kv, kp, vp, k_scale, v_scale)
    kp = kp.to(q.dtype).permute(0, 2, 1, 3).repeat_interleave(grp, dim=1)
    vp = vp.to(q.dtype).permute(0, 2, 1, 3).repeat_interleave(grp, dim=1)

    cu = view.cu_seqlens_q[: bs + 1].to(torch.int64)
    q_lens = cu[1:] - cu[:-1]
    j = torch.arange(qmax, device=dev)
    pos = cu[:-1, None] + j[None, :]  # [bs, Qmax] packed query positions
    q_ok = (j[None, :] < q_lens[:, None]) & (pos < total)
    q_idx = torch.where(q_ok, pos, 0).clamp_(max=max(total - 1, 0))
    qp = q[q_idx].permute(0, 2, 1, 3) if total else q.new_zeros(bs, h, qmax, d)

    t = torch.arange(lmax, device=dev)
    allowed = t[None, None, :] < lens[:, None, None]  # [bs, 1, L]
    if view.causal:  # query j of a row with q_len queries sits at position len - q_len + j
        last = (lens - q_lens)[:, None, None] + j[None, :, None]  # [bs, Qmax, 1]
        allowed = allowed & (t[None, None, :] <= last)
    allowed = allowed.expand(bs, qmax, lmax)
    any_key = allowed.any(-1)  # [bs, Qmax]
    # A query with no key would make softmax 0/0; give it key 0 and zero its output below.
    safe = allowed | (~any_key[:, :, None] & (t == 0)[None, None, :])
    o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=safe[:, None], scale=scale)
    o = torch.where(any_key[:, None, :, None], o, 0).permute(0, 2, 1, 3)  # [bs, Qmax, H, D]

    scores = torch.matmul(qp.float(), kp.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1).permute(0, 2, 1)  # [bs, Qmax, H]

    # Scatter back to packed positions; lanes that are not a real query go to a scratch row.
    dst = torch.where(q_ok, pos, total).reshape(-1)
    out = q.new_zeros(total + 1, h, v_cache.shape[3])
    out_lse = torch.full((total + 1, h), float("-inf"), device=dev)
    out.index_copy_(0, dst, o.reshape(-1, h, v_cache.shape[3]))
    out_lse.index_copy_(0, dst, lse.reshape(-1, h))
    return Attn(out[:total], out_lse[:total])


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
    keys. A pass with no keys (``lse = -inf``) contributes nothing; if both are empty the output is
    0 with ``lse = -inf``.

    Args:
        o1, o2: ``[T, H, D]`` outputs. lse1, lse2: ``[T, H]`` natural-log log-sum-exp.
    """
    if o1.shape != o2.shape or lse1.shape != lse2.shape or tuple(o1.shape[:2]) != tuple(lse1.shape):
        raise InputError(f"merge_by_lse needs o [T, H, D] and lse [T, H] of equal shapes, got "
                         f"{tuple(o1.shape)}, {tuple(lse1.shape)}, {tuple(o2.shape)}, "
                         f"{tuple(lse2.shape)}")
    a, b = lse1.float(), lse2.float()
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
