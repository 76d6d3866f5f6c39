"""fp8 KV caches through the kernel adapters, on CPU against fakes that check and compute with the
real libraries' fp8 arguments (``fakes_fa3.py``, ``fakes_flashinfer.py``).

The caches are written by :meth:`attnpool.KVCachePool.store_kv_` with scales. Through each adapter
the result must be the SDPA adapter's over the same fp8 cache with the same scales (itself equal
to attention over the dequantized values, ``test_kv_fp8.py``), and clearly not the raw fp8 read.
FA3 computes with q in ``float8_e4m3fn`` (its kernels take one dtype for q, k and v), so its
reference takes the same fp8-rounded queries. Bad scales raise a :class:`attnpool.PoolError`
before any kernel call, leaving pool, cache and wrappers unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnpool import (
    BufferPool,
    InputError,
    KVCacheConfig,
    KVCachePool,
    Layout,
    LayoutError,
    PagedView,
    PoolConfig,
    PoolError,
)
from attnpool.adapters import flash_attn as fa
from attnpool.adapters import flashinfer as fi
from attnpool.adapters import fp8, sdpa
from attnpool.kv.quant import dequantize

from tests.helpers.batches import make_batch, tree_mask
from tests.helpers.fakes_fa3 import FA2, FA3
from tests.helpers.fakes_flashinfer import BatchDecodeWithPagedKVCacheWrapper as Decode
from tests.helpers.fakes_flashinfer import BatchPrefillWithPagedKVCacheWrapper as Prefill

P, H, H_KV, D, ND = 4, 4, 2, 16, 4
E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
FA3_NAMES = [name for name, _ in fa.FA3_MODULES]


def _pool(layout: Layout, device: str = "cpu", **kw: Any) -> BufferPool:
    cfg = PoolConfig(max_bs=6, max_context_len=64, page_size=P, device=device, layout=layout,
                     pad_page=2, **kw)
    return BufferPool(cfg, poison=True)


def _scales(per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if per_head:
        return torch.tensor([0.02, 0.07]), torch.tensor([0.5, 0.03])
    return torch.tensor([0.04]), torch.tensor([0.2])


def _kv(pool: BufferPool, dtype: torch.dtype, ks: torch.Tensor, vs: torch.Tensor,
        seed: int = 0, d: int = D) -> KVCachePool:
    """Every page a view of ``pool`` may read (make_table's ids, the pad page 2) written by the
    quantizing store; page 0 stays poisoned (NaN), so a read of it would show."""
    pages = 12 * pool.cfg.max_pages + 2
    dev = pool.cfg.torch_device
    c = KVCacheConfig(num_pages=pages, page_size=P, max_tokens=pages * P, num_kv_heads=H_KV,
                      head_dim=d, dtype=dtype, device=dev)
    kv = KVCachePool(c, poison=True)
    g = torch.Generator().manual_seed(seed)
    n = (pages - 1) * P
    k, v = torch.randn(n, H_KV, d, generator=g) * 4, torch.randn(n, H_KV, d, generator=g)
    kv.store_kv_(0, k.to(dev, BF16), v.to(dev, BF16), torch.arange(P, pages * P, device=dev),
                 k_scale=ks.to(dev), v_scale=vs.to(dev))
    return kv


def _view(pool: BufferPool, part: str, seed: int = 1) -> tuple[object, int]:
    """A refilled view and its real query rows."""
    rng = random.Random(seed)
    dev = pool.cfg.torch_device
    if part == "decode":
        b = make_batch(pool.cfg, 3, rng)
        return pool.decode.update_(4, **b.inputs(dev)), 3
    topk = 2 if part == "tree" else 1
    b = make_batch(pool.cfg, 3, rng, extra=ND)
    mask = tree_mask(3, ND, device=dev) if topk > 1 else None
    return pool.verify.update_(5, **b.inputs(dev), tree_mask=mask), 3 * ND


def _rows(view: object) -> int:
    return view.bs * (ND if not isinstance(view, PagedView) else view.max_seqlen_q)  # type: ignore


def _q8(q: torch.Tensor) -> torch.Tensor:
    """What FA3 reads of ``q``: saturated to +-448 and rounded to float8_e4m3fn."""
    return q.float().clamp(-448, 448).to(E4M3).float()


def _close_out(got: torch.Tensor, want: torch.Tensor, rows: int) -> None:
    # both computed in float32; the kernel's output is rounded once to bfloat16 (2^-9 relative)
    torch.testing.assert_close(got[:rows].float(), want[:rows].float(), atol=1e-2, rtol=1e-2)


def _close_lse(got: torch.Tensor, want: torch.Tensor, rows: int) -> None:
    torch.testing.assert_close(got[:rows], want[:rows], atol=1e-4, rtol=1e-4)


def _differs(got: torch.Tensor, raw: torch.Tensor, rows: int) -> None:
    assert (got[:rows].float() - raw[:rows].float()).abs().max() > 0.1  # scales matter


# ---- FA3 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", FA3_NAMES)
@pytest.mark.parametrize("part", ["decode", "tree"])
@pytest.mark.parametrize("per_head", [False, True])
def test_fa3_over_fp8_equals_sdpa_over_the_same_cache(install: Callable[[str, Any], None],
                                                      module: str, part: str,
                                                      per_head: bool) -> None:
    fake = FA3()
    install(module, fake.module(module, varlen=module == "vllm.vllm_flash_attn"))
    pool = _pool(Layout.FLASH_ATTN, num_draft_tokens=ND, topk=2)
    ks, vs = _scales(per_head)
    kv = _kv(pool, E4M3, ks, vs)
    k8, v8 = kv.k_cache(0), kv.v_cache(0)
    view, rows = _view(pool, part)
    q = (torch.randn(_rows(view), H, D, generator=torch.Generator().manual_seed(3)) * 2).to(BF16)
    got = fa.attention(view, q, k8, v8, k_scale=ks, v_scale=vs)
    assert got.out.dtype == BF16 and got.out.shape == q.shape
    want = sdpa.attention(view, _q8(q), k8, v8, k_scale=ks, v_scale=vs)
    _close_out(got.out, want.out, rows)
    _close_lse(got.lse, want.lse, rows)
    deq = sdpa.attention(view, _q8(q), dequantize(k8, ks), dequantize(v8, vs))
    assert torch.equal(want.out, deq.out) and torch.equal(want.lse, deq.lse)
    _differs(got.out, sdpa.attention(view, _q8(q), k8.float(), v8.float()).out, rows)
    # what the kernel got: q in e4m3fn, the scales as [bs, H_kv] views of our tensors (no copy)
    for _, kw in fake.calls:
        bs = kw["cu_seqlens_q"].numel() - 1
        assert kw["q"].dtype == E4M3 and kw["q_descale"] is None
        for name, s in (("k_descale", ks), ("v_descale", vs)):
            t = kw[name]
            assert t.shape == (bs, H_KV) and t.dtype == torch.float32
            assert t.data_ptr() == s.data_ptr() and t.stride() == (0, 1 if per_head else 0)


def test_fa3_reads_the_scale_tensors_at_every_call() -> None:
    """The descale views alias the caller's scales: an in-place change (as between graph
    replays) is what the next call computes with."""
    fake = FA3()
    kernel = fa.FlashKernel("fake", fa.FlashAttnVersion.FA3, fa.CallStyle.KVCACHE,
                            fake.flash_attn_with_kvcache, None)
    pool = _pool(Layout.FLASH_ATTN)
    ks, vs = _scales(True)
    kv = _kv(pool, E4M3, ks, vs)
    view, rows = _view(pool, "decode")
    q = torch.randn(4, H, D).to(BF16)
    kw = fa.fa3_kwargs(view, q, kv.k_cache(0), kv.v_cache(0), k_scale=ks, v_scale=vs)
    first = fa.run(view, q, kv.k_cache(0), kv.v_cache(0), kernel=kernel, k_scale=ks, v_scale=vs)
    vs.mul_(2)  # the kwargs built before see it too: same memory
    assert torch.equal(kw["v_descale"][0], vs)
    second = fa.run(view, q, kv.k_cache(0), kv.v_cache(0), kernel=kernel, k_scale=ks, v_scale=vs)
    _close_out(second.out, first.out.float() * 2, rows)


@pytest.mark.parametrize("qdtype", [torch.float16, BF16, torch.float32])
def test_fa3_q_scale_and_output_dtype(qdtype: torch.dtype) -> None:
    fake = FA3()
    kernel = fa.FlashKernel("fake", fa.FlashAttnVersion.FA3, fa.CallStyle.KVCACHE,
                            fake.flash_attn_with_kvcache, None)
    pool = _pool(Layout.FLASH_ATTN, num_draft_tokens=ND)
    ks, vs = _scales(True)
    kv = _kv(pool, E4M3, ks, vs)
    view, rows = _view(pool, "chain")
    q = (torch.randn(_rows(view), H, D) * 30).to(qdtype)
    q[0, 0, :2] = torch.tensor([5000.0, -5000.0])  # past e4m3's range even after q_scale
    qs = torch.tensor([0.5, 2.0])
    got = fa.attention(view, q, kv.k_cache(0), kv.v_cache(0), kernel=kernel, k_scale=ks,
                       v_scale=vs, q_scale=qs)
    assert got.out.dtype == qdtype  # FA3's bfloat16 output cast back to q's dtype
    assert not got.out[:rows].isnan().any()  # the outlier saturated, not NaN
    qh = qs.repeat_interleave(H // H_KV).view(1, H, 1)
    q_read = (q.float() / qh).clamp(-448, 448).to(E4M3).float() * qh  # q8 * q_descale
    want = sdpa.attention(view, q_read, kv.k_cache(0), kv.v_cache(0), k_scale=ks, v_scale=vs)
    _close_out(got.out, want.out, rows)
    _close_lse(got.lse, want.lse, rows)
    kw = fake.calls[-1][1]
    assert kw["q_descale"].data_ptr() == qs.data_ptr() and kw["q_descale"].shape == (view.bs, H_KV)


def test_fa3_scheduler_metadata_planned_in_fp8() -> None:
    fake = FA3()
    kernel = fa.FlashKernel("fake", fa.FlashAttnVersion.FA3, fa.CallStyle.KVCACHE,
                            fake.flash_attn_with_kvcache, fake.get_scheduler_metadata)
    pool = _pool(Layout.FLASH_ATTN, fa3_scheduler_metadata=True)
    ks, vs = _scales(False)
    kv = _kv(pool, E4M3, ks, vs)
    view, rows = _view(pool, "decode")
    assert isinstance(view, PagedView)
    md = fa.scheduler_metadata_(pool, view, num_heads_q=H, num_heads_kv=H_KV, head_dim=D,
                                qkv_dtype=E4M3, kernel=kernel)
    q = torch.randn(4, H, D).to(BF16)
    got = fa.run(view, q, kv.k_cache(0), kv.v_cache(0), scheduler_metadata=md, kernel=kernel,
                 k_scale=ks, v_scale=vs)
    want = sdpa.attention(view, _q8(q), kv.k_cache(0), kv.v_cache(0), k_scale=ks, v_scale=vs)
    _close_out(got.out, want.out, rows)


def _fa3_bad_cases() -> list[tuple[str, type[PoolError], str, dict[str, Any]]]:
    ks, vs = _scales(True)
    return [
        ("e4m3", InputError, "v_scale is required", {"k_scale": ks}),
        ("e4m3", InputError, "k_scale must be a float32", {"k_scale": ks.half(), "v_scale": vs}),
        ("e4m3", InputError, "with 1 or 2 elements", {"k_scale": torch.ones(3), "v_scale": vs}),
        ("e4m3", InputError, "q_scale must be a float32", {"k_scale": ks, "v_scale": vs,
                                                           "q_scale": torch.ones(4)}),
        ("e4m3", InputError, "must be a torch.Tensor", {"k_scale": 0.5, "v_scale": vs}),
        ("bf16", InputError, "k_scale must be None", {"k_scale": ks, "v_scale": vs}),
        ("bf16", InputError, "q_scale must be None", {"q_scale": ks}),
        ("e5m2", LayoutError, "float8_e4m3fn only", {"k_scale": ks, "v_scale": vs}),
        ("e4m3-d8", LayoutError, "multiples of 16", {"k_scale": ks, "v_scale": vs}),
    ]


@pytest.mark.parametrize("case", range(len(_fa3_bad_cases())))
def test_fa3_bad_scales_raise_before_the_kernel(case: int) -> None:
    cache, err, match, kw = _fa3_bad_cases()[case]
    fake = FA3()
    kernel = fa.FlashKernel("fake", fa.FlashAttnVersion.FA3, fa.CallStyle.KVCACHE,
                            fake.flash_attn_with_kvcache, None)
    pool = _pool(Layout.FLASH_ATTN)
    view, _ = _view(pool, "decode")
    dtype = {"e4m3": E4M3, "e4m3-d8": E4M3, "e5m2": E5M2, "bf16": BF16}[cache]
    if dtype == BF16:
        k = torch.randn(12 * pool.cfg.max_pages + 2, P, H_KV, D).to(BF16)
        v = k.clone()
    else:
        kv = _kv(pool, dtype, *_scales(True))
        k, v = kv.k_cache(0), kv.v_cache(0)
    if cache == "e4m3-d8":
        k, v = k[..., :8], v[..., :8]
    q = torch.randn(4, H, k.shape[-1]).to(BF16)
    arena, kb, vb = pool.arena.storage.clone(), k.clone(), v.clone()
    with pytest.raises(err, match=match):
        fa.attention(view, q, k, v, kernel=kernel, **kw)
    assert fake.calls == []
    assert torch.equal(pool.arena.storage, arena)
    assert torch.equal(k.view(torch.uint8), kb.view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), vb.view(torch.uint8))


def test_fake_fa3_checks_fp8_arguments_as_fa3_does() -> None:
    """The fake refuses what FA3's mha_fwd refuses, so the adapter's arguments are checked."""
    fake = FA3()
    pool = _pool(Layout.FLASH_ATTN)
    ks, vs = _scales(True)
    kv = _kv(pool, E4M3, ks, vs)
    view, _ = _view(pool, "decode")
    q = torch.randn(4, H, D).to(BF16)
    kw = fa.fa3_kwargs(view, q, kv.k_cache(0), kv.v_cache(0), k_scale=ks, v_scale=vs)
    with pytest.raises(RuntimeError, match="query and key must have the same dtype"):
        fake.flash_attn_with_kvcache(**{**kw, "q": q})  # model-dtype q over an fp8 cache
    with pytest.raises(RuntimeError, match=r"k_descale must have shape \(batch_size, num_heads_k\)"):
        fake.flash_attn_with_kvcache(**{**kw, "k_descale": ks})  # the flat [H_kv] scale
    with pytest.raises(RuntimeError, match="expected scalar type Float but found Half"):
        fake.flash_attn_with_kvcache(**{**kw, "v_descale": kw["v_descale"].half()})
    with pytest.raises(RuntimeError, match="Ampere/Ada cards only supports fp16 and bf16"):
        FA3(arch=80).flash_attn_with_kvcache(**kw)
    out, _, *_ = fake.flash_attn_with_kvcache(**kw)
    assert out.dtype == BF16  # FA3's output dtype for fp8 inputs


def test_fa2_refuses_fp8_and_stray_scales(install: Callable[[str, Any], None]) -> None:
    fake = FA2()
    install("flash_attn", fake.module())
    cfg = PoolConfig(max_bs=4, max_context_len=512, page_size=256, device="cpu", pad_page=0)
    big = BufferPool(cfg)
    view = big.decode.view(2)
    k8 = torch.zeros(4, 256, H_KV, D, dtype=E4M3)
    q = torch.randn(2, H, D).to(BF16)
    with pytest.raises(LayoutError, match="flash-attn 2 has no fp8 KV cache"):
        fa.attention(view, q, k8, k8, version=fa.FlashAttnVersion.FA2, k_scale=torch.ones(1),
                     v_scale=torch.ones(1))
    kb = torch.zeros(4, 256, H_KV, D, dtype=BF16)
    with pytest.raises(InputError, match="k_scale must be None"):
        fa.attention(view, q, kb, kb, version=fa.FlashAttnVersion.FA2, k_scale=torch.ones(1),
                     v_scale=torch.ones(1))
    assert fake.calls == []


# ---- FlashInfer ---------------------------------------------------------------------------------
def _wrappers() -> fi.GraphWrappers:
    return fi.GraphWrappers(torch.empty(256, dtype=torch.uint8), decode_cls=Decode,
                            prefill_cls=Prefill)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("part", ["decode", "chain", "tree"])
def test_flashinfer_over_fp8_equals_sdpa_over_the_same_cache(dtype: torch.dtype,
                                                             part: str) -> None:
    pool = _pool(Layout.FLASHINFER, num_draft_tokens=ND, topk=2 if part == "tree" else 1)
    ks, vs = _scales(False)
    kv = _kv(pool, dtype, ks, vs)
    k8, v8 = kv.k_cache(0), kv.v_cache(0)
    kf, vf = fp8.host_scales(k8, ks, vs)  # once, at "model load"
    assert (kf, vf) == (ks.item(), vs.item())
    w = _wrappers()
    view, rows = _view(pool, part)
    parts = [view] if isinstance(view, PagedView) else [view.prefix, view.expand]  # type: ignore
    for p in parts:
        if p is not None:
            w.wrapper(p)
            w.plan(p, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D, q_dtype=BF16,
                   kv_dtype=dtype)
    q = torch.randn(_rows(view), H, D).to(BF16)
    got = w.attention(view, q, k8, v8, k_scale=kf, v_scale=vf)
    want = sdpa.attention(view, q.float(), k8, v8, k_scale=ks, v_scale=vs,
                          layout=Layout.FLASHINFER)
    _close_out(got.out, want.out, rows)
    _close_lse(got.lse, want.lse, rows)
    deq = sdpa.attention(view, q.float(), dequantize(k8, ks), dequantize(v8, vs),
                         layout=Layout.FLASHINFER)
    assert torch.equal(want.out, deq.out)
    raw = w.attention(view, q, k8, v8)  # an fp8 cache read raw: no scales passed
    _differs(got.out, raw.out, rows)


def test_flashinfer_plan_needs_the_cache_dtype() -> None:
    pool = _pool(Layout.FLASHINFER)
    ks, vs = _scales(False)
    kv = _kv(pool, E4M3, ks, vs)
    view, _ = _view(pool, "decode")
    assert isinstance(view, PagedView)
    w = _wrappers()
    w.wrapper(view)
    w.plan(view, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D, q_dtype=BF16)
    with pytest.raises(ValueError, match="does not match the kv_data_type"):
        w.run(view, torch.randn(4, H, D).to(BF16), kv.k_cache(0), kv.v_cache(0), k_scale=0.1,
              v_scale=0.1)


def _fi_bad_cases() -> list[tuple[str, str, dict[str, Any]]]:
    ks, vs = _scales(False)
    return [
        ("e4m3", "must be a Python float", {"k_scale": ks, "v_scale": vs}),
        ("e4m3", "v_scale is required", {"k_scale": 0.5}),
        ("e4m3", "must be finite and > 0", {"k_scale": 0.5, "v_scale": float("nan")}),
        ("e4m3", "must be finite and > 0", {"k_scale": 0.0, "v_scale": 0.5}),
        ("e4m3", "must be a Python float", {"k_scale": True, "v_scale": 0.5}),
        ("bf16", "k_scale must be None", {"k_scale": 0.5, "v_scale": 0.5}),
    ]


@pytest.mark.parametrize("case", range(len(_fi_bad_cases())))
def test_flashinfer_bad_scales_raise_before_the_wrapper(case: int) -> None:
    cache, match, kw = _fi_bad_cases()[case]
    pool = _pool(Layout.FLASHINFER)
    view, _ = _view(pool, "decode")
    assert isinstance(view, PagedView)
    if cache == "bf16":
        k = torch.randn(12 * pool.cfg.max_pages + 2, P, H_KV, D).to(BF16)
        v = k.clone()
    else:
        kv = _kv(pool, E4M3, *_scales(False))
        k, v = kv.k_cache(0), kv.v_cache(0)
    w = _wrappers()
    wr = w.wrapper(view)
    w.plan(view, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D, q_dtype=BF16, kv_dtype=k.dtype)
    wr.run = None  # a call would fail: the adapter must refuse first
    arena, kb = pool.arena.storage.clone(), k.clone()
    with pytest.raises(InputError, match=match):
        w.run(view, torch.randn(4, H, D).to(BF16), k, v, **kw)
    assert torch.equal(pool.arena.storage, arena)
    assert torch.equal(k.view(torch.uint8), kb.view(torch.uint8))


def test_host_scales_refuses_what_flashinfer_cannot_take() -> None:
    pool = _pool(Layout.FLASHINFER)
    ks, vs = _scales(True)
    kv = _kv(pool, E4M3, ks, vs)
    k8 = kv.k_cache(0)
    with pytest.raises(InputError, match=r"k_scale must have 1 element for FlashInfer .*got 2"):
        fp8.host_scales(k8, ks, vs)
    with pytest.raises(InputError, match="v_scale must be finite and > 0"):
        fp8.host_scales(k8, torch.tensor([0.5]), torch.tensor([-1.0]))
    with pytest.raises(InputError, match="float32"):
        fp8.host_scales(k8, torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.5]))
    with pytest.raises(InputError, match="for fp8 caches"):
        fp8.host_scales(torch.zeros(2, P, H_KV, D), torch.tensor([0.5]), torch.tensor([0.5]))


def test_fake_flashinfer_takes_float_scales_only() -> None:
    pool = _pool(Layout.FLASHINFER)
    ks, vs = _scales(False)
    kv = _kv(pool, E4M3, ks, vs)
    view, _ = _view(pool, "decode")
    assert isinstance(view, PagedView)
    w = _wrappers()
    wr = w.wrapper(view)
    w.plan(view, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D, q_dtype=BF16, kv_dtype=E4M3)
    q = torch.randn(4, H, D).to(BF16)
    with pytest.raises(TypeError, match="k_scale must be a Python float"):
        wr.run(q, (kv.k_cache(0), kv.v_cache(0)), k_scale=ks, v_scale=0.2, return_lse=True)


# ---- real kernels (GPU) -------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("part", ["decode", "tree"])
@pytest.mark.parametrize("per_head", [False, True])
def test_fa3_kernel_over_fp8_matches_sdpa(part: str, per_head: bool) -> None:
    try:
        kernel = fa.load_fa3()
    except ImportError as e:
        pytest.skip(str(e))
    pool = _pool(Layout.FLASH_ATTN, "cuda", num_draft_tokens=ND, topk=2)
    ks, vs = (s.cuda() for s in _scales(per_head))
    kv = _kv(pool, E4M3, ks, vs, d=64)
    view, rows = _view(pool, part)
    q = torch.randn(_rows(view), H, 64, device="cuda", dtype=BF16)
    got = fa.attention(view, q, kv.k_cache(0), kv.v_cache(0), kernel=kernel, k_scale=ks,
                       v_scale=vs)
    want = sdpa.attention(view, _q8(q), kv.k_cache(0), kv.v_cache(0), k_scale=ks, v_scale=vs)
    # fp8 products accumulated in float32 by both; the kernel also rounds P to fp8 for P @ V
    torch.testing.assert_close(got.out[:rows].float(), want.out[:rows].float(), atol=3e-2,
                               rtol=3e-2)
    torch.testing.assert_close(got.lse[:rows], want.lse[:rows], atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_flashinfer_kernel_over_fp8_matches_sdpa(dtype: torch.dtype) -> None:
    pytest.importorskip("flashinfer")
    pool = _pool(Layout.FLASHINFER, "cuda")
    ks, vs = (s.cuda() for s in _scales(False))
    kv = _kv(pool, dtype, ks, vs, d=64)
    k8, v8 = kv.k_cache(0), kv.v_cache(0)
    kf, vf = fp8.host_scales(k8, ks, vs)
    w = fi.GraphWrappers(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    view, rows = _view(pool, "decode")
    assert isinstance(view, PagedView)
    w.wrapper(view)
    w.plan(view, num_qo_heads=H, num_kv_heads=H_KV, head_dim=64, q_dtype=BF16, kv_dtype=dtype)
    q = torch.randn(4, H, 64, device="cuda", dtype=BF16)
    got = w.run(view, q, k8, v8, k_scale=kf, v_scale=vf)
    want = sdpa.attention(view, q.float(), k8, v8, k_scale=ks, v_scale=vs,
                          layout=Layout.FLASHINFER)
    torch.testing.assert_close(got.out[:rows].float(), want.out[:rows].float(), atol=3e-2,
                               rtol=3e-2)
    torch.testing.assert_close(got.lse[:rows], want.lse[:rows], atol=2e-2, rtol=2e-2)
