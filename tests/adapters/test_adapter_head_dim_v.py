"""flash-attn and FlashInfer adapters over a cache whose K and V head sizes differ.

Through the fakes (``fakes_fa3.py``, ``fakes_flashinfer.py``), which check the arguments the real
libraries take and compute with V's size: FA3 takes DeepSeek's 192 / 128 (planned with
``headdim_v``: a plan without it is another plan) and agrees with the SDPA adapter; pairs FA3 has
no kernel for, FA2, vLLM's ``s_aux`` with such a cache, FlashInfer's decode wrapper and its
``cute-dsl`` backend are refused with :class:`attnpool.LayoutError` before any call, naming the
constraint; FlashInfer's prefill wrapper takes ``head_dim_vo`` and serves decode parts too
(``GraphWrappers(prefill_only=True)``); caches that do not match the plan are refused.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import BufferPool, Impl, InputError, Layout, LayoutError, PoolConfig
from attnpool.adapters import flash_attn as fa
from attnpool.adapters import flashinfer as fi
from attnpool.adapters import sdpa
from attnpool.kv import KVCacheConfig, KVCachePool

from tests.helpers.batches import shuffled_table
from tests.helpers.fakes_fa3 import FA2, FA3, assert_close
from tests.helpers.fakes_flashinfer import BatchDecodeWithPagedKVCacheWrapper as Decode
from tests.helpers.fakes_flashinfer import BatchPrefillWithPagedKVCacheWrapper as Prefill

H, H_KV, PAGE, C, ROWS, ND = 4, 2, 4, 32, 4, 3
BF16 = torch.bfloat16


def _pool(layout: Layout = Layout.FLASH_ATTN, **kw: Any) -> BufferPool:
    c = PoolConfig(max_bs=4, max_context_len=C, page_size=PAGE, device="cpu", layout=layout,
                   num_draft_tokens=ND, pad_page=0, **kw)
    return BufferPool(c, poison=True)


def _cache(d: int, dv: int, dtype: torch.dtype = BF16) -> tuple[Tensor, Tensor]:
    """K ``[pages, P, H_kv, d]`` and V ``[.., dv]`` of one layer of a filled KVCachePool."""
    pages = ROWS * (C // PAGE) + 1
    kv = KVCachePool(KVCacheConfig(num_pages=pages, page_size=PAGE, max_tokens=8,
                                   num_kv_heads=H_KV, head_dim=d, head_dim_v=dv, dtype=dtype,
                                   device="cpu"))
    n = (pages - 1) * PAGE
    g = torch.Generator().manual_seed(d * 1000 + dv)
    kv.store_kv_(0, torch.randn(n, H_KV, d, generator=g).to(dtype),
                 torch.randn(n, H_KV, dv, generator=g).to(dtype), torch.arange(PAGE, PAGE + n),
                 impl=Impl.REFERENCE)
    return kv.k_cache(0), kv.v_cache(0)


def _table(rng: random.Random) -> Tensor:
    return shuffled_table(rng, ROWS, C, PAGE)


def _update(pool: BufferPool, phase: str, seed: int) -> Any:
    rng = random.Random(seed)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    kw = {"seq_lens": t([rng.randint(1, C - ND) for _ in range(3)]),
          "req_pool_indices": t(rng.sample(range(ROWS), 3)), "req_to_token": _table(rng)}
    return (pool.decode if phase == "decode" else pool.verify).update_(4, **kw)


def _kernels(fake: FA3) -> list[fa.FlashKernel]:
    return [fa.FlashKernel("flash_attn_interface", fa.FlashAttnVersion.FA3, fa.CallStyle.KVCACHE,
                           fake.flash_attn_with_kvcache, fake.get_scheduler_metadata),
            fa.FlashKernel("vllm.vllm_flash_attn", fa.FlashAttnVersion.FA3, fa.CallStyle.VARLEN,
                           fake.flash_attn_varlen_func, fake.get_scheduler_metadata)]


# ---- flash-attn ---------------------------------------------------------------------------------
@pytest.mark.parametrize("style", [0, 1])
@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_fa3_takes_192_128(phase: str, style: int) -> None:
    fake = FA3()
    kernel = _kernels(fake)[style]
    pool = _pool(fa3_scheduler_metadata=True)
    view = _update(pool, phase, 1)
    part = view if phase == "decode" else view.prefix
    k, v = _cache(192, 128)
    rows = 4 * (1 if phase == "decode" else ND)
    x = torch.randn(rows, H, 192).to(BF16)
    plan = {"num_heads_q": H, "num_heads_kv": H_KV, "head_dim": 192, "qkv_dtype": BF16,
            "kernel": kernel}
    md = fa.scheduler_metadata_(pool, part, head_dim_v=128, **plan)
    assert fake.calls[-1][1]["headdim_v"] == 128
    got = fa.attention(view, x, k, v, kernel=kernel, scheduler_metadata=md)
    assert got.out.shape == (rows, H, 128)
    want = sdpa.attention(view, x.float(), k.float(), v.float())
    assert_close(got.out, want.out, 3 * (1 if phase == "decode" else ND))
    # a plan made for equal sizes is another plan: FA3 would run it, the fake refuses it
    md = fa.scheduler_metadata_(pool, part, **plan)
    assert fake.calls[-1][1]["headdim_v"] is None  # unset: not passed, the call is as before
    with pytest.raises(RuntimeError, match=r"planned for \(headdim, headdim_v\) = \(192, 192\)"):
        fa.attention(view, x, k, v, kernel=kernel, scheduler_metadata=md)


@pytest.mark.parametrize("d, dv", [(192, 64), (256, 128), (128, 96), (96, 512), (72, 64)])
def test_fa3_refuses_pairs_without_a_kernel(d: int, dv: int) -> None:
    fake = FA3()
    view = _update(_pool(), "decode", 2)
    k, v = _cache(d, dv)
    x = torch.randn(4, H, d).to(BF16)
    for kernel in _kernels(fake):
        with pytest.raises(LayoutError, match=rf"no kernel for K head size D={d} with V head "
                                              rf"size Dv={dv}: FA3 takes D != Dv only for"):
            fa.attention(view, x, k, v, kernel=kernel)
    assert not fake.calls  # refused before the kernel
    # what the fake (FA3's own check) says when called anyway
    with pytest.raises(RuntimeError, match="If V headdim is different from Q/K dim"):
        fake.flash_attn_with_kvcache(x, k, v, cache_seqlens=view.cache_seqlens,
                                     page_table=view.page_table, cu_seqlens_q=view.cu_seqlens_q,
                                     max_seqlen_q=1)


def test_fa3_head_dim_rules() -> None:
    fa.check_fa3_head_dims(40, 40)  # equal sizes: always (FA3's own limits apply)
    fa.check_fa3_head_dims(192, 128)
    fa.check_fa3_head_dims(24, 16)  # small K heads: any V up to 512
    fa.check_fa3_head_dims(64, 512)
    fa.check_fa3_head_dims(64, 256, fp8=True)
    with pytest.raises(LayoutError, match="fp8 needs Dv <= 256"):
        fa.check_fa3_head_dims(64, 512, fp8=True)
    # Hopper only: only the kernel knows the GPU (the fake's arch)
    view = _update(_pool(), "decode", 3)
    k, v = _cache(192, 128)
    with pytest.raises(RuntimeError, match="Only Hopper supports different V headdim"):
        fa.attention(view, torch.randn(4, H, 192).to(BF16), k, v,
                     kernel=_kernels(FA3(arch=80))[0])


def test_fa3_takes_small_k_heads() -> None:
    """``D <= 64`` takes any ``Dv <= 512``: the tests' 24 / 16 runs (on Hopper)."""
    fake = FA3()
    view = _update(_pool(), "verify", 7)
    k, v = _cache(24, 16)
    x = torch.randn(4 * ND, H, 24).to(BF16)
    got = fa.attention(view, x, k, v, kernel=_kernels(fake)[0])
    want = sdpa.attention(view, x.float(), k.float(), v.float())
    assert got.out.shape == (4 * ND, H, 16)
    assert_close(got.out, want.out, 3 * ND)


