"""Triton kernel of the draft-tree expand part (imported lazily: it imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _floor_div, _slot


@triton.jit  # type: ignore[untyped-decorator]
def _expand_rows(rows, seq_ptr, n_rows, bs, K, pad_len, P):  # type: ignore[no-untyped-def]
    """Per-row facts of expand rows ``rows`` (one row as a scalar, or a block of rows):
    ``(step-0 length, prefix-page tokens, step-0 CSR entries)``, 0 past ``bs * K``; padded rows
    own no CSR entries. The program's own row and every chunk of its prefix sums come from this
    one function, so they cannot disagree."""
    rreal = rows < n_rows
    inb = rows < bs * K
    s = tl.load(seq_ptr + rows // K, mask=rreal, other=0).to(tl.int64)
    part = tl.where(rreal, (s - _floor_div(s, P) * P).to(tl.int32), 0)
    base = tl.where(inb, tl.where(rreal, part + 1, pad_len), 0)  # step 0 lengths
    return base, part, tl.where(rreal, part + 1, 0)


@triton.jit  # type: ignore[untyped-decorator]
def draft_expand_kernel(  # type: ignore[no-untyped-def]
    seq_ptr, rpi_ptr, tok_ptr, loc_ptr, nreal_ptr,
    cache_ptr, cuk_ptr, pt_ptr, indptr_ptr, indices_ptr, last_ptr,
    n, bs, K, S, W, pad_len, pad_id, P,
    ls0, ls1, ls2, tok_rows, tok_cols, tok_stride, pt_stride,
    len_ss, cu_ss, ip_ss, idx_ss, last_ss, indices_cap, TP,
    DEVICE_N: tl.constexpr, HAS_PT: tl.constexpr, HAS_FI: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_TABLE: tl.constexpr,
):
    """One program per expand row ``pid = i*K + k < bs*K``, writing all ``S`` steps.

    The row's token slots are the ``part = seq % P`` slots of its request's last, partial prefix
    page (the table's slots at positions ``full + c``; ``TP``: see :mod:`.kernels`), then
    branch ``k``'s drafts ``loc[i, c - part, k]``. Step ``d`` (0-based) reads ``part + d + 1`` of
    them. Its lengths' cumsum is the step-0 cumsum plus
    ``d`` per real row so far (one scan for all steps). The shared table is written once, for the
    last step; each step has its own small CSR.
    """
    pid = tl.program_id(0)
    n_req = n
    if DEVICE_N:
        n_req = tl.minimum(tl.maximum(tl.load(nreal_ptr).to(tl.int32), 0), bs)
    n_rows = n_req * K
    is_real = pid < n_rows
    my_base, my_part, my_npg0 = _expand_rows(pid, seq_ptr, n_rows, bs, K, pad_len, P)
    # inclusive prefix sums over rows 0..pid, BLOCK rows at a time (registers: one chunk)
    acc_base = tl.zeros([BLOCK], dtype=tl.int32)
    acc_pg = tl.zeros([BLOCK], dtype=tl.int32)
    for c0 in range(0, pid + 1, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        base, _, npg0 = _expand_rows(offs, seq_ptr, n_rows, bs, K, pad_len, P)
        mine = offs <= pid
        acc_base += tl.where(mine, base, 0)
        if HAS_FI:
            acc_pg += tl.where(mine, npg0, 0)
    my_cum0 = tl.sum(acc_base, axis=0)
    my_ip0 = tl.sum(acc_pg, axis=0)
    my_from0 = my_ip0 - my_npg0
    upto = tl.minimum(pid + 1, n_rows)  # real rows in 0..pid
    before = tl.minimum(pid, n_rows)  # real rows in 0..pid-1

    # the row's slots: partial prefix page first, then the branch's drafts
    req = pid // K
    c = tl.arange(0, BLOCK_W)
    r = tl.load(rpi_ptr + req, mask=is_real, other=0).to(tl.int64)
    r = tl.minimum(tl.maximum(r, 0), tok_rows - 1)
    my_s = tl.load(seq_ptr + req, mask=is_real, other=0).to(tl.int64)
    full = _floor_div(my_s, P) * P
    pre = c < tl.where(is_real, my_part, 0)
    tcol = tl.minimum(tl.maximum(full + c.to(tl.int64), 0), tok_cols - 1)
    tok = _slot(tok_ptr + r * tok_stride, tcol, pre, TP, BLOCK_TABLE)
    di = tl.minimum(tl.maximum(c - my_part, 0), S - 1).to(tl.int64)
    drf_ok = (c >= my_part) & (c < tl.where(is_real, W, 0))
    drf = tl.load(loc_ptr + req.to(tl.int64) * ls0 + di * ls1 + (pid % K) * ls2, mask=drf_ok,
                  other=0)
    slot = tl.where(pre, tok.to(tl.int64), drf.to(tl.int64)).to(tl.int32)

    for d in range(S):
        tl.store(cache_ptr + d * len_ss + pid, my_base + tl.where(is_real, d, 0))
        tl.store(cuk_ptr + d * cu_ss + pid + 1, my_cum0 + d * upto)
        if pid == 0:
            tl.store(cuk_ptr + d * cu_ss, my_cum0 * 0)
        if HAS_FI:
            tl.store(indptr_ptr + d * ip_ss + pid + 1, my_ip0 + d * upto)
            tl.store(last_ptr + d * last_ss + pid, tl.where(is_real, 1, 0) + my_cum0 * 0)
            if pid == 0:
                tl.store(indptr_ptr + d * ip_ss, my_cum0 * 0)
            pos = my_from0 + d * before + c
            ok = (c < tl.where(is_real, my_part + d + 1, 0)) & (pos >= 0) & (pos < indices_cap)
            tl.store(indices_ptr + d * idx_ss + pos, slot, mask=ok)
    if HAS_PT:
        cnt = tl.where(is_real, my_part + S, pad_len)
        val = tl.where(is_real, slot, pad_id)
        tl.store(pt_ptr + pid.to(tl.int64) * pt_stride + c, val, mask=(c < cnt) & (c < W))
