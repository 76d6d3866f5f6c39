"""Triton kernels behind :mod:`attnpool.update.triton` (imported lazily: it imports triton).

Each kernel writes one paged part's whole read region in a single launch. Every program loads
the (small) per-row vector it needs and computes the batch prefix sums with ``tl.cumsum`` (a
parallel scan in registers; no serial loop over the batch, no second launch, no global
synchronisation between programs). Page writes loop over a row's own live pages only, so the
bytes written grow with the live pages, not with the table width.

Every address is bounded without reading lengths on the host: row indices are clamped into the
caller's table, token columns into its width, page columns into the page table's width and CSR
positions into ``kv_indices``. Out-of-range inputs (which only a host sync could detect) thus
produce wrong-but-in-bounds metadata instead of a stray write, which matters inside a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _floor_div(a, b):  # type: ignore[no-untyped-def]
    """``floor(a / b)`` for ``b > 0`` whatever ``//`` rounds to (torch's ``rounding_mode="floor"``)."""
    q = a // b
    return tl.where(a - q * b < 0, q - 1, q)


@triton.jit
def _pick(v, me):  # type: ignore[no-untyped-def]
    """The element of ``v`` where ``me`` holds (a one-hot row selector), as a scalar."""
    return tl.sum(tl.where(me, v, 0), axis=0)


