"""The SDPA adapter's one gather of K and V together (``sdpa.gather.gather_pair``).

A :class:`attnpool.KVCachePool` layer keeps its V pages after its K pages in one allocation, so
one ``index_select`` over both serves a layer. It must give exactly what two separate gathers
give (the same rows are copied), be taken only where K and V really are one run of rows, and
leave every other cache (different head sizes, separate tensors, fp8 with scales, a V before its
K) to the two gathers.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from attnpool.adapters import sdpa
from attnpool.adapters.sdpa import gather, planning
from attnpool.kv import KVCacheConfig, KVCachePool
from attnpool.views import DecodeView

H, H_KV, D, PAGE, PAGES, ROWS = 6, 2, 8, 4, 12, 3


def pool(dv: int | None = None, dtype: torch.dtype = torch.float32) -> KVCachePool:
    kv = KVCachePool(KVCacheConfig(num_pages=PAGES, page_size=PAGE, max_tokens=8, num_layers=3,
                                   num_kv_heads=H_KV, head_dim=D, head_dim_v=dv, dtype=dtype,
                                   device="cpu"))
    g = torch.Generator().manual_seed(0)
    for layer in range(3):
        for t in (kv.k_cache(layer), kv.v_cache(layer)):
            t[1:].copy_(torch.randn(t[1:].shape, generator=g).to(dtype))
    return kv


def view(lens: tuple[int, ...] = (5, 9, 1)) -> DecodeView:
    n = len(lens)
    table = torch.tensor([[1 + j * n + i for j in range(3)] for i in range(n)], dtype=torch.int32)
    return DecodeView(n, torch.tensor(lens, dtype=torch.int32),
                      torch.arange(n + 1, dtype=torch.int32),
                      torch.zeros(n + 1, dtype=torch.int32), table, None, None, None, 1,
                      max(lens), PAGE, True)


def plan_of(v: DecodeView) -> planning.Plan:
    return sdpa.plan(v, num_q=v.bs, num_heads=H, num_kv_heads=H_KV, dtype=torch.float32)


def spans(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record, per gather, whether the one-gather path was taken."""
    seen: list[bool] = []
    orig = gather._kv_gap

    def rec(k: Tensor, v: Tensor) -> int | None:
        r = orig(k, v)
        seen.append(r is not None)
        return r

    monkeypatch.setattr(gather, "_kv_gap", rec)
    return seen


@pytest.mark.parametrize("layer", [0, 2])
def test_pool_layer_is_one_gather_and_exact(monkeypatch: pytest.MonkeyPatch, layer: int) -> None:
    kv, v = pool(), view()
    pl = plan_of(v)
    k_cache, v_cache = kv.k_cache(layer), kv.v_cache(layer)
    seen = spans(monkeypatch)
    k, vv = gather.gather_pair(pl, k_cache, v_cache, torch.float32)
    assert seen == [True]
    assert torch.equal(k, gather.gather_kv(pl, k_cache, torch.float32))
    assert torch.equal(vv, gather.gather_kv(pl, v_cache, torch.float32))
    q = torch.randn(ROWS, H, D)
    out = sdpa.run_plan(pl, q, k_cache, v_cache)
    # the same caches as separate tensors: the two-gather path, the same bits
    ref = sdpa.run_plan(pl, q, k_cache.clone(), v_cache.clone())
    assert seen[-1] is False
    assert torch.equal(out, ref)


def test_plan_keeps_combined_slots_across_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, v = pool(), view()
    pl = plan_of(v)
    for layer in range(3):
        gather.gather_pair(pl, kv.k_cache(layer), kv.v_cache(layer), torch.float32)
    assert len(pl.gather.pair) == 1  # one K-to-V distance for every layer of the pool


