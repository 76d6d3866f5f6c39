"""The fused FlashMLA scheduler kernel (imported lazily: it imports triton).

FlashMLA's schedule (:mod:`attnpool.update.reference.flashmla` says what it is) is a walk over
``num_sm_parts`` parts, each taking whole requests while they fit and cutting the one that does
not. The torch port runs it as ~15 small ops per part, so hundreds of launches per update on a GPU;
this kernel is one program doing the same walk: the rows' inclusive block-cost prefix sums sit in
one ``BLOCK``-wide vector (``tl.cumsum``), and each part finds the last request its payload reaches
by counting the prefix sums at or below its target (they increase strictly: every request costs at
least 6 blocks), which is the port's ``searchsorted``. The part's row and the per-request cut
counts follow the port's formulas one for one, in int32 (the config bounds every block count below
2**31), so the two write the same bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: KV tokens per block, and a request's fixed cost in blocks (the port's BLOCK_N and
#: FIXED_OVERHEAD_BLOCKS)
BLOCK_N: tl.constexpr = tl.constexpr(64)
OVERHEAD: tl.constexpr = tl.constexpr(5)


@triton.jit  # type: ignore[untyped-decorator]
def _cost_at(cinc, offs, j):  # type: ignore[no-untyped-def]
    """``cost[j]``, the blocks before request ``j``: ``cinc[j - 1]``, 0 for ``j = 0``."""
    return tl.sum(tl.where(offs == j - 1, cinc, 0), axis=0)


@triton.jit  # type: ignore[untyped-decorator]
def _end_block(cache_ptr, j, nr):  # type: ignore[no-untyped-def]
    """A finished request's end block: its block count, 0 for a row of length 0 (and for no
    request at all, ``nr = 0``)."""
    length = tl.load(cache_ptr + j, mask=nr > 0, other=0)
    return tl.where(length == 0, 0, (tl.maximum(length - 1, 0) // BLOCK_N) + 1)


@triton.jit  # type: ignore[untyped-decorator]
def flashmla_sched_kernel(  # type: ignore[no-untyped-def]
    cache_ptr, nreal_ptr, md_ptr, ns_ptr,
    n, bs, num_parts,
    DEVICE_N: tl.constexpr, BLOCK: tl.constexpr, SCHED_META: tl.constexpr,
):
    """One program: the schedule of the first ``n`` rows of ``cache_ptr`` (``num_real``'s
    count, clamped to ``[0, bs]``, with ``DEVICE_N``) into ``md_ptr [num_parts, 8]`` (the
    argument layout, or ``DecodingSchedMeta``'s with ``SCHED_META``) and ``ns_ptr[: bs + 1]``;
    padded rows get no work (see :mod:`attnpool.update.reference.flashmla`)."""
    zero = tl.full([], 0, tl.int32)
    nr = zero + n
    if DEVICE_N:
        nr = tl.minimum(tl.maximum(tl.load(nreal_ptr).to(tl.int32), 0), bs)
    offs = tl.arange(0, BLOCK)
    real = offs < nr
    lens = tl.load(cache_ptr + offs, mask=real, other=0)
    cost = tl.where(real, tl.maximum(lens - 1, 0) // BLOCK_N + 1 + OVERHEAD, 0)
    cinc = tl.cumsum(cost, axis=0)
    payload = (tl.sum(cost, axis=0) + num_parts - 1) // num_parts + OVERHEAD
    # an idle part's begin block: request 0's last block (FlashMLA reads it past its array)
    first_last = tl.maximum(tl.load(cache_ptr, mask=nr > 0, other=1) - 1, 0) // BLOCK_N
    cuts = tl.zeros([BLOCK], tl.int32)
    k = tl.arange(0, 8)
    req = zero
    blk = zero
    split = zero
    for p in range(0, num_parts):
        idle = req >= nr
        target = _cost_at(cinc, offs, tl.minimum(req, nr)) + blk + payload
        m = tl.sum(tl.where(real, (cinc <= target).to(tl.int32), 0), axis=0)
        done = m > req
        left = tl.where(done, target - _cost_at(cinc, offs, m), payload) - OVERHEAD
        cut = (m < nr) & (left > 0) & (req < nr)
        new_req = tl.where(idle, req, m)
        new_blk = tl.where(idle, blk, tl.where(done, 0, blk) + tl.where(cut, left, 0))
        new_split = tl.where(idle, split, tl.where(done, 0, split) + cut.to(tl.int32))
        end_req = tl.where(new_blk > 0, new_req, new_req - 1)
        end_blk = tl.where(new_blk > 0, new_blk,
                           _end_block(cache_ptr, tl.maximum(new_req - 1, 0), nr))
        begin_blk = tl.where(idle, blk + first_last, blk)
        if SCHED_META:
            # the request split flags: the part resumes its first request, or stops inside its
            # last one (a request of length 0 never counts); one request: either
            first = blk != 0
            end_len = tl.load(cache_ptr + tl.maximum(end_req, 0), mask=nr > 0, other=0)
            last = (end_blk != tl.maximum(end_len - 1, 0) // BLOCK_N + 1) & (end_len != 0)
            same = req == end_req
            flag_first = tl.where(same, first | last, first).to(tl.int32)
            flag_last = tl.where(same, first | last, last).to(tl.int32)
            row = tl.where(k == 0, tl.where(idle, bs, req),
                  tl.where(k == 1, end_req,
                  tl.where(k == 2, begin_blk,
                  tl.where(k == 3, end_blk,
                  tl.where(k == 4, split,
                  tl.where(k == 5, flag_first,
                  tl.where(k == 6, flag_last, 0)))))))
        else:
            row = tl.where(k == 0, tl.where(idle, bs, req),
                  tl.where(k == 1, begin_blk,
                  tl.where(k == 2, end_req,
                  tl.where(k == 3, end_blk,
                  tl.where(k == 4, split, 0)))))
        tl.store(md_ptr + p * 8 + k, row)
        cuts += (offs == tl.where(cut, m, -1)).to(tl.int32)
        req = new_req
        blk = new_blk
        split = new_split
    splits = tl.cumsum(tl.where(real, cuts + 1, 0), axis=0)
    total = tl.sum(tl.where(real, cuts + 1, 0), axis=0)
    tl.store(ns_ptr + 1 + offs, tl.where(real, splits, total), mask=offs < bs)
    tl.store(ns_ptr, zero)
