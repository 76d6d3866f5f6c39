"""Triton kernels behind :mod:`attnpool.update.triton` (imported lazily: it imports triton): the
shared row helpers, the verify tree expand kernel and the chunked local kernel (the paged kernel
is in :mod:`.paged_kernels`).

Each kernel writes one paged part's whole read region in a single launch. Every program needs
the prefix sums of the rows up to its own (its cumsum entries, its CSR offset) and computes them
itself: it loops over rows ``0..pid`` ``BLOCK`` rows at a time, adding each chunk's masked values
into one chunk-wide running-sum vector per prefix sum, reduced once after the loop (no second
launch, no global synchronisation between programs). Its own row's values come from the same
per-row function as each chunk's (``_rows``, ``_local_rows``, ``_expand_rows``), so the two
cannot disagree. The sums are the int32 sums a ``tl.cumsum`` over the batch gives, in another
order, which two's complement makes exact: chunk size changes no byte. Page writes loop over a
row's own live pages only, so the bytes written grow with the live pages, not the table width.

Registers: a program holds one chunk (``BLOCK`` = the rows rounded up to a power of two, at most
``tuning.MAX_BLOCK`` = 1024), whatever the batch, with 4 warps at every size. Holding the
whole batch instead (a single ``tl.cumsum``) spilled kilobytes per program from 8192 rows on.
Every update launch also passes ``maxnreg=255`` (``tuning.MAXNREG``, the architecture's
limit, so it caps nothing): Triton 3.9 always runs ptxas with ``--regAllocOptLevel=2`` (a
workaround of its own), at which ptxas keeps some specializations of a kernel without a
``.maxnreg`` at a low register count and spills a few bytes to stay there. On sm_90 three
chain-window (draft) extend specializations did so at 32 and 40 registers (4-8 bytes: a value
kept across the sum loop); the same PTX given a ``.maxnreg``, or compiled without that flag,
takes 48-50 registers and spills nothing. With both, no specialization spills on sm_80 or sm_90
(``python -m attnpool kernels``; tests/update/triton/test_kernels_compile.py).

Every address is bounded without reading lengths on the host: row indices are clamped into the
caller's table, token columns into its width, page columns into the page table's width and CSR
positions into ``kv_indices``. Out-of-range inputs (which only a host sync could detect) thus
produce wrong-but-in-bounds metadata instead of a stray write, which matters inside a CUDA graph.

Request tables: every token-slot read goes through :func:`_slot`, so a kernel reads a token-level
``req_to_token`` or (``BLOCK_TABLE``) a page-level block table of ``TP``-token pages alike. ``TP``
is the *table's* page size, separate from the part's ``P`` (token-slot parts have ``P = 1`` but
still read a paged table); ``tok_cols`` is the table's width in tokens either way.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _floor_div(a, b):  # type: ignore[no-untyped-def]
    """``floor(a / b)`` for ``b > 0`` whatever ``//`` rounds to (torch's ``rounding_mode="floor"``)."""
    q = a // b
    return tl.where(a - q * b < 0, q - 1, q)


