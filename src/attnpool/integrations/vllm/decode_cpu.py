"""One-query attention straight from vLLM's CPU cache blocks: the decode path on a CPU.

vLLM's CPU cache keeps, per block and KV head, the keys transposed (``[D, block_size]``) and then
the values (``[block_size, D]``) (:mod:`.cache`). The SDPA adapter needs keys as ``[b, H_kv, L,
D]``, so it copies every row's keys out of the blocks *and transposes them*, a strided copy that
cost more than attention itself (measured with SmolLM2: 0.74 ms per layer against vLLM's own
0.41). For a decode step the transposed layout is what a matrix product wants: scores are
``q · K`` with ``K`` as ``[D, block_size]`` per block, so this path copies each row's blocks
whole (one ``index_select`` over the cache viewed as ``[blocks, H_kv, 2, block_size * D]``: K
and V of a block in one contiguous run) and never transposes a key:

* scores ``[n, W, H_kv, g, P] = q [n, 1, H_kv, g, D] @ K [n, W, H_kv, D, P]`` (``g`` query heads
  per KV head, ``W`` blocks per row, ``P`` tokens per block), scaled, capped (softcap),
* lanes past a row's length (and before its window) masked with ``-inf`` (and the V lanes past
  it in its last block zeroed in the copy), the softmax taken over the row's ``W * P`` lanes in
  float32 (float64 for a float64 cache), with a sink logit per head when the layer has sinks,
* ``out = sum over W of p [n, W, H_kv, g, P] @ V [n, W, H_kv, P, D]``.

What a step's layers share, the block ids and the mask of each part, is computed once per step
and part (:class:`BlockPlan`, kept on the step's metadata). The part is the pool's decode view
(or its window part): its ``page_table`` and ``cache_seqlens`` are the refilled pool buffers,
read as the SDPA adapter reads them (lane ``j`` of row ``i`` is live when ``j <
cache_seqlens[i]`` and, in a window part, ``j >= cache_seqlens[i] - 1 - window_left``); block
ids past a row's length read block 0, vLLM's null block (zeros).

Results equal the SDPA adapter's to float32 rounding (another summation order), not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...config import ceil_div
from ...errors import InputError
from ...views import PagedView


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """What every layer of a step reads of one decode part.

    Fields:
        pages: ``[n * W]`` int64 block ids, row-major (block 0 past a row's length).
        dead: ``[n, 1, 1, W * P]`` bool, True on lanes a row does not attend.
        tail: ``[m]`` int64 rows of the copied blocks viewed as ``[-1, D]`` rows (each a V lane
            of one head): the V lanes past a row's length in its last, partly used block, zeroed
            in the copy (None when every row ends on a block boundary). A freed block may
            hold anything there; ``0 * NaN`` would be NaN.
        n: rows. blocks_per_row: ``W``. page: ``P``. num_kv_heads: ``H_kv`` of the cache.
    """

    pages: Tensor
    dead: Tensor
    tail: Tensor | None
    n: int
    blocks_per_row: int
    page: int
    num_kv_heads: int


def plan_blocks(part: PagedView, n: int, num_kv_heads: int) -> BlockPlan:
    """The :class:`BlockPlan` of the first ``n`` rows of a decode part (a few small ops, once
    per step and part). ``part.max_seqlen_k`` must bound the rows' lengths (the CPU refill
    passes host lengths, so it is the longest row's); the tail lanes are found on the host from
    the lengths (free on a CPU, like the SDPA adapter's page copy)."""
    if part.page_table is None:
        raise InputError("the CPU decode path reads page tables (Layout.FLASH_ATTN)")
    p, hk = part.page_size, num_kv_heads
    w = max(1, ceil_div(part.max_seqlen_k, p))
    lens = part.cache_seqlens[:n].to(torch.int64)[:, None]
    lanes = torch.arange(w * p, device=lens.device)
    live = lanes < lens
    if part.window_left >= 0:
        live &= lanes >= lens - 1 - part.window_left
    table = part.page_table[:n, :w].to(torch.int64)
    pages = torch.where(lanes[::p] < lens, table, 0).reshape(-1)
    tail: list[int] = []
    for i, length in enumerate(lens.view(-1).tolist()):
        blk, off = divmod(length, p)
        if off and blk < w:  # lanes off .. P-1 of block blk, V half, every head
            for h in range(hk):
                first = (((i * w + blk) * hk + h) * 2 + 1) * p
                tail.extend(range(first + off, first + p))
    tail_t = torch.tensor(tail, dtype=torch.int64, device=lens.device) if tail else None
    return BlockPlan(pages, ~live[:, None, None, :], tail_t, n, w, p, hk)


def attend(plan: BlockPlan, q: Tensor, kv_cache: Tensor, scale: float, softcap: float = 0.0,
           sinks: Tensor | None = None) -> Tensor:
    """``out [n, H, D]`` of queries ``q [n, H, D]`` over vLLM's CPU cache ``[num_blocks, H_kv,
    P, 2 * D]`` (module docstring); ``sinks``: float32 ``[H]`` sink logits, or None."""
    blocks, hk, page, two_d = kv_cache.shape
    d, n, w = two_d // 2, plan.n, plan.blocks_per_row
    h = q.shape[1]
    if page != plan.page or hk != plan.num_kv_heads or q.shape != (n, h, d) or h % hk:
        raise InputError(f"expected q [{n}, H, {d}] (H a multiple of {plan.num_kv_heads}) over "
                         f"blocks of {plan.page} tokens and {plan.num_kv_heads} KV heads, got q "
                         f"{tuple(q.shape)} and a cache {tuple(kv_cache.shape)}")
    g = h // hk
    sel = kv_cache.view(blocks, hk, 2, page * d).index_select(0, plan.pages)
    if plan.tail is not None:
        sel.view(-1, d).index_fill_(0, plan.tail, 0)
    sel = sel.view(n, w, hk, 2, page * d)
    keys = sel[:, :, :, 0].view(n, w, hk, d, page)
    values = sel[:, :, :, 1].view(n, w, hk, page, d)
    qg = q.view(n, 1, hk, g, d).to(kv_cache.dtype)
    scores = torch.matmul(qg, keys)  # [n, W, H_kv, g, P]
    acc = torch.float64 if kv_cache.dtype == torch.float64 else torch.float32  # softmax dtype
    s = scores.permute(0, 2, 3, 1, 4).reshape(n, hk, g, w * page).to(acc).mul_(scale)
    if softcap:
        s = torch.tanh(s.div_(softcap)).mul_(softcap)
    s.masked_fill_(plan.dead, float("-inf"))  # (also replaces a NaN key lane's score)
    if sinks is None:
        probs = torch.softmax(s, -1)
    else:
        sink = sinks.view(1, hk, g, 1).to(acc)
        top = torch.maximum(s.amax(-1, keepdim=True), sink)
        e = torch.exp(s - top)
        probs = e.div_(e.sum(-1, keepdim=True) + torch.exp(sink - top))
    p = probs.to(kv_cache.dtype).view(n, hk, g, w, page).permute(0, 3, 1, 2, 4)
    out = torch.matmul(p, values).sum(1)  # [n, H_kv, g, D]
    return out.reshape(n, h, d).to(q.dtype)
