"""KV cache pool: one allocation, store/gather round trips, MLA rows, slot mapping, Triton parity,
errors before any write, poison checks."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpool import CapacityError, Impl, InputError, LayoutError, PoolError, ReadRegionError
from attnpool.kv import KVCacheConfig, KVCachePool, KVKind, KVLayout

from tests.helpers.opcount import OpRecorder


def mha(layout: KVLayout = KVLayout.NHD, *, pages: int = 6, page: int = 4, heads: int = 3,
        dim: int = 5, layers: int = 2, dtype: torch.dtype = torch.float32) -> KVCacheConfig:
    return KVCacheConfig(num_pages=pages, page_size=page, max_tokens=32, num_layers=layers,
                         num_kv_heads=heads, head_dim=dim, dtype=dtype, layout=layout,
                         device="cpu")


def mla(rank: int = 8, rope: int = 3, dtype: torch.dtype = torch.bfloat16) -> KVCacheConfig:
    return KVCacheConfig(num_pages=5, page_size=4, max_tokens=32, num_layers=2, kind=KVKind.MLA,
                         kv_lora_rank=rank, rope_dim=rope, dtype=dtype, device="cpu")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise image (NaN-safe equality with torch.equal)."""
    return t.contiguous().view(torch.uint8)


def random_slots(cfg: KVCacheConfig, n: int, rng: random.Random, holes: float) -> list[int]:
    """n distinct usable slots (never the pad page), with about ``holes`` of them -1."""
    usable = list(range(cfg.page_size, cfg.num_slots))
    picked = rng.sample(usable, min(n, len(usable)))
    return [-1 if rng.random() < holes else s for s in picked]


def loop_store(cache: torch.Tensor, layout: KVLayout, slots: list[int], rows: torch.Tensor,
               col: int = 0) -> None:
    """Plain-loop reference: write ``rows[i]`` at slot ``slots[i]`` unless it is negative."""
    p = cache.shape[1] if layout is KVLayout.NHD else cache.shape[2]
    for i, s in enumerate(slots):
        if s < 0:
            continue
        page, off = divmod(s, p)
        w = rows.shape[-1]
        if layout is KVLayout.NHD:
            cache[page, off, :, col : col + w] = rows[i]
        else:
            cache[page, :, off, col : col + w] = rows[i]


# ---- allocation -------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [mha(), mha(KVLayout.HND), mla()], ids=["nhd", "hnd", "mla"])
@pytest.mark.parametrize("poison", [False, True])
def test_one_allocation(cfg: KVCacheConfig, poison: bool) -> None:
    rec = OpRecorder()
    with rec:
        pool = KVCachePool(cfg, poison=poison)
    factories = [op for op in rec.ops if re.match(r"aten\.(empty|zeros|ones|full|new_)", op)]
    assert factories == ["aten.empty.memory_format"], factories
    assert rec.storages <= {pool.storage.untyped_storage().data_ptr()}
    if not poison:  # no memset of the cache: the only write is zeroing the pad page
        writes = [op for op in rec.ops if "fill" in op or "zero" in op or "copy" in op]
        assert writes == ["aten.zero_.default"], writes
    assert pool.nbytes == pool.storage.numel()
    base = pool.storage.untyped_storage().data_ptr()
    for layer in range(cfg.num_layers):
        views = ([pool.k_cache(layer), pool.v_cache(layer)] if cfg.kind is KVKind.MHA
                 else [pool.kv_cache(layer)])
        for v in views:
            assert v.untyped_storage().data_ptr() == base
            assert v.shape == (cfg.num_pages, *cfg.page_shape()) and v.is_contiguous()
            assert not bits(v[0]).any()  # the pad page is zero
    assert pool.slot_mapping.dtype == torch.int64 and pool.slot_mapping.shape == (cfg.max_tokens,)
    assert (pool.slot_mapping.data_ptr() - pool.storage.data_ptr()) % 256 == 0


def test_report_bytes() -> None:
    c = mha(heads=3, dim=5, layers=2, dtype=torch.float32)
    assert c.bytes_per_token == 2 * 2 * 3 * 5 * 4 and c.bytes_per_page == 4 * 240
    m = mla(rank=8, rope=3, dtype=torch.bfloat16)
    assert m.bytes_per_token == 2 * (8 + 3) * 2 and m.bytes_per_page == 4 * 44
    text = KVCachePool(c).report()
    assert "bytes per token: 240" in text and "bytes per page:  960" in text
    assert "one allocation" in text and "pad page" in text


