"""FlashMLA's dense-decode tile scheduler, ported exactly: ``tile_scheduler_metadata`` and
``num_splits`` from ``cache_seqlens``.

FlashMLA's dense decode kernel splits each request's KV into 64-token blocks and spreads the
blocks of the whole batch over ``num_sm_parts`` persistent parts; a request cut across parts gets
several splits, merged by its combine kernel. The schedule is integer arithmetic over the lengths
(FlashMLA computes it with a one-warp kernel, ``get_mla_metadata``), so a torch port is exact:

* every request costs ``ceil(max(len, 1) / 64)`` blocks (a row of length 0 still costs one) plus
  a fixed overhead of 5 blocks, and each part takes ``payload = ceil(total / num_sm_parts) + 5``;
* a part finishes whole requests while they fit (``remaining blocks + 5 <= payload left``); the
  request that does not fit gets ``payload left - 5`` of its blocks in this part (when that is
  positive) and one more split, and the next part goes on from there;
* ``num_sm_parts = max(num_sms // h_k // ceil(s_q * h_q / h_k / 64), 1)`` (the bf16 kernel; an
  fp8 cache halves ``num_sms``), with ``s_q`` the query rows per request: 1 for decode, ``N`` for
  verify, so the two need different metadata.

Row ``p`` of ``tile_scheduler_metadata [num_sm_parts, 8] int32`` in the layout of the API that
takes the metadata as arguments (``get_mla_metadata`` returning the pair, vLLM's FlashMLA build)
is ``[begin_req, begin_block, end_req, end_block, begin_split, 0, 0, 0]`` (requests inclusive,
the last three unused: FlashMLA leaves them unwritten and never reads them; zeros here;
blocks ``[begin, end)`` in the first and last request); ``num_splits [b + 1]`` is the cumulative
count of splits per request. :class:`SchedLayout.DECODING_SCHED_META` gives FlashMLA's later
struct order instead (``DecodingSchedMeta``: begin and end request, begin and end block, begin
split, first-request-split flag, last-request-split flag, pad), what a caller filling a
``FlashMLASchedMeta`` itself writes.

Padded rows (a graph captured for ``bs`` rows, metadata for ``n <= bs`` requests): a part with
no work left has ``begin_req = bs``, the kernel call's batch, in both layouts: every build of the
kernel skips a part whose begin request is ``>= b`` (FlashMLA's own planner marks idle parts
so), while ``-1``, the mark of vLLM's FlashMLA build (which skips both), would run requests
``-1 .. end`` in FlashMLA's own build of the argument API. ``num_splits[n + 1:]`` repeats
``num_splits[n]`` when a longer buffer is filled (so padded rows have no split).

**The pool's buffers** (``PoolConfig(flashmla=...)``; :func:`flashmla_part_`, the reference
path's part, and :mod:`.triton.flashmla`, the fused one, write the same bytes) schedule the
``n`` real rows only, never the padded ones, although those hold a valid ``pad_seq_len``: a
padded row that took blocks would take SM time from real rows in every replay of a graph
captured for more rows than the step has, and its splits would shift every later row's. So
padded rows get no work: parts past the real work are marked idle (begin request ``bs``),
``num_splits[n + 1 : bs + 1] = num_splits[n]``. A batch of no real row (``n = 0``, the capture
state) has every part idle: ``[bs, 0, -1, 0, 0, 0, 0, 0]`` (``[bs, -1, 0, ...]`` in the struct
layout; :func:`idle_row_`) and ``num_splits`` all 0.

One loop over the parts (a few tensor ops each, on the lengths' device, no host read); no loop
over requests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...config import FLASHMLA_PAGE_SIZE, SchedLayout, is_int
from ...config import num_sm_parts as num_sm_parts
from ...errors import InputError
from ..buffers import PagedBuffers
from ..parts import FlashMLAPart

__all__ = ["BLOCK_N", "FIXED_OVERHEAD_BLOCKS", "METADATA_SIZE", "SchedLayout", "flashmla_part_",
           "get_mla_metadata", "idle_row_", "num_sm_parts"]

#: KV tokens per block of FlashMLA's dense decode kernel (and its page size).
BLOCK_N = FLASHMLA_PAGE_SIZE
#: the scheduler's fixed cost of a request, in blocks
FIXED_OVERHEAD_BLOCKS = 5
#: int32 per part in ``tile_scheduler_metadata``
METADATA_SIZE = 8


def get_mla_metadata(cache_seqlens: Tensor, num_parts: int, *,
                     layout: SchedLayout = SchedLayout.ARGUMENTS,
                     tile_scheduler_metadata: Tensor | None = None,
                     num_splits: Tensor | None = None,
                     batch: int | None = None) -> tuple[Tensor, Tensor]:
    """``(tile_scheduler_metadata [num_parts, 8] int32, num_splits [>= b + 1] int32)`` of the
    ``b`` requests of ``cache_seqlens`` (int32 or int64, ``>= 0``), as FlashMLA computes them.

    ``num_parts``: :func:`num_sm_parts` of the kernel call. ``tile_scheduler_metadata`` /
    ``num_splits``: buffers to write instead of new tensors (``[num_parts, 8]`` and ``[>= b +
    1]`` int32 on the lengths' device); ``num_splits`` past ``b + 1`` gets ``num_splits[b]``.
    Values are not read on the host: a negative length is the caller's bug (as in FlashMLA).
    ``batch``: the kernel call's batch (``>= b``, default ``b``), the begin request of a part
    with no work in the struct layout, which the kernel skips when it is ``>= batch``.
    """
    if not isinstance(cache_seqlens, Tensor) or cache_seqlens.dim() != 1 \
            or cache_seqlens.dtype not in (torch.int32, torch.int64) or cache_seqlens.numel() < 1:
        got = ((tuple(cache_seqlens.shape), cache_seqlens.dtype)
               if isinstance(cache_seqlens, Tensor) else type(cache_seqlens).__name__)
        raise InputError(f"cache_seqlens must be a non-empty [b] int32/int64 tensor, got {got}")
    if not is_int(num_parts) or num_parts < 1:
        raise InputError(f"num_parts must be an int >= 1, got {num_parts!r}")
    if not isinstance(layout, SchedLayout):
        raise InputError(f"layout must be a SchedLayout, got {layout!r}")
    b, dev = cache_seqlens.shape[0], cache_seqlens.device
    if batch is None:
        batch = b
    if not is_int(batch) or batch < b:
        raise InputError(f"batch must be an int >= b={b}, got {batch!r}")
    md = _buffer("tile_scheduler_metadata", tile_scheduler_metadata, (num_parts, METADATA_SIZE),
                 dev)
    ns = _buffer("num_splits", num_splits, None, dev, min_len=b + 1)
    lens = cache_seqlens.to(torch.int64)
    last_block = (lens - 1).clamp(min=0) // BLOCK_N  # index of each request's last block
    nb = last_block + 1
    # CS[j]: the cost before request j (a prefix sum of the host reference; element 0 is 0)
    cost = torch.zeros(b + 1, dtype=torch.int64, device=dev)  # ok: scratch of the scheduler
    torch.cumsum(nb + FIXED_OVERHEAD_BLOCKS, 0, out=cost[1:])
    payload = -(-cost[b] // num_parts) + FIXED_OVERHEAD_BLOCKS
    end_block_full = torch.where(lens == 0, 0, nb)  # a finished request's end block
    zero = torch.zeros((), dtype=torch.int64, device=dev)  # ok: one scalar, the loop's start
    req, blk, split = zero, zero, zero
    rows, cut_reqs = [], []
    for _ in range(num_parts):
        idle = req >= b
        pos = cost[req.clamp(max=b)] + blk
        m = (torch.searchsorted(cost, (pos + payload).view(1), right=True)[0] - 1).clamp(max=b)
        done = m > req  # finished the current request (and maybe more)
        left = torch.where(done, pos + payload - cost[m], payload) - FIXED_OVERHEAD_BLOCKS
        cut = (m < b) & (left > 0) & ~idle  # the part ends inside request m
        new_blk = torch.where(done, zero, blk) + torch.where(cut, left, zero)
        new_split = torch.where(done, zero, split) + cut.long()
        new_req = torch.where(idle, req, m)
        new_blk, new_split = torch.where(idle, blk, new_blk), torch.where(idle, split, new_split)
        end_req = torch.where(new_blk > 0, new_req, new_req - 1)
        end_blk = torch.where(new_blk > 0, new_blk, end_block_full[(new_req - 1).clamp(min=0)])
        # FlashMLA reads the begin block of a part past the last request from the word after its
        # per-request first-block array: request 0's last block (never used: the part is idle)
        begin_blk = torch.where(idle, blk + last_block[0], blk)
        rows.append((req, begin_blk, end_req, end_blk, split, blk))
        cut_reqs.append(torch.where(cut, m, b))
        req, blk, split = new_req, new_blk, new_split
    begin_req, begin_blk, end_req, end_blk, begin_split, resumed = (
        torch.stack(c) for c in zip(*rows, strict=True))
    md.zero_()
    if layout is SchedLayout.ARGUMENTS:
        md[:, 0] = torch.where(begin_req >= b, batch, begin_req)
        md[:, 1], md[:, 2], md[:, 3], md[:, 4] = begin_blk, end_req, end_blk, begin_split
    else:
        first = resumed != 0  # the part starts inside a request another part began
        last = (end_blk != last_block[end_req] + 1) & (lens[end_req] != 0)
        same = begin_req == end_req
        both = first | last
        md[:, 0], md[:, 1], md[:, 2], md[:, 3], md[:, 4] = (
            torch.where(begin_req >= b, batch, begin_req), end_req, begin_blk, end_blk,
            begin_split)
        md[:, 5] = torch.where(same, both, first)
        md[:, 6] = torch.where(same, both, last)
    splits = 1 + torch.bincount(torch.stack(cut_reqs), minlength=b + 1)[:b]
    ns[0] = 0
    torch.cumsum(splits, 0, out=splits)
    ns[1: b + 1] = splits
    ns[b + 1:] = splits[-1]
    return md, ns


def idle_row_(tile_scheduler_metadata: Tensor, layout: SchedLayout = SchedLayout.ARGUMENTS,
              bs: int = 0) -> None:
    """Every part idle, the schedule of no request (``n = 0``), as the fused kernel writes it
    (its idle-part formulas read no request: begin and end block 0, end request ``n - 1``):
    ``[bs, 0, -1, 0, 0, 0, 0, 0]``, or ``[bs, -1, 0, 0, 0, 0, 0, 0]`` in the struct layout."""
    md = tile_scheduler_metadata
    md.zero_()
    if layout is SchedLayout.ARGUMENTS:
        md[:, 0] = bs
        md[:, 2] = -1
    else:
        md[:, 0] = bs
        md[:, 1] = -1


def flashmla_part_(b: PagedBuffers, part: FlashMLAPart) -> None:
    """The reference path's FlashMLA part: the schedule of the first ``n`` rows of the part's
    ``cache_seqlens`` (written by the paged part just before, in stream order) into
    ``tile_scheduler_metadata [num_parts, 8]`` and ``num_splits[: bs + 1]`` (see the module
    docstring: padded rows get no work), in ``layout`` (an idle part's begin request in the
    struct layout is ``bs``, the call's batch). ``num_real`` is refused (capturable updates are
    the fused path's)."""
    bs, n, md, layout = part.bs, part.n, part.tile_scheduler_metadata, part.layout
    if part.num_real is not None:
        raise InputError("num_real (a capturable update) needs the fused path, impl=TRITON; "
                         "the reference path reads the real count n on the host")
    if not (is_int(n) and is_int(bs) and 0 <= n <= bs):
        raise InputError(f"n must be an int in [0, bs={bs}], got {n!r}")
    if md.shape[0] != part.num_parts:
        raise InputError(f"tile_scheduler_metadata must have num_parts={part.num_parts} rows, "
                         f"got {tuple(md.shape)}")
    ns = part.num_splits[: bs + 1]
    if n == 0:
        idle_row_(md, layout, bs)
        ns.zero_()
        return
    get_mla_metadata(b.cache_seqlens[:n], part.num_parts, layout=layout, tile_scheduler_metadata=md,
                     num_splits=ns, batch=bs)


def _buffer(name: str, t: Tensor | None, shape: tuple[int, ...] | None, dev: torch.device,
            min_len: int = 0) -> Tensor:
    if t is None:
        return torch.empty(shape or (min_len,), dtype=torch.int32, device=dev)
    ok = (isinstance(t, Tensor) and t.dtype == torch.int32 and t.device == dev
          and t.is_contiguous()
          and (tuple(t.shape) == shape if shape else t.dim() == 1 and t.shape[0] >= min_len))
    if not ok:
        got = (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, Tensor) else type(t).__name__
        want = f"{list(shape)}" if shape else f"[>= {min_len}]"
        raise InputError(f"{name} must be a contiguous {want} int32 tensor on {dev}, got {got}")
    return t
