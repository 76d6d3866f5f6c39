"""The paged-part kernel behind :func:`attnpool.update.triton.paged_update_` (imported lazily: it
imports triton). Every paged part of every phase is this one kernel, specialised by constexprs.

With a sliding window (``WINDOW``) the launch has ``2 * bs`` programs: programs ``bs..2bs-1``
write the *window part* of the same rows into their own buffers, from the window table, so a
phase with a window part still costs one launch (docs/design.md, Sliding windows). A window row
of total length ``L`` with ``q`` queries starts at page ``s = max(0, L - q - W + 1) // P`` of its
request: every length, page and CSR entry of that row is the full row's shifted by ``s * P``
tokens, which keeps each query's distance to each key (the kernels align the causal mask
bottom-right), so the part equals the full row under ``window_left = W - 1``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _csr_head, _floor_div, _row_pages, _slot


@triton.jit  # type: ignore[untyped-decorator]
def _row_tokens(  # type: ignore[no-untyped-def]
    pid, bs, is_real, length, q, q_end, q_real, rpi_ptr, off_ptr, tok_ptr, tok_rows, tok_cols,
    tok_stride, pos_ptr, slot_ptr, pos_cap, slot_cap, tail_end, TP, tok_base,
    HAS_OFF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_TABLE: tl.constexpr,
):
    """Per-token facts of row ``pid``'s ``q`` queries (packed at ``q_end - q``): position
    ``length - q + j`` and KV slot ``req_to_token[r, off + tok_base + position]`` (``tok_base``:
    a window row's shift, whose ``length`` is shifted by as much). The last program then pads
    ``[q_real, tail_end)`` of both buffers (position 0, slot -1; ``tail_end`` = the larger
    capacity): padded rows' tokens and the unused tail."""
    nq = tl.where(is_real, q, 0)
    start = q_end - nq
    r = tl.load(rpi_ptr + pid, mask=is_real, other=0).to(tl.int64)
    r = tl.minimum(tl.maximum(r, 0), tok_rows - 1)
    tok0 = r * 0 + tok_base
    if HAS_OFF:
        tok0 += tl.load(off_ptr + pid, mask=is_real, other=0).to(tl.int64)
    # only tokens that land in [0, tail_end): out-of-contract lengths cannot make the loop long
    j_lo = tl.maximum(-start, 0)
    j_hi = tl.minimum(nq, tail_end - start)
    for j0 in range(j_lo, j_hi, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        ok = j < j_hi
        t = start + j
        pos = length - nq + j
        col = tl.minimum(tl.maximum(tok0 + pos.to(tl.int64), 0), tok_cols - 1)
        slot = _slot(tok_ptr + r * tok_stride, col, ok, TP, BLOCK_TABLE)
        tl.store(pos_ptr + t, pos, mask=ok & (t >= 0) & (t < pos_cap))
        tl.store(slot_ptr + t, slot, mask=ok & (t >= 0) & (t < slot_cap))
    if pid == bs - 1:
        lo = tl.maximum(q_real, 0)
        for t0 in range(lo, tail_end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tl.store(pos_ptr + t, t * 0, mask=t < pos_cap)
            tl.store(slot_ptr + t, t * 0 - 1, mask=t < slot_cap)


@triton.jit  # type: ignore[untyped-decorator]
def _rows(  # type: ignore[no-untyped-def]
    rows, n_real, bs, seq_ptr, qlen_ptr, extra, pad_len, pad_q, max_len, max_q, P, win, win_q,
    win_max_len, HAS_Q: tl.constexpr, FULL_PAGES: tl.constexpr, Q_FIXED: tl.constexpr,
    WIN: tl.constexpr,
):
    """Per-row facts of ``rows`` (one row as a scalar, or a block of rows): ``(length, window
    shift, queries, CSR pages)``, each 0 past ``bs`` (and for padded rows, shift and pages).

    The program's own row and every chunk of its prefix sums come from this one function, so
    a row's value and its share of the sums cannot disagree. Real lengths (``seq + extra``,
    int32 like the buffer) are clamped into ``[0, max_len]``: an out-of-contract value (only a
    sync could see it) then still gives a read region that fits the part's buffers; padded
    rows get ``pad_len``. ``q``: real rows' clamped ``q_lens``; padded rows 0 (``Q_FIXED``)
    or ``pad_q``.
    """
    real = rows < n_real
    inb = rows < bs
    s = tl.load(seq_ptr + rows, mask=real, other=0) + extra
    s = tl.minimum(tl.maximum(s, 0), max_len)
    if FULL_PAGES:
        s = _floor_div(s, P) * P  # a draft tree's prefix pass: whole pages only
    shift = s.to(tl.int64) * 0
    if WIN:  # (int64: an out-of-contract length cannot wrap the window start around)
        s64 = s.to(tl.int64)
        if HAS_Q:
            qw = tl.minimum(tl.maximum(tl.load(qlen_ptr + rows, mask=real, other=0), 0),
                            max_q).to(tl.int64)
        else:
            qw = s64 * 0 + win_q
        shift = _floor_div(tl.maximum(s64 - qw - win + 1, 0), P) * P
        s = tl.minimum(tl.maximum(s64 - shift, 0), win_max_len).to(s.dtype)
    lens = tl.where(inb, tl.where(real, s.to(tl.int32), pad_len), 0)
    q = lens * 0
    if HAS_Q:
        q = tl.load(qlen_ptr + rows, mask=real, other=0)
        q = tl.minimum(tl.maximum(q, 0), max_q).to(tl.int32)
        q = tl.where(real, q, 0) if Q_FIXED else tl.where(inb, tl.where(real, q, pad_q), 0)
    npg = tl.where(real, _floor_div(lens + (P - 1), P), 0)  # padded rows own no pages
    return lens, tl.where(real, shift, 0), q, npg


@triton.jit  # type: ignore[untyped-decorator]
def _paged_part(  # type: ignore[no-untyped-def]
    pid, seq_ptr, rpi_ptr, tok_ptr, off_ptr, nreal_ptr, keep_ptr, qlen_ptr,
    cache_ptr, cuk_ptr, pt_ptr, indptr_ptr, indices_ptr, last_ptr, cuq_ptr, pos_ptr, slot_ptr,
    n, bs, extra, pad_len, pad_page, pad_pages, pad_q, steps, len_sstride, cu_sstride,
    max_len, max_q, P, tok_rows, tok_cols, tok_stride, pt_stride, cap_pages, indices_cap,
    q_total, pos_cap, slot_cap, tail_end, TP, win, win_q, win_max_len,
    HAS_OFF: tl.constexpr, DEVICE_N: tl.constexpr, HAS_PT: tl.constexpr,
    HAS_FI: tl.constexpr, INCR: tl.constexpr, HAS_Q: tl.constexpr, FULL_PAGES: tl.constexpr,
    Q_FIXED: tl.constexpr, TOKENS: tl.constexpr, BLOCK_TABLE: tl.constexpr, WIN: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Row ``pid < bs`` of one paged part (the full part, or with ``WIN`` its window part).

    With ``steps > 1`` (chain draft steps) step ``d`` writes its own lengths (``+ d``) and cumsum
    at ``d * len_sstride`` / ``d * cu_sstride``: ``cumsum(len + d) = cumsum(len) + d * (real rows
    so far)``, no second scan. Pages are written once, for the last step's lengths.

    ``Q_FIXED`` (extend): padded rows' query offsets all end at ``max(q_total, real total)``.
    ``TOKENS`` (extend): each real row also writes its queries' positions (``len - q + j``) and
    KV slots at their packed offsets; the last program writes the pad values (position 0,
    slot -1) from the real total to the end of both token buffers (``pos_cap``, ``slot_cap``).

    ``WIN``: the row starts ``shift = floor(max(0, L - q - win + 1) / P) * P`` tokens into its
    request (``q``: the row's ``q_lens`` entry, else ``win_q``; with ``steps``, step 1's length
    decides, so the one table serves every step), and its lengths are clamped into
    ``win_max_len`` (the window table's width) after the shift. The window part writes no query
    part and no positions (the full part owns them); with ``TOKENS`` only the window table's
    slots. It is never incremental (its start moves every step).
    """
    n_real = n
    if DEVICE_N:
        n_real = tl.minimum(tl.maximum(tl.load(nreal_ptr).to(tl.int32), 0), bs)
    is_real = pid < n_real
    my_len, my_shift, my_q, my_npg = _rows(
        pid, n_real, bs, seq_ptr, qlen_ptr, extra, pad_len, pad_q, max_len, max_q, P, win,
        win_q, win_max_len, HAS_Q, FULL_PAGES, Q_FIXED, WIN)
    # inclusive prefix sums over rows 0..pid, BLOCK rows at a time (registers: one chunk)
    acc_len = tl.zeros([BLOCK], dtype=tl.int32)
    acc_q = tl.zeros([BLOCK], dtype=tl.int32)
    acc_pg = tl.zeros([BLOCK], dtype=tl.int32)
    for c0 in range(0, pid + 1, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        lens, _, q, npg = _rows(
            offs, n_real, bs, seq_ptr, qlen_ptr, extra, pad_len, pad_q, max_len, max_q, P, win,
            win_q, win_max_len, HAS_Q, FULL_PAGES, Q_FIXED, WIN)
        upto = offs <= pid
        acc_len += tl.where(upto, lens, 0)
        if HAS_Q:
            acc_q += tl.where(upto, q, 0)
        if HAS_FI:
            acc_pg += tl.where(upto, npg, 0)
    my_cum = tl.sum(acc_len, axis=0)
    old_len = my_len
    if INCR:
        old_len = tl.load(cache_ptr + pid)  # the previous step's length, read before it is replaced
    real_so_far = tl.minimum(pid + 1, n_real)
    for d in range(steps):
        tl.store(cache_ptr + d * len_sstride + pid, my_len + tl.where(is_real, d, 0))
        tl.store(cuk_ptr + d * cu_sstride + pid + 1, my_cum + d * real_so_far)
        if pid == 0:
            tl.store(cuk_ptr + d * cu_sstride, my_cum * 0)
    my_len = my_len + tl.where(is_real, steps - 1, 0)  # pages cover the last step

    if HAS_Q:
        my_cq = tl.sum(acc_q, axis=0)
        my_qend = my_cq
        if Q_FIXED:  # padded rows (and the last program) see every real row: my_cq = real total
            my_qend = tl.where(is_real, my_cq, tl.maximum(my_cq, q_total))
        if not WIN:
            tl.store(cuq_ptr + pid + 1, my_qend)
            if pid == 0:
                tl.store(cuq_ptr, my_cum * 0)
        if TOKENS:
            _row_tokens(pid, bs, is_real, my_len, my_q, my_qend, my_cq,
                        rpi_ptr, off_ptr, tok_ptr, tok_rows, tok_cols, tok_stride,
                        pos_ptr, slot_ptr, pos_cap, slot_cap, tail_end, TP, my_shift, HAS_OFF,
                        BLOCK_T, BLOCK_TABLE)

    my_start = _csr_head(pid, my_cum, acc_pg, my_npg, my_len, is_real, P, indptr_ptr, last_ptr,
                         HAS_FI)

    if HAS_PT or HAS_FI:
        live = tl.minimum(_floor_div(my_len + (P - 1), P), cap_pages)
        zero = live * 0
        n_gather = tl.where(is_real, live, 0)
        pt_from = zero
        if INCR:
            kept = (tl.load(keep_ptr + pid) != 0) & is_real
            pt_from = tl.where(kept, tl.maximum(_floor_div(old_len + (P - 1), P), 0), 0)
        lo = zero
        if INCR and not HAS_FI:
            lo = pt_from  # CSR positions move with every earlier row; only the table is incremental
        r = tl.load(rpi_ptr + pid, mask=is_real, other=0).to(tl.int64)
        r = tl.minimum(tl.maximum(r, 0), tok_rows - 1)
        tok0 = my_shift
        if HAS_OFF:
            tok0 += tl.load(off_ptr + pid, mask=is_real, other=0).to(tl.int64)
        _row_pages(pid, n_gather, tl.where(is_real, live, pad_pages),  # pad_pages <= width: checked
                   n_gather, lo, pt_from, tok_ptr + r * tok_stride, tok0, P, tok_cols, pad_page,
                   pt_ptr, pt_stride, indices_ptr, my_start, indices_cap, TP,
                   HAS_PT, HAS_FI, INCR, BLOCK_P, BLOCK_TABLE)


@triton.jit  # type: ignore[untyped-decorator]
def paged_kernel(  # type: ignore[no-untyped-def]
    seq_ptr, rpi_ptr, tok_ptr, off_ptr, nreal_ptr, keep_ptr, qlen_ptr,
    cache_ptr, cuk_ptr, pt_ptr, indptr_ptr, indices_ptr, last_ptr, cuq_ptr, pos_ptr, slot_ptr,
    n, bs, extra, pad_len, pad_page, pad_pages, pad_q, steps, len_sstride, cu_sstride,
    max_len, max_q, P, tok_rows, tok_cols, tok_stride, pt_stride, cap_pages, indices_cap,
    q_total, pos_cap, slot_cap, tail_end, TP,
    w_tok_ptr, w_slot_ptr, w_cache_ptr, w_cuk_ptr, w_pt_ptr, w_indptr_ptr, w_indices_ptr,
    w_last_ptr, win, win_q, win_max_len, w_tok_rows, w_tok_cols, w_tok_stride, w_pt_stride,
    w_cap_pages, w_indices_cap, w_slot_cap, w_len_sstride, w_cu_sstride,
    HAS_OFF: tl.constexpr, DEVICE_N: tl.constexpr, HAS_PT: tl.constexpr,
    HAS_FI: tl.constexpr, INCR: tl.constexpr, HAS_Q: tl.constexpr, FULL_PAGES: tl.constexpr,
    Q_FIXED: tl.constexpr, TOKENS: tl.constexpr, BLOCK_TABLE: tl.constexpr,
    WINDOW: tl.constexpr, W_TOKENS: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Programs ``pid < bs``: the part's rows; with ``WINDOW``, programs ``bs + i``: row ``i``'s
    window part (``w_*``: its buffers, table and sizes; ``W_TOKENS``: it also writes the window
    table's slots of the queries into ``w_slot_ptr``). See :func:`_paged_part`."""
    pid = tl.program_id(0)
    part = pid * 0
    if WINDOW:
        part = (pid >= bs).to(tl.int32)
    if part == 1:  # (constant-folded away without WINDOW)
        _paged_part(pid - bs, seq_ptr, rpi_ptr, w_tok_ptr, off_ptr, nreal_ptr, keep_ptr, qlen_ptr,
                    w_cache_ptr, w_cuk_ptr, w_pt_ptr, w_indptr_ptr, w_indices_ptr, w_last_ptr,
                    cuq_ptr, pos_ptr, w_slot_ptr, n, bs, extra, pad_len, pad_page, pad_pages,
                    pad_q, steps, w_len_sstride, w_cu_sstride, max_len, max_q, P, w_tok_rows,
                    w_tok_cols, w_tok_stride, w_pt_stride, w_cap_pages, w_indices_cap, q_total,
                    0, w_slot_cap, w_slot_cap, TP, win, win_q, win_max_len,
                    HAS_OFF, DEVICE_N, HAS_PT, HAS_FI, False, HAS_Q, FULL_PAGES, Q_FIXED,
                    W_TOKENS, BLOCK_TABLE, True, BLOCK, BLOCK_P, BLOCK_T)
    else:
        _paged_part(pid, seq_ptr, rpi_ptr, tok_ptr, off_ptr, nreal_ptr, keep_ptr, qlen_ptr,
                    cache_ptr, cuk_ptr, pt_ptr, indptr_ptr, indices_ptr, last_ptr, cuq_ptr,
                    pos_ptr, slot_ptr, n, bs, extra, pad_len, pad_page, pad_pages, pad_q, steps,
                    len_sstride, cu_sstride, max_len, max_q, P, tok_rows, tok_cols, tok_stride,
                    pt_stride, cap_pages, indices_cap, q_total, pos_cap, slot_cap, tail_end, TP,
                    0, 1, max_len, HAS_OFF, DEVICE_N, HAS_PT, HAS_FI, INCR, HAS_Q, FULL_PAGES,
                    Q_FIXED, TOKENS, BLOCK_TABLE, False, BLOCK, BLOCK_P, BLOCK_T)
