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