@triton.jit  # type: ignore[untyped-decorator]
def paged_kernel(  # type: ignore[no-untyped-def]
    seq_ptr, rpi_ptr, tok_ptr, off_ptr, nreal_ptr, keep_ptr, qlen_ptr,
    cache_ptr, cuk_ptr, pt_ptr, indptr_ptr, indices_ptr, last_ptr, cuq_ptr,
    n, bs, extra, pad_len, pad_page, pad_pages, pad_q,
    P, tok_rows, tok_cols, tok_stride, pt_stride, cap_pages, indices_cap,
    HAS_OFF: tl.constexpr, DEVICE_N: tl.constexpr, HAS_PT: tl.constexpr,
    HAS_FI: tl.constexpr, INCR: tl.constexpr, HAS_Q: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One program per row ``pid < bs`` of a paged part (see ``triton.paged_update_``)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    n_real = n
    if DEVICE_N:
        n_real = tl.minimum(tl.maximum(tl.load(nreal_ptr).to(tl.int32), 0), bs)
    real = offs < n_real
    inb = offs < bs
    me = offs == pid
    is_real = pid < n_real

    # lengths: real rows seq + extra (int32 like the int32 buffer), padded rows pad_len
    s = tl.load(seq_ptr + offs, mask=real, other=0)
    lens = tl.where(real, (s + extra).to(tl.int32), pad_len)
    lens = tl.where(inb, lens, 0)
    my_len = _pick(lens, me)
    my_cum = _pick(tl.cumsum(lens, axis=0), me)
    old_len = my_len
    if INCR:
        old_len = tl.load(cache_ptr + pid)  # the previous step's length, read before it is replaced
    tl.store(cache_ptr + pid, my_len)
    tl.store(cuk_ptr + pid + 1, my_cum)
    if pid == 0:
        tl.store(cuk_ptr, my_cum * 0)

    if HAS_Q:
        q = tl.load(qlen_ptr + offs, mask=real, other=0).to(tl.int32)
        q = tl.where(inb, tl.where(real, q, pad_q), 0)
        tl.store(cuq_ptr + pid + 1, _pick(tl.cumsum(q, axis=0), me))
        if pid == 0:
            tl.store(cuq_ptr, my_cum * 0)

    my_start = my_cum * 0
    if HAS_FI:
        npg = tl.where(real, _floor_div(lens + (P - 1), P), 0)  # padded rows own no pages
        my_end = _pick(tl.cumsum(npg, axis=0), me)
        my_start = my_end - _pick(npg, me)
        tl.store(indptr_ptr + pid + 1, my_end)
        if pid == 0:
            tl.store(indptr_ptr, my_end * 0)
        last = tl.where(is_real, tl.maximum(my_len - 1, 0) % P + 1, 1)
        tl.store(last_ptr + pid, last)

    if HAS_PT or HAS_FI:
        live = _floor_div(my_len + (P - 1), P)
        cnt = tl.where(is_real, live, pad_pages if HAS_PT else 0)
        cnt = tl.minimum(cnt, cap_pages)
        pt_from = cnt * 0
        if INCR:
            kept = (tl.load(keep_ptr + pid) != 0) & is_real
            pt_from = tl.where(kept, tl.maximum(_floor_div(old_len + (P - 1), P), 0), 0)
        lo = cnt * 0
        if INCR and not HAS_FI:
            lo = pt_from  # CSR positions move with every earlier row; only the table is incremental
        r = tl.load(rpi_ptr + pid, mask=is_real, other=0).to(tl.int64)
        r = tl.minimum(tl.maximum(r, 0), tok_rows - 1)
        row_base = tok_ptr + r * tok_stride
        tok0 = r * 0
        if HAS_OFF:
            tok0 = tl.load(off_ptr + pid, mask=is_real, other=0).to(tl.int64)
        # (block masks are built from block compares only: never `block & scalar_bool`)
        live_cnt = tl.where(is_real, cnt, 0)  # columns holding gathered pages (0 for padding)
        for c0 in range(lo, cnt, BLOCK_P):
            p = c0 + tl.arange(0, BLOCK_P)
            m = p < cnt
            m_live = p < live_cnt
            col = tok0 + p.to(tl.int64) * P
            col = tl.minimum(tl.maximum(col, 0), tok_cols - 1)
            tok = tl.load(row_base + col, mask=m_live, other=0)
            pg = tl.where(is_real, _floor_div(tok, P), pad_page).to(tl.int32)
            if HAS_PT:
                m_pt = m
                if INCR:
                    m_pt = m & (p >= pt_from)
                tl.store(pt_ptr + pid.to(tl.int64) * pt_stride + p, pg, mask=m_pt)
            if HAS_FI:
                pos = my_start + p
                ok = m_live & (pos >= 0) & (pos < indices_cap)
                tl.store(indices_ptr + pos, pg, mask=ok)


@triton.jit  # type: ignore[untyped-decorator]
def tree_expand_kernel(  # type: ignore[no-untyped-def]
    mask_ptr, seq_ptr, rpi_ptr, tok_ptr, nreal_ptr,
    cache_ptr, cuk_ptr, pt_ptr, indptr_ptr, indices_ptr, last_ptr,
    n, bs, ND, pad_len, pad_id, ms0, ms1, ms2,
    tok_rows, tok_cols, tok_stride, pt_stride, indices_cap,
    DEVICE_N: tl.constexpr, HAS_PT: tl.constexpr, HAS_FI: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One program per request ``i < bs``: its ``ND`` expand rows ``i*ND .. i*ND+ND-1``.

    A program needs the allowed count of every earlier row (its CSR / cumsum offset): it sums the
    mask rows of earlier requests in ``[BLOCK_R, BLOCK_N]`` tiles. That is ``i*ND*ND`` bytes,
    tiny next to the launch, and it keeps the whole part to one launch. Within a request, row and
    column positions are exclusive ``tl.cumsum`` s of the mask.
    """
    i = tl.program_id(0)
    n_real = n
    if DEVICE_N:
        n_real = tl.minimum(tl.maximum(tl.load(nreal_ptr).to(tl.int32), 0), bs)
    is_real = i < n_real
    kk = tl.arange(0, BLOCK_N)
    k_ok = kk < ND
    nd_real = tl.where(is_real, ND, 0)  # (block masks from block compares, never `& scalar_bool`)
    k_real = kk < nd_real

    # allowed count of all rows before this request (all real rows for a padded request)
    before = tl.minimum(i, n_real) * ND
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.int32)
    for r0 in range(0, before, BLOCK_R):
        row = r0 + rr
        req = (row // ND).to(tl.int64)
        j = (row % ND).to(tl.int64)
        addr = (req * ms0 + j * ms1)[:, None] + kk.to(tl.int64)[None, :] * ms2
        mm = (row < before)[:, None] & k_ok[None, :]
        acc += tl.load(mask_ptr + addr, mask=mm, other=0).to(tl.int32)
    prefix = tl.sum(tl.sum(acc, axis=1), axis=0)

    # this request's ND x ND mask block: a[j, k] = draft j may attend draft k
    jj = kk
    m2 = k_real[:, None] & k_real[None, :]
    addr2 = (i.to(tl.int64) * ms0 + jj.to(tl.int64)[:, None] * ms1
             + kk.to(tl.int64)[None, :] * ms2)
    a = tl.load(mask_ptr + addr2, mask=m2, other=0).to(tl.int32)
    cnt = tl.sum(a, axis=1)  # allowed count of each row j
    col = tl.cumsum(a, axis=1) - a  # where allowed draft k goes in row j (allowed first, in order)
    cnt_incl = tl.cumsum(cnt, axis=0)

    rows = i * ND + jj
    pad_t = (i - n_real) * ND + jj + 1  # padded rows after all real ones, pad_len each
    lens = tl.where(is_real, cnt, pad_len)
    cu = tl.where(is_real, prefix + cnt_incl, prefix + pad_t * pad_len)
    tl.store(cache_ptr + rows, lens, mask=k_ok)
    tl.store(cuk_ptr + rows + 1, cu, mask=k_ok)
    if i == 0:
        tl.store(cuk_ptr, prefix * 0)

    # slots of the ND draft tokens: req_to_token[r, seq_len + k]
    r = tl.load(rpi_ptr + i, mask=is_real, other=0).to(tl.int64)
    r = tl.minimum(tl.maximum(r, 0), tok_rows - 1)
    s = tl.load(seq_ptr + i, mask=is_real, other=0).to(tl.int64)
    tcol = tl.minimum(tl.maximum(s + kk.to(tl.int64), 0), tok_cols - 1)
    slot = tl.load(tok_ptr + r * tok_stride + tcol, mask=k_real, other=0).to(tl.int32)
    allowed = (a != 0) & m2

    if HAS_FI:
        tl.store(indptr_ptr + rows + 1, tl.where(is_real, prefix + cnt_incl, prefix), mask=k_ok)
        tl.store(last_ptr + rows, cnt * 0 + 1, mask=k_ok)
        if i == 0:
            tl.store(indptr_ptr, prefix * 0)
        pos = (prefix + cnt_incl - cnt)[:, None] + col
        ok = allowed & (pos >= 0) & (pos < indices_cap)
        tl.store(indices_ptr + pos, slot[None, :] + col * 0, mask=ok)

    if HAS_PT:
        tcol2 = tl.where(is_real, col, kk[None, :] + col * 0)
        val = tl.where(is_real, slot[None, :] + col * 0, pad_id)
        wm = tl.where(is_real, allowed, (kk[None, :] < pad_len) & k_ok[:, None])
        tl.store(pt_ptr + rows.to(tl.int64)[:, None] * pt_stride + tcol2, val, mask=wm)
