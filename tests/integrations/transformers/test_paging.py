"""Pages: page 0 is never handed out, a page has one owner, a request that does not fit waits.

Unit tests of :class:`attnpool.integrations.transformers.paging.PageAllocator`, then the generator
under a KV cache too small for ``max_bs`` requests at once: requests wait for pages, every admission
is checked against the live requests' pages, and the outputs still equal ``model.generate`` (with
the cache poisoned, so a request reading pages another one overwrote, or never wrote, would show).
Last, the per-step store the generator's layers write through (:class:`attnpool.kv.cache.StepStore`)
writes the bytes :meth:`KVCachePool.store_kv_` writes, on both store paths and both layouts.
"""

from __future__ import annotations

import pytest
import torch

from attnpool import CapacityError, Impl, InputError, LayoutError
from attnpool.integrations.transformers import PagedGenerator
from attnpool.integrations.transformers.paging import Allocation, PageAllocator
from attnpool.kv import KVCacheConfig, KVCachePool, KVKind, KVLayout

from tests.helpers import hf_tiny
from tests.helpers.opcount import count

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.usefixtures("one_thread")]


def test_allocator_never_hands_out_the_pad_page_and_is_all_or_nothing() -> None:
    a = PageAllocator(num_pages=6, page_size=4, num_rows=3)
    assert a.usable_pages == a.free_pages == 5
    x = a.admit(9)  # 3 pages
    assert x is not None and len(x.pages) == 3 and 0 not in x.pages
    assert a.admit(12) is None  # needs 3, 2 left: nothing taken
    assert a.free_pages == 2 and a.free_rows == 2
    y = a.admit(8)
    assert y is not None and set(x.pages).isdisjoint(y.pages) and 0 not in y.pages
    assert a.admit(1) is None  # no page left (a row is free)
    a.release(x)
    z = a.admit(12)
    assert z is not None and set(z.pages) == set(x.pages) and z.row == x.row
    assert {al.row for al in a.live()} == {y.row, z.row}
    assert a.slot(z, 0) == z.pages[0] * 4 and a.slot(z, 5) == z.pages[1] * 4 + 1
    with pytest.raises(CapacityError, match="position 12 is outside the 3 pages"):
        a.slot(z, 12)
    with pytest.raises(InputError, match="released twice"):
        a.release(x)
    with pytest.raises(CapacityError, match="needs 6 pages of 4, more than the 5 usable"):
        a.check_fits(21)


def test_rows_run_out_before_pages() -> None:
    a = PageAllocator(num_pages=100, page_size=1, num_rows=1, pad_page=3)
    x = a.admit(5)
    assert x is not None and 3 not in x.pages
    assert a.admit(1) is None
    a.release(x)
    assert a.admit(1) == Allocation(0, (0,))


def test_lowest_free_pages_first_so_requests_get_runs() -> None:
    """Requests admitted together get consecutive runs of pages in admission order, also after
    every request of an earlier batch ended (whatever order they ended in): the layout the SDPA
    adapter reads in place on a CPU."""
    a = PageAllocator(num_pages=20, page_size=4, num_rows=4)
    first = [a.admit(12) for _ in range(3)]
    assert [x.pages for x in first if x is not None] == [(1, 2, 3), (4, 5, 6), (7, 8, 9)]
    for x in (first[1], first[2], first[0]):
        assert x is not None
        a.release(x)
    again = [a.admit(16) for _ in range(3)]
    assert [(x.row, x.pages) for x in again if x is not None] == [
        (0, (1, 2, 3, 4)), (1, (5, 6, 7, 8)), (2, (9, 10, 11, 12))]
    assert again[1] is not None
    a.release(again[1])  # a hole in the middle: the next request fills it first
    x = a.admit(20)
    assert x is not None and x.pages == (5, 6, 7, 8, 13)


class _Watch:
    """Checks every admission against the allocations already live."""

    def __init__(self, gen: PagedGenerator) -> None:
        self.alloc, self.peak, self.admitted = gen.alloc, 0, 0
        self._admit = gen.alloc.admit
        gen.alloc.admit = self.admit  # type: ignore[method-assign]

    def admit(self, tokens: int) -> Allocation | None:
        live = self.alloc.live()
        got = self._admit(tokens)
        if got is not None:
            self.admitted += 1
            assert 0 not in got.pages
            for other in live:
                assert set(got.pages).isdisjoint(other.pages), (got, other)
                assert got.row != other.row
            self.peak = max(self.peak, len(live) + 1)
        return got


