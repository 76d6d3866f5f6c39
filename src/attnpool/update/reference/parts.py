"""The reference path's part updates, in plain torch: what :mod:`.reference`'s ``*_launch``
functions bind and run (the semantics of :mod:`.triton`'s fused kernels, same bytes in every
read region). The caller's inputs are trusted here: the phases check them first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...config import ceil_div
from ...errors import InputError, LayoutError
from ..buffers import PagedBuffers, table_width, window_width
from ..parts import DraftExpandPart, LocalExtendPart, LocalPart, PagedPart, TreeExpandPart
from .rows import (
    draft_expand,
    extend_tokens,
    floor_div,
    gather_pages,
    local_extend_rows,
    local_rows,
    tree_expand,
)
from .writes import cumsum_, lengths_, paged_


def _no_num_real(num_real: Tensor | None) -> None:
    if num_real is not None:
        raise InputError("num_real (a capturable update) needs the fused path, impl=TRITON; "
                         "the reference path got one")


def _arange(b: PagedBuffers, size: int, like: Tensor) -> Tensor:
    """``0, 1, ..., size-1``: the pool's constant when the part carries it, else a temporary."""
    if b.arange is not None and b.arange.shape[0] >= size:
        return b.arange
    return torch.arange(size, dtype=torch.int32, device=like.device)


