"""Paged attention over any :class:`attnpool.PagedView` with PyTorch SDPA (CPU and CUDA).

This is the library's CPU backend and the oracle the kernel adapters are checked against:
obviously right first, then as cheap as vectorised torch allows.

* **One padded batched gather, no loop over rows.** Each row's keys are copied into a
  ``[bs, Lmax, H_kv, D]`` block (``Lmax = view.max_seqlen_k``; K and V of a pool layer in one
  ``index_select``, by whole pages on a CPU: :mod:`attnpool.adapters.sdpa.gather`) and its
  queries into ``[bs, Qmax, H, D]`` (``Qmax = view.max_seqlen_q``); a mask hides the lanes past a
  row's length (and, when ``view.causal``, keys after each query, aligned to the end of the KV
  row as in flash-attn and FlashInfer). The extents are the view's host ints: off a CPU nothing
  is read back, no host sync. Views refilled with ``seq_lens_cpu`` carry tight bounds; capture
  views carry ``max_context_len`` (correct, bigger).
* **Grouped-query attention without copies of K/V**: the query heads sharing a KV head are
  grouped as extra query rows of it (:mod:`attnpool.adapters.sdpa.planning`); a decode view (one
  query per row) skips the query gather and scatter.
* **Both layouts, read as a kernel reads them.** ``FLASH_ATTN``: a row's length is
  ``cache_seqlens[i]`` and its pages ``page_table[i, :ceil(len / page_size)]``. ``FLASHINFER``: its
  pages are ``kv_indices[kv_indptr[i] : kv_indptr[i+1]]`` and its length
  ``(pages - 1) * page_size + kv_last_page_len[i]`` (0 for a row that owns no pages, as padded
  rows do). Lanes outside a row's pages are masked *before* they are used as indices, so whatever
  the arena holds there (poison included) is never dereferenced.
* **Any page size.** Token slot = ``page * view.page_size + offset`` into the cache flattened to
  ``[tokens, H_kv, D]``: expand parts (``page_size = 1``, ids are raw slots) and page-level parts
  read the same cache.
* **Log-sum-exp only when a merge needs it.** SDPA's public API does not return it, so
  :func:`paged_attention` / :func:`attention` compute the pass by hand from the masked scores in
  float32 (float64 for float64 inputs) and return both; two passes over disjoint keys merge
  exactly with :func:`merge_by_lse`. A single pass (decode, chain verify, draft steps, extend)
  needs only the output: :func:`paged_attention_out` / :func:`attention_out` run SDPA and skip it.
  A forward over many layers computes the view's :func:`plan` once and calls :func:`run_plan` per
  layer.

Padding: the adapter computes every row of the view, padded ones included (as a captured kernel
does), and returns an output shaped like ``q``. The caller keeps the real rows' queries
``[:cu_seqlens_q[n]]`` and discards the rest. Query positions at or past ``q.shape[0]`` are
skipped, so ``q`` may be the whole padded query buffer or just the real rows' queries. A row with
no keys (a FlashInfer padded row, an empty tree prefix) yields output 0 and log-sum-exp ``-inf``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

import torch
import torch.nn.functional as F
from torch import Tensor

from ...config import Layout
from ...errors import InputError
from ...views import DraftStepView, PagedView, VerifyView
from ..fp8 import cache_scales
from ..merge import Attn, passes, run_passes
from ..variants import cap_scores_, check_sinks, check_softcap, with_sinks
from .checks import check_qkv, pick_layout, softmax_scale_of
from .gather import gather_pair
from .planning import Plan, build, group_q, packed_heads_q, scatter, ungroup
from .tree import build_tree, tree_parts

if TYPE_CHECKING:
    from typing import Unpack

#: SDPA takes fewer KV heads than query heads itself (``enable_gqa``) from torch 2.5 on.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def plan(view: PagedView | VerifyView | DraftStepView, *, num_q: int, num_heads: int,
         num_kv_heads: int, layout: Layout | None = None, dtype: torch.dtype | None = None,
         prefix_free: bool = False) -> Plan:
    """The layer-independent part of :func:`attention_out` for ``view``: compute it once per
    forward and pass it to :func:`run_plan` in every layer (see
    :mod:`attnpool.adapters.sdpa.planning`).

    A tree verify or tree draft step (a view with an ``expand`` part) is planned as one pass
    over its prefix and expand lanes under one mask (:mod:`attnpool.adapters.sdpa.tree`): the
    same keys per query as the two passes a kernel merges, in one SDPA call per layer.

    Args:
        num_q: packed query rows the layers will pass (``q.shape[0]``).
        num_heads, num_kv_heads: the model's ``H`` and ``H_kv`` (``H % H_kv == 0``).
        layout: which of the view's layouts to read (default: the page table when present).
        dtype: the queries' dtype, when known: the key mask is then built once as SDPA's
            additive mask instead of being converted from bool by SDPA in every layer.
        prefix_free: the caller's promise that ``view`` is a causal prefill with nothing cached
            (every real row's queries start at position 0, ``cache_seqlens`` = its query
            count): SDPA's own causal mask is then exact, and no mask is built or applied (the
            cheapest prefill). Wrong for a view with a cached prefix.
    """
    if not isinstance(num_q, int) or num_q < 0:
        raise InputError(f"num_q must be an int >= 0, got {num_q!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InputError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if not isinstance(view, PagedView):
        parts = tree_parts(view)
        if parts is None:
            first, second = passes(view)  # (refuses what no adapter reads)
            if second is None:
                view = first
            else:
                raise InputError(f"plan cannot serve this tree {type(view).__name__}: its "
                                 "prefix is causal or has a window (the pool's trees have "
                                 "neither); run it with attention_out (two passes, merged)")
        else:
            if prefix_free:
                raise InputError("prefix_free is for a causal prefill, not a tree view")
            pre, exp = parts
            return build_tree(pre, exp, (pick_layout(pre, layout), pick_layout(exp, layout)),
                              num_q, num_heads, num_kv_heads, dtype)
    return build(view, pick_layout(view, layout), num_q, num_heads, num_kv_heads, clamp=True,
                 dtype=dtype, prefix_free=prefix_free)


def run_plan(pl: Plan, q: Tensor, k_cache: Tensor, v_cache: Tensor, *,
             softmax_scale: float | None = None, k_scale: Tensor | None = None,
             v_scale: Tensor | None = None, softcap: float = 0.0,
             sinks: Tensor | None = None) -> Tensor:
    """One layer's attention output ``[num_q, H, Dv]`` through PyTorch SDPA, from a :class:`Plan`
    of the view (no log-sum-exp).

    Called once per layer, so its checks are only what the plan does not already fix: the
    shapes against the plan (which checked the view), dtypes and devices. ``softcap`` and
    ``sinks`` (see :func:`paged_attention`) take the explicit path: PyTorch's SDPA can express
    neither, so the scores are computed here (the plan must carry a mask: not prefix-free).
    """
    h, h_kv = pl.num_heads, pl.num_kv_heads
    if (q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4
            or (q.shape[0], q.shape[1], k_cache.shape[2]) != (pl.total, h, h_kv)
            or k_cache.shape[3] != q.shape[2] or v_cache.shape[:3] != k_cache.shape[:3]
            or not (q.dtype.is_floating_point and k_cache.dtype.is_floating_point)
            or not q.device == k_cache.device == v_cache.device):
        check_qkv(q, k_cache, v_cache)  # names the problem when it is one it knows
        raise InputError(f"q / cache must match the plan: expected q [{pl.total}, {h}, D] and "
                         f"caches [pages, P, {h_kv}, D] on one device; got q "
                         f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
                         f"{tuple(v_cache.shape)}")
    if softcap or sinks is not None:
        return _explicit(pl, q, k_cache, v_cache, softmax_scale, k_scale, v_scale,
                         check_softcap(softcap), check_sinks(sinks, h, q.device, None)).out
    ks, vs = cache_scales(k_cache, h_kv, k_scale, v_scale)
    k, v = gather_pair(pl, k_cache, v_cache, q.dtype, ks, vs)
    mask = pl.allowed
    if mask is None:  # prefix-free causal: SDPA's causal mask, heads kept in place
        g, qh = h // h_kv, packed_heads_q(pl, q)
        if g > 1 and _SDPA_GQA:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=softmax_scale,
                                               enable_gqa=True)
        else:  # torch < 2.5: SDPA needs as many KV heads as query heads
            if g > 1:
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=softmax_scale)
        return scatter(o.transpose(1, 2).reshape(pl.b * pl.qmax, h, -1), pl, 0.0)
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        raise InputError(f"the plan's mask was built for {mask.dtype}, q is {q.dtype}")
    o = F.scaled_dot_product_attention(group_q(pl, q), k, v, attn_mask=mask, scale=softmax_scale)
    o = ungroup(o, pl)
    if pl.keyed is not None:  # queries with no key: 0, not key 0
        o = torch.where(pl.keyed, o, 0)
    return scatter(o, pl, 0.0)


def _explicit(pl: Plan, q: Tensor, k_cache: Tensor, v_cache: Tensor,
              softmax_scale: float | None, k_scale: Tensor | None, v_scale: Tensor | None,
              softcap: float, sinks: Tensor | None) -> Attn:
    """The pass computed by hand, with its log-sum-exp: scores ``q k^T * scale``, then the
    softcap (``softcap * tanh(x / softcap)``), then the mask, then softmax (and the sinks from
    the log-sum-exp), in float32 at least (float64 stays float64)."""
    if pl.allowed is None:
        raise InputError("softcap, sinks and log-sum-exp need a masked plan; this one was built "
                         "prefix_free (SDPA's own causal mask): plan it without prefix_free")
    scale = softmax_scale_of(softmax_scale, q.shape[2])
    ct = torch.promote_types(q.dtype, torch.float32)
    ks, vs = cache_scales(k_cache, pl.num_kv_heads, k_scale, v_scale)
    k, v = gather_pair(pl, k_cache, v_cache, ct, ks, vs)
    scores = torch.matmul(group_q(pl, q).to(ct), k.transpose(-1, -2)).mul_(scale)
    if softcap:
        cap_scores_(scores, softcap)
    if pl.allowed.dtype == torch.bool:
        scores.masked_fill_(~pl.allowed, float("-inf"))
    else:  # an additive mask (0 / -inf) built for q's dtype
        scores.add_(pl.allowed)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    # A query with no key has lse = -inf: exp(-inf - 0) = 0 weights, so its output is 0.
    probs = scores.sub_(torch.where(torch.isneginf(lse), 0.0, lse)).exp_()
    o, lse_l = ungroup(torch.matmul(probs, v).to(q.dtype), pl), ungroup(lse, pl)[..., 0]
    if pl.keyed is not None:  # a clamped plan's queries with no key: output 0, no log-sum-exp
        o = torch.where(pl.keyed, o, 0)
        lse_l = torch.where(pl.keyed[:, :, 0], lse_l, float("-inf"))
    out = scatter(o, pl, 0.0)
    lse_q = scatter(lse_l, pl, float("-inf"))
    if sinks is not None:  # (in the scores' precision, before lse goes to float32)
        out, lse_q = with_sinks(out, lse_q, sinks)
    return Attn(out, lse_q if lse_q.dtype == torch.float64 else lse_q.float())


class AttnOptions(TypedDict, total=False):
    """The keyword options every SDPA entry point takes (documented in :func:`paged_attention`):
    ``softmax_scale``, ``layout``, an fp8 cache's ``k_scale`` / ``v_scale``, ``softcap`` and
    ``sinks``. Typed for checkers through ``**opts: Unpack[AttnOptions]``, checked by name at
    run time, so a misspelt option is refused rather than ignored."""

    softmax_scale: float | None
    layout: Layout | None
    k_scale: Tensor | None
    v_scale: Tensor | None
    softcap: float
    sinks: Tensor | None


_OPTIONS = frozenset(AttnOptions.__annotations__)


def _options(opts: AttnOptions, fn: str) -> AttnOptions:
    if not _OPTIONS.issuperset(opts):
        raise InputError(f"{fn} got unexpected keyword(s) {sorted(set(opts) - _OPTIONS)}; it "
                         f"takes {sorted(_OPTIONS)}")
    return opts


def _checked_plan(view: PagedView, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                  layout: Layout | None, clamp: bool) -> Plan:
    if not isinstance(view, PagedView):
        raise InputError(f"paged_attention expects a PagedView, got {type(view).__name__}")
    h, h_kv, _ = check_qkv(q, k_cache, v_cache)
    if view.cache_seqlens.device != q.device:
        raise InputError(f"view is on {view.cache_seqlens.device}, q on {q.device}")
    return build(view, pick_layout(view, layout), q.shape[0], h, h_kv, clamp)


def paged_attention(
    view: PagedView,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    **opts: Unpack[AttnOptions],
) -> Attn:
    """Attention of the packed queries ``q`` over the KV rows of ``view`` (one pass), with its
    log-sum-exp (for a merge; :func:`paged_attention_out` skips it).

    Args:
        view: any :class:`attnpool.PagedView` (decode, a verify/draft prefix or expand part,
            draft extend, encoder cross or decoder part, local, a sliding-window part).
        q: ``[total_q, H, D]``; row ``i``'s queries are ``q[cu_seqlens_q[i] : cu_seqlens_q[i+1]]``.
        k_cache, v_cache: ``[num_pages, P, H_kv, D]`` and ``[num_pages, P, H_kv, Dv]`` (any
            ``P``: ids are read in units of ``view.page_size``; ``Dv`` may differ from ``D``).
        softmax_scale: default ``1 / sqrt(D)``.
        layout: which of the view's layouts to read (default: the page table when present).
        k_scale, v_scale: for an fp8 cache, float32 ``[1]`` or ``[H_kv]`` scales: the gathered rows
            are dequantized (``stored * scale``, :func:`attnpool.kv.quant.dequantize`) first.
        softcap: logit softcapping, ``softcap * tanh(scores / softcap)`` after the scale and
            before the mask (:mod:`~attnpool.adapters.variants`); 0: off.
        sinks: ``[H]`` attention-sink logits on ``q``'s device (float32, or the model's own
            floating dtype: the adapter computes in float32 at least), joining every query
            row's softmax denominator (:func:`~attnpool.adapters.variants.with_sinks`); the
            returned log-sum-exp includes them.

    Returns:
        :class:`Attn` ``(out [q.shape[0], H, Dv], lse [q.shape[0], H])``. Every row of the view
        is computed, padded rows included; positions no row covers hold 0 and ``-inf``.
    """
    o = _options(opts, "paged_attention")
    pl = _checked_plan(view, q, k_cache, v_cache, o.get("layout"), clamp=False)
    return _explicit(pl, q, k_cache, v_cache, o.get("softmax_scale"), o.get("k_scale"),
                     o.get("v_scale"), check_softcap(o.get("softcap", 0.0)),
                     check_sinks(o.get("sinks"), q.shape[1], q.device, None))


def paged_attention_out(
    view: PagedView,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    **opts: Unpack[AttnOptions],
) -> Tensor:
    """:func:`paged_attention`'s output alone, through PyTorch SDPA (no log-sum-exp): what a
    single-pass forward needs (decode, chain verify and draft steps, extend). A forward that
    runs many layers over one view should :func:`plan` once and :func:`run_plan` per layer.
    With ``softcap`` or ``sinks`` it is computed by hand (SDPA expresses neither)."""
    o = _options(opts, "paged_attention_out")
    pl = _checked_plan(view, q, k_cache, v_cache, o.get("layout"), clamp=True)
    return run_plan(pl, q, k_cache, v_cache, softmax_scale=o.get("softmax_scale"),
                    k_scale=o.get("k_scale"), v_scale=o.get("v_scale"),
                    softcap=o.get("softcap", 0.0), sinks=o.get("sinks"))


def attention(
    view: object,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    **opts: Unpack[AttnOptions],
) -> Attn:
    """Attention for a whole phase part: a :class:`PagedView`, or a two-pass
    :class:`attnpool.VerifyView` / :class:`attnpool.DraftStepView` (prefix, plus the expand pass
    merged by log-sum-exp when the tree has one).

    Tree prefix and expand passes see the same packed queries (request ``i``'s ``N`` or ``K``
    queries at ``i*N ..``): the prefix pass groups them per request, the expand pass has one row
    per query. Views with parts that are separate attentions (an encoder view's cross and decoder
    parts, a draft round's steps) are called part by part. ``k_scale`` / ``v_scale``: an fp8
    cache's scales, ``softcap`` / ``sinks``: as in :func:`paged_attention` (sinks once per query
    row, after a tree's merge: :func:`~attnpool.adapters.merge.run_passes`).
    """
    o = _options(opts, "attention")
    sinks = o.get("sinks")
    checked = check_sinks(sinks, q.shape[1], q.device, None) if isinstance(q, Tensor) else sinks

    def one(part: PagedView, first: bool, s: Tensor | None) -> Attn:
        each: AttnOptions = {**o, "sinks": s}
        return paged_attention(part, q, k_cache, v_cache, **each)

    return run_passes(view, one, checked)


def attention_out(
    view: object,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    **opts: Unpack[AttnOptions],
) -> Tensor:
    """:func:`attention`'s output alone, through SDPA. A single pass (a :class:`PagedView`, a
    chain verify or draft step) computes no log-sum-exp unless ``softcap`` or ``sinks`` need the
    explicit path; a tree view is one pass over its prefix and expand lanes under one mask
    (:mod:`attnpool.adapters.sdpa.tree`: the same keys per query, no merge); a hand-built tree
    whose prefix is causal or has a window (the pool makes neither) has its two passes merged."""
    first, second = passes(view)
    if second is None:
        return paged_attention_out(first, q, k_cache, v_cache, **opts)
    parts = tree_parts(view)
    if parts is None:  # (a hand-built tree, causal or windowed prefix: its passes merged)
        return attention(view, q, k_cache, v_cache, **opts).out
    o = _options(opts, "attention_out")
    h, h_kv, _ = check_qkv(q, k_cache, v_cache)
    for part in parts:
        if part.cache_seqlens.device != q.device:
            raise InputError(f"view is on {part.cache_seqlens.device}, q on {q.device}")
    pl = plan(view, num_q=q.shape[0], num_heads=h, num_kv_heads=h_kv,  # type: ignore[arg-type]
              layout=o.get("layout"))
    return run_plan(pl, q, k_cache, v_cache, softmax_scale=o.get("softmax_scale"),
                    k_scale=o.get("k_scale"), v_scale=o.get("v_scale"),
                    softcap=o.get("softcap", 0.0), sinks=o.get("sinks"))