def test_lean_import() -> None:
    code = ("import sys, torch, attnpool.kv, attnpool.lora\n"
            "assert 'triton' not in sys.modules and not torch.cuda.is_initialized()\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.stdout.strip() == "ok", out.stderr


# ---- store / gather ---------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(list(KVLayout)), page=st.sampled_from([1, 4, 16]),
       heads=st.integers(1, 4), n=st.integers(0, 24), holes=st.sampled_from([0.0, 0.3, 1.0]),
       int32=st.booleans(), seed=st.integers(0, 2**16))
def test_store_matches_loop_and_round_trips(layout: KVLayout, page: int, heads: int, n: int,
                                            holes: float, int32: bool, seed: int) -> None:
    cfg = mha(layout, pages=8, page=page, heads=heads, dim=6)
    pool = KVCachePool(cfg, poison=True)
    rng = random.Random(seed)
    slots = random_slots(cfg, n, rng, holes)
    n = len(slots)
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, heads, 6, generator=g), torch.randn(n, heads, 6, generator=g)
    want_k, want_v = pool.k_cache(1).clone(), pool.v_cache(1).clone()
    other = bits(pool.k_cache(0)).clone()
    loop_store(want_k, layout, slots, k)
    loop_store(want_v, layout, slots, v)
    st_ = torch.tensor(slots, dtype=torch.int32 if int32 else torch.int64)
    pool.store_kv_(1, k, v, st_)
    assert torch.equal(bits(pool.k_cache(1)), bits(want_k))
    assert torch.equal(bits(pool.v_cache(1)), bits(want_v))
    assert torch.equal(bits(pool.k_cache(0)), other)  # another layer is untouched
    real = [i for i, s in enumerate(slots) if s >= 0]
    gk, gv = pool.gather(1, torch.tensor([slots[i] for i in real], dtype=torch.int64))
    assert torch.equal(gk, k[real]) and torch.equal(gv, v[real])
    pool.check_written(1, torch.tensor([slots[i] for i in real], dtype=torch.int64))


def test_store_from_strided_qkv_and_pool_slot_mapping() -> None:
    """K and V as slices of a fused qkv projection; slots from the pool's own slot_mapping."""
    cfg = mha(KVLayout.HND, heads=2, dim=4)
    pool = KVCachePool(cfg, poison=True)
    qkv = torch.randn(5, 8 + 2 * 8)
    k = qkv[:, 8:16].view(5, 2, 4)
    v = qkv[:, 16:].view(5, 2, 4)
    pool.slot_view(8)
    pool.update_slots_(torch.tensor([7, 4, 21], dtype=torch.int32), bs=5)
    assert pool.slot_mapping[:5].tolist() == [7, 4, 21, -1, -1]
    pool.check_slots(5)
    pool.store_kv_(0, k, v)
    gk, gv = pool.gather(0, torch.tensor([7, 4, 21]))
    assert torch.equal(gk, k[:3]) and torch.equal(gv, v[:3])
    # tokens 3, 4 were padding: nothing else in the cache was written
    rest = torch.ones(cfg.num_slots, dtype=torch.bool)
    rest[[7, 4, 21]] = False
    rest[: cfg.page_size] = False  # the pad page holds zeros
    k_nhd = pool.k_cache(0).transpose(1, 2).reshape(cfg.num_slots, 2, 4)
    assert torch.isnan(k_nhd[rest]).all()


def test_store_has_no_host_sync() -> None:
    pool = KVCachePool(mha())
    k = torch.randn(6, 3, 5)
    slots = torch.tensor([4, -1, 9, -1, 23, 30])  # 30 is past the cache: skipped, not a crash
    rec = OpRecorder()
    with rec:
        pool.update_slots_(slots, bs=8)
        pool.store_kv_(0, k, k, impl=Impl.REFERENCE)
    banned = ("_local_scalar_dense", "nonzero", "masked_select", "item")
    assert not [op for op in rec.ops if any(b in op for b in banned)], rec.ops
    inplace = [op for op in rec.ops if op.split(".")[1].endswith("_")]
    # update: copy the real slots, fill the tail; store: one index_put_ per part (K, V)
    assert inplace == ["aten.copy_.default", "aten.fill_.Scalar", "aten.index_put_.default",
                       "aten.index_put_.default"], inplace
    gk, _ = pool.gather(0, torch.tensor([4, 9, 23]))
    assert torch.equal(gk, k[[0, 2, 4]])