def test_s_aux_needs_equal_sizes() -> None:
    fake = FA3()
    view = _update(_pool(), "decode", 4)
    k, v = _cache(192, 128)
    with pytest.raises(LayoutError, match="s_aux needs equal K and V head sizes, got D=192, "
                                          "Dv=128"):
        fa.attention(view, torch.randn(4, H, 192).to(BF16), k, v, kernel=_kernels(fake)[1],
                     sinks=torch.zeros(H, dtype=BF16))
    assert not fake.calls


def test_fa2_refuses_different_sizes() -> None:
    pool = BufferPool(PoolConfig(max_bs=2, max_context_len=512, page_size=256, device="cpu",
                                 layout=Layout.FLASH_ATTN, pad_page=0), poison=True)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    table = torch.arange(256, 256 * 3, dtype=torch.int32)[None].repeat(2, 1)
    view = pool.decode.update_(2, seq_lens=t([300, 7]), req_pool_indices=t([0, 1]),
                               req_to_token=table)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 256, H_KV, 24, generator=g).to(BF16)
    v = torch.randn(3, 256, H_KV, 16, generator=g).to(BF16)
    fake = FA2()
    q = torch.randn(2, H, 24).to(BF16)
    with pytest.raises(LayoutError, match="flash-attn 2 needs equal K and V head sizes, got "
                                          "D=24, Dv=16"):
        fa.attention(view, q, k, v, version=fa.FlashAttnVersion.FA2,
                     fn=fake.flash_attn_with_kvcache)
    assert not fake.calls
    with pytest.raises(RuntimeError, match="vcache must have shape"):  # flash-attn 2's own check
        fake.flash_attn_with_kvcache(q[:, None], k, v, cache_seqlens=view.cache_seqlens,
                                     block_table=view.page_table)
    # equal sizes still run
    out = fa.attention(view, q, k, k.clone(), version=fa.FlashAttnVersion.FA2,
                       fn=fake.flash_attn_with_kvcache).out
    assert out.shape == (2, H, 24)


