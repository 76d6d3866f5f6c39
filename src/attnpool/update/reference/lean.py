"""The reference path's lean paged part: an engine's step from its own block table, in the
fewest torch ops and Python lines.

An engine's builder calls the pool once per step (and KV-cache group) on the host, between two
forwards: on a CPU its whole cost is host time, spent on code the model's forward has just
pushed out of the caches. The general part update (:func:`.parts.paged_part_`)
serves every shape of part (chain draft steps, window twins, encoder offsets, CSR, token-level
tables); this one serves the shape engines step with and nothing else:

- a page table and no CSR (``Layout.FLASH_ATTN``),
- a block table of the part's own pages (``block_size == page_size``: page ``p`` of a row is
  column ``p`` of its table row),
- one step, no token offset, no length added, no whole-page rounding,
- a window part when it has a page table too (its rows start at a page of the table: a
  gather of each row's window columns),
- the extend query part and ``positions`` when the part has them; ``out_slots`` when given.

:func:`lean_fits` says at bind time (on the record's static fields) whether a part has that
shape; the reference ``paged_launch`` then binds :func:`lean_paged_part_` instead of the
general one. The bytes are the general part's in every read region (the tests compare them
with ``torch.equal`` over random steps, padded rows included), so which of the two ran is not
observable. A replay whose inputs leave the shape (a table narrower than the columns asked
for) runs the general part.

Ops of a decode step with the batch's rows in table order: the lengths (one clamp), their
cumsum (two) and the page rows (one copy), plus one fill per padded field when ``n < bs``.
An extend step adds its query offsets (three) and, with the host token count, the positions of
the real tokens (six) and the tail's fill.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...config import ceil_div
from ..buffers import PagedBuffers
from ..parts import PagedPart
from .parts import INT32_MAX, _queries_, _tokens_, paged_part_
from .rows import floor_div


def lean_fits(b: PagedBuffers, part: PagedPart) -> bool:
    """Whether ``part`` over ``b`` has the lean shape (see the module docstring)."""
    w = part.window
    return (b.page_table is not None and b.kv_indptr is None and b.arange is not None
            and part.block_size is not None and part.block_size == part.page_size
            and part.steps == 1 and not part.full_pages and not part.extra
            and (w is None or (w.page_table is not None and w.kv_indptr is None
                               and part.window_size is not None))
            and part.window_out_slots is None
            and part.token_offset is None and part.num_real is None)


#: slices memoised per lean part and kind before starting over (a bound, as the phases' views)
_MAX_SLICES = 4096


def _memo(cache: dict[tuple[int, ...], Any], key: tuple[int, ...],
          make: Callable[[], Any]) -> Any:
    got = cache.get(key)
    if got is None:
        if len(cache) >= _MAX_SLICES:
            cache.clear()
        got = cache[key] = make()
    return got


class LeanPaged:
    """The lean part update of one part's buffers: :func:`.parts.paged_part_`'s
    bytes for a part of the lean shape, as a callable ``(b, part)``.

    The arena never moves, so every slice of the part's own buffers that a step needs (a
    function of ``n``, ``bs``, the page columns and the token count only) is made once and
    kept: on a CPU a slice is a dispatched op of its own, about as dear as a small write.
    """

    __slots__ = ("_cols", "_queries", "_rows", "_tokens", "_window")

    def __init__(self) -> None:
        self._rows: dict[tuple[int, ...], tuple[Tensor, ...]] = {}
        self._cols: dict[tuple[int, ...], Tensor] = {}
        self._queries: dict[tuple[int, ...], tuple[Tensor, ...]] = {}
        self._tokens: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}
        self._window: dict[tuple[int, ...], tuple[Tensor, ...]] = {}

    def __call__(self, b: PagedBuffers, part: PagedPart) -> None:
        table, seq_lens, rows = part.req_to_token, part.seq_lens, part.req_pool_indices
        cap = b.page_table.shape[1]  # type: ignore[union-attr]
        w = cap if part.width is None else min(part.width, cap)
        if table.shape[1] < w:  # (a table narrower than the columns asked for)
            paged_part_(b, part)
            return
        bs, n, p = part.bs, seq_lens.shape[0], part.page_size
        max_len = cap * p if part.max_len is None else part.max_len
        real = self.rows_(b, seq_lens, rows, table, n, bs, w, max_len, p, part.pad_seq_len,
                          part.pad_page)
        q_lens, cu_q, window = part.q_lens, part.cu_seqlens_q, part.window
        if window is not None:
            if q_lens is not None and not part.exact_tokens:
                q_lens = q_lens.clamp(0, INT32_MAX if part.max_q is None else part.max_q)
            self.window_(b, window, table if part.window_table is None else part.window_table,
                         rows, real, n, bs, p, part.pad_seq_len, part.pad_page,
                         int(part.window_size or 0), q_lens)  # (lean_fits: a size is given)
        q_lens = part.q_lens
        if q_lens is None or cu_q is None:
            return
        if part.q_total is None:  # (draft extend's padded rows: the general query part)
            _queries_(b, bs, q_lens, cu_q, part.pad_q, part.max_q, part.q_total)
        else:
            # (exact host-checked lengths are inside [0, max_q]: no clamp to change them)
            bounded = part.max_q is None or part.exact_tokens
            self.queries_(cu_q, q_lens if bounded else q_lens.clamp(0, part.max_q), n, bs,
                          part.q_total)
        positions, tokens = part.positions, part.tokens
        if positions is None and part.out_slots is None:
            return
        if (part.exact_tokens and tokens is not None and part.out_slots is None
                and positions is not None and tokens <= positions.shape[0]):
            self.positions_(seq_lens, q_lens, cu_q, n, tokens, positions)
            return
        _tokens_(seq_lens, 0, q_lens, rows, table, part.block_size, None, positions,
                 part.out_slots, tokens)

    def rows_(self, b: PagedBuffers, seq_lens: Tensor, rows: Tensor, table: Tensor, n: int,
              bs: int, w: int, max_len: int, p: int, pad_seq_len: int, pad_page: int,
              exact: bool = False) -> Tensor:
        """The rows of the part: ``cache_seqlens`` (real lengths clamped into ``[0,
        max_len]``), the first ``w`` page columns of each real row, the padded rows'
        ``pad_seq_len`` and ``pad_page``, and ``cu_seqlens_k``. Returns the real rows'
        ``cache_seqlens`` (the window part's start).

        ``exact``: ``seq_lens`` holds the very values the caller checked on the host, inside
        ``[1, max_len]``, so they are copied, not clamped (the same bytes). Every write but the
        cumsum is then one ``copy_`` (``cu_seqlens_k[0]`` from the constant ``arange``'s 0):
        in an engine's build, each distinct op is paid on cold caches, a repeated one far
        less."""
        pt, cs, cu = b.page_table, b.cache_seqlens, b.cu_seqlens_k
        pad_cols = ceil_div(pad_seq_len, p)
        real: Tensor
        real, lens, cu0, cu_rest, pad_lens, pad_pages, zero = _memo(
            self._rows, (n, bs, pad_cols), lambda: (
                cs[:n], cs[:bs], cu[:1], cu[1 : bs + 1], cs[n:bs],
                pt[n:bs, :pad_cols], b.arange[:1]))  # type: ignore[index]
        if exact:
            real.copy_(seq_lens)
        elif seq_lens.dtype == real.dtype:
            torch.clamp(seq_lens, 0, max_len, out=real)
        else:
            real.copy_(seq_lens).clamp_(0, max_len)
        out = _memo(self._cols, (n, w), lambda: pt[:n, :w])  # type: ignore[index]
        if rows.data_ptr() == b.arange.data_ptr():  # type: ignore[union-attr]
            # rows in table order (a block table given without req_pool_indices)
            out.copy_(table[:, :w] if table.shape[0] == n else table[:n, :w])
        else:
            picked = rows.clamp(0, table.shape[0] - 1)
            if table.dtype == out.dtype:
                torch.index_select(table[:, :w], 0, picked, out=out)
            else:
                out.copy_(table[:, :w].index_select(0, picked))
        if n < bs:
            pad_lens.fill_(pad_seq_len)
            pad_pages.fill_(pad_page)
        cu0.copy_(zero)
        torch.cumsum(lens, 0, dtype=cu_rest.dtype, out=cu_rest)
        return real

    def queries_(self, cu_q: Tensor, q_lens: Tensor, n: int, bs: int, q_total: int) -> None:
        """The extend query part: ``cu_seqlens_q = [0, cumsum(q_lens)]`` (``q_lens`` already
        inside its bound), padded rows ending at ``max(q_total, real total)``."""
        q0, q_real, q_last, q_pads = _memo(self._queries, (n, bs), lambda: (
            cu_q[:1], cu_q[1 : n + 1], cu_q[n : n + 1], cu_q[n + 1 : bs + 1]))
        q0.zero_()
        torch.cumsum(q_lens, 0, dtype=q_real.dtype, out=q_real)
        if n < bs:  # (max(T, total) keeps it non-decreasing if the caller broke sum <= T)
            torch.clamp(q_last.expand(bs - n), min=q_total, out=q_pads)

    def window_(self, b: PagedBuffers, w: PagedBuffers, table: Tensor, rows: Tensor,
                total: Tensor, n: int, bs: int, p: int, pad_seq_len: int, pad_page: int,
                window: int, q_lens: Tensor | None) -> None:
        """The window twin ``w`` of part ``b`` (:func:`.parts._window_`'s bytes),
        read from ``table``: row ``i`` of length ``L`` (``total``: the full part's clamped
        lengths, just written) with ``q`` queries (``q_lens``, already inside their bound;
        None: one) starts ``shift = floor(max(0, L - q - W + 1) / P) * P`` tokens in, that is
        at column ``shift / P`` of its table row; it reads ``min(L - shift, cap * P)`` tokens
        from the ``cap`` columns from there (clamped into the table; the column numbers are an
        int64 constant made once, as the gather takes them)."""
        pt, cs, cu = w.page_table, w.cache_seqlens, w.cu_seqlens_k
        cap = pt.shape[1]  # type: ignore[union-attr]
        pad_cols = ceil_div(pad_seq_len, p)
        real, lens, cu0, cu_rest, pad_lens, pad_pages, out, cols, start, column = _memo(
            self._window, (n, bs, pad_cols), lambda: (
                cs[:n], cs[:bs], cu[:1], cu[1 : bs + 1], cs[n:bs], pt[n:bs, :pad_cols],  # type: ignore[index]
                pt[:n], torch.arange(cap, device=pt.device),  # type: ignore[index,union-attr]
                *_start_scratch(n, pt.device)))  # type: ignore[union-attr]
        if q_lens is None:
            first = total - window  # (one query: L - 1 - (W - 1))
        else:
            first = total - q_lens
            first -= window - 1
        first.clamp_(min=0)
        floor_div(first, p, out=start)  # (each row's first window column, int64)
        torch.sub(total, start, alpha=p, out=real)  # L - shift
        real.clamp_(0, cap * p)
        idx = column + cols
        idx.clamp_(max=table.shape[1] - 1)
        if rows.data_ptr() != b.arange.data_ptr() or table.shape[0] < n:  # type: ignore[union-attr]
            table = table.index_select(0, rows.clamp(0, table.shape[0] - 1))
        elif table.shape[0] != n:
            table = table[:n]
        if table.dtype == out.dtype:
            torch.gather(table, 1, idx, out=out)
        else:
            out.copy_(torch.gather(table, 1, idx))
        if n < bs:
            pad_lens.fill_(pad_seq_len)
            pad_pages.fill_(pad_page)
        cu0.zero_()
        torch.cumsum(lens, 0, dtype=cu_rest.dtype, out=cu_rest)

    def positions_(self, seq_lens: Tensor, q_lens: Tensor, cu_q: Tensor, n: int,
                   tokens: int, positions: Tensor) -> None:
        """Positions of the ``tokens`` real query tokens, 0 after: token ``t = cu_q[i] + j``
        of row ``i`` sits at ``seq_lens[i] - q_lens[i] + j``, that is its row's
        ``start[i] = seq_lens[i] - q_lens[i] - cu_q[i]`` plus ``t``; its row is found
        in the query offsets the part has just written (a ``searchsorted``: on a CPU several
        times cheaper than repeating each row's start). ``tokens`` is the exact sum of
        ``q_lens`` (``PagedPart.exact_tokens``), so every token has a real row."""
        starts, ends = _memo(self._queries, (n, -1), lambda: (cu_q[:n], cu_q[1 : n + 1]))
        start = seq_lens - q_lens
        start -= starts
        size = positions.shape[0]
        real, tail = _memo(self._tokens, (tokens, size),
                           lambda: (positions[:tokens], positions[tokens:]))
        t = torch.arange(tokens, dtype=ends.dtype, device=positions.device)
        row = torch.searchsorted(ends, t, right=True)
        torch.add(start.index_select(0, row), t, out=real)
        if tokens < size:
            tail.fill_(0)


def _start_scratch(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """A window part's per-row first columns: an ``[n]`` int64 scratch and its ``[n, 1]`` view
    (made once per ``n``: the column gather broadcasts it without a view op per step)."""
    column = torch.empty((n, 1), dtype=torch.int64, device=device)
    return column.view(n), column