@triton.jit  # type: ignore[untyped-decorator]
def _slot(row, t, mask, TP, BLOCK_TABLE: tl.constexpr):  # type: ignore[no-untyped-def]
    """The token slot at token column ``t`` (already clamped into ``[0, tok_cols)``) of request
    table row ``row``: ``row[t]``, or for a block table ``row[t // TP] * TP + t % TP``."""
    if BLOCK_TABLE:
        s = tl.load(row + t // TP, mask=mask, other=0).to(tl.int64) * TP + t % TP
    else:
        s = tl.load(row + t, mask=mask, other=0)
    return s


@triton.jit  # type: ignore[untyped-decorator]
def _row_pages(  # type: ignore[no-untyped-def]
    row, n_gather, n_pt, n_csr, lo, pt_from, row_base, tok0, P, tok_cols, pad_page,
    pt_ptr, pt_stride, indices_ptr, csr_start, indices_cap, TP,
    HAS_PT: tl.constexpr, HAS_FI: tl.constexpr, INCR: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_TABLE: tl.constexpr,
):
    """Write one row's pages, a ``BLOCK_P`` chunk at a time, from column ``lo``.

    Column ``p < n_gather`` holds page ``slot(tok0 + p*P) // P``, later ones ``pad_page``. The
    page table gets ``n_pt`` columns (only from ``pt_from`` on with ``INCR``), the CSR ``n_csr``
    entries from ``csr_start``. Block masks are built from block compares only (never
    ``block & scalar_bool``, which the interpreter mistypes).
    """
    if HAS_PT and HAS_FI:
        hi = tl.maximum(n_pt, n_csr)
    elif HAS_PT:
        hi = n_pt
    else:
        hi = n_csr
    for c0 in range(lo, hi, BLOCK_P):
        p = c0 + tl.arange(0, BLOCK_P)
        col = tl.minimum(tl.maximum(tok0 + p.to(tl.int64) * P, 0), tok_cols - 1)
        g = p < n_gather
        tok = _slot(row_base, col, g, TP, BLOCK_TABLE)
        pg = tl.where(g, _floor_div(tok, P), pad_page).to(tl.int32)
        if HAS_PT:
            m_pt = p < n_pt
            if INCR:
                m_pt = m_pt & (p >= pt_from)
            tl.store(pt_ptr + row.to(tl.int64) * pt_stride + p, pg, mask=m_pt)
        if HAS_FI:
            pos = csr_start + p
            tl.store(indices_ptr + pos, pg, mask=(p < n_csr) & (pos >= 0) & (pos < indices_cap))


@triton.jit  # type: ignore[untyped-decorator]
def _csr_head(pid, my_cum, acc_pg, my_npg, my_len, owns, P,  # type: ignore[no-untyped-def]
              indptr_ptr, last_ptr, HAS_FI: tl.constexpr):
    """Row ``pid``'s head of FlashInfer's CSR lists: ``kv_indptr[pid + 1]`` (the inclusive sum
    ``acc_pg`` of the pages of rows ``0..pid``; row 0 also writes ``kv_indptr[0] = 0``) and
    ``kv_last_page_len[pid]`` (0 for a row that owns no page: not ``owns`` or empty). Returns
    the row's first position in ``kv_indices`` (0 without the CSR layout; ``my_cum`` only
    gives the scalar its type)."""
    my_start = my_cum * 0
    if HAS_FI:
        my_end = tl.sum(acc_pg, axis=0)
        my_start = my_end - my_npg
        tl.store(indptr_ptr + pid + 1, my_end)
        if pid == 0:
            tl.store(indptr_ptr, my_end * 0)
        tl.store(last_ptr + pid, tl.where(owns & (my_len > 0), (my_len - 1) % P + 1, 0))
    return my_start


@triton.jit  # type: ignore[untyped-decorator]
def tree_expand_kernel(  # type: ignore[no-untyped-def]
    mask_ptr, seq_ptr, rpi_ptr, tok_ptr, nreal_ptr,
    cache_ptr, cuk_ptr, pt_ptr, indptr_ptr, indices_ptr, last_ptr,
    n, bs, ND, pad_len, pad_id, ms0, ms1, ms2,
    tok_rows, tok_cols, tok_stride, pt_stride, indices_cap, TP,
    DEVICE_N: tl.constexpr, HAS_PT: tl.constexpr, HAS_FI: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_TABLE: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """One program per request ``i < bs``: its ``ND`` expand rows ``i*ND .. i*ND+ND-1``.

    A program needs the allowed count of every earlier row (its CSR / cumsum offset): it sums the
    mask rows of earlier requests in ``[BLOCK_R, BLOCK_N]`` tiles. That is ``i*ND*ND`` bytes,
    tiny next to the launch, and it keeps the whole part to one launch. Within a request, row and
    column positions are exclusive ``tl.cumsum`` s of the mask, over ``[BLOCK_J, BLOCK_N]``
    tiles of its rows (a running count carries the offset), so a program holds at most 2048
    mask entries whatever ``N`` is: registers stay flat and nothing spills up to 128 drafts.
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

    # slots of the ND draft tokens: the table's slots at positions seq_len + k
    r = tl.load(rpi_ptr + i, mask=is_real, other=0).to(tl.int64)
    r = tl.minimum(tl.maximum(r, 0), tok_rows - 1)
    s = tl.load(seq_ptr + i, mask=is_real, other=0).to(tl.int64)
    tcol = tl.minimum(tl.maximum(s + kk.to(tl.int64), 0), tok_cols - 1)
    slot = _slot(tok_ptr + r * tok_stride, tcol, k_real, TP, BLOCK_TABLE).to(tl.int32)
    if i == 0:
        tl.store(cuk_ptr, prefix * 0)
        if HAS_FI:
            tl.store(indptr_ptr, prefix * 0)

    # this request's ND x ND mask block, BLOCK_J rows at a time (a running count carries the
    # CSR offset from one block to the next): a[j, k] = draft j may attend draft k
    run = prefix
    for j0 in tl.static_range(0, BLOCK_N, BLOCK_J):
        jj = j0 + tl.arange(0, BLOCK_J)
        j_ok = jj < ND
        m2 = (jj < nd_real)[:, None] & k_real[None, :]
        addr2 = (i.to(tl.int64) * ms0 + jj.to(tl.int64)[:, None] * ms1
                 + kk.to(tl.int64)[None, :] * ms2)
        a = tl.load(mask_ptr + addr2, mask=m2, other=0).to(tl.int32)
        cnt = tl.sum(a, axis=1)  # allowed count of each row j
        col = tl.cumsum(a, axis=1) - a  # where allowed draft k goes in row j (in order)
        cnt_incl = run + tl.cumsum(cnt, axis=0)

        rows = i * ND + jj
        pad_t = (i - n_real) * ND + jj + 1  # padded rows after all real ones, pad_len each
        lens = tl.where(is_real, cnt, pad_len)
        cu = tl.where(is_real, cnt_incl, prefix + pad_t * pad_len)
        tl.store(cache_ptr + rows, lens, mask=j_ok)
        tl.store(cuk_ptr + rows + 1, cu, mask=j_ok)
        allowed = (a != 0) & m2

        if HAS_FI:
            tl.store(indptr_ptr + rows + 1, tl.where(is_real, cnt_incl, prefix), mask=j_ok)
            tl.store(last_ptr + rows, (cnt > 0).to(tl.int32), mask=j_ok)  # 0: no slots
            pos = (cnt_incl - cnt)[:, None] + col
            ok = allowed & (pos >= 0) & (pos < indices_cap)
            tl.store(indices_ptr + pos, slot[None, :] + col * 0, mask=ok)

        if HAS_PT:
            tcol2 = tl.where(is_real, col, kk[None, :] + col * 0)
            val = tl.where(is_real, slot[None, :] + col * 0, pad_id)
            wm = tl.where(is_real, allowed, (kk[None, :] < pad_len) & j_ok[:, None])
            tl.store(pt_ptr + rows.to(tl.int64)[:, None] * pt_stride + tcol2, val, mask=wm)
        run += tl.sum(cnt, axis=0)


@triton.jit  # type: ignore[untyped-decorator]
def _local_rows(  # type: ignore[no-untyped-def]
    rows, seq_ptr, n_req, bs, per, extra, q, chunk, pad_len, P,
):
    """Per-row facts of virtual rows ``rows`` (one row as a scalar, or a block of rows) of
    chunked local attention: ``(keys, queries, CSR pages, valid, first key)``, 0 past
    ``bs * per`` (see :func:`local_kernel`). The program's own row and every chunk of its
    prefix sums come from this one function, so they cannot disagree."""
    req = rows // per
    v = rows % per
    rreal = req < n_req
    inb = rows < bs * per
    length = tl.load(seq_ptr + req, mask=rreal, other=0).to(tl.int64) + extra
    c = _floor_div(length - q, chunk) + v
    valid = (c <= _floor_div(length - 1, chunk)) & rreal
    start = c * chunk
    q_end = tl.minimum(start + chunk, length)
    q_len = tl.where(valid, q_end - tl.maximum(start, length - q), 0)
    q_len = tl.where(rreal, q_len, tl.where(v == 0, q, 0))
    q_len = tl.where(inb, q_len, 0).to(tl.int32)
    lens = tl.where(inb, tl.where(valid, (q_end - start).to(tl.int32), pad_len), 0)
    npg = tl.where(rreal, _floor_div(lens + (P - 1), P), 0)
    return lens, q_len, npg, valid, tl.where(valid, start, 0)


@triton.jit  # type: ignore[untyped-decorator]
def local_kernel(  # type: ignore[no-untyped-def]
    seq_ptr, rpi_ptr, tok_ptr, nreal_ptr,
    cache_ptr, cuk_ptr, cuq_ptr, pt_ptr, indptr_ptr, indices_ptr, last_ptr,
    n, bs, per, extra, q, chunk, pad_len, pad_page,
    P, tok_rows, tok_cols, tok_stride, pt_stride, cap_pages, indices_cap, TP,
    DEVICE_N: tl.constexpr, HAS_PT: tl.constexpr, HAS_FI: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_TABLE: tl.constexpr,
):
    """One program per virtual row ``pid < bs*per`` of chunked local attention.

    Row ``i*per + v`` is chunk ``c = (L-q)//A + v`` of request ``i`` (``L = seq + extra``): keys
    ``cA .. min((c+1)A, L)-1``, queries from ``max(cA, L-q)``. Rows past a request's last chunk
    are "invalid": no queries, ``pad_len`` keys on the pad page, but still rows of a real request
    (they own CSR pages). Padded requests' first rows take ``q`` queries, the others none.
    """
    pid = tl.program_id(0)
    n_req = n
    if DEVICE_N:
        n_req = tl.minimum(tl.maximum(tl.load(nreal_ptr).to(tl.int32), 0), bs)
    my_len, _, my_npg, my_valid, tok0 = _local_rows(
        pid, seq_ptr, n_req, bs, per, extra, q, chunk, pad_len, P)
    # inclusive prefix sums over rows 0..pid, BLOCK rows at a time (registers: one chunk)
    acc_len = tl.zeros([BLOCK], dtype=tl.int32)
    acc_q = tl.zeros([BLOCK], dtype=tl.int32)
    acc_pg = tl.zeros([BLOCK], dtype=tl.int32)
    for c0 in range(0, pid + 1, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        lens, q_len, npg, _v, _s = _local_rows(
            offs, seq_ptr, n_req, bs, per, extra, q, chunk, pad_len, P)
        upto = offs <= pid
        acc_len += tl.where(upto, lens, 0)
        acc_q += tl.where(upto, q_len, 0)
        if HAS_FI:
            acc_pg += tl.where(upto, npg, 0)
    my_cum = tl.sum(acc_len, axis=0)
    tl.store(cache_ptr + pid, my_len)
    tl.store(cuk_ptr + pid + 1, my_cum)
    tl.store(cuq_ptr + pid + 1, tl.sum(acc_q, axis=0))
    if pid == 0:
        tl.store(cuk_ptr, my_cum * 0)
        tl.store(cuq_ptr, my_cum * 0)
    my_req = pid // per
    owns = my_req < n_req  # a real request's row (valid or not)

    my_start = _csr_head(pid, my_cum, acc_pg, my_npg, my_len, owns, P, indptr_ptr, last_ptr,
                         HAS_FI)

    if HAS_PT or HAS_FI:
        live = tl.minimum(_floor_div(my_len + (P - 1), P), cap_pages)  # pad pages if not valid
        r = tl.load(rpi_ptr + my_req, mask=owns, other=0).to(tl.int64)
        r = tl.minimum(tl.maximum(r, 0), tok_rows - 1)
        zero = live * 0
        _row_pages(pid, tl.where(my_valid, live, 0), live, tl.where(owns, live, 0), zero, zero,
                   tok_ptr + r * tok_stride, tok0, P, tok_cols, pad_page,
                   pt_ptr, pt_stride, indices_ptr, my_start, indices_cap, TP,
                   HAS_PT, HAS_FI, False, BLOCK_P, BLOCK_TABLE)