@pytest.mark.parametrize("spec", [False, True])
def test_requests_wait_for_pages_and_never_share_them(spec: bool) -> None:
    model = hf_tiny.llama()
    ps = hf_tiny.prompts((33, 40, 17, 50, 5, 64), seed=5)
    new = 20
    # the longest request needs ceil((64 + 20 - 1 + N) / 8) pages; give the cache a bit more
    # than two such requests, so at most 2-3 of the max_bs = 4 can run at once
    n = 3 if spec else 0
    pages = 2 * -(-(64 + new - 1 + n) // 8) + 2 + 1
    gen = PagedGenerator(model, max_bs=4, max_context_len=hf_tiny.CONTEXT, page_size=8,
                         num_pages=pages, draft_model=model if spec else None,
                         num_draft_tokens=n)
    gen.poison_()
    watch = _Watch(gen)
    assert gen.generate(ps, max_new_tokens=new) == hf_tiny.greedy(model, ps, new=new)
    assert watch.admitted == len(ps)
    assert watch.peak < 4  # pages, not max_bs, limited the batch: some requests waited
    assert max(gen.stats.batch_sizes) < 4
    assert gen.alloc.live() == () and gen.alloc.free_pages == pages - 1


def _caches(layout: KVLayout, n: int, seed: int = 0) -> tuple[KVCachePool, KVCachePool, torch.Tensor]:
    """Two poisoned caches with the same slot mapping: distinct slots, -1 padding, one slot past
    the cache (skipped, like -1)."""
    cfg = KVCacheConfig(num_pages=7, page_size=4, max_tokens=16, num_layers=3, num_kv_heads=2,
                        head_dim=8, dtype=torch.float32, layout=layout, device="cpu")
    a, b = KVCachePool(cfg, poison=True), KVCachePool(cfg, poison=True)
    g = torch.Generator().manual_seed(seed)
    slots = (torch.randperm(cfg.num_slots - 4, generator=g)[:n] + 4).tolist()  # never the pad page
    slots[1], slots[-1] = -1, cfg.num_slots + 3
    t = torch.tensor(slots)
    a.update_slots_(t, bs=n + 2)
    b.update_slots_(t, bs=n + 2)
    return a, b, t


@pytest.mark.parametrize("impl", [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)])
@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
def test_step_store_writes_what_store_kv_writes(layout: KVLayout, impl: Impl) -> None:
    n = 9
    a, b, _ = _caches(layout, n)
    store = a.step_store(n + 2, impl=impl)  # two padded tokens (slot -1) too
    g = torch.Generator().manual_seed(1)
    for layer in range(3):
        # the integration's sources: [T, H, D] views of transformers' [1, H, T, D] (strided)
        k = torch.randn(1, 2, n + 2, 8, generator=g)[0].transpose(0, 1)
        v = torch.randn(1, 2, n + 2, 8, generator=g)[0].transpose(0, 1)
        store(layer, k, v)
        b.store_kv_(layer, k, v, impl=Impl.REFERENCE)
    for layer in range(3):  # bitwise, poison (NaN) included: nothing else was written
        for x, y in ((a.k_cache(layer), b.k_cache(layer)), (a.v_cache(layer), b.v_cache(layer))):
            assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


def test_step_store_costs_two_ops_per_layer() -> None:
    a, _, _ = _caches(KVLayout.NHD, 6)
    store = a.step_store(6, impl=Impl.REFERENCE)
    k = torch.randn(6, 2, 8)
    c = count(lambda: store(0, k, k))
    assert c.num_ops == 2, dict(c.ops)  # one index_copy_ per part, nothing recomputed


def test_step_store_refuses_bad_input_before_writing() -> None:
    a, _, _ = _caches(KVLayout.NHD, 6)
    store = a.step_store(6, impl=Impl.REFERENCE)
    before = a.storage.clone()
    k = torch.randn(6, 2, 8)
    for bad, what in ((lambda: store(3, k, k), r"layer must be an int in \[0, 3\), got 3"),
                      (lambda: store(0, k[:5], k), r"k must be torch.float32 \(6, 2, 8\)"),
                      (lambda: store(0, k, k.double()), r"v must be torch.float32 .* got torch.float64"),
                      (lambda: store(0, k, torch.randn(6, 2, 16)[..., ::2]), "stride 1")):
        with pytest.raises(InputError, match=what):
            bad()
    assert torch.equal(before, a.storage)
    with pytest.raises(CapacityError):
        a.step_store(17)
    mla = KVCacheConfig(num_pages=4, page_size=4, max_tokens=8, num_layers=1, kind=KVKind.MLA,
                        kv_lora_rank=8, rope_dim=4, dtype=torch.float32, device="cpu")
    with pytest.raises(LayoutError, match="MLA"):
        KVCachePool(mla).step_store(2)
    fp8 = KVCacheConfig(num_pages=4, page_size=4, max_tokens=8, num_layers=1, num_kv_heads=1,
                        head_dim=8, dtype=torch.float8_e4m3fn, device="cpu")
    with pytest.raises(LayoutError, match="fp8"):
        KVCachePool(fp8).step_store(2)
