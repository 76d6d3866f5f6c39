"""fp8 KV cache: quantizing stores (reference and fused Triton write the same bytes as an independent
oracle), dequantizing reads, SDPA over the fp8 cache, errors before any write, memory report."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from attnpool import BufferPool, Impl, Layout, PagedView, PoolConfig, PoolError
from attnpool.adapters.sdpa import attention
from attnpool.kv import KVCacheConfig, KVCachePool, KVKind, KVLayout
from attnpool.kv.quant import FP8, dequantize

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
MODEL = [torch.float16, torch.bfloat16, torch.float32]


def cfg(dtype: torch.dtype, layout: KVLayout = KVLayout.NHD, heads: int = 3, dim: int = 8,
        page: int = 4, pages: int = 8) -> KVCacheConfig:
    return KVCacheConfig(num_pages=pages, page_size=page, max_tokens=32, num_layers=2,
                         num_kv_heads=heads, head_dim=dim, dtype=dtype, layout=layout, device="cpu")


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def oracle(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Independent of attnpool: float32 divide per head, clamp to the finite max, torch's cast."""
    fmax = torch.finfo(dtype).max
    out = torch.empty(x.shape, dtype=dtype)
    for h in range(x.shape[1]):
        s = scale[h if scale.numel() > 1 else 0].item()
        y = x[:, h].to(torch.float32) / torch.tensor(s, dtype=torch.float32)
        out[:, h] = torch.clamp(y, -fmax, fmax).to(dtype)
    return out


def fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite fp8 value, as float64."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double()
    return v[torch.isfinite(v)].unique()


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_torch_cast_is_round_to_nearest_even(dtype: torch.dtype) -> None:
    """The oracle relies on torch's float32 -> fp8 cast rounding to nearest, ties to even: check it
    against the grid on every midpoint and on values just beside each midpoint."""
    g = fp8_grid(dtype)
    lo, hi = g[:-1], g[1:]
    mid = (lo + hi) / 2  # exact in float64 and float32 (a few more bits than fp8)
    assert torch.equal(mid.float().double(), mid)
    got = mid.float().to(dtype).double()
    lo_even = (u8(lo.to(dtype)).to(torch.int64) & 1) == 0  # the even neighbour has mantissa lsb 0
    assert torch.equal(got, torch.where(lo_even, lo, hi))
    below = torch.nextafter(mid.float(), lo.float())
    above = torch.nextafter(mid.float(), hi.float())
    assert torch.equal(below.to(dtype).double(), lo)
    assert torch.equal(above.to(dtype).double(), hi)
    # and the fp8 maximum is what the semantics saturate at
    assert g.max().item() == FP8[dtype][0] == torch.finfo(dtype).max


def _inputs(dtype: torch.dtype, n: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g) * 3
    x[0, 0, :4] = torch.tensor([1e9, -1e9, 6e4, -6e4])  # outliers far past e4m3 (and e5m2) max
    x[1, -1, :3] = torch.tensor([1e-7, -3e-3, 0.0])  # subnormal and zero territory
    return x.to(dtype)


@pytest.mark.parametrize("cache", FP8_DTYPES)
@pytest.mark.parametrize("src", MODEL)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("layout", list(KVLayout))
def test_store_bytes_equal_oracle_and_gather_dequantizes(cache: torch.dtype, src: torch.dtype,
                                                         per_head: bool, layout: KVLayout) -> None:
    c = cfg(cache, layout)
    pool = KVCachePool(c, poison=True)
    slots = torch.tensor([5, -1, 17, 9, 30, -1, 12])
    n = slots.numel()
    k = _inputs(src, n, 3, 8, 1)
    v = _inputs(src, n, 3, 8, 2) * 100
    ks = torch.tensor([0.02, 0.5, 3.0] if per_head else [0.05])
    vs = torch.tensor([1.5, 0.01, 7.0] if per_head else [0.3])
    before = pool.storage.clone()
    pool.store_kv_(1, k, v, slots, k_scale=ks, v_scale=vs, impl=Impl.REFERENCE)
    real = slots >= 0
    gk, gv = pool.gather(1, slots[real])
    assert gk.dtype == cache
    assert torch.equal(u8(gk), u8(oracle(k[real], ks, cache)))
    assert torch.equal(u8(gv), u8(oracle(v[real], vs, cache)))
    assert torch.isfinite(gk.float()).all() and torch.isfinite(gv.float()).all()
    fmax = FP8[cache][0]
    assert gk[0, 0, 0].float() == fmax and gk[0, 0, 1].float() == -fmax  # saturated, not NaN/inf
    # nothing but the real rows (and the hidden scratch page) changed; layer 0 untouched
    assert torch.equal(u8(pool._cache[0]), u8(before[: pool._cache.numel()].view(cache)
                                              .view(pool._cache.shape)[0]))
    # dequantizing read: stored * scale, in float32 or a given dtype
    dk, dv = pool.gather(1, slots[real], ks, vs)
    assert dk.dtype == torch.float32
    assert torch.equal(dk, gk.float() * ks.reshape(-1, 1))
    assert torch.equal(dv, gv.float() * vs.reshape(-1, 1))
    bk, _ = pool.gather(1, slots[real], ks, vs, dtype=torch.bfloat16)
    assert torch.equal(bk, dk.to(torch.bfloat16))
    # in range, the round trip error is at most half an fp8 quantum (relative 2^-4 / 2^-3)
    ok = (k[real].float().abs() / ks.reshape(-1, 1) < fmax)
    rel = 2.0 ** -(FP8[cache][1] + 1)
    err = (dk - k[real].float()).abs()
    tiny = 2.0 ** (FP8[cache][2] - FP8[cache][1]) * ks.reshape(-1, 1)  # subnormal quantum
    assert bool((err <= rel * k[real].float().abs() + tiny)[ok].all())