@pytest.mark.parametrize("rope", [3, 0])
def test_mla_layout_and_store(rope: int) -> None:
    cfg = mla(rope=rope)
    pool = KVCachePool(cfg, poison=True)
    kv = pool.kv_cache(1)
    assert kv.shape == (5, 4, 1, 8 + rope)
    assert pool.latent_cache(1).shape[-1] == 8 and pool.rope_cache(1).shape[-1] == rope
    assert pool.latent_cache(1).data_ptr() == kv.data_ptr()
    lat = torch.randn(4, 8).bfloat16()
    rp = torch.randn(4, 1, rope).bfloat16() if rope else None
    slots = [5, -1, 19, 12]
    want = kv.clone()
    loop_store(want, KVLayout.NHD, slots, lat[:, None, :])
    if rp is not None:
        loop_store(want, KVLayout.NHD, slots, rp, col=8)
    pool.store_mla_(1, lat, rp, torch.tensor(slots))
    assert torch.equal(bits(kv), bits(want))
    (row,) = pool.gather(1, torch.tensor([5, 19, 12]))
    assert torch.equal(row[:, 0, :8], lat[[0, 2, 3]])
    with pytest.raises(LayoutError, match="MHA"):
        pool.store_kv_(0, lat[:, None], lat[:, None], torch.tensor(slots))
    with pytest.raises(LayoutError):
        pool.k_cache(0)


# ---- triton parity (interpret mode on CPU) ----------------------------------------------------
@pytest.mark.triton
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(list(KVLayout)), page=st.sampled_from([1, 4]),
       heads=st.sampled_from([1, 3]), n=st.integers(0, 10),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       seed=st.integers(0, 2**16))
def test_triton_store_equals_reference(layout: KVLayout, page: int, heads: int, n: int,
                                       dtype: torch.dtype, seed: int) -> None:
    cfg = mha(layout, pages=6, page=page, heads=heads, dim=6, dtype=dtype)
    ref, fused = KVCachePool(cfg, poison=True), KVCachePool(cfg, poison=True)
    slots = [*random_slots(cfg, n, random.Random(seed), 0.3), cfg.num_slots + 3]
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(len(slots), heads, 6, generator=g).to(dtype)
    v = torch.randn(len(slots), heads, 6, generator=g).to(dtype)
    s = torch.tensor(slots)
    ref.store_kv_(0, k, v, s, impl=Impl.REFERENCE)
    fused.store_kv_(0, k, v, s, impl=Impl.TRITON)
    for a, b in ((ref.k_cache(0), fused.k_cache(0)), (ref.v_cache(0), fused.v_cache(0))):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.triton
@pytest.mark.parametrize("rope", [3, 0])
def test_triton_mla_equals_reference(rope: int) -> None:
    cfg = mla(rope=rope)
    ref, fused = KVCachePool(cfg, poison=True), KVCachePool(cfg, poison=True)
    lat = torch.randn(5, 1, 8).bfloat16()
    rp = torch.randn(5, rope).bfloat16() if rope else None
    s = torch.tensor([6, -1, 17, 4, 11], dtype=torch.int32)
    ref.store_mla_(0, lat, rp, s, impl=Impl.REFERENCE)
    fused.store_mla_(0, lat, rp, s, impl=Impl.TRITON)
    assert torch.equal(bits(ref.kv_cache(0)), bits(fused.kv_cache(0)))
    assert torch.equal(bits(ref.kv_cache(1)), bits(fused.kv_cache(1)))


def test_triton_forced_without_interpret_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pool = KVCachePool(mha(), poison=True)
    before = pool.storage.clone()
    k = torch.randn(2, 3, 5)
    with pytest.raises(LayoutError, match="TRITON_INTERPRET"):
        pool.store_kv_(0, k, k, torch.tensor([4, 5]), impl=Impl.TRITON)
    assert torch.equal(pool.storage, before)


# ---- errors leave the pool unchanged ----------------------------------------------------------
def _bad_calls(pool: KVCachePool) -> list[tuple[type[PoolError], str, Callable[[], object]]]:
    k = torch.randn(3, 3, 5)
    s = torch.tensor([4, 5, 6])
    return [
        (InputError, "dtype", lambda: pool.store_kv_(0, k.half(), k.half(), s)),
        (InputError, "shape", lambda: pool.store_kv_(0, k[:, :2], k[:, :2], s)),
        (InputError, "shape", lambda: pool.store_kv_(0, k, k[:2], s)),
        (InputError, "3 elements", lambda: pool.store_kv_(0, k, k, s[:2])),
        (InputError, "dtype", lambda: pool.store_kv_(0, k, k, s.float())),
        (InputError, "stride 1", lambda: pool.store_kv_(0, k.transpose(1, 2).contiguous()
                                                         .transpose(1, 2), k, s)),
        (InputError, "layer", lambda: pool.store_kv_(2, k, k, s)),
        (InputError, "got meta", lambda: pool.store_kv_(0, k, k, s.to("meta"))),
        (InputError, "Impl", lambda: pool.store_kv_(0, k, k, s, impl="triton")),  # type: ignore
        (CapacityError, "is 2,", lambda: pool.store_kv_(0, k, k, torch.tensor([4, 2, 5]),
                                                        check_range=True)),
        (CapacityError, "is 24,", lambda: pool.store_kv_(0, k, k, torch.tensor([4, 24, 5]),
                                                         check_range=True)),
        (CapacityError, "repeated", lambda: pool.store_kv_(0, k, k, torch.tensor([4, 9, 4]),
                                                           check_range=True)),
        (CapacityError, "more than bs", lambda: pool.update_slots_(s, bs=2)),
        (CapacityError, "max_tokens", lambda: pool.update_slots_(s, bs=33)),
        (InputError, "1 dim", lambda: pool.update_slots_(s[None])),
        (CapacityError, "max_tokens", lambda: pool.store_kv_(0, torch.randn(33, 3, 5),
                                                             torch.randn(33, 3, 5))),
    ]