@pytest.mark.parametrize("case", ["head_dim_v", "v_before_k", "other_storage", "dtype"])
def test_other_caches_take_two_gathers(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    v = view()
    pl = plan_of(v)
    if case == "head_dim_v":
        kv = pool(dv=4)
        k_cache, v_cache = kv.k_cache(1), kv.v_cache(1)
    else:
        kv = pool()
        k_cache, v_cache = kv.k_cache(1), kv.v_cache(1)
        if case == "v_before_k":
            k_cache, v_cache = v_cache, k_cache
        elif case == "other_storage":
            v_cache = v_cache.clone()
        else:
            v_cache = v_cache.double()
    seen = spans(monkeypatch)
    k, vv = gather.gather_pair(pl, k_cache, v_cache, torch.float32)
    assert seen == [False]
    assert torch.equal(k, gather.gather_kv(pl, k_cache, torch.float32))
    assert torch.equal(vv, gather.gather_kv(pl, v_cache, torch.float32))


def test_lower_precision_cache_is_converted_once() -> None:
    kv, v = pool(dtype=torch.bfloat16), view()
    pl = plan_of(v)
    k_cache, v_cache = kv.k_cache(0), kv.v_cache(0)
    k, vv = gather.gather_pair(pl, k_cache, v_cache, torch.float32)
    assert k.dtype == vv.dtype == torch.float32
    assert torch.equal(k, gather.gather_kv(pl, k_cache, torch.float32))
    assert torch.equal(vv, gather.gather_kv(pl, v_cache, torch.float32))


# ---- rows read in place (``Gather.run``) -------------------------------------------------------
def run_view(lens: tuple[int, ...], firsts: tuple[int, ...], width: int = 3) -> DecodeView:
    """A decode view whose row ``i`` owns pages ``firsts[i] ..`` (consecutive)."""
    n = len(lens)
    table = torch.tensor([[f + j for j in range(width)] for f in firsts], dtype=torch.int32)
    return DecodeView(n, torch.tensor(lens, dtype=torch.int32),
                      torch.arange(n + 1, dtype=torch.int32),
                      torch.zeros(n + 1, dtype=torch.int32), table, None, None, None, 1,
                      max(lens), PAGE, True)


def copied(pl: planning.Plan) -> planning.Plan:
    """The same plan with the in-place read turned off: the copy path's answer."""
    g = pl.gather
    return planning.Plan(pl.b, pl.qmax, pl.lmax, pl.total, pl.num_heads, pl.num_kv_heads,
                         gather.Gather(g.pages, g.page, g.span, g.tail, g.slots, g.raw),
                         pl.keys, pl.allowed, pl.keyed, pl.q_idx, pl.dst)


def shares(x: Tensor, cache: Tensor) -> bool:
    return x.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()


@pytest.mark.parametrize(("lens", "firsts"), [
    ((9, 9, 9), (1, 4, 7)),       # requests admitted together: pages in order
    ((12, 12), (2, 8)),           # whole pages, rows six pages apart
    ((7,), (5,)),                 # one request
    ((6, 6, 6), (3, 3, 3)),       # rows sharing their pages (stride 0)
])
@pytest.mark.parametrize("layer", [0, 2])
def test_equal_rows_in_runs_of_pages_are_read_in_place(lens: tuple[int, ...],
                                                       firsts: tuple[int, ...],
                                                       layer: int) -> None:
    kv, v = pool(), run_view(lens, firsts)
    pl = plan_of(v)
    assert pl.gather.run is not None
    k_cache, v_cache = kv.k_cache(layer), kv.v_cache(layer)
    k, vv = gather.gather_pair(pl, k_cache, v_cache, torch.float32)
    assert shares(k, k_cache) and shares(vv, v_cache)  # views of the cache: nothing copied
    ref = copied(pl)
    rk, rv = gather.gather_pair(ref, k_cache, v_cache, torch.float32)
    assert not shares(rk, k_cache)
    assert torch.equal(k, rk) and torch.equal(vv, rv)
    assert torch.equal(gather.gather_kv(pl, k_cache, torch.float32), rk)
    q = torch.randn(len(lens), H, D)
    assert torch.equal(sdpa.run_plan(pl, q, k_cache, v_cache),
                       sdpa.run_plan(ref, q, k_cache, v_cache))


@pytest.mark.parametrize(("lens", "firsts"), [
    ((9, 5, 9), (1, 4, 7)),       # a row shorter than L: lanes past it were never written
    ((9, 9, 9), (1, 4, 8)),       # rows not a fixed number of pages apart
    ((9, 9), (7, 4)),             # rows going backwards
])
def test_other_rows_are_copied(lens: tuple[int, ...], firsts: tuple[int, ...]) -> None:
    kv, v = pool(), run_view(lens, firsts)
    pl = plan_of(v)
    assert pl.gather.run is None
    k, _ = gather.gather_pair(pl, kv.k_cache(0), kv.v_cache(0), torch.float32)
    assert not shares(k, kv.k_cache(0))


def test_pages_not_in_a_run_are_copied() -> None:
    kv = pool()
    v = run_view((9, 9), (1, 4))
    v.page_table[1, 1] = 9  # the second row's pages: 4, 9, 6
    pl = plan_of(v)
    assert pl.gather.run is None
    k, _ = gather.gather_pair(pl, kv.k_cache(0), kv.v_cache(0), torch.float32)
    assert not shares(k, kv.k_cache(0))


@pytest.mark.parametrize("case", ["dtype", "fp8_scale", "past_the_end"])
def test_caches_not_readable_as_they_lie_are_copied(case: str) -> None:
    v = run_view((9, 9), (1, 4))
    pl = plan_of(v)
    assert pl.gather.run is not None
    if case == "dtype":  # a bf16 cache read as float32: converted, so copied
        kv = pool(dtype=torch.bfloat16)
        k, _ = gather.gather_pair(pl, kv.k_cache(0), kv.v_cache(0), torch.float32)
        assert k.dtype == torch.float32 and not shares(k, kv.k_cache(0))
        assert torch.equal(k, gather.gather_kv(copied(pl), kv.k_cache(0), torch.float32))
    elif case == "fp8_scale":
        kv = pool()
        s = torch.tensor([0.5])
        k, _ = gather.gather_pair(pl, kv.k_cache(0), kv.v_cache(0), torch.float32, s, s)
        assert not shares(k, kv.k_cache(0))
        assert torch.equal(k, gather.gather_kv(copied(pl), kv.k_cache(0), torch.float32, s))
    else:  # a cache of fewer pages than the rows name: the copy's index error, as before
        kv = pool()
        short = kv.k_cache(0)[:5]
        with pytest.raises((IndexError, RuntimeError)):
            gather.gather_pair(pl, short, short, torch.float32)


def test_in_place_reads_only_written_lanes_of_a_poisoned_cache() -> None:
    """Poison (NaN) everywhere but the rows' tokens: the in-place read sees none of it."""
    kv = KVCachePool(KVCacheConfig(num_pages=PAGES, page_size=PAGE, max_tokens=8, num_layers=1,
                                   num_kv_heads=H_KV, head_dim=D, dtype=torch.float32,
                                   device="cpu"), poison=True)
    lens, firsts = (6, 6), (2, 6)
    for f in firsts:  # write each row's 6 tokens; lanes 6.. of its second page stay NaN
        for t in (kv.k_cache(0), kv.v_cache(0)):
            t.view(-1, H_KV, D)[f * PAGE: f * PAGE + 6] = torch.randn(6, H_KV, D)
    pl = plan_of(run_view(lens, firsts, width=2))
    assert pl.gather.run is not None
    out = sdpa.run_plan(pl, torch.randn(2, H, D), kv.k_cache(0), kv.v_cache(0))
    assert torch.isfinite(out).all()