@pytest.mark.parametrize("cache", FP8_DTYPES)
def test_mla_fp8_store(cache: torch.dtype) -> None:
    c = KVCacheConfig(num_pages=5, page_size=4, max_tokens=32, num_layers=1, kind=KVKind.MLA,
                      kv_lora_rank=8, rope_dim=3, dtype=cache, device="cpu")
    pool = KVCachePool(c, poison=True)
    lat = torch.randn(4, 8, dtype=torch.bfloat16) * 500
    rope = torch.randn(4, 3, dtype=torch.bfloat16)
    s, sc = torch.tensor([4, 7, -1, 13]), torch.tensor([0.25])
    pool.store_mla_(0, lat, rope, s, scale=sc)
    (row,) = pool.gather(0, s[s >= 0])
    want = oracle(torch.cat([lat, rope], 1)[s >= 0].unsqueeze(1), sc, cache)
    assert torch.equal(u8(row), u8(want))
    (deq,) = pool.gather(0, s[s >= 0], sc)
    assert torch.equal(deq, row.float() * 0.25)


def test_report_and_bytes_half_of_float16() -> None:
    half, f8 = KVCachePool(cfg(torch.float16)), KVCachePool(cfg(torch.float8_e4m3fn))
    assert f8.cfg.bytes_per_token * 2 == half.cfg.bytes_per_token
    assert f8._cache.numel() * f8._cache.itemsize * 2 == half._cache.numel() * half._cache.itemsize
    assert "float8_e4m3fn" in f8.report()
    assert f"bytes per token: {half.cfg.bytes_per_token // 2} " in f8.report()
    assert f"bytes per token: {half.cfg.bytes_per_token} " in half.report()


# ---- errors: PoolError, and not one byte of the pool changed ----------------------------------
def _err_cases() -> list[tuple[str, torch.dtype, Callable[[KVCachePool], None]]]:
    k = torch.randn(3, 3, 8, dtype=torch.float16)
    s = torch.tensor([5, 6, 7])
    one, three = torch.tensor([0.5]), torch.tensor([0.5, 1.0, 2.0])
    e4 = torch.float8_e4m3fn
    return [
        ("k_scale must be finite and > 0", e4,
         lambda p: p.store_kv_(0, k, k, s, k_scale=torch.tensor([0.0]), v_scale=one)),
        ("v_scale must be finite and > 0", e4,
         lambda p: p.store_kv_(0, k, k, s, k_scale=one, v_scale=torch.tensor([1.0, -1.0, 2.0]))),
        ("k_scale must be finite and > 0", e4,
         lambda p: p.store_kv_(0, k, k, s, k_scale=torch.tensor([math.nan]), v_scale=one)),
        ("v_scale must be finite and > 0", torch.float8_e5m2,
         lambda p: p.store_kv_(0, k, k, s, k_scale=one, v_scale=torch.tensor([math.inf]))),
        ("1 or 3 elements", e4,
         lambda p: p.store_kv_(0, k, k, s, k_scale=torch.ones(2), v_scale=one)),
        ("float32", e4,
         lambda p: p.store_kv_(0, k, k, s, k_scale=one.double(), v_scale=one)),
        ("k_scale is required", e4, lambda p: p.store_kv_(0, k, k, s)),
        ("v_scale is required", e4, lambda p: p.store_kv_(0, k, k, s, k_scale=three)),
        ("scales are only for fp8", torch.float16,
         lambda p: p.store_kv_(0, k, k, s, k_scale=one, v_scale=one)),
        ("scales are only for fp8", torch.float16,
         lambda p: p.store_kv_(0, k, k, s, v_scale=one)),
        ("dtype", e4,  # fp8 sources are refused: the store quantizes model dtypes
         lambda p: p.store_kv_(0, k.to(e4), k.to(e4), s, k_scale=one, v_scale=one)),
        ("scales are only for fp8", torch.float16, lambda p: p.gather(0, s, one, one) and None),
    ]