# ---- FlashInfer ---------------------------------------------------------------------------------
D, DV = 24, 16


def _wrappers(**kw: Any) -> fi.GraphWrappers:
    return fi.GraphWrappers(torch.empty(256, dtype=torch.uint8), decode_cls=Decode,
                            prefill_cls=Prefill, **kw)


def _plan(w: fi.GraphWrappers, view: Any, **kw: Any) -> Any:
    return w.plan(view, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D, q_dtype=BF16, **kw)


def test_flashinfer_prefill_takes_head_dim_vo() -> None:
    pool = _pool(Layout.FLASHINFER)
    w = _wrappers()
    k, v = _cache(D, DV)
    cap = pool.verify.view(4)
    w.wrapper(cap.prefix)
    _plan(w, cap.prefix, head_dim_v=DV)  # the capture view first (its row count is the max)
    view = _update(pool, "verify", 5)
    wr = _plan(w, view.prefix, head_dim_v=DV)
    assert isinstance(wr, Prefill) and wr._head_dims == (D, DV)
    x = torch.randn(4 * ND, H, D).to(BF16)
    got = w.attention(view, x, k, v)
    assert got.out.shape == (4 * ND, H, DV)
    want = sdpa.attention(view, x.float(), k.float(), v.float())
    assert_close(got.out, want.out, 3 * ND)
    # the caches must be the planned sizes
    k2, v2 = _cache(D, 8)
    with pytest.raises(InputError, match=r"head sizes \(24, 8\) differ from the \(head_dim, "
                                         r"head_dim_v\) \(24, 16\)"):
        w.run(view.prefix, x, k2, v2)
    _plan(w, view.prefix)  # planned for equal sizes: the V cache no longer fits
    with pytest.raises(InputError, match=r"\(24, 16\) differ from .* \(24, 24\)"):
        w.run(view.prefix, x, k, v)
    with pytest.raises(RuntimeError, match="fake FlashInfer: q, k, v head sizes"):
        fi.run(wr, view.prefix, x, k, v, rows=3 * ND)  # what the kernel would get


def test_flashinfer_decode_parts_on_prefill_wrappers() -> None:
    pool = _pool(Layout.FLASHINFER)
    k, v = _cache(D, DV)
    w = _wrappers()
    cap = pool.decode.view(4)
    assert isinstance(w.wrapper(cap), Decode)
    with pytest.raises(LayoutError, match=r"decode wrapper takes one head_dim; K and V head sizes "
                                          r"differ .*prefill_only=True"):
        _plan(w, cap, head_dim_v=DV)
    w = _wrappers(prefill_only=True)
    assert isinstance(w.wrapper(cap), Prefill)
    _plan(w, cap, head_dim_v=DV)
    view = _update(pool, "decode", 6)
    _plan(w, view, head_dim_v=DV)
    x = torch.randn(4, H, D).to(BF16)
    got = w.run(view, x, k, v)
    want = sdpa.attention(view, x.float(), k.float(), v.float())
    assert got.out.shape == (4, H, DV)
    assert_close(got.out, want.out, 3)


def test_flashinfer_cute_dsl_needs_equal_sizes() -> None:
    pool = _pool(Layout.FLASHINFER)
    w = _wrappers(backend="cute-dsl")
    cap = pool.verify.view(4)
    w.wrapper(cap.prefix)
    with pytest.raises(LayoutError, match="cute-dsl backend requires head_dim_vo == head_dim_qk"):
        _plan(w, cap.prefix, head_dim_v=DV)
    with pytest.raises(NotImplementedError, match="cute-dsl"):  # FlashInfer's own refusal
        pre = cap.prefix
        w.wrapper(pre).plan(pre.cu_seqlens_q, pre.kv_indptr, pre.kv_indices, pre.kv_last_page_len,
                            H, H_KV, D, PAGE, DV)
    _plan(w, cap.prefix)  # equal sizes: planned as before