@pytest.mark.parametrize("i", range(16))
def test_errors_leave_pool_unchanged(i: int) -> None:
    pool = KVCachePool(mha(), poison=True)
    pool.update_slots_(torch.tensor([8, 9]), bs=4)
    err, match, call = _bad_calls(pool)[i]
    before = pool.storage.clone()
    with pytest.raises(err, match=match):
        call()
    assert torch.equal(pool.storage, before)


def test_config_errors() -> None:
    with pytest.raises(PoolError, match="num_pages"):
        KVCacheConfig(num_pages=1, page_size=4, max_tokens=8, head_dim=8, device="cpu")
    with pytest.raises(PoolError, match="MHA needs"):
        KVCacheConfig(num_pages=4, page_size=4, max_tokens=8, device="cpu")
    with pytest.raises(PoolError, match="MLA needs"):
        KVCacheConfig(num_pages=4, page_size=4, max_tokens=8, kind=KVKind.MLA, kv_lora_rank=8,
                      num_kv_heads=2, device="cpu")
    with pytest.raises(PoolError, match="floating"):
        KVCacheConfig(num_pages=4, page_size=4, max_tokens=8, head_dim=8, dtype=torch.int8,
                      device="cpu")
    with pytest.raises(PoolError, match="KVCacheConfig"):
        KVCachePool(mha().__class__)  # type: ignore[arg-type]


# ---- poison -----------------------------------------------------------------------------------
def test_poison_checks_find_unwritten() -> None:
    pool = KVCachePool(mha(), poison=True)
    with pytest.raises(ReadRegionError, match="slot_mapping"):
        pool.check_slots(4)
    v = pool.slot_view(4)
    assert v.tolist() == [-1] * 4 and v.data_ptr() == pool.slot_mapping.data_ptr()
    pool.check_slots(4)
    pool.update_slots_(torch.tensor([5, 6]), bs=3)
    pool.check_slots(4)
    pool.update_slots_(torch.tensor([5, 2]), bs=2)  # slot 2 lies in the pad page
    with pytest.raises(ReadRegionError, match="slot_mapping\\[1\\] is 2"):
        pool.check_slots(2)
    with pytest.raises(ReadRegionError, match="never written"):
        pool.check_written(0, torch.tensor([5, 6]))
    k = torch.randn(2, 3, 5)
    pool.store_kv_(0, k, k, torch.tensor([5, 6]))
    pool.check_written(0, torch.tensor([5, 6]))
    ptr = pool.k_cache(0).data_ptr()
    pool.poison_()
    assert pool.k_cache(0).data_ptr() == ptr
    assert not bits(pool.k_cache(0)[0]).any()  # pad page re-zeroed
    with pytest.raises(ReadRegionError):
        pool.check_written(0, torch.tensor([5]))


# ---- CUDA (skipped without a GPU) -------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize("layout", list(KVLayout))
def test_cuda_auto_store_is_fused_and_equals_reference(layout: KVLayout,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from attnpool.kv import store_kernels

    calls: list[int] = []
    real = store_kernels.store_

    def counted(*a: object, **kw: object) -> None:
        calls.append(1)
        real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store_kernels, "store_", counted)
    cfg = KVCacheConfig(num_pages=64, page_size=16, max_tokens=256, num_layers=2,
                        num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, layout=layout,
                        device="cuda")
    ref, fused = KVCachePool(cfg, poison=True), KVCachePool(cfg, poison=True)
    slots = torch.tensor(random_slots(cfg, 200, random.Random(0), 0.2), device="cuda")
    k = torch.randn(slots.shape[0], 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ref.store_kv_(1, k, v, slots, impl=Impl.REFERENCE)
    fused.store_kv_(1, k, v, slots)  # AUTO on CUDA: the Triton store
    assert calls == [1]
    assert torch.equal(bits(ref.k_cache(1)), bits(fused.k_cache(1)))
    assert torch.equal(bits(ref.v_cache(1)), bits(fused.v_cache(1)))