@pytest.mark.parametrize("i", range(len(_err_cases())))
@pytest.mark.parametrize("impl", [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)])
def test_errors_leave_pool_unchanged(i: int, impl: Impl) -> None:
    msg, dtype, call = _err_cases()[i]
    pool = KVCachePool(cfg(dtype), poison=True)
    before = pool.storage.view(torch.uint8).clone()

    def run(p: KVCachePool) -> None:
        orig = p.store_kv_
        p.store_kv_ = lambda *a, **kw: orig(*a, impl=impl, **kw)  # type: ignore[method-assign]
        call(p)

    with pytest.raises(PoolError, match=msg):
        run(pool)
    assert torch.equal(pool.storage.view(torch.uint8), before)


def test_scale_value_check_can_be_skipped() -> None:
    """``check_scales=False`` trusts the scales (no host read): a zero scale then saturates."""
    pool = KVCachePool(cfg(torch.float8_e4m3fn))
    k = torch.ones(1, 3, 8)
    z = torch.tensor([0.0])
    pool.store_kv_(0, k, -k, torch.tensor([5]), k_scale=z, v_scale=z, check_scales=False)
    gk, gv = pool.gather(0, torch.tensor([5]))
    assert (gk.float() == 448).all() and (gv.float() == -448).all()


# ---- fused Triton store == reference, bytes ---------------------------------------------------
def _special(dtype: torch.dtype) -> torch.Tensor:
    """Every float16 value (NaN, inf, subnormals included), the midpoints between neighbours, and
    the fp8 grid's own midpoints and their float32 neighbours: every rounding case."""
    h = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    fin = h[torch.isfinite(h)].sort().values
    g = fp8_grid(dtype).float()
    mid = (g[:-1] + g[1:]) / 2
    extra = torch.tensor([1e30, -1e30, 3e38, 1e-40, -1e-40, -0.0])
    return torch.cat([h, (fin[:-1] + fin[1:]) / 2, mid, torch.nextafter(mid, g[:-1]),
                      torch.nextafter(mid, g[1:]), extra])


