"""K and V of different head sizes (``KVCacheConfig(head_dim_v=)``, DeepSeek-style 192 / 128; the
tiny configs here use 24 / 16): the cache, its stores, and the adapters that read it.

The cache keeps one allocation whose K and V parts have rows of their own widths: the shapes, the
byte accounting (K rows plus V rows, nothing else), the pad page, poison and the reads are checked
directly; stores are exact (``torch.equal``) on the torch reference and the fused Triton store
(interpret mode on CPU), byte for byte between the two, in every model dtype and fp8 with
per-tensor and per-head scales; bad input is refused before any byte changes. The SDPA adapter
over such a cache equals dense float64 attention for every phase it serves; the flash-attn and
FlashInfer adapters pass the sizes as the libraries take them (checked by the fakes) and refuse,
naming the constraint, where the library has no kernel (tests/adapters/test_adapter_head_dim_v.py).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import (
    BufferPool,
    Impl,
    InputError,
    Layout,
    LayoutError,
    PoolConfig,
    PoolError,
    ReadRegionError,
)
from attnpool.adapters import sdpa
from attnpool.kv import KVCacheConfig, KVCachePool, KVKind, KVLayout
from attnpool.kv.quant import dequantize, quantize

from tests.helpers.batches import shuffled_table, tree_mask
from tests.helpers.dense import dense_attention

D, DV, H, H_KV, PAGE, C, ROWS, ND = 24, 16, 4, 2, 4, 48, 5, 3
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def cfg(layout: KVLayout = KVLayout.NHD, dtype: torch.dtype = torch.float32, *, d: int = D,
        dv: int | None = DV, pages: int = 6, layers: int = 2) -> KVCacheConfig:
    return KVCacheConfig(num_pages=pages, page_size=PAGE, max_tokens=16, num_layers=layers,
                         num_kv_heads=H_KV, head_dim=d, head_dim_v=dv, dtype=dtype,
                         layout=layout, device="cpu")


def u8(t: Tensor) -> Tensor:
    """Bitwise image: NaN-safe equality with torch.equal."""
    return t.contiguous().view(torch.uint8)


def pages(pool: KVCachePool) -> Tensor:
    """Every user page's bytes (K and V of each layer; not the scratch pages, where the
    reference store sends skipped tokens and the fused store writes nothing)."""
    return torch.cat([u8(t).flatten() for i in range(pool.cfg.num_layers)
                      for t in (pool.k_cache(i), pool.v_cache(i))])


def kv_rows(n: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H_KV, D, generator=g).to(dtype) * 3,
            torch.randn(n, H_KV, DV, generator=g).to(dtype) * 3)


SLOTS = torch.tensor([4, 13, -1, 22, 7, 23])  # page 1 and on; one padded token (-1)
REAL = SLOTS >= 0


# ---- the cache ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_shapes_and_bytes(layout: KVLayout, dtype: torch.dtype) -> None:
    c = cfg(layout, dtype)
    assert c.head_dim_v == DV and c.part_dims == (D, DV) and not c.equal_parts
    pool = KVCachePool(c)
    nhd = layout is KVLayout.NHD
    for layer in range(c.num_layers):
        k, v = pool.k_cache(layer), pool.v_cache(layer)
        assert k.shape == ((6, PAGE, H_KV, D) if nhd else (6, H_KV, PAGE, D))
        assert v.shape == ((6, PAGE, H_KV, DV) if nhd else (6, H_KV, PAGE, DV))
        assert k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == dtype
    # bytes: K rows plus V rows (the pad page and one scratch page per layer part included)
    size = dtype.itemsize
    assert c.bytes_per_token == 2 * H_KV * (D + DV) * size
    assert c.bytes_per_page == c.bytes_per_token * PAGE
    assert c.cache_nbytes == 2 * (6 + 1) * PAGE * H_KV * (D + DV) * size
    assert pool.nbytes == c.nbytes == pool.storage.numel()
    assert c.nbytes == -(-c.cache_nbytes // 256) * 256 + 16 * 8
    # every part lies inside the one allocation, none overlaps another or the slot mapping
    lo = pool.storage.data_ptr()
    spans = sorted((t.data_ptr() - lo, t.data_ptr() - lo + t.numel() * size)
                   for i in range(2) for t in (pool.k_cache(i), pool.v_cache(i)))
    assert spans[0][0] == 0 and spans[-1][1] <= c.cache_nbytes
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert (pool.slot_mapping.data_ptr() - lo) % 256 == 0
    assert pool.slot_mapping.data_ptr() - lo >= c.cache_nbytes
    assert f"K x {H_KV} heads x {D}, V x {H_KV} heads x {DV}" in pool.report()


def test_equal_sizes_are_the_old_cache() -> None:
    """``head_dim_v`` left out resolves to ``head_dim``: the same config, layout and bytes."""
    a, b = cfg(dv=None, d=8), cfg(dv=8, d=8)
    assert a == b and a.head_dim_v == 8 and a.equal_parts and a.part_dims == (8, 8)
    pool = KVCachePool(a)
    assert pool._cache is not None and pool._cache.shape == (2, 2, 7, PAGE, H_KV, 8)
    assert "K, V x 2 heads x 8" in a.report()
    mla = KVCacheConfig(num_pages=4, page_size=4, max_tokens=8, kind=KVKind.MLA, kv_lora_rank=8,
                        rope_dim=2, device="cpu")
    assert mla.head_dim_v is None and mla.part_dims == (10,)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "16"])
def test_bad_head_dim_v(bad: object) -> None:
    with pytest.raises(PoolError, match="head_dim_v must be an int >= 1"):
        cfg(dv=bad)  # type: ignore[arg-type]


def test_mla_refuses_head_dim_v() -> None:
    with pytest.raises(PoolError, match="head_dim_v is for MHA caches"):
        KVCacheConfig(num_pages=4, page_size=4, max_tokens=8, kind=KVKind.MLA, kv_lora_rank=8,
                      head_dim_v=8, device="cpu")


def test_no_stacked_kv_cache() -> None:
    pool = KVCachePool(cfg())
    with pytest.raises(LayoutError, match="this cache is MHA, the call needs MLA"):
        pool.kv_cache(0)


@pytest.mark.parametrize("layout", list(KVLayout))
def test_pad_page_and_poison(layout: KVLayout) -> None:
    pool = KVCachePool(cfg(layout), poison=True)
    for i in range(2):
        for t in (pool.k_cache(i), pool.v_cache(i)):
            assert torch.equal(t[0], torch.zeros_like(t[0])) and bool(t[1:].isnan().all())
    fresh = KVCachePool(cfg(layout))
    assert all(bool((t[0] == 0).all()) for i in range(2)
               for t in (fresh.k_cache(i), fresh.v_cache(i)))
    k, v = kv_rows(6, torch.float32)
    pool.store_kv_(1, k, v, SLOTS)
    pool.check_written(1, SLOTS[REAL])
    page, off = 13 // PAGE, 13 % PAGE
    cell = (page, off) if layout is KVLayout.NHD else (page, slice(None), off)
    pool.v_cache(1)[cell] = float("nan")  # a V row read unwritten: the V part is checked too
    with pytest.raises(ReadRegionError, match="layer 1 part 1: slot 13"):
        pool.check_written(1, SLOTS[REAL])
    pool.poison_()
    assert bool(pool.k_cache(1)[1:].isnan().all()) and bool(pool.v_cache(1)[1:].isnan().all())
    assert bool((pool.v_cache(0)[0] == 0).all())


# ---- stores -------------------------------------------------------------------------------------
IMPLS = [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_store_and_gather_exact(impl: Impl, layout: KVLayout, dtype: torch.dtype) -> None:
    pool = KVCachePool(cfg(layout, dtype), poison=True)
    k, v = kv_rows(6, dtype)
    pool.store_kv_(1, k, v, SLOTS, impl=impl)
    gk, gv = pool.gather(1, SLOTS[REAL])
    assert torch.equal(gk, k[REAL]) and torch.equal(gv, v[REAL])
    assert bool(pool.k_cache(0)[1:].isnan().all())  # the other layer is untouched
    # the reference and the fused store leave the same bytes, and so does the step store
    ref = KVCachePool(cfg(layout, dtype), poison=True)
    ref.store_kv_(1, k, v, SLOTS, impl=Impl.REFERENCE)
    assert torch.equal(pages(pool), pages(ref))
    step = KVCachePool(cfg(layout, dtype), poison=True)
    step.update_slots_(SLOTS)
    step.step_store(6, impl=impl)(1, k, v)
    assert torch.equal(pages(step), pages(ref))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_store(impl: Impl, layout: KVLayout, dtype: torch.dtype, per_head: bool) -> None:
    pool = KVCachePool(cfg(layout, dtype), poison=True)
    k, v = kv_rows(6, torch.bfloat16, seed=3)
    ks = torch.tensor([0.05, 0.5] if per_head else [0.25])
    vs = torch.tensor([2.0, 0.125] if per_head else [0.75])
    pool.store_kv_(0, k, v, SLOTS, k_scale=ks, v_scale=vs, impl=impl)
    raw_k, raw_v = pool.gather(0, SLOTS[REAL])
    assert torch.equal(u8(raw_k), u8(quantize(k[REAL], ks, dtype)))
    assert torch.equal(u8(raw_v), u8(quantize(v[REAL], vs, dtype)))
    dk, dv = pool.gather(0, SLOTS[REAL], ks, vs)
    assert torch.equal(dv, dequantize(quantize(v[REAL], vs, dtype), vs))
    assert dk.shape == (5, H_KV, D) and dv.shape == (5, H_KV, DV)
    ref = KVCachePool(cfg(layout, dtype), poison=True)
    ref.store_kv_(0, k, v, SLOTS, k_scale=ks, v_scale=vs, impl=Impl.REFERENCE)
    assert torch.equal(pages(pool), pages(ref))


def _bad(pool: KVCachePool, what: str) -> None:
    k, v = kv_rows(6, pool.cfg.dtype if pool.cfg.dtype not in FP8 else torch.float16)
    sc = {"k_scale": torch.ones(1), "v_scale": torch.ones(1)} if pool.cfg.dtype in FP8 else {}
    if what == "v of K's size":
        pool.store_kv_(1, k, k.clone(), SLOTS, **sc)
    elif what == "k of V's size":
        pool.store_kv_(1, v.clone(), v, SLOTS, **sc)
    elif what == "v one token short":
        pool.store_kv_(1, k, v[:5], SLOTS, **sc)
    elif what == "step v of K's size":
        pool.update_slots_(SLOTS)
        pool.step_store(6)(1, k, k.clone())
    else:
        pool.update_slots_(SLOTS)
        pool.step_store(6)(1, v.clone(), v)


@pytest.mark.parametrize("what, msg", [
    ("v of K's size", rf"v must have shape \(6, {H_KV}, {DV}\), got \(6, {H_KV}, {D}\)"),
    ("k of V's size", rf"k must have shape \(n, {H_KV}, {D}\), got \(6, {H_KV}, {DV}\)"),
    ("v one token short", rf"v must have shape \(6, {H_KV}, {DV}\), got \(5, {H_KV}, {DV}\)"),
    ("step v of K's size", rf"v must be torch.float32 \(6, {H_KV}, {DV}\).*got torch.float32 "
                           rf"\(6, {H_KV}, {D}\)"),
    ("step k of V's size", rf"k must be torch.float32 \(6, {H_KV}, {D}\).*got torch.float32 "
                           rf"\(6, {H_KV}, {DV}\)"),
])
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_input_writes_nothing(what: str, msg: str, impl: Impl) -> None:
    pool = KVCachePool(cfg(), poison=True)
    k, v = kv_rows(6, torch.float32)
    pool.store_kv_(1, k, v, SLOTS, impl=impl)  # some real content to keep
    before = u8(pool.storage).clone()
    with pytest.raises(InputError, match=msg):
        _bad(pool, what)
    if what.startswith("step"):  # the slot mapping was written on purpose: compare the pages
        before[pool.cfg.cache_nbytes:] = u8(pool.storage)[pool.cfg.cache_nbytes:]
    assert torch.equal(u8(pool.storage), before)


@pytest.mark.parametrize("what", ["v of K's size", "k of V's size", "v one token short"])
def test_bad_fp8_input_writes_nothing(what: str) -> None:
    pool = KVCachePool(cfg(dtype=torch.float8_e4m3fn), poison=True)
    before = u8(pool.storage).clone()
    with pytest.raises(InputError, match="must have shape"):
        _bad(pool, what)
    assert torch.equal(u8(pool.storage), before)


# ---- the SDPA adapter over a K != V cache -------------------------------------------------------
def _table(rng: random.Random) -> Tensor:
    return shuffled_table(rng, ROWS, C, PAGE)


def _filled(dtype: torch.dtype = torch.float64) -> KVCachePool:
    """A cache whose every user slot holds random K (D wide) and V (DV wide)."""
    pages = ROWS * (C // PAGE) + 1
    pool = KVCachePool(KVCacheConfig(num_pages=pages, page_size=PAGE, max_tokens=C,
                                     num_kv_heads=H_KV, head_dim=D, head_dim_v=DV, dtype=dtype,
                                     device="cpu"), poison=True)
    n = (pages - 1) * PAGE
    g = torch.Generator().manual_seed(5)
    k = torch.randn(n, H_KV, D, generator=g).to(dtype)
    v = torch.randn(n, H_KV, DV, generator=g).to(dtype)
    pool.store_kv_(0, k, v, torch.arange(PAGE, PAGE + n), impl=Impl.REFERENCE)
    return pool


def _pool(**kw: Any) -> BufferPool:
    c = PoolConfig(max_bs=4, max_context_len=C, page_size=PAGE, device="cpu",
                   layout=kw.pop("layout", Layout.BOTH), num_draft_tokens=ND, pad_page=0, **kw)
    return BufferPool(c, poison=True)


def _view(pool: BufferPool, phase: str, rng: random.Random, table: Tensor, **extra: Any
          ) -> tuple[Any, list[tuple[int, int]], list[int], list[int]]:
    """A view of 3 real rows (of 4), each real query's ``(row, position)``, the sequence
    lengths and the request rows."""
    seq = [rng.randint(1, C - ND) for _ in range(3)]
    rows = rng.sample(range(ROWS), 3)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    kw: dict[str, Any] = {"seq_lens": t(seq), "req_pool_indices": t(rows), "req_to_token": table}
    if phase == "decode":
        qs = [(r, s - 1) for r, s in zip(rows, seq, strict=True)]
        return pool.decode.update_(4, **kw), qs, seq, rows
    if phase == "verify":
        view = pool.verify.update_(4, **kw, **extra)
        return view, [(r, s + j) for r, s in zip(rows, seq, strict=True) for j in range(ND)], \
            seq, rows
    ext = [min(s, 4) for s in seq]
    view = pool.extend.update_(4, **kw, extend_lens=t(ext))
    return view, [(r, s - e + j) for r, s, e in zip(rows, seq, ext, strict=True)
                  for j in range(e)], seq, rows


@pytest.mark.parametrize("layout", [Layout.FLASH_ATTN, Layout.FLASHINFER])
@pytest.mark.parametrize("phase", ["decode", "verify", "extend"])
def test_sdpa_equals_dense(phase: str, layout: Layout) -> None:
    rng = random.Random(f"{phase}{layout}")
    table = _table(rng)
    kv = _filled()
    k, v = kv.k_cache(0), kv.v_cache(0)
    view, qs, _, _ = _view(_pool(max_extend_tokens=12), phase, rng, table)
    x = torch.randn(64, H, D, dtype=torch.float64)
    keys = [[int(table[r, j]) for j in range(p + 1)] for r, p in qs]
    want, want_lse = dense_attention(x, k, v, keys)
    n = len(qs)
    for got in (sdpa.attention_out(view, x, k, v, layout=layout),
                sdpa.attention(view, x, k, v, layout=layout).out):
        assert got.shape == (64, H, DV)
        torch.testing.assert_close(got[:n], want, rtol=1e-10, atol=1e-10)
    lse = sdpa.attention(view, x, k, v, layout=layout).lse
    torch.testing.assert_close(lse[:n].double(), want_lse, rtol=1e-6, atol=1e-6)
    part = view.prefix if phase == "verify" else view  # (a chain verify is one pass)
    pl = sdpa.plan(part, num_q=64, num_heads=H, num_kv_heads=H_KV, layout=layout,
                   dtype=torch.float64)
    torch.testing.assert_close(sdpa.run_plan(pl, x, k, v)[:n], want, rtol=1e-10, atol=1e-10)


def test_sdpa_tree_verify_merges_v_rows() -> None:
    """A tree verify view's prefix and expand passes, merged by log-sum-exp, equal dense attention
    over the union of their keys, with V's size."""
    rng = random.Random(11)
    table = _table(rng)
    kv = _filled()
    k, v = kv.k_cache(0), kv.v_cache(0)
    mask = tree_mask(3, ND)
    mask[:, 2, 1] = False  # draft 2 hangs off draft 0
    view, _, seq, rows = _view(_pool(topk=2), "verify", rng, table, tree_mask=mask)
    x = torch.randn(4 * ND, H, D, dtype=torch.float64)
    keys = [[int(table[rows[i], kk]) for kk in range(s)]
            + [int(table[rows[i], s + a]) for a in range(ND) if mask[i, j, a]]
            for i, s in enumerate(seq) for j in range(ND)]
    want, _ = dense_attention(x, k, v, keys)
    got = sdpa.attention(view, x, k, v).out
    assert got.shape == (4 * ND, H, DV)
    # (the merge weighs the passes by their float32 log-sum-exp, the adapters' convention)
    torch.testing.assert_close(got[: 3 * ND], want, rtol=1e-6, atol=1e-6)


def test_sdpa_prefix_free_extend() -> None:
    """A prefill with nothing cached takes SDPA's own causal mask: V's size still comes out."""
    rng = random.Random(4)
    table = _table(rng)
    kv = _filled()
    k, v = kv.k_cache(0), kv.v_cache(0)
    pool = _pool(max_extend_tokens=12)
    seq = [3, 4, 2]
    rows = rng.sample(range(ROWS), 3)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    view = pool.extend.update_(4, seq_lens=t(seq), req_pool_indices=t(rows), req_to_token=table,
                               extend_lens=t(seq))
    x = torch.randn(12, H, D, dtype=torch.float64)
    qs = [(r, j) for r, s in zip(rows, seq, strict=True) for j in range(s)]
    keys = [[int(table[r, j]) for j in range(p + 1)] for r, p in qs]
    want, _ = dense_attention(x, k, v, keys)
    pl = sdpa.plan(view, num_q=12, num_heads=H, num_kv_heads=H_KV, prefix_free=True)
    got = sdpa.run_plan(pl, x, k, v)
    assert got.shape == (12, H, DV)
    torch.testing.assert_close(got[: len(qs)], want, rtol=1e-10, atol=1e-10)
