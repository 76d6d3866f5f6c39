"""A deliberately plain, per-row loop reference of what each view's read region must hold.

It shares no code with attnpool: every value is computed from DESIGN.md's definitions with Python
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
                last.append((exp.lens[i] - 1) % page + 1)
            else:  # padded rows own no pages
                last.append(1)
            indptr.append(len(indices))
        assert ip.tolist() == indptr
        assert view.kv_indices[: indptr[-1]].tolist() == indices  # type: ignore[attr-defined]
        assert view.kv_last_page_len.tolist() == last  # type: ignore[attr-defined]
