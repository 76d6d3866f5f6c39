"""Decode phase: exact equality with the loop reference, padding, poison, capture state."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnpool
from attnpool import BufferPool, Layout, PoolConfig

from tests.helpers.batches import make_batch
from tests.helpers.loopref import assert_paged_equal, decode_rows

LAYOUTS = [Layout.FLASH_ATTN, Layout.FLASHINFER, Layout.BOTH]


def _pool(page: int, layout: Layout, max_bs: int = 12, context: int = 256, **kw: object
          ) -> BufferPool:
    cfg = PoolConfig(max_bs=max_bs, max_context_len=context, page_size=page, device="cpu",
                     layout=layout, **kw)  # type: ignore[arg-type]
    return BufferPool(cfg, poison=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page=st.sampled_from([1, 16, 64]),
    layout=st.sampled_from(LAYOUTS),
    n=st.integers(0, 12),
    pad=st.integers(0, 4),
    host=st.booleans(),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_decode_matches_loop_reference(page: int, layout: Layout, n: int, pad: int, host: bool,
                                       dtype: torch.dtype, seed: int) -> None:
    pool = _pool(page, layout)
    bs = max(1, min(12, n + pad))
    n = min(n, bs)
    rng = random.Random(seed)
    b = make_batch(pool.cfg, n, rng)
    seq, rpi, table = b.tensors(dtype=dtype)
    view = pool.decode.update_(bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                               seq_lens_cpu=b.seq_lens if host else None)
    pool.check(view)
    assert_paged_equal(view, decode_rows(b.seq_lens, b.slots, table, bs, page))
    assert view.max_seqlen_q == 1
    if host:
        assert view.max_seqlen_k == max(b.seq_lens + ([1] if n < bs else []))
    else:
        assert view.max_seqlen_k == pool.cfg.max_context_len


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page", [1, 16, 64])
def test_consecutive_updates_shrinking_batch(page: int, layout: Layout) -> None:
    """A smaller batch after a larger one: stale rows of the earlier step must never be read."""
    pool = _pool(page, layout)
    rng = random.Random(page)
    for n, bs in [(12, 12), (3, 8), (0, 4), (7, 7), (1, 12)]:
        b = make_batch(pool.cfg, n, rng)
        view = pool.decode.update_(bs, **b.inputs())
        pool.check(view)
        assert_paged_equal(view, decode_rows(b.seq_lens, b.slots, b.req_to_token, bs, page))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_capture_view_is_valid_before_any_update(layout: Layout) -> None:
    pool = _pool(16, layout, pad_seq_len=20, pad_page=3)
    for bs in (1, 5, 12):
        view = pool.decode.view(bs)
        pool.check(view)
        assert_paged_equal(view, decode_rows([], [], pool.arena.storage, bs, 16, 20, 3))
        assert view.max_seqlen_k == pool.cfg.max_context_len


def test_view_after_smaller_update_is_repadded() -> None:
    """view(12) after update_(bs=4) must not expose rows the 4-row update left inconsistent."""
    pool = _pool(1, Layout.BOTH)
    b = make_batch(pool.cfg, 4, random.Random(1))
    pool.decode.update_(4, **b.inputs())
    pool.check(pool.decode.view(12))


def test_view_allocates_nothing_and_pointers_are_stable() -> None:
    pool = _pool(16, Layout.BOTH)
    v1 = pool.decode.view(8)
    b = make_batch(pool.cfg, 5, random.Random(2))
    v2 = pool.decode.update_(8, **b.inputs())
    storage = pool.arena.storage.untyped_storage().data_ptr()
    for name in ("cache_seqlens", "cu_seqlens_q", "cu_seqlens_k", "page_table", "kv_indptr",
                 "kv_indices", "kv_last_page_len"):
        t1, t2 = getattr(v1, name), getattr(v2, name)
        assert t1.data_ptr() == t2.data_ptr(), name
        assert t1.untyped_storage().data_ptr() == storage, name


def test_view_never_aliases_inputs() -> None:
    pool = _pool(1, Layout.FLASH_ATTN)
    b = make_batch(pool.cfg, 4, random.Random(3))
    seq, rpi, table = b.tensors(dtype=torch.int32)
    view = pool.decode.update_(4, seq_lens=seq, req_pool_indices=rpi, req_to_token=table)
    seq.fill_(99)
    assert view.cache_seqlens.tolist() == b.seq_lens


def test_views_are_frozen_and_slotted() -> None:
    pool = _pool(1, Layout.FLASH_ATTN)
    view = pool.decode.view(2)
    assert isinstance(view, attnpool.DecodeView)
    assert not hasattr(view, "__dict__")
    with pytest.raises(AttributeError):
        view.bs = 3  # type: ignore[misc]
    assert view.kv_indptr is None and view.page_table is not None


def test_cu_seqlens_k_head_is_rewritten() -> None:
    pool = _pool(1, Layout.FLASH_ATTN)
    b = make_batch(pool.cfg, 3, random.Random(4))
    view = pool.decode.update_(3, **b.inputs())
    view.cu_seqlens_k[0] = 12345  # something else scribbled on it
    view = pool.decode.update_(3, **b.inputs())
    assert int(view.cu_seqlens_k[0]) == 0


def test_poison_then_update_writes_whole_read_region() -> None:
    pool = _pool(16, Layout.BOTH)
    rng = random.Random(5)
    for _ in range(5):
        pool.poison_()
        stale = pool.decode._view(12, pool.cfg.max_context_len)
        with pytest.raises(attnpool.StaleViewError, match="poisoned"):
            pool.check(stale)
        with pytest.raises(attnpool.ReadRegionError):  # the bytes are poison, too
            attnpool.check_view(stale)
        b = make_batch(pool.cfg, rng.randint(0, 12), rng)
        pool.check(pool.decode.update_(12, **b.inputs()))


def test_checker_catches_out_of_range_page() -> None:
    cfg = PoolConfig(max_bs=4, max_context_len=64, page_size=16, device="cpu", num_pages=10)
    pool = BufferPool(cfg, poison=True)
    table = torch.full((2, 64), 16 * 20, dtype=torch.int32)  # page 20 >= num_pages
    view = pool.decode.update_(2, seq_lens=torch.tensor([5, 5]), req_pool_indices=torch.tensor([0, 1]),
                               req_to_token=table)
    with pytest.raises(attnpool.ReadRegionError, match="page id"):
        pool.check(view)
