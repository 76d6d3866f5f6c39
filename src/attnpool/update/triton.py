"""Fused update path: one Triton launch per phase part, capturable, writes ∝ live pages.

Each function here writes exactly the bytes the reference path (:mod:`.reference`) writes in every
read region of a part (docs/design.md, The contract), in **one kernel launch**, and nothing else
on the hot path: no host read (``Tensor.item``, ``Tensor.cpu``), no allocation, no aten op, no
shape that depends on a tensor's values. Host checks (shapes, dtypes, devices, capacities) read
only tensor metadata and raise attnpool errors before the launch, so a rejected call writes nothing.

Two ways to use them:

* **Eager, one launch per part** (``num_real=None``): ``seq_lens`` etc. hold the ``n`` real rows,
  ``n`` is their Python length, rows ``n..bs`` are padding. The grid is ``bs`` programs.
* **Inside the engine's own CUDA graph** (``num_real`` given): the inputs are padded to ``bs``
  rows (the values of rows past the real count are never read) and ``num_real`` is a one-element
  int32/int64 device tensor holding the real count ``n``. Everything the launch bakes into a graph
  (grid, block sizes, pointers, ``bs``) is then independent of ``n``, so an engine can record the
  update in the same graph as the forward and change the real count per replay by writing
  ``num_real`` (and the inputs) in place, without recapture. ``num_real`` is clamped to
  ``[0, bs]`` on the device. Call the function once before capture: the first call of a shape
  (and of each flag combination) compiles the kernel, which must not happen inside a capture.

Parts and their launches: decode, verify chain, draft extend (with its query part), encoder cross
and decoder rows (``token_offset``) are :func:`paged_update_`; all chain draft steps of a round are
one :func:`paged_update_` with ``steps``; a draft tree round is :func:`paged_update_` with
``full_pages`` (prefix) plus :func:`draft_tree_expand_update_` (every step's expand rows); a verify
tree is :func:`paged_update_` plus :func:`tree_expand_update_`; chunked local attention is
:func:`local_update_`.

Every address a kernel touches is bounded without a host read (row indices clamped into
``req_to_token``, columns into its width and the page table's, CSR positions into ``kv_indices``):
out-of-contract values (which only a sync could detect) give wrong metadata, never a stray write.

Incremental page tables (``keep``): the page id of page ``p`` of a request never changes once the
page exists, so a row whose request is the same as at the previous update already holds its old
pages. ``keep [bs]`` (a device tensor, non-zero = same request as last time; see
:func:`keep_flags`) makes such rows write only page-table columns from the previous length's page
count onward, where the previous length is what ``cache_seqlens`` holds before this update. That is
valid only if nothing else wrote this part's buffers since the previous update (an overlaid phase,
a capture state) and ``extra``/``token_offset`` are unchanged for the row: the caller (the phase)
tracks that and passes ``keep=None`` otherwise. FlashInfer's CSR is always written in full: its
positions shift whenever an earlier row's page count changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..config import ceil_div, is_int
from ..errors import CapacityError, InputError, LayoutError
from ..inputs import check_tensor
from . import triton_checks as ck
from .reference import PagedBuffers
from .reference import local_extend_launch as local_extend_launch
from .triton_draft import draft_tree_expand_launch, draft_tree_expand_update_

__all__ = [
    "draft_tree_expand_launch",
    "draft_tree_expand_update_", "keep_flags", "local_extend_launch", "local_launch",
    "local_update_", "paged_launch", "paged_update_", "tree_expand_launch", "tree_expand_update_",
]
# ``local_extend_launch`` is the reference part's (torch ops): the prefill shape of local
# attention has a varying row count per request, which no fixed-stride program covers; its
# rows come from a ``searchsorted`` with no host read, on either path (see LocalPhase).

def paged_update_(b: PagedBuffers, **kw: Any) -> None:
    """Write one paged part's read region for ``bs`` rows in one launch: :func:`paged_launch`
    with the same arguments, run once."""
    paged_launch(b, **kw)()


def paged_launch(
    b: PagedBuffers,
    *,
    bs: int,
    seq_lens: Tensor,
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    extra: int,
    page_size: int,
    pad_seq_len: int,
    pad_page: int,
    token_offset: Tensor | None = None,
    num_real: Tensor | None = None,
    keep: Tensor | None = None,
    q_lens: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    pad_q: int = 1,
    steps: int = 1,
    full_pages: bool = False,
    max_len: int | None = None,
    max_q: int | None = None,
    q_total: int | None = None,
    positions: Tensor | None = None,
    out_slots: Tensor | None = None,
    block_size: int | None = None,
    width: int | None = None,
    window: PagedBuffers | None = None,
    window_size: int | None = None,
    window_table: Tensor | None = None,
    window_out_slots: Tensor | None = None,
) -> ck.Launch:
    """Check one paged part's update and assemble its launch (see :func:`paged_update_`).

    Same bytes in every read region as ``reference.lengths_`` + ``reference.paged_`` over
    ``reference.gather_pages`` (page ``p`` of row ``i`` is ``req_to_token[r_i, off_i + p*P] // P``):
    ``cache_seqlens = seq_lens + extra`` (``pad_seq_len`` for padded rows), ``cu_seqlens_k =
    [0, cumsum]`` (element 0 written every time), page-table rows = live page ids (padded rows:
    ``pad_page`` in their first ``ceil(pad_seq_len / P)`` columns), CSR rows = live pages with
    ``kv_last_page_len = (len-1) % P + 1`` (padded rows, and empty ones, own no pages:
    ``kv_last_page_len = 0``).
    Columns past a row's live pages are not written (outside the read region).

    Args:
        b: the part's buffers; ``page_table`` and/or the CSR triple may be None (layouts).
        bs: rows to write (the captured size); the grid is ``bs`` programs.
        seq_lens, req_pool_indices, token_offset: ``[n]`` (``[bs]`` with ``num_real``) int32/int64.
        extra: added to every real length (verify chain N, draft step d).
        page_size: ``P`` of this part (1 for token-slot parts).
        num_real: capturable mode (see the module docstring): ``[1]`` device count of real rows.
        keep: incremental page table (module docstring): ``[bs]`` device flags.
        q_lens, cu_seqlens_q: optional query part: ``cu_seqlens_q = [0, cumsum(q_lens)]`` with
            ``pad_q`` queries per padded row (draft extend), written by the same launch.
        steps: chain draft steps in one launch: ``b.cache_seqlens`` / ``b.cu_seqlens_k`` are then
            ``[steps, rows]`` / ``[steps, rows+1]``, step ``d`` (0-based) holding ``seq_lens +
            extra + d`` and its cumsum; the page table is written once, for the last step's
            lengths (its row prefixes serve every earlier step). No CSR (``LayoutError``).
        full_pages: lengths rounded down to whole pages (a draft tree's prefix pass).
        max_len: real lengths (``seq_lens + extra``; with ``steps``, the last step's) are clamped
            into ``[0, max_len]`` (default: the page table's width in tokens). In-contract inputs
            never reach the bound; an out-of-contract device value, which only a sync could
            detect, then gives wrong but valid metadata (a read region inside the buffers).
        max_q: ``q_lens`` are clamped into ``[0, max_q]`` likewise (default: no bound but int32).
        q_total: with the query part, padded rows' offsets end at ``max(q_total, real total)``
            instead of growing by ``pad_q`` each (extend: the first padded row takes the slack).
        positions, out_slots: with ``q_total``, optional ``[T]`` int32 / ``[L]`` int32/int64
            token buffers: packed query token ``j`` of real row ``i`` gets position ``len_i -
            q_i + j`` (``len_i = seq_lens[i] + extra``) and slot ``req_to_token[r_i, off_i +
            position]``; every later element gets 0 / -1. Same bytes as
            ``reference.extend_tokens``.
        block_size: ``req_to_token`` is a page-level block table of pages of this many tokens
            (its token slot at position ``t`` is ``table[r, t // B] * B + t % B``); None: a
            token-level table. Same bytes as the equivalent token-level table.
        width: a host bound on the page columns any real row needs; only the reference path
            uses it (to gather fewer columns): each program here loops over its own row's live
            pages. Accepted so both paths take the same arguments.
        window: the part's sliding-window twin (docs/design.md, Sliding windows), written by
            the same launch (``2 * bs`` programs): row ``i`` of length ``L`` (as above) with
            ``q`` queries (``q_lens[i]``, else ``max(extra, 1)``) starts ``shift = floor(max(0,
            L - q - window_size + 1) / P) * P`` tokens into its request: ``cache_seqlens = L -
            shift``, pages from the table's position ``shift``; same layouts and padding as the
            part, never incremental, no query part of its own.
        window_size: ``W`` (keys a query sees, itself included); only with ``window``.
        window_table: the table the window part reads (an engine's sliding-window KV group),
            of ``req_to_token``'s kind (``block_size``) and dtype and at least its width;
            default ``req_to_token``. Entries before a row's window are never read.
        window_out_slots: with ``out_slots``, the window table's slots of the same query tokens
            (-1 past the real ones): the window group's slot mapping, by the same launch.
    """
    dev = b.cache_seqlens.device
    ck.need(is_int(bs) and bs >= 1, CapacityError, f"bs must be an int >= 1, got {bs}")
    if not isinstance(seq_lens, Tensor):
        raise InputError(f"seq_lens must be a torch.Tensor, got {type(seq_lens).__name__}")
    rows = bs if num_real is not None else seq_lens.shape[0]
    ck.need(page_size >= 1, InputError, f"page_size must be >= 1, got {page_size}")
    ck.need(pad_seq_len >= 0, InputError, f"pad_seq_len must be >= 0, got {pad_seq_len}")
    seq_lens = ck.vec("seq_lens", seq_lens, rows, dev)
    n = seq_lens.shape[0]
    ck.real_count(num_real, n, bs, dev)
    req_pool_indices = ck.vec("req_pool_indices", req_pool_indices, rows, dev)
    table = ck.table(req_to_token, dev)
    tok_cols, tp, block_table = ck.block(table, block_size)
    if token_offset is not None:
        ck.vec("token_offset", token_offset, rows, dev)
    pad_pages = ceil_div(pad_seq_len, page_size)
    ck.need(is_int(steps) and steps >= 1, InputError, f"steps must be an int >= 1, got {steps}")
    has_pt, has_fi = ck.layouts(b, bs, dev, pad_pages, steps if steps > 1 else 0)
    ck.need(steps == 1 or not has_fi, LayoutError,
          f"steps > 1 (got {steps}) share one page table; a CSR layout cannot be given")
    ck.need(steps == 1 or keep is None, InputError, "keep cannot be combined with steps > 1")
    if keep is not None:
        ck.vec("keep", keep, bs, dev, (torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64))
    if (q_lens is None) != (cu_seqlens_q is None):
        raise InputError("q_lens and cu_seqlens_q must be given together")
    if q_lens is not None and cu_seqlens_q is not None:
        ck.vec("q_lens", q_lens, rows, dev)
        ck.buf("cu_seqlens_q", cu_seqlens_q, bs + 1, dev)
    tokens = positions is not None or out_slots is not None
    ck.need(q_total is None or (q_lens is not None and isinstance(q_total, int) and q_total >= 0),
            InputError, f"q_total needs q_lens and must be an int >= 0, got {q_total}")
    ck.need(not tokens or q_total is not None, InputError,
            "positions / out_slots need q_total (the extend query part)")
    if positions is not None:
        ck.buf("positions", positions, 0, dev)
    if out_slots is not None:
        ck.vec("out_slots", out_slots,
               out_slots.shape[0] if isinstance(out_slots, Tensor) else 0, dev)
    pos_cap = positions.shape[0] if positions is not None else 0
    slot_cap = out_slots.shape[0] if out_slots is not None else 0
    # most page columns a row may write: the table's width (a CSR-only part: a whole token row)
    if b.page_table is not None:
        width, pt_stride = b.page_table.shape[1], b.page_table.stride(0)
    else:
        width, pt_stride = ceil_div(tok_cols, page_size), 0

    if max_len is None:
        max_len = width * page_size
    dummy = b.cache_seqlens
    w_args, _, w_tokens = ck.window_args(
        window, table=table, block_size=block_size, window_size=window_size,
        window_table=window_table, window_out_slots=window_out_slots, bs=bs, dev=dev,
        has_layouts=(has_pt, has_fi), pad_pages=pad_pages, steps=steps, page_size=page_size,
        extra=extra, tokens=tokens, dummy=dummy)
    args = (
        seq_lens, req_pool_indices, table,
        token_offset if token_offset is not None else dummy,
        num_real if num_real is not None else dummy,
        keep if keep is not None else dummy,
        q_lens if q_lens is not None else dummy,
        b.cache_seqlens, b.cu_seqlens_k,
        b.page_table if b.page_table is not None else dummy,
        b.kv_indptr if b.kv_indptr is not None else dummy,
        b.kv_indices if b.kv_indices is not None else dummy,
        b.kv_last_page_len if b.kv_last_page_len is not None else dummy,
        cu_seqlens_q if cu_seqlens_q is not None else dummy,
        positions if positions is not None else dummy,
        out_slots if out_slots is not None else dummy,
        n, bs, extra, pad_seq_len, pad_page, pad_pages, pad_q, steps,
        b.cache_seqlens.stride(0) if steps > 1 else 0,
        b.cu_seqlens_k.stride(0) if steps > 1 else 0,
        max(max_len - (steps - 1), 0), ck.INT32_MAX if max_q is None else max_q,
        page_size, table.shape[0], tok_cols, table.stride(0), pt_stride, width,
        b.kv_indices.shape[0] if b.kv_indices is not None else 0,
        q_total or 0, pos_cap, slot_cap, max(pos_cap, slot_cap), tp, *w_args,
    )
    kw = {"HAS_OFF": token_offset is not None, "DEVICE_N": num_real is not None,
          "HAS_PT": has_pt, "HAS_FI": has_fi, "INCR": keep is not None, "HAS_Q": q_lens is not None,
          "FULL_PAGES": full_pages, "Q_FIXED": q_total is not None, "TOKENS": tokens,
          "BLOCK_TABLE": block_table, "WINDOW": window is not None, "W_TOKENS": w_tokens,
          "BLOCK": ck.scan_block(bs), "BLOCK_P": min(ck.MAX_BLOCK_P, ck.pow2(width)),
          "BLOCK_T": ck.BLOCK_T, "num_warps": ck.warps(bs), "maxnreg": ck.MAXNREG}
    dyn = ck.dyn(n=(16, n), seq_lens=(0, seq_lens), req_pool_indices=(1, req_pool_indices),
                 req_to_token=(2, table), token_offset=(3, token_offset), num_real=(4, num_real),
                 keep=(5, keep), q_lens=(6, q_lens), out_slots=(15, out_slots),
                 window_table=(_W_TABLE, window_table),
                 window_out_slots=(_W_TABLE + 1, window_out_slots))
    if window is not None and window_table is None:  # the window reads the part's own table
        dyn["req_to_token@window"] = _W_TABLE
    grid = (2 * bs,) if window is not None else (bs,)
    return ck.Launch(ck.paged_kernels().paged_kernel, grid, args, kw, dyn)


#: position of ``w_tok_ptr`` (the window table) in the paged kernel's arguments
_W_TABLE = 40


def tree_expand_update_(e: PagedBuffers, **kw: Any) -> None:
    """Write the verify tree *expand* part in one launch: :func:`tree_expand_launch`, run once."""
    tree_expand_launch(e, **kw)()


def tree_expand_launch(
    e: PagedBuffers,
    *,
    bs: int,
    tree_mask: Tensor,
    seq_lens: Tensor,
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    pad_len: int,
    pad_id: int,
    num_real: Tensor | None = None,
    block_size: int | None = None,
) -> ck.Launch:
    """Check and assemble the verify tree *expand* part (``bs*N`` token-slot rows, page size 1).

    Row ``i*N + j`` lists the slots ``req_to_token[r_i, seq_lens[i] + k]`` of the drafts ``k``
    that ``tree_mask[i, j, k]`` allows, allowed first in increasing ``k``; its length is the
    allowed count. Rows of padded requests get ``pad_len`` copies of ``pad_id`` (the pad page's
    first slot). Same bytes in every read region as ``reference.tree_expand`` written with
    ``page_size=1``. ``num_real`` works as in :func:`paged_update_` (inputs padded to ``bs``),
    ``block_size`` as in :func:`paged_launch` (the expand rows are token slots either way).
    """
    dev = e.cache_seqlens.device
    tree_mask = check_tensor("tree_mask", tree_mask, None, 3, (torch.bool,), device=dev,
                             contiguous=False)
    if not tree_mask.shape[1] == tree_mask.shape[2] >= 1:
        raise InputError(f"tree_mask must be [n, N, N] with N >= 1, got shape "
                         f"{tuple(tree_mask.shape)}")
    n, nd = tree_mask.shape[0], tree_mask.shape[1]
    ck.need(is_int(bs) and bs >= 1, CapacityError, f"bs must be an int >= 1, got {bs}")
    if num_real is not None:
        ck.need(n == bs, InputError, f"with num_real, tree_mask must have bs={bs} rows, got {n}")
    ck.real_count(num_real, n, bs, dev)
    ck.need(0 <= pad_len <= nd, InputError, f"pad_len must be in [0, N={nd}], got {pad_len}")
    seq_lens = ck.vec("seq_lens", seq_lens, n, dev)
    req_pool_indices = ck.vec("req_pool_indices", req_pool_indices, n, dev)
    table = ck.table(req_to_token, dev)
    tok_cols, tp, block_table = ck.block(table, block_size)
    has_pt, has_fi = ck.layouts(e, bs * nd, dev, nd)
    dummy = e.cache_seqlens
    bn = ck.pow2(nd, 2)
    args = (
        tree_mask, seq_lens, req_pool_indices, table,
        num_real if num_real is not None else dummy,
        e.cache_seqlens, e.cu_seqlens_k,
        e.page_table if e.page_table is not None else dummy,
        e.kv_indptr if e.kv_indptr is not None else dummy,
        e.kv_indices if e.kv_indices is not None else dummy,
        e.kv_last_page_len if e.kv_last_page_len is not None else dummy,
        n, bs, nd, pad_len, pad_id, *tree_mask.stride(),
        table.shape[0], tok_cols, table.stride(0),
        e.page_table.stride(0) if e.page_table is not None else 0,
        e.kv_indices.shape[0] if e.kv_indices is not None else 0, tp,
    )
    kw = {"DEVICE_N": num_real is not None, "HAS_PT": has_pt, "HAS_FI": has_fi,
          "BLOCK_N": bn, "BLOCK_TABLE": block_table, **ck.tree_tile(bn)}
    dyn = ck.dyn(n=(11, n), tree_mask=(0, tree_mask), seq_lens=(1, seq_lens),
                 req_pool_indices=(2, req_pool_indices), req_to_token=(3, table),
                 num_real=(4, num_real))
    return ck.Launch(ck.kernels().tree_expand_kernel, (bs,), args, kw, dyn)


def local_update_(b: PagedBuffers, **kw: Any) -> None:
    """Write the chunked-local-attention part in one launch: :func:`local_launch`, run once."""
    local_launch(b, **kw)()


def local_launch(
    b: PagedBuffers,
    *,
    cu_seqlens_q: Tensor,
    bs: int,
    seq_lens: Tensor,
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    extra: int,
    num_queries: int,
    rows_per_request: int,
    chunk: int,
    page_size: int,
    pad_len: int,
    pad_page: int,
    num_real: Tensor | None = None,
    block_size: int | None = None,
) -> ck.Launch:
    """Check and assemble the chunked-local-attention part (``bs * rows_per_request`` virtual rows).

    Same bytes in every read region as the reference local phase: ``reference.local_rows`` over
    ``seq_lens + extra`` with ``num_queries`` queries per request, pages gathered from each row's
    chunk start (rows past a request's last chunk: ``pad_len`` keys on ``pad_page``), and
    ``cu_seqlens_q`` where a padded request's first row takes ``num_queries`` queries so request
    ``i``'s queries start at row ``i * rows_per_request``. ``num_real`` as in
    :func:`paged_update_` (a count of requests; inputs padded to ``bs``); ``block_size`` as in
    :func:`paged_launch`.
    """
    dev = b.cache_seqlens.device
    ck.need(is_int(bs) and bs >= 1, CapacityError, f"bs must be an int >= 1, got {bs}")
    for name, x, lo in (("rows_per_request", rows_per_request, 1), ("chunk", chunk, 1),
                        ("page_size", page_size, 1), ("num_queries", num_queries, 0),
                        ("pad_len", pad_len, 0)):
        ck.need(is_int(x) and x >= lo, InputError, f"{name} must be an int >= {lo}, got {x}")
    if not isinstance(seq_lens, Tensor):
        raise InputError(f"seq_lens must be a torch.Tensor, got {type(seq_lens).__name__}")
    seq_lens = ck.vec("seq_lens", seq_lens, bs if num_real is not None else seq_lens.shape[0], dev)
    n = seq_lens.shape[0]
    ck.real_count(num_real, n, bs, dev)
    req_pool_indices = ck.vec("req_pool_indices", req_pool_indices, n, dev)
    table = ck.table(req_to_token, dev)
    tok_cols, tp, block_table = ck.block(table, block_size)
    rows = bs * rows_per_request
    pad_pages = ceil_div(pad_len, page_size)
    has_pt, has_fi = ck.layouts(b, rows, dev, pad_pages)
    ck.buf("cu_seqlens_q", cu_seqlens_q, rows + 1, dev)
    if b.page_table is not None:
        width, pt_stride = b.page_table.shape[1], b.page_table.stride(0)
    else:
        width, pt_stride = ceil_div(min(chunk, tok_cols), page_size), 0
    dummy = b.cache_seqlens
    args = (
        seq_lens, req_pool_indices, table, num_real if num_real is not None else dummy,
        b.cache_seqlens, b.cu_seqlens_k, cu_seqlens_q,
        b.page_table if b.page_table is not None else dummy,
        b.kv_indptr if b.kv_indptr is not None else dummy,
        b.kv_indices if b.kv_indices is not None else dummy,
        b.kv_last_page_len if b.kv_last_page_len is not None else dummy,
        n, bs, rows_per_request, extra, num_queries, chunk, pad_len, pad_page,
        page_size, table.shape[0], tok_cols, table.stride(0), pt_stride, width,
        b.kv_indices.shape[0] if b.kv_indices is not None else 0, tp,
    )
    kw = {"DEVICE_N": num_real is not None, "HAS_PT": has_pt, "HAS_FI": has_fi,
          "BLOCK": ck.scan_block(rows), "BLOCK_P": min(ck.MAX_BLOCK_P, ck.pow2(width)),
          "BLOCK_TABLE": block_table, "num_warps": ck.warps(rows),
          "maxnreg": ck.MAXNREG}
    dyn = ck.dyn(n=(11, n), seq_lens=(0, seq_lens), req_pool_indices=(1, req_pool_indices),
                 req_to_token=(2, table), num_real=(3, num_real))
    return ck.Launch(ck.kernels().local_kernel, (rows,), args, kw, dyn)


def keep_flags(prev_ids: Sequence[int] | None, ids: Sequence[int], bs: int) -> list[int]:
    """Host-side ``keep`` values for :func:`paged_update_`: 1 where row ``i`` serves the same
    request as at the previous update, 0 for new requests, padded rows and when there was no
    previous update. ``ids`` are host ids unique per live request: not ``req_pool_indices``, whose
    slots are reused by new requests. The caller copies the flags into its ``[bs]`` device tensor
    (a ``non_blocking`` copy; from pinned memory it also leaves the host free at once)."""
    if len(ids) > bs:
        raise CapacityError(f"ids must have <= bs={bs} values, got {len(ids)}")
    prev = list(prev_ids) if prev_ids is not None else []
    return [int(i < len(prev) and prev[i] == x) for i, x in enumerate(ids)] + [0] * (bs - len(ids))
