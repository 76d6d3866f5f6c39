"""A view's host bounds follow each step while its tensors are sliced once per row count: a
decode step whose longest row grew gets a view of its own over the same slices, its window
part's bound capped at the window table's width."""

from __future__ import annotations

import torch

from attnpool import BufferPool, Impl, Layout, PoolConfig

P, C, W = 16, 512, 40


def test_new_bounds_reuse_the_slices() -> None:
    pool = BufferPool(PoolConfig(max_bs=4, max_context_len=C, page_size=P, device="cpu",
                                 layout=Layout.FLASH_ATTN, max_extend_tokens=64, pad_page=0,
                                 num_pages=200, impl=Impl.REFERENCE, sliding_window=W),
                      poison=True)
    table = torch.arange(1, 1 + 4 * (C // P), dtype=torch.int32).view(4, C // P)
    views = []
    for longest in (30, 31, 300):
        seq = torch.tensor([5, longest, 17], dtype=torch.int32)
        views.append(pool.decode.update_(3, seq_lens=seq, block_table=table, seq_lens_cpu=seq))
        pool.check(views[-1])
    cap = pool.cfg.window_pages(pool.decode.phase) * P
    assert [v.max_seqlen_k for v in views] == [30, 31, 300]
    assert [v.window.max_seqlen_k for v in views] == [min(k, cap) for k in (30, 31, 300)]
    assert cap < 300
    first = views[0]
    for v in views[1:]:
        assert v is not first and v.cache_seqlens is first.cache_seqlens
        assert v.page_table is first.page_table and v.window.page_table is first.window.page_table
        assert v.stamp is first.stamp and v.is_current
    ext = pool.extend.update_(2, seq_lens=torch.tensor([9, 40], dtype=torch.int32),
                              extend_lens=torch.tensor([3, 5], dtype=torch.int32),
                              block_table=table, seq_lens_cpu=[9, 40], extend_lens_cpu=[3, 5])
    assert (ext.max_seqlen_q, ext.max_seqlen_k) == (5, 40) and ext.window.max_seqlen_k == 40
