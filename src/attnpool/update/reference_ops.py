"""The reference path's torch building blocks: vectorised, any device, no loop over rows, no sync.

:mod:`.reference` composes these into the part updates a phase runs (the same functions, with
the same signatures, as :mod:`.triton`'s fused ones). Each writer here writes the *whole read
region* of its buffers for ``bs`` rows (padded rows included) and nothing the caller has not
validated. Writes go in place into arena slices (``out=``, ``copy_``, ``fill_``); the few
temporaries are ``[n, width]`` page blocks. Every gather from the caller's table clamps its rows
and columns into the table (as the fused kernels do), so no value can make one fail half-way.

Request tables come in two kinds, read through one helper (:func:`table_slots`): a token-level
``req_to_token [rows, >= C]`` (the token slot of every position) and a page-level block table
``[rows, >= ceil(C / B)]`` of pages of ``B`` tokens (``block_size=B``), whose token slot at
position ``t`` is ``table[r, t // B] * B + t % B``. The same update over either writes the same
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class PagedBuffers:
    """Full-size buffers of one paged part (see ``specs.paged_specs``); layout-less ones are None."""

    cache_seqlens: Tensor
    cu_seqlens_k: Tensor
    page_table: Tensor | None
    kv_indptr: Tensor | None
    kv_indices: Tensor | None
    kv_last_page_len: Tensor | None
    #: the pool's constant ``0, 1, 2, ...`` (int32, longer than any row count or page width):
    #: the reference path's column numbers without a temporary. The fused path never reads it;
    #: None makes the reference path build a temporary instead.
    arange: Tensor | None = None


def table_width(table: Tensor, block_size: int | None = None) -> int:
    """Token positions a request table covers: its columns, times ``block_size`` for a block
    table (see the module docstring)."""
    return table.shape[1] * (block_size or 1)


def window_width(w: PagedBuffers) -> int:
    """Page columns a window part holds: its page table's width, or for a CSR-only part its
    ``kv_indices`` capacity per row (``rows * width + 1`` elements). Window lengths are clamped
    to it on both paths, so no value can list more pages than the part has room for."""
    if w.page_table is not None:
        return int(w.page_table.shape[1])
    assert w.kv_indices is not None and w.kv_last_page_len is not None  # (the CSR triple)
    return (w.kv_indices.shape[0] - 1) // max(1, w.kv_last_page_len.shape[-1])


def table_slots(table: Tensor, rows: Tensor, cols: Tensor, block_size: int | None = None
                ) -> Tensor:
    """Token slots of request rows ``rows`` at token positions ``cols`` (broadcast together,
    both already inside the table): ``table[rows, cols]`` for a token-level table, else
    ``table[rows, cols // B] * B + cols % B`` for a block table of pages of ``B = block_size``
    tokens. Every gather of this module reads the caller's table through here."""
    if block_size is None:
        return table[rows, cols]
    return table[rows, cols // block_size] * block_size + cols % block_size


def gather_pages(
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    page_size: int,
    width: int,
    token_offset: Tensor | None = None,
    out: Tensor | None = None,
    block_size: int | None = None,
) -> Tensor:
    """Page ids ``[n, width]`` of pages ``0..width-1`` of each request (a temporary, or ``out``).

    Page ``p`` of request ``r`` is ``req_to_token[r, off + p*P] // P``. Columns past a row's live
    pages hold whatever the table holds there; they are outside every read region and the writers
    below never copy them into one. ``token_offset [n]`` shifts each row (decoder rows after their
    encoder tokens); shifted columns are clamped into the table. Request rows are clamped into
    the table too (as on the fused path): an out-of-range ``req_pool_indices`` value, which only a
    sync could detect, gives wrong page ids, never an indexing error.

    ``out`` (the part's ``page_table[:n, :width]``) takes the page ids directly, saving the copy
    :func:`paged_` would make (it skips a ``pages`` that is its own table slice); with page size 1
    only when the table has ``out``'s dtype (the gather is then the only op). Nothing here can
    raise on values, so writing the table first is safe. ``block_size``: ``req_to_token`` is a
    page-level block table (module docstring).
    """
    rows = req_pool_indices.clamp(0, req_to_token.shape[0] - 1)
    if token_offset is None and block_size is None:
        cols = req_to_token[:, : width * page_size : page_size]
        if page_size == 1 and out is not None and out.dtype == cols.dtype:
            return torch.index_select(cols, 0, rows, out=out)
        tok = cols.index_select(0, rows)
    else:
        idx = torch.arange(width, device=req_to_token.device) * page_size
        if token_offset is not None:
            idx = idx[None, :] + token_offset[:, None]
        idx = idx.clamp_(0, table_width(req_to_token, block_size) - 1)
        tok = table_slots(req_to_token, rows[:, None], idx, block_size)
    if page_size == 1:
        return tok
    return floor_div(tok, page_size, out)


#: 0-dim shift amounts per (bits, dtype): a Python int shift is wrapped into a tensor and cast
#: on every call, which costs more than the shift itself on a small tensor
_SHIFTS: dict[tuple[int, torch.dtype], Tensor] = {}


def floor_div(t: Tensor, d: int, out: Tensor | None = None) -> Tensor:
    """``floor(t / d)`` for ints, into ``out`` when given. A power of two is an arithmetic right
    shift (the same bytes as the floor division, negative values included, about three times
    faster on CPU for a large block); any other ``d`` divides."""
    if d & (d - 1) == 0:
        key = (d.bit_length() - 1, t.dtype)
        shift = _SHIFTS.get(key)
        if shift is None:  # (a host scalar: usable with a tensor on any device)
            shift = _SHIFTS[key] = torch.tensor(key[0], dtype=t.dtype, device="cpu")
        if out is not None:
            return torch.bitwise_right_shift(t, shift, out=out)
        return torch.bitwise_right_shift(t, shift)
    if out is not None:
        return torch.div(t, d, rounding_mode="floor", out=out)
    return torch.div(t, d, rounding_mode="floor")


def lengths_(dst: Tensor, src: Tensor, add: int, bs: int, pad: int, max_len: int = 2**31 - 1
             ) -> None:
    """``dst[:n] = clamp(src + add, 0, max_len)`` (int32); ``dst[n:bs] = pad`` (the padded length).

    The clamp never changes an in-contract length. It bounds an out-of-contract device value
    (which only a sync could detect) so the rest of the update, and every kernel reading the
    view, stays inside the part's buffers: wrong metadata, never a stray index.
    """
    n = src.shape[0]
    real = dst[:n]
    if not add and src.dtype == dst.dtype:
        torch.clamp(src, 0, max_len, out=real)  # one op for int32 inputs
    else:
        if add:
            torch.add(src, add, out=real)
        else:
            real.copy_(src)
        real.clamp_(0, max_len)  # (a value past int32 has wrapped by now; the clamp bounds it)
    if n < bs:  # (an empty fill is still a dispatched op)
        dst[n:bs].fill_(pad)


def cumsum_(dst: Tensor, lens: Tensor) -> None:
    """``dst[0] = 0``, ``dst[1:len+1] = cumsum(lens)`` in place (int32)."""
    dst[:1].zero_()
    torch.cumsum(lens, 0, dtype=dst.dtype, out=dst[1 : lens.shape[0] + 1])


def paged_(
    b: PagedBuffers,
    *,
    bs: int,
    pages: Tensor,
    page_size: int,
    pad_page: int,
    pad_pages: int,
    arange: Tensor,
) -> None:
    """Write ``cu_seqlens_k`` and the page layouts of ``bs`` rows from ``cache_seqlens[:bs]``.

    ``pages [n, W]`` are the real rows' page ids (``W`` covers every real row's live pages); rows
    ``n..bs`` are padding. ``arange`` is the pool's constant ``0, 1, 2, ...`` (no temporary needed
    for column numbers). Padded FlashInfer rows own no pages (``kv_indptr`` repeats) and have
    ``kv_last_page_len = 0``, as has any row that owns no pages: FlashInfer's prefill plan takes a
    row's length as ``max(pages - 1, 0) * P + kv_last_page_len`` on the host, so a 1 there makes its
    Hopper kernels read a page the row does not own (an illegal address when that entry was never
    written); padded page-table rows read ``pad_page`` in their first
    ``pad_pages`` columns.
    """
    n, width = pages.shape
    if arange.shape[0] < max(width, bs) + 1:
        raise RuntimeError(f"arange constant too short: {arange.shape[0]} < {max(width, bs) + 1}")
    lens = b.cache_seqlens[:bs]
    cumsum_(b.cu_seqlens_k, lens)
    if b.page_table is not None:
        if pages.data_ptr() != b.page_table.data_ptr():  # (not gathered in place)
            b.page_table[:n, :width].copy_(pages)
        if n < bs:
            b.page_table[n:bs, :pad_pages].fill_(pad_page)
    if b.kv_indptr is not None and b.kv_indices is not None and b.kv_last_page_len is not None:
        real = lens[:n]
        npages = torch.div(real + (page_size - 1), page_size, rounding_mode="floor")
        cumsum_(b.kv_indptr, npages)
        if n < bs:
            b.kv_indptr[n + 1 : bs + 1].copy_(b.kv_indptr[n : n + 1].expand(bs - n))
        cols = arange[:width]
        pos = b.kv_indptr[:n, None] + cols[None, :]
        # Lanes past a row's live pages go to the scratch slot at the end of kv_indices, so the
        # scatter needs no host-side compaction; so do lanes past the CSR's capacity, which only
        # out-of-contract lengths reach (as the fused kernels mask them: wrong metadata, never
        # an indexing error half-way through the update).
        scratch = b.kv_indices.shape[0] - 1
        pos = torch.where((cols[None, :] < npages[:, None]) & (pos < scratch), pos, scratch)
        b.kv_indices.scatter_(0, pos.reshape(-1).long(), pages.reshape(-1).to(b.kv_indices.dtype))
        # (len - 1) % P + 1, and 0 for a row that owns no pages (an empty row: a draft tree
        # prefix shorter than a page)
        torch.remainder((real - 1).clamp_(min=0), page_size, out=b.kv_last_page_len[:n])
        b.kv_last_page_len[:n].add_(1).mul_(npages > 0)
        if n < bs:
            b.kv_last_page_len[n:bs].fill_(0)


def tree_expand(
    tree_mask: Tensor, seq_lens: Tensor, req_pool_indices: Tensor, req_to_token: Tensor,
    block_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Verify tree expand rows: ``(lens [n*N], slots [n*N, N])`` temporaries.

    Row ``i*N + j`` lists the token slots ``req_to_token[r_i, seq_lens[i] + k]`` of the draft
    tokens ``k`` that ``tree_mask[i, j, k]`` allows (ancestors and itself), allowed first in
    increasing ``k``; its length is the allowed count. A stable sort on "not allowed" orders the
    columns without any host sync.
    """
    n, nd, _ = tree_mask.shape
    lens = tree_mask.sum(-1, dtype=torch.int32).reshape(n * nd)
    order = torch.argsort((~tree_mask).to(torch.uint8), dim=-1, stable=True)
    cols = (seq_lens.to(torch.int64)[:, None, None] + order).clamp_(
        0, table_width(req_to_token, block_size) - 1)
    rows = req_pool_indices.to(torch.int64).clamp(0, req_to_token.shape[0] - 1)
    slots = table_slots(req_to_token, rows[:, None, None], cols, block_size)
    return lens, slots.reshape(n * nd, nd)


def draft_expand(
    seq_lens: Tensor,
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    out_cache_loc: Tensor,
    page_size: int,
    block_size: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Draft tree prefix/expand split: ``(full [n], partial [n*K], slots [n*K, P-1+S])``.

    ``full = seq_lens`` rounded down to whole pages (the shared prefix pass); row ``i*K + k``
    lists the ``partial = seq_lens - full`` token slots of the last, partial prefix page, then
    branch ``k``'s draft slots ``out_cache_loc[i, 0..S-1, k]``. Step ``d`` reads ``partial + d``.
    """
    n, steps, topk = out_cache_loc.shape
    width = page_size - 1 + steps
    seq = seq_lens.to(torch.int64)
    full = torch.div(seq, page_size, rounding_mode="floor") * page_size
    part = seq - full
    c = torch.arange(width, device=seq.device)
    tok_col = (full[:, None] + c[None, :]).clamp_(0, table_width(req_to_token, block_size) - 1)
    rows = req_pool_indices.to(torch.int64).clamp(0, req_to_token.shape[0] - 1)
    prefix_slots = table_slots(req_to_token, rows[:, None], tok_col, block_size)  # [n, W]
    s_idx = (c[None, :] - part[:, None]).clamp_(0, steps - 1)  # [n, W]
    drafts = out_cache_loc.gather(1, s_idx[:, :, None].expand(n, width, topk))  # [n, W, K]
    is_prefix = (c[None, :] < part[:, None])[:, :, None]
    slots = torch.where(is_prefix, prefix_slots[:, :, None].to(drafts.dtype), drafts)
    slots = slots.permute(0, 2, 1).reshape(n * topk, width)
    return full, part.repeat_interleave(topk), slots


def local_rows(
    kv_lens: Tensor, num_queries: int, chunk: int, rows_per_request: int, pad_seq_len: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Chunked local attention virtual rows: ``(q_lens, kv_lens, token_offset, valid)``, each
    ``[n*V]``.

    The request's last ``num_queries`` positions ``L-q .. L-1`` are split by chunk: row ``v``
    covers chunk ``c = (L-q)//A + v`` with queries ``max(cA, L-q) .. min((c+1)A, L)-1`` and keys
    ``cA .. min((c+1)A, L)-1`` (so ``kv_len = (L-1) % A + 1`` in decode). Rows past the last
    chunk have no queries and the padded length.
    """
    seq = kv_lens.to(torch.int64)
    v = torch.arange(rows_per_request, device=seq.device)
    c = torch.div(seq - num_queries, chunk, rounding_mode="floor")[:, None] + v[None, :]
    last = torch.div(seq - 1, chunk, rounding_mode="floor")[:, None]
    valid = c <= last
    start = c * chunk
    q_end = torch.minimum(start + chunk, seq[:, None])
    q_start = torch.maximum(start, (seq - num_queries)[:, None])
    q_lens = torch.where(valid, q_end - q_start, 0)
    kv = torch.where(valid, q_end - start, pad_seq_len)
    off = torch.where(valid, start, 0)
    return q_lens.reshape(-1), kv.reshape(-1), off.reshape(-1), valid.reshape(-1)


def local_extend_rows(
    seq_lens: Tensor, extend_lens: Tensor, chunk: int, rows: int, pad_seq_len: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Chunked local attention virtual rows of a prefill: ``(q_lens, kv_lens, token_offset,
    valid, request)``, each ``[rows]``.

    Request ``i`` (``L = seq_lens[i]`` keys, the last ``q = extend_lens[i]`` new) touches chunks
    ``(L-q)//A .. (L-1)//A``; it gets one row per chunk, the rows of all requests laid out one
    after the other in request order (a ``searchsorted`` over their cumsum finds each row's
    request, no host sync), so the packed queries stay in order. Row of chunk ``c``: queries
    ``max(cA, L-q) .. min((c+1)A, L)-1``, keys ``cA .. min((c+1)A, L)-1``. Rows past the last
    request's are padding: no queries, the padded length, request 0.
    """
    seq = seq_lens.to(torch.int64)
    start = seq - extend_lens.to(torch.int64)
    first = torch.div(start, chunk, rounding_mode="floor")
    count = torch.div(seq - 1, chunk, rounding_mode="floor") - first + 1
    ends = torch.cumsum(count, 0)
    v = torch.arange(rows, device=seq.device)
    req = torch.searchsorted(ends, v, right=True)
    valid = req < seq.shape[0]
    req = req.clamp_(max=max(seq.shape[0] - 1, 0))
    c = first[req] + v - (ends[req] - count[req])
    lo = c * chunk
    q_end = torch.minimum(lo + chunk, seq[req])
    q_lens = torch.where(valid, q_end - torch.maximum(lo, start[req]), 0)
    kv = torch.where(valid, q_end - lo, pad_seq_len)
    return q_lens, kv, torch.where(valid, lo, 0), valid, torch.where(valid, req, 0)


def extend_tokens(
    seq_lens: Tensor,
    extend_lens: Tensor,
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    num_tokens: int,
    block_size: int | None = None,
    token_offset: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per packed query token of an extend batch: ``(positions, slots)``, each ``[num_tokens]``
    int64 temporaries.

    Token ``cu[i] + j`` (``cu = [0, cumsum(extend_lens)]``, ``j < extend_lens[i]``) of request
    ``i`` is at position ``p = seq_lens[i] - extend_lens[i] + j`` and its KV slot is
    ``req_to_token[req_pool_indices[i], off_i + p]`` (``off_i = token_offset[i]``, else 0);
    tokens past ``sum(extend_lens)`` get position 0 and slot -1. A ``searchsorted`` over the
    cumsum finds each token's request, no host sync. Table rows and columns are clamped into the
    table (as on the fused path): out-of-contract values give wrong slots, never an IndexError.
    """
    dev = seq_lens.device
    n = seq_lens.shape[0]
    t = torch.arange(num_tokens, device=dev)
    if n == 0:
        return torch.zeros_like(t), torch.full_like(t, -1)  # ok: no real token; padded values
    ext = extend_lens.to(torch.int64)
    ends = torch.cumsum(ext, 0)
    row = torch.searchsorted(ends, t, right=True)
    real = row < n
    row = row.clamp_(max=n - 1)
    pos = seq_lens.to(torch.int64)[row] - ends[row] + t
    pos = torch.where(real, pos, 0)
    col = pos if token_offset is None else pos + token_offset.to(torch.int64)[row]
    col = col.clamp(0, table_width(req_to_token, block_size) - 1)
    rows = req_pool_indices.to(torch.int64)[row].clamp_(0, req_to_token.shape[0] - 1)
    slots = table_slots(req_to_token, rows, col, block_size).to(torch.int64)
    return pos, torch.where(real, slots, -1)