@pytest.mark.triton
@pytest.mark.parametrize("cache", FP8_DTYPES)
def test_triton_store_equals_reference_exhaustive(cache: torch.dtype) -> None:
    x = _special(cache)
    heads, dim = 2, 64
    n = -(-x.numel() // (heads * dim))
    x = torch.cat([x, torch.zeros(n * heads * dim - x.numel())]).view(n, heads, dim)
    c = KVCacheConfig(num_pages=n // 16 + 3, page_size=16, max_tokens=n, num_kv_heads=heads,
                      head_dim=dim, dtype=cache, device="cpu")
    slots = torch.arange(16, 16 + n)
    for ks in (torch.tensor([1.0]), torch.tensor([0.37, 3.0])):
        ref, fused = KVCachePool(c, poison=True), KVCachePool(c, poison=True)
        ref.store_kv_(0, x, -x, slots, k_scale=ks, v_scale=ks, impl=Impl.REFERENCE)
        fused.store_kv_(0, x, -x, slots, k_scale=ks, v_scale=ks, impl=Impl.TRITON)
        assert torch.equal(ref.storage, fused.storage)
    # and the scale-1 reference equals the oracle on all of it (NaN bytes included)
    want = oracle(x, torch.tensor([1.0]), cache)
    ref1 = KVCachePool(c, poison=True)
    ref1.store_kv_(0, x, x, slots, k_scale=torch.tensor([1.0]), v_scale=torch.tensor([1.0]))
    assert torch.equal(u8(ref1.gather(0, slots)[0]), u8(want))


@pytest.mark.triton
@pytest.mark.parametrize("cache", FP8_DTYPES)
@pytest.mark.parametrize("src", MODEL)
@pytest.mark.parametrize("layout", list(KVLayout))
def test_triton_store_equals_reference(cache: torch.dtype, src: torch.dtype,
                                       layout: KVLayout) -> None:
    c = cfg(cache, layout)
    slots = torch.tensor([5, -1, 17, 9, 30, -1, 12, 200])  # 200: past the cache, skipped
    k, v = _inputs(src, 8, 3, 8, 3), _inputs(src, 8, 3, 8, 4) * 50
    for ks, vs in ((torch.tensor([0.1]), torch.tensor([2.0])),
                   (torch.tensor([0.02, 0.5, 3.0]), torch.tensor([1.5, 0.01, 7.0]))):
        ref, fused = KVCachePool(c, poison=True), KVCachePool(c, poison=True)
        ref.store_kv_(0, k, v, slots, k_scale=ks, v_scale=vs, impl=Impl.REFERENCE)
        fused.store_kv_(0, k, v, slots, k_scale=ks, v_scale=vs, impl=Impl.TRITON)
        # the scratch page is meaningless (the reference writes skipped tokens there)
        n = c.num_pages
        assert torch.equal(u8(ref._cache[:, :, :n]), u8(fused._cache[:, :, :n]))


@pytest.mark.triton
def test_triton_mla_fp8_equals_reference() -> None:
    c = KVCacheConfig(num_pages=5, page_size=4, max_tokens=32, kind=KVKind.MLA, kv_lora_rank=8,
                      rope_dim=3, dtype=torch.float8_e4m3fn, device="cpu")
    lat, rope = torch.randn(5, 8) * 900, torch.randn(5, 3)
    s, sc = torch.tensor([4, 7, -1, 13, 19]), torch.tensor([0.5])
    ref, fused = KVCachePool(c, poison=True), KVCachePool(c, poison=True)
    ref.store_mla_(0, lat, rope, s, scale=sc, impl=Impl.REFERENCE)
    fused.store_mla_(0, lat, rope, s, scale=sc, impl=Impl.TRITON)
    assert torch.equal(u8(ref._cache[:, :, :5]), u8(fused._cache[:, :, :5]))


# ---- attention over the fp8 cache -------------------------------------------------------------
@pytest.mark.parametrize("cache", FP8_DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
def test_sdpa_over_fp8_equals_attention_over_dequantized(cache: torch.dtype, per_head: bool) -> None:
    page, h_kv, d = 4, 2, 8
    pool = BufferPool(PoolConfig(max_bs=3, max_context_len=32, page_size=page, device="cpu",
                                 layout=Layout.FLASH_ATTN))
    c = KVCacheConfig(num_pages=30, page_size=page, max_tokens=64, num_kv_heads=h_kv, head_dim=d,
                      dtype=cache, device="cpu")
    kv = KVCachePool(c)
    seq = [5, 11, 3]
    req_to_token = torch.zeros(3, 32, dtype=torch.int32)
    pages = (torch.randperm(c.num_pages - 1) + 1).tolist()  # whole pages per request, shuffled
    per: list[torch.Tensor] = []
    for i, n in enumerate(seq):
        own = torch.tensor([pages.pop() for _ in range(-(-n // page))])
        tok = torch.arange(n)
        per.append(own[tok // page] * page + tok % page)
        req_to_token[i, :n] = per[-1]
    slots = torch.cat(per)
    ks = torch.tensor([0.03, 0.2]) if per_head else torch.tensor([0.05])
    vs = torch.tensor([0.5, 0.01]) if per_head else torch.tensor([0.02])
    k, v = torch.randn(sum(seq), h_kv, d), torch.randn(sum(seq), h_kv, d)
    kv.store_kv_(0, k, v, slots, k_scale=ks, v_scale=vs)
    view = pool.decode.update_(3, seq_lens=torch.tensor(seq), req_pool_indices=torch.arange(3),
                               req_to_token=req_to_token)
    assert isinstance(view, PagedView)
    q = torch.randn(3, 4, d)
    got = attention(view, q, kv.k_cache(0), kv.v_cache(0), k_scale=ks, v_scale=vs)
    kd = dequantize(kv.k_cache(0), ks)
    vd = dequantize(kv.v_cache(0), vs)
    want = attention(view, q, kd, vd)
    assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)
    # and it is not the undequantized read
    raw = attention(view, q, kv.k_cache(0).float(), kv.v_cache(0).float())
    assert not torch.allclose(raw.out, got.out)
    with pytest.raises(PoolError, match="v_scale is required"):
        attention(view, q, kv.k_cache(0), kv.v_cache(0), k_scale=ks)


def test_config_report_plans_the_fp8_cache_at_half_without_allocating() -> None:
    def cfg(dtype: torch.dtype) -> KVCacheConfig:
        return KVCacheConfig(num_layers=32, num_kv_heads=8, head_dim=128, num_pages=4096,
                             page_size=16, dtype=dtype, device="cpu", max_tokens=8192)

    half, fp8 = cfg(torch.float16), cfg(torch.float8_e4m3fn)
    assert fp8.bytes_per_token * 2 == half.bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert fp8.cache_nbytes * 2 == half.cache_nbytes
    assert "total:           4.00 GiB" in fp8.report() and "8.00 GiB" in half.report()
    small = KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, num_pages=8, page_size=4,
                          dtype=torch.float8_e5m2, device="cpu", max_tokens=16)
    pool = KVCachePool(small)
    assert pool.nbytes == small.nbytes == pool.storage.numel()
    assert pool.report() == small.report()
