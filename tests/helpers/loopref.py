"""A deliberately plain, per-row loop reference of what each view's read region must hold.

It shares no code with attnpool: every value is computed from docs/design.md's definitions with Python
ints, so a bug in the vectorised paths cannot hide in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PagedRows:
    """Expected read region of one paged part: per row, its length and page ids."""

    lens: list[int]  # cache_seqlens[:bs]
    pages: list[list[int]]  # page ids of each row (padded rows: what a page-table row reads)
    real: int  # n
    q_lens: list[int]  # query tokens per row


def decode_rows(
    seq_lens: list[int], slots: list[int], req_to_token: torch.Tensor, bs: int, page: int,
    pad_seq_len: int = 1, pad_page: int = 0, extra: int = 0, q_len: int = 1,
) -> PagedRows:
    lens, pages = [], []
    for i in range(bs):
        if i < len(seq_lens):
            length = seq_lens[i] + extra
            row = [int(req_to_token[slots[i], p * page]) // page
                   for p in range(ceil_div(length, page))]
        else:
            length = pad_seq_len
            row = [pad_page] * ceil_div(pad_seq_len, page)
        lens.append(length)
        pages.append(row)
    return PagedRows(lens, pages, len(seq_lens), [q_len] * bs)


def assert_paged_equal(view: object, exp: PagedRows) -> None:
    """Compare a PagedView's read region with the loop reference, element by element."""
    bs = len(exp.lens)
    assert view.bs == bs  # type: ignore[attr-defined]
    assert view.cache_seqlens.tolist() == exp.lens  # type: ignore[attr-defined]
    cu_k = [0]
    for x in exp.lens:
        cu_k.append(cu_k[-1] + x)
    assert view.cu_seqlens_k.tolist() == cu_k  # type: ignore[attr-defined]
    cu_q = [0]
    for x in exp.q_lens:
        cu_q.append(cu_q[-1] + x)
    assert view.cu_seqlens_q.tolist() == cu_q  # type: ignore[attr-defined]
    pt = view.page_table  # type: ignore[attr-defined]
    if pt is not None:
        for i, row in enumerate(exp.pages):
            assert pt[i, : len(row)].tolist() == row, f"page_table row {i}"
    ip = view.kv_indptr  # type: ignore[attr-defined]
    if ip is not None:
        page = view.page_size  # type: ignore[attr-defined]
        indptr, indices, last = [0], [], []
        for i in range(bs):
            if i < exp.real:
                indices += exp.pages[i]
                # a row with no pages (an empty one) has no tokens in its last page
                last.append((exp.lens[i] - 1) % page + 1 if exp.pages[i] else 0)
            else:  # padded rows own no pages
                last.append(0)
            indptr.append(len(indices))
        assert ip.tolist() == indptr
        assert view.kv_indices[: indptr[-1]].tolist() == indices  # type: ignore[attr-defined]
        assert view.kv_last_page_len.tolist() == last  # type: ignore[attr-defined]


def _pad_rows(rows: PagedRows, count: int, length: int, pad_id: int, page: int, q: int) -> None:
    for _ in range(count):
        rows.lens.append(length)
        rows.pages.append([pad_id] * ceil_div(length, page))
        rows.q_lens.append(q)


def tree_expand_rows(seq_lens: list[int], slots: list[int], table: torch.Tensor,
                     mask: torch.Tensor, bs: int, nd: int, pad_seq_len: int, pad_slot: int
                     ) -> PagedRows:
    out = PagedRows([], [], len(seq_lens) * nd, [])
    for i, s in enumerate(seq_lens):
        for j in range(nd):
            allowed = [k for k in range(nd) if bool(mask[i, j, k])]
            out.lens.append(len(allowed))
            out.pages.append([int(table[slots[i], s + k]) for k in allowed])
            out.q_lens.append(1)
    _pad_rows(out, (bs - len(seq_lens)) * nd, min(pad_seq_len, nd), pad_slot, 1, 1)
    return out


