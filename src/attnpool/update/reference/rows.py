"""Reading the caller's request table, and the row layouts of the reference path's parts.

Every function here returns temporaries and writes nothing into a pool (the writers are in
:mod:`.writes`): vectorised torch, any device, no loop over rows, no host sync. Every gather from
the caller's table clamps its rows and columns into the table (as the fused kernels do), so no
value can make one fail half-way through an update.

Request tables come in two kinds, read through one helper (:func:`table_slots`): a token-level
``req_to_token [rows, >= C]`` (the token slot of every position) and a page-level block table
``[rows, >= ceil(C / B)]`` of pages of ``B`` tokens (``block_size=B``), whose token slot at
position ``t`` is ``table[r, t // B] * B + t % B``. The same update over either writes the same
bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..buffers import table_width


def table_slots(table: Tensor, rows: Tensor, cols: Tensor, block_size: int | None = None
                ) -> Tensor:
    """Token slots of request rows ``rows`` at token positions ``cols`` (broadcast together,
    both already inside the table): ``table[rows, cols]`` for a token-level table, else
    ``table[rows, cols // B] * B + cols % B`` for a block table of pages of ``B = block_size``
    tokens. Every gather of this module reads the caller's table through here."""
    if block_size is None:
        return table[rows, cols]
    return table[rows, cols // block_size] * block_size + cols % block_size


def gather_pages(req_to_token: Tensor, req_pool_indices: Tensor, page_size: int, width: int,
                 token_offset: Tensor | None = None, out: Tensor | None = None,
                 block_size: int | None = None) -> Tensor:
    """Page ids ``[n, width]`` of pages ``0..width-1`` of each request (a temporary, or ``out``).

    Page ``p`` of request ``r`` is ``req_to_token[r, off + p*P] // P``. Columns past a row's live
    pages hold whatever the table holds there; they are outside every read region, and the
    writers (:mod:`.writes`) never copy them into one. ``token_offset [n]`` shifts each row
    (decoder rows after their encoder tokens); shifted columns are clamped into the table.
    Request rows are clamped into the table too (as on the fused path): an out-of-range
    ``req_pool_indices`` value, which only a sync could detect, gives wrong page ids, never an
    indexing error.

    ``out`` (the part's ``page_table[:n, :width]``) takes the page ids directly, saving the copy
    :func:`.writes.paged_` would make (it skips a ``pages`` that is its own table slice); with
    page size 1 only when the table has ``out``'s dtype (the gather is then the only op).
    Nothing here can raise on values, so writing the table first is safe. ``block_size``:
    ``req_to_token`` is a
    page-level block table (module docstring).
    """
    rows = req_pool_indices.clamp(0, req_to_token.shape[0] - 1)
    if token_offset is None and block_size == page_size and req_to_token.shape[1] >= width:
        # a block table of the part's own pages (vLLM's): page p of a row is column p itself,
        # the bytes of slot // P with slot = id * B (no multiply, shift and divide per page)
        cols = req_to_token[:, :width]
        if out is None:
            return cols.index_select(0, rows)
        if out.dtype == cols.dtype:
            return torch.index_select(cols, 0, rows, out=out)
        return out.copy_(cols.index_select(0, rows))
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


def extend_tokens(seq_lens: Tensor, extend_lens: Tensor, req_pool_indices: Tensor,
                  req_to_token: Tensor, num_tokens: int, block_size: int | None = None,
                  token_offset: Tensor | None = None) -> tuple[Tensor, Tensor]:
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
