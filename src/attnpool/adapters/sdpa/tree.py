"""One SDPA pass for a tree view (a tree verify or a tree draft step): its prefix and expand
lanes side by side under one mask, instead of two passes merged by log-sum-exp.

A tree view (:class:`attnpool.VerifyView` / :class:`attnpool.DraftStepView` with an ``expand``
part) is two attentions over disjoint keys: every query of request ``i`` sees the request's
committed prefix (the prefix part, non-causal), and query row ``r`` sees, in addition, the
draft slots its expand row ``r`` lists. A kernel runs them as two passes and merges them by
log-sum-exp (:func:`attnpool.adapters.merge.run_passes`). Through SDPA on a CPU that costs a
hand-computed softmax per pass, a merge and two plans per layer: hundreds of small ops, most of
a small batch's attention.

The keys of one query are the union of the two passes' keys, so one softmax over both is the
same attention (up to rounding: a different summation order, not a different set of keys).
:func:`build_tree` lays request ``i``'s key lanes out as its prefix lanes, then the expand rows
of its ``Q`` queries one after the other (``Q * E`` lanes, ``E`` the expand part's widest row),
and masks query ``j`` to the prefix lanes below the request's length plus the lanes of its own
expand row below that row's count. No key is read twice for one query, and a draft slot two
queries share is two lanes that neither query sees twice: the result is a plain
:class:`~attnpool.adapters.sdpa.planning.Plan` that :func:`~attnpool.adapters.sdpa.run_plan`
runs per layer like any other (SDPA's own kernel, no log-sum-exp, GQA grouping, fp8 scales,
softcap and sinks as for a single pass).

Lane ``j`` of a request maps to packed query row ``cu_seqlens_q[i] + j``; the expand part has one
row per packed query row (its ``cu_seqlens_q`` is the identity), so that is also its expand row.
Lanes past a row's length read slot 0 (valid memory, masked out), as every plan's do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...config import Layout
from ...errors import InputError, LayoutError
from ...views import DraftStepView, PagedView, VerifyView
from .gather import Gather
from .planning import Plan, row_slots


def tree_parts(view: object) -> tuple[PagedView, PagedView] | None:
    """``(prefix, expand)`` of a tree view one pass can serve, else None: a verify or draft step
    with an expand part, its prefix non-causal and without a window (a tree with a sliding
    window has no one-pass mask here: its passes are merged as before)."""
    if not isinstance(view, (VerifyView, DraftStepView)) or view.expand is None:
        return None
    pre = view.prefix
    if pre.causal or pre.window_left >= 0:
        return None
    return pre, view.expand


def build_tree(pre: PagedView, exp: PagedView, layouts: tuple[Layout, Layout], total: int,
               num_heads: int, num_kv_heads: int, dtype: torch.dtype | None = None) -> Plan:
    """The one-pass :class:`Plan` of a tree view's ``prefix`` and ``expand`` parts (see the
    module docstring), for ``total`` packed query rows of ``num_heads`` heads, read in
    ``layouts`` (the prefix's, the expand part's). ``dtype``: the mask as SDPA's additive mask
    of that dtype (else bool). A query lane with no key at all (a padded row of a layout that
    gives it none) gets lane 0 unmasked and its output zeroed (``keyed``), as in any plan."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise InputError(f"query heads must be a multiple of KV heads ({num_kv_heads}), got "
                         f"{num_heads}")
    if exp.page_size != 1:
        raise LayoutError(f"a tree's expand part lists token slots (page_size 1), got "
                          f"page_size={exp.page_size}")
    g, dev = num_heads // num_kv_heads, pre.cache_seqlens.device
    b, qmax = pre.bs, max(1, pre.max_seqlen_q)
    lp, e = max(1, pre.max_seqlen_k), max(1, exp.max_seqlen_k)
    p_lens, _, p_slots = _slots(pre, layouts[0], b, lp)
    e_lens, _, e_slots = _slots(exp, layouts[1], exp.bs, e)
    cu = pre.cu_seqlens_q[: b + 1].to(torch.int64)
    j = torch.arange(qmax, device=dev)
    pos = cu[:-1, None] + j  # [b, Q] packed query row of each lane: also its expand row
    q_ok = (j < (cu[1:] - cu[:-1])[:, None]) & (pos < total)
    dst = torch.where(q_ok, pos, total).view(-1)
    q_idx = pos.clamp(max=max(total - 1, 0)).view(-1)
    row = pos.clamp(max=exp.bs - 1)
    # key lanes: the prefix's L_p, then each query's expand row (Q rows of E lanes)
    lmax = lp + qmax * e
    slots = torch.cat((p_slots, e_slots[row].view(b, qmax * e)), dim=1)
    # query j sees lanes [0, prefix length) and [lo_j, lo_j + its expand row's count)
    lane = torch.arange(lmax, device=dev)
    lo = j * e + lp  # [Q] its expand row's first lane
    # (lengths clamped to the lanes they own: a bad length never reaches another row's lanes)
    p_len = p_lens.to(torch.int64).clamp(max=lp)  # [b]
    e_row = e_lens[row].to(torch.int64).clamp(max=e)  # [b, Q]
    keys = p_len[:, None] + e_row
    allowed = (lane < p_len[:, None, None]) | (
        (lane >= lo[:, None]) & (lane < (lo + e_row)[:, :, None]))
    allowed[:, :, 0] |= keys == 0  # a lane with no key reads lane 0 (valid), output zeroed
    if qmax > 1 and g > 1:  # grouped row order is (query, head in group)
        allowed = allowed[:, :, None].expand(b, qmax, g, lmax).reshape(b, 1, qmax * g, lmax)
    else:
        allowed = allowed[:, None]
    if dtype is not None:
        allowed = torch.full(allowed.shape, float("-inf"), dtype=dtype,
                             device=dev).masked_fill_(allowed, 0.0)
    gather = Gather(None, 1, lmax, None, slots.view(-1), None)  # (dead lanes: slot 0)
    has_key = (keys > 0).view(-1, 1, 1)
    # (a host read is free on a CPU): with every lane keyed, nothing to zero per layer
    keyed = None if dev.type == "cpu" and bool(has_key.all()) else has_key
    return Plan(b, qmax, lmax, total, num_heads, num_kv_heads, gather, keys, allowed, keyed,
                q_idx, dst)