def draft_tree_rows(seq_lens: list[int], slots: list[int], table: torch.Tensor,
                    loc: torch.Tensor, bs: int, page: int, topk: int, step: int,
                    pad_seq_len: int, pad_page: int) -> tuple[PagedRows, PagedRows]:
    """(prefix rows over full pages, expand rows of step ``step``)."""
    prefix = PagedRows([], [], len(seq_lens), [])
    steps = loc.shape[1] if loc.dim() == 3 else 0
    width = page - 1 + steps
    expand = PagedRows([], [], len(seq_lens) * topk, [])
    for i, s in enumerate(seq_lens):
        full = (s // page) * page
        prefix.lens.append(full)
        prefix.pages.append([int(table[slots[i], p * page]) // page for p in range(full // page)])
        prefix.q_lens.append(topk)
        for k in range(topk):
            toks = [int(table[slots[i], full + t]) for t in range(s - full)]
            toks += [int(loc[i, d, k]) for d in range(step)]
            expand.lens.append(len(toks))
            expand.pages.append(toks)
            expand.q_lens.append(1)
    pad = len(seq_lens)
    _pad_rows(prefix, bs - pad, pad_seq_len, pad_page, page, topk)
    _pad_rows(expand, (bs - pad) * topk, min(pad_seq_len, width), pad_page * page, 1, 1)
    return prefix, expand


def cross_rows(enc_lens: list[int], slots: list[int], table: torch.Tensor, bs: int, page: int,
               max_enc: int, pad_seq_len: int, pad_page: int) -> PagedRows:
    out = PagedRows([], [], len(enc_lens), [])
    for i, e in enumerate(enc_lens):
        out.lens.append(e)
        out.pages.append([int(table[slots[i], p * page]) // page for p in range(ceil_div(e, page))])
        out.q_lens.append(1)
    _pad_rows(out, bs - len(enc_lens), min(pad_seq_len, max_enc), pad_page, page, 1)
    return out


def decoder_rows(seq_lens: list[int], enc_lens: list[int], slots: list[int], table: torch.Tensor,
                 bs: int, page: int, pad_seq_len: int, pad_page: int) -> PagedRows:
    out = PagedRows([], [], len(seq_lens), [])
    for i, s in enumerate(seq_lens):
        out.lens.append(s)
        out.pages.append([int(table[slots[i], enc_lens[i] + p * page]) // page
                          for p in range(ceil_div(s, page))])
        out.q_lens.append(1)
    _pad_rows(out, bs - len(seq_lens), pad_seq_len, pad_page, page, 1)
    return out


def local_rows(kv_lens: list[int], slots: list[int], table: torch.Tensor, bs: int, page: int,
               chunk: int, q: int, per: int, pad_seq_len: int, pad_page: int) -> PagedRows:
    pad_len = min(pad_seq_len, chunk)
    out = PagedRows([], [], len(kv_lens) * per, [])
    for i, length in enumerate(kv_lens):
        first, last = (length - q) // chunk, (length - 1) // chunk
        for v in range(per):
            c = first + v
            if c <= last:
                qs, qe = max(c * chunk, length - q), min(c * chunk + chunk, length)
                kv = qe - c * chunk
                out.lens.append(kv)
                out.q_lens.append(qe - qs)
                out.pages.append([int(table[slots[i], c * chunk + p * page]) // page
                                  for p in range(ceil_div(kv, page))])
            else:
                out.lens.append(pad_len)
                out.q_lens.append(0)
                out.pages.append([pad_page] * ceil_div(pad_len, page))
    for _ in range(bs - len(kv_lens)):
        for v in range(per):
            out.lens.append(pad_len)
            out.q_lens.append(q if v == 0 else 0)
            out.pages.append([pad_page] * ceil_div(pad_len, page))
    return out


@dataclass
class ExtendRows:
    """Expected extend view: the paged rows plus per-token positions and KV slots."""

    rows: PagedRows
    positions: list[int]  # [T]
    slots: list[int]  # [L]


def extend_rows(seq_lens: list[int], ext: list[int], slots: list[int], table: torch.Tensor,
                bs: int, page: int, total: int, num_slots: int, pad_seq_len: int = 1,
                pad_page: int = 0) -> ExtendRows:
    """Request i: ext[i] new tokens after a prefix of seq_lens[i] - ext[i]; padded rows keep the
    pad length and pad page; the first padded row takes the query slack up to ``total``."""
    rows = decode_rows(seq_lens, slots, table, bs, page, pad_seq_len, pad_page)
    n = len(seq_lens)
    real = sum(ext)
    rows.q_lens = list(ext) + [max(total - real, 0) if i == n else 0 for i in range(n, bs)]
    positions, toks = [], []
    for i in range(n):
        prefix = seq_lens[i] - ext[i]
        for j in range(ext[i]):
            positions.append(prefix + j)
            toks.append(int(table[slots[i], prefix + j]))
    positions += [0] * (total - len(positions))
    toks += [-1] * (num_slots - len(toks))
    return ExtendRows(rows, positions[:total], toks[:num_slots])