def _step(b: PagedBuffers, d: int, table: bool) -> PagedBuffers:
    """Step ``d`` of stacked ``[S, ...]`` per-step buffers; the shared table only if ``table``."""
    def at(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[d]

    return PagedBuffers(b.cache_seqlens[d], b.cu_seqlens_k[d], b.page_table if table else None,
                        at(b.kv_indptr), at(b.kv_indices), at(b.kv_last_page_len), b.arange)


def paged_part_(b: PagedBuffers, part: PagedPart) -> None:
    """Write one paged part's read region for ``part.bs`` rows: what :class:`PagedPart` says,
    the fused :func:`attnpool.update.triton.paged_launch`'s bytes, in torch.

    A window part is the same paged part again over the window table, with each row's lengths
    shifted by its window start (:func:`_window_`), before anything of the full part is written.

    The caller's inputs are trusted (the phases check them; see the module docstring for
    ``width`` and ``keep``). Page ids are gathered first, straight into the page table when the
    part has one; nothing here can fail on values (rows and columns are clamped into the table),
    so that first write is safe.
    """
    _no_num_real(part.num_real)
    if part.window is not None or part.window_size is not None or (
            part.window_out_slots is not None):
        _window_(b, part)
    p, pt, bs, seq_lens = part.page_size, b.page_table, part.bs, part.seq_lens
    max_len, extra, pad_len = part.max_len, part.extra, part.pad_seq_len
    if max_len is None:
        cols = pt.shape[1] if pt is not None else ceil_div(
            table_width(part.req_to_token, part.block_size), p)
        max_len = cols * p
    cap = pt.shape[1] if pt is not None else ceil_div(max_len, p)
    w = cap if part.width is None else min(part.width, cap)
    n = seq_lens.shape[0]
    out = None if pt is None else pt[:n, :w]
    pages = gather_pages(part.req_to_token, part.req_pool_indices, p, w, part.token_offset, out,
                         part.block_size)
    if part.steps > 1:
        _steps_(b, bs, seq_lens, pages, extra, part.steps, p, pad_len, part.pad_page, max_len)
        return
    lengths_(b.cache_seqlens, seq_lens, extra, bs, pad_len, max_len)
    if part.full_pages and n:  # a draft tree's prefix pass: whole pages only
        real = b.cache_seqlens[:n]
        real.div_(p, rounding_mode="floor").mul_(p)
    if part.q_lens is not None and part.cu_seqlens_q is not None:
        _queries_(b, bs, part.q_lens, part.cu_seqlens_q, part.pad_q, part.max_q, part.q_total)
    if part.positions is not None or part.out_slots is not None:
        _tokens_(seq_lens, extra, part.q_lens, part.req_pool_indices, part.req_to_token,
                 part.block_size, part.token_offset, part.positions, part.out_slots, part.tokens)
    paged_(b, bs=bs, pages=pages, page_size=p, pad_page=part.pad_page,
           pad_pages=ceil_div(pad_len, p), arange=_arange(b, max(w, bs) + 1, seq_lens))


INT32_MAX = 2**31 - 1


def _window_(b: PagedBuffers, part: PagedPart) -> None:
    """The window part of a paged part (the fused kernel's programs ``bs..2bs-1``): row ``i``
    of length ``L`` (clamped as the part's) with ``q`` queries starts ``shift = floor(max(0,
    L - q - W + 1) / P) * P`` tokens into its request, so it is the part's own update over
    lengths ``min(L - shift, window width in tokens)`` and token offset ``shift``."""
    w, window_size, q_lens = part.window, part.window_size, part.q_lens
    if w is None or window_size is None:
        raise LayoutError("window_size, window_table and window_out_slots need a window part "
                          f"and a window_size, got window={w is not None}, "
                          f"window_size={window_size!r}")
    if part.window_out_slots is not None and q_lens is None:
        raise InputError("window_out_slots needs q_lens (the extend query part)")
    p, steps, max_len, extra = part.page_size, part.steps, part.max_len, part.extra
    table = part.req_to_token if part.window_table is None else part.window_table
    if max_len is None:
        cols = b.page_table.shape[1] if b.page_table is not None else -(
            -table_width(part.req_to_token, part.block_size) // p)
        max_len = cols * p
    cap = window_width(w)
    # (int64: a window start computed from an out-of-contract length cannot wrap around)
    total = (part.seq_lens.to(torch.int64) + extra).clamp(0, max(max_len - (steps - 1), 0))
    qc = None if q_lens is None else q_lens.clamp(0, INT32_MAX if part.max_q is None
                                                    else part.max_q)
    q: Tensor | int = max(extra, 1) if qc is None else qc
    first = (total - q - (window_size - 1)).clamp_(min=0)
    shift = floor_div(first, p).mul_(p)
    lens = (total - shift).clamp_(0, max(cap * p - (steps - 1), 0))
    off = shift if part.token_offset is None else shift + part.token_offset
    paged_part_(w, PagedPart(bs=part.bs, seq_lens=lens, req_pool_indices=part.req_pool_indices,
                             req_to_token=table, page_size=p, pad_seq_len=part.pad_seq_len,
                             pad_page=part.pad_page, token_offset=off, steps=steps,
                             max_len=cap * p, block_size=part.block_size))
    if part.window_out_slots is not None:
        _tokens_(lens, 0, qc, part.req_pool_indices, table, part.block_size, off, None,
                 part.window_out_slots, part.tokens)


def _steps_(b: PagedBuffers, bs: int, seq_lens: Tensor, pages: Tensor, extra: int, steps: int,
            p: int, pad_len: int, pad_page: int, max_len: int) -> None:
    """Chain draft steps: step ``d`` holds ``clamp(seq + extra) + d`` (the clamp leaves room for
    the last step, as the fused kernel's), its own cumsum; the shared table once, for the last."""
    n = seq_lens.shape[0]
    base = b.cache_seqlens[0]
    lengths_(base, seq_lens, extra, bs, pad_len, max(max_len - (steps - 1), 0))
    arange = _arange(b, max(pages.shape[1], bs) + 1, seq_lens)
    for d in range(steps):
        step = _step(b, d, table=d == steps - 1)
        if d:
            torch.add(base[:n], d, out=step.cache_seqlens[:n])
            if n < bs:
                step.cache_seqlens[n:bs].fill_(pad_len)
        paged_(step, bs=bs, pages=pages if d == steps - 1 else pages[:, :0], page_size=p,
               pad_page=pad_page, pad_pages=ceil_div(pad_len, p), arange=arange)


def _queries_(b: PagedBuffers, bs: int, q_lens: Tensor, cu: Tensor, pad_q: int,
              max_q: int | None, q_total: int | None) -> None:
    """The query part: ``cu = [0, cumsum(q_lens)]`` (clamped into ``[0, max_q]``), then padded
    rows: with ``q_total`` all end at ``max(q_total, real total)`` (the first takes the slack),
    else ``pad_q`` queries each, continuing from the real total (device values, no sync)."""
    n = q_lens.shape[0]
    cumsum_(cu, q_lens if max_q is None else q_lens.clamp(0, max_q))
    if n == bs:
        return
    if q_total is not None:
        # (max(T, total) keeps it non-decreasing if the caller broke sum <= T)
        torch.clamp(cu[n : n + 1].expand(bs - n), min=q_total, out=cu[n + 1 : bs + 1])
        return
    pad = _arange(b, bs - n + 1, q_lens)[1 : bs - n + 1]
    torch.add(pad if pad_q == 1 else pad * pad_q, cu[n : n + 1], out=cu[n + 1 : bs + 1])


def _tokens_(seq_lens: Tensor, extra: int, q_lens: Tensor | None, req_pool_indices: Tensor,
             table: Tensor, block_size: int | None, token_offset: Tensor | None,
             positions: Tensor | None, out_slots: Tensor | None, tokens: int | None) -> None:
    """Packed query tokens' positions and KV slots (:func:`extend_tokens`), then their pads.

    With ``tokens`` (the host count of real tokens) only those are computed, and each buffer's
    tail gets its pad value in one fill: the bytes :func:`extend_tokens` gives past the real
    tokens (position 0, slot -1), without its per-token work over the whole buffer."""
    if q_lens is None:
        raise InputError("positions / out_slots need q_lens and q_total (the extend query part)")
    size = max(0 if positions is None else positions.shape[0],
               0 if out_slots is None else out_slots.shape[0])
    live = size if tokens is None else min(tokens, size)
    lens = seq_lens + extra if extra else seq_lens
    pos, slots = extend_tokens(lens, q_lens, req_pool_indices, table, live, block_size,
                               token_offset)
    for buf, got, pad in ((positions, pos, 0), (out_slots, slots, -1)):
        if buf is not None:
            m = min(live, buf.shape[0])
            buf[:m].copy_(got[:m])
            if m < buf.shape[0]:
                buf[m:].fill_(pad)


def tree_expand_part_(e: PagedBuffers, part: TreeExpandPart) -> None:
    """The verify tree *expand* part: what :class:`TreeExpandPart` says, from
    :func:`tree_expand` written with page size 1."""
    _no_num_real(part.num_real)
    nd = part.tree_mask.shape[1]
    lens, slots = tree_expand(part.tree_mask, part.seq_lens, part.req_pool_indices,
                              part.req_to_token, part.block_size)
    rows = part.bs * nd
    lengths_(e.cache_seqlens, lens, 0, rows, part.pad_len, nd)
    paged_(e, bs=rows, pages=slots, page_size=1, pad_page=part.pad_id, pad_pages=part.pad_len,
           arange=_arange(e, max(nd, rows) + 1, part.seq_lens))


def draft_tree_expand_part_(e: PagedBuffers, part: DraftExpandPart) -> None:
    """Every step's draft tree expand rows: what :class:`DraftExpandPart` says (``e`` stacked
    ``[S, ...]`` per step, one shared table), from :func:`draft_expand`: step ``d`` (1-based)
    reads ``partial + d`` keys."""
    _no_num_real(part.num_real)
    loc, pad_len = part.out_cache_loc, part.pad_len
    _, partial, slots = draft_expand(part.seq_lens, part.req_pool_indices, part.req_to_token,
                                     loc, part.page_size, part.block_size)
    steps, topk = loc.shape[1], loc.shape[2]
    rows, width = part.bs * topk, slots.shape[1]
    arange = _arange(e, max(width, rows) + 1, part.seq_lens)
    for d in range(steps):
        last = d == steps - 1
        step = _step(e, d, table=last)
        lengths_(step.cache_seqlens, partial, d + 1, rows, pad_len, width)
        # (every step's CSR lists the slots; the shared table is written once, by the last)
        paged_(step, bs=rows, pages=slots, page_size=1, pad_page=part.pad_id, pad_pages=pad_len,
               arange=arange)


def local_part_(b: PagedBuffers, part: LocalPart) -> None:
    """Chunked local attention's virtual rows: what :class:`LocalPart` says, from
    :func:`local_rows` (pages gathered from each row's chunk start; rows past a request's last
    chunk read the pad page)."""
    _no_num_real(part.num_real)
    per, q, p = part.rows_per_request, part.num_queries, part.page_size
    seq_lens, pad_len, pad_page, cu_seqlens_q = (part.seq_lens, part.pad_len, part.pad_page,
                                                 part.cu_seqlens_q)
    kv = seq_lens + part.extra if part.extra else seq_lens
    q_lens, kv_lens, off, valid = local_rows(kv, q, part.chunk, per, pad_len)
    width = _local_width(b, part)
    pages = gather_pages(part.req_to_token, part.req_pool_indices.repeat_interleave(per), p,
                         width, off, block_size=part.block_size)
    pages = torch.where(valid[:, None], pages, pad_page)
    # --- writes start here ---
    rows, real = part.bs * per, q_lens.shape[0]
    arange = _arange(b, max(width, rows) + 1, seq_lens)
    cumsum_(cu_seqlens_q, q_lens)
    # Padded requests: their first row takes the q queries, the others none, so request
    # i's queries start at cu[i*V] = i*q as in the caller's packed query buffer.
    pad = torch.div(arange[: rows - real], per, rounding_mode="floor").add_(1).mul_(q)
    torch.add(pad, cu_seqlens_q[real : real + 1], out=cu_seqlens_q[real + 1 : rows + 1])
    lengths_(b.cache_seqlens, kv_lens, 0, rows, pad_len, width * p)
    paged_(b, bs=rows, pages=pages, page_size=p, pad_page=pad_page, pad_pages=ceil_div(pad_len, p),
           arange=arange)


def _local_width(b: PagedBuffers, part: LocalPart | LocalExtendPart) -> int:
    """Page columns of a local part's rows: the page table's, else one chunk's (CSR only)."""
    if b.page_table is not None:
        return int(b.page_table.shape[1])
    return ceil_div(min(part.chunk, table_width(part.req_to_token, part.block_size)),
                    part.page_size)


def local_extend_part_(b: PagedBuffers, part: LocalExtendPart) -> None:
    """Chunked local attention for a prefill (extend or draft extend): what
    :class:`LocalExtendPart` says, from :func:`local_extend_rows`."""
    _no_num_real(part.num_real)
    p, rows, rpi, pad_len = part.page_size, part.bs, part.req_pool_indices, part.pad_len
    q_lens, kv_lens, off, valid, req = local_extend_rows(part.seq_lens, part.extend_lens,
                                                         part.chunk, rows, pad_len)
    width = _local_width(b, part)
    row_requests = rpi[req] if rpi.shape[0] else rpi.new_zeros(rows)
    pages = gather_pages(part.req_to_token, row_requests, p, width, off,
                         block_size=part.block_size)
    pages = torch.where(valid[:, None], pages, part.pad_page)
    # --- writes start here ---
    arange = _arange(b, max(width, rows) + 1, part.seq_lens)
    cumsum_(part.cu_seqlens_q, q_lens)
    lengths_(b.cache_seqlens, kv_lens, 0, rows, pad_len, width * p)
    paged_(b, bs=rows, pages=pages, page_size=p, pad_page=part.pad_page,
           pad_pages=ceil_div(pad_len, p), arange=arange)