def _slots(view: PagedView, layout: Layout, rows: int, lmax: int
           ) -> tuple[Tensor, Tensor, Tensor]:
    """``(lens [rows], live [rows, lmax] bool, slots [rows, lmax] int64)`` of the view's first
    ``rows`` rows: token slots of each row's key lanes, 0 at or past its length. A page table is
    read directly (its ids are masked by ``live`` before use, so poison past a row's pages is
    never an index); the CSR layout goes through :func:`~.planning.row_slots`."""
    if layout is not Layout.FLASH_ATTN or view.page_table is None:
        lens, live, _, gather = row_slots(view, layout, rows, lmax)
        return lens, live, gather.token_slots().view(rows, lmax)
    p = view.page_size
    width = -(-lmax // p)
    pages = view.page_table[:rows, :width]
    if pages.shape[1] < width:
        raise LayoutError(f"page_table has {pages.shape[1]} columns, max_seqlen_k="
                          f"{view.max_seqlen_k} needs {width} pages of {p}")
    lens = view.cache_seqlens[:rows]
    t = torch.arange(width * p, device=lens.device)
    live = t[:lmax] < lens[:, None]
    ids = pages.to(torch.int64)
    if p > 1:
        ids = (ids * p)[:, :, None].add(t[:p]).view(rows, -1)[:, :lmax]
    return lens, live, torch.where(live, ids, 0)
