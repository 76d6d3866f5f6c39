"""flash-attn adapter: keyword arguments built on CPU (shapes, dtypes, contiguity, aliasing, values),
the call path through a stand-in kernel, FA3 scheduler metadata, and the real kernels on a GPU.

The stand-in kernels below know only what the keyword arguments carry (exactly what the real
kernel would see): they rebuild a paged batch from them and compute it with the SDPA adapter, whose
own correctness is checked against dense attention in ``test_adapter_sdpa.py``. They return
outputs in each kernel's own layout, so the adapter's normalisation is exercised too.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
from typing import Any

import pytest
import torch

from attnpool import BufferPool, InputError, Layout, LayoutError, PagedView, Phase, PoolConfig
from attnpool.adapters import flash_attn as fa
from attnpool.adapters import sdpa

from batches import make_batch

D = 8


def _pool(page: int = 16, c: int = 128, **kw: Any) -> BufferPool:
    cfg = PoolConfig(max_bs=6, max_context_len=c, page_size=page, device="cpu",
                     layout=kw.pop("layout", Layout.FLASH_ATTN), pad_page=2, **kw)
    return BufferPool(cfg, poison=True)


def _cache(pool: BufferPool, h_kv: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    pages = 12 * pool.cfg.max_pages + 2  # covers make_table's page ids for 12 request slots
    g = torch.Generator().manual_seed(seed)
    p = pool.cfg.page_size
    return torch.randn(pages, p, h_kv, D, generator=g), torch.randn(pages, p, h_kv, D, generator=g)


def _fa3_standin(**kw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA3 semantics from its keyword arguments alone; returns ``(out, lse [H, total_q], extra)``."""
    k = kw["k_cache"]
    bs = kw["cache_seqlens"].shape[0]
    view = PagedView(
        bs=bs, cache_seqlens=kw["cache_seqlens"], cu_seqlens_q=kw["cu_seqlens_q"],
        cu_seqlens_k=torch.zeros(bs + 1, dtype=torch.int32), page_table=kw["page_table"],
        kv_indptr=None, kv_indices=None, kv_last_page_len=None,
        max_seqlen_q=kw["max_seqlen_q"], max_seqlen_k=kw["page_table"].shape[1] * k.shape[1],
        page_size=k.shape[1], causal=kw["causal"])
    got = sdpa.paged_attention(view, kw["q"], k, kw["v_cache"], softmax_scale=kw["softmax_scale"])
    return got.out, got.lse.t().contiguous(), torch.empty(0)


def _fa2_standin(**kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """FA2 semantics from its keyword arguments alone; ``(out [bs, sq, H, D], lse [bs, H, sq])``."""
    q, k = kw["q"], kw["k_cache"]
    bs, sq, h, d = q.shape
    view = PagedView(
        bs=bs, cache_seqlens=kw["cache_seqlens"],
        cu_seqlens_q=torch.arange(0, (bs + 1) * sq, sq, dtype=torch.int32),
        cu_seqlens_k=torch.zeros(bs + 1, dtype=torch.int32), page_table=kw["block_table"],
        kv_indptr=None, kv_indices=None, kv_last_page_len=None, max_seqlen_q=sq,
        max_seqlen_k=kw["block_table"].shape[1] * k.shape[1], page_size=k.shape[1],
        causal=kw["causal"])
    got = sdpa.paged_attention(view, q.reshape(bs * sq, h, d), k, kw["v_cache"],
                               softmax_scale=kw["softmax_scale"])
    return got.out.view(bs, sq, h, d), got.lse.view(bs, sq, h).transpose(1, 2)


def _tree_mask(n: int, nd: int) -> torch.Tensor:
    return torch.ones(n, nd, nd, dtype=torch.bool).tril()


def test_fa3_kwargs_alias_the_pool_and_have_kernel_dtypes() -> None:
    pool = _pool()
    b = make_batch(pool.cfg, 3, random.Random(0))
    view = pool.decode.update_(4, *b.tensors(), seq_lens_cpu=b.seq_lens)
    k, v = _cache(pool)
    q = torch.randn(4, 4, D)
    kw = fa.fa3_kwargs(view, q, k, v)
    assert set(kw) == {"q", "k_cache", "v_cache", "cache_seqlens", "page_table", "cu_seqlens_q",
                       "max_seqlen_q", "softmax_scale", "causal", "return_softmax_lse"}
    assert kw["q"] is q and kw["k_cache"] is k and kw["v_cache"] is v
    arena = pool.arena
    for name, want in (("cache_seqlens", arena.buffer(Phase.DECODE, "cache_seqlens")),
                       ("page_table", arena.buffer(Phase.DECODE, "page_table")),
                       ("cu_seqlens_q", arena.buffer(None, "arange"))):
        t = kw[name]
        assert t.dtype == torch.int32 and t.is_contiguous(), name
        assert t.data_ptr() == want.data_ptr(), f"{name} must be the pool's own memory"
    assert kw["cache_seqlens"].shape == (4,) and kw["cu_seqlens_q"].tolist() == [0, 1, 2, 3, 4]
    assert kw["page_table"].shape == (4, pool.cfg.max_pages)
    assert kw["cache_seqlens"].tolist() == [*b.seq_lens, 1]
    assert kw["max_seqlen_q"] == 1 and kw["causal"] is True and kw["return_softmax_lse"] is True
    assert kw["softmax_scale"] == pytest.approx(1 / math.sqrt(D))


def test_fa3_kwargs_of_a_token_slot_part_view_the_cache_without_copy() -> None:
    pool = _pool(num_draft_tokens=4, topk=2)
    b = make_batch(pool.cfg, 2, random.Random(1), extra=4)
    view = pool.verify.update_(2, *b.tensors(), tree_mask=_tree_mask(2, 4))
    assert view.expand is not None
    k, v = _cache(pool)
    kw = fa.fa3_kwargs(view.expand, torch.randn(8, 4, D), k, v, softmax_scale=0.5)
    assert kw["k_cache"].shape == (k.shape[0] * 16, 1, 2, D)
    assert kw["k_cache"].data_ptr() == k.data_ptr() and kw["v_cache"].data_ptr() == v.data_ptr()
    assert kw["causal"] is False and kw["softmax_scale"] == 0.5
    assert kw["page_table"].shape[0] == 8  # bs * N one-query rows


@pytest.mark.parametrize("topk", [1, 2])
def test_fa3_call_path_matches_sdpa(topk: int) -> None:
    """Through the stand-in kernel: what the kwargs carry is enough, and out/lse come back in the
    adapters' layout (tree passes merged)."""
    pool = _pool(num_draft_tokens=4, topk=topk)
    b = make_batch(pool.cfg, 3, random.Random(2), extra=4)
    mask = _tree_mask(3, 4) if topk > 1 else None
    view = pool.verify.update_(5, *b.tensors(), tree_mask=mask)
    k, v = _cache(pool)
    q = torch.randn(20, 4, D)
    got = fa.attention(view, q, k, v, fn=_fa3_standin)
    want = sdpa.attention(view, q, k, v)
    torch.testing.assert_close(got.out, want.out)
    torch.testing.assert_close(got.lse, want.lse)


def test_fa2_kwargs_and_call_path() -> None:
    pool = _pool(page=256, c=1024, num_draft_tokens=3)
    b = make_batch(pool.cfg, 2, random.Random(3), extra=3)
    view = pool.verify.update_(3, *b.tensors())
    k, v = _cache(pool)
    q = torch.randn(9, 4, D)
    kw = fa.fa2_kwargs(view.prefix, q, k, v)
    assert set(kw) == {"q", "k_cache", "v_cache", "cache_seqlens", "block_table",
                       "softmax_scale", "causal", "return_softmax_lse"}
    assert kw["q"].shape == (3, 3, 4, D) and kw["q"].data_ptr() == q.data_ptr()
    assert kw["block_table"].data_ptr() == pool.arena.buffer(Phase.VERIFY, "page_table").data_ptr()
    assert kw["block_table"].dtype == torch.int32 and kw["block_table"].is_contiguous()
    assert kw["cache_seqlens"].tolist() == [s + 3 for s in b.seq_lens] + [1]
    assert kw["causal"] is True
    got = fa.attention(view, q, k, v, version=fa.FlashAttnVersion.FA2, fn=_fa2_standin)
    want = sdpa.attention(view, q, k, v)
    torch.testing.assert_close(got.out, want.out)
    torch.testing.assert_close(got.lse, want.lse)


def test_fa2_refuses_what_it_cannot_take() -> None:
    pool = _pool(page=16, num_draft_tokens=3)
    view = pool.decode.view(2)
    k, v = _cache(pool)
    with pytest.raises(LayoutError, match=r"multiple of 256, got 16"):
        fa.fa2_kwargs(view, torch.randn(2, 4, D), k, v)
    big = _pool(page=256, c=1024, num_draft_tokens=3)
    kb, vb = _cache(big)
    with pytest.raises(LayoutError, match="same query count"):
        fa.fa2_kwargs(big.draft_extend.view(2), torch.randn(6, 4, D), kb, vb)
    with pytest.raises(InputError, match="bs \\* max_seqlen_q = 2 rows, got 3"):
        fa.fa2_kwargs(big.decode.view(2), torch.randn(3, 4, D), kb, vb)
    with pytest.raises(InputError, match="FA3 argument"):
        fa.run(big.decode.view(2), torch.randn(2, 4, D), kb, vb,
               version=fa.FlashAttnVersion.FA2, scheduler_metadata=torch.zeros(9), fn=_fa2_standin)


def test_flashinfer_only_view_is_refused() -> None:
    pool = _pool(layout=Layout.FLASHINFER)
    k, v = _cache(pool)
    with pytest.raises(LayoutError, match="page_table"):
        fa.fa3_kwargs(pool.decode.view(2), torch.randn(2, 4, D), k, v)


@pytest.mark.parametrize("bs", [1, 3, 6])
def test_scheduler_metadata_fills_head_and_zeroes_tail(bs: int) -> None:
    pool = _pool(fa3_scheduler_metadata=True)
    buf = pool.arena.buffer(None, "scheduler_metadata")
    assert buf.shape == (8 * 4 + 1,)  # round_up(max_bs=6, 4) * 4 + 1
    b = make_batch(pool.cfg, bs, random.Random(bs))
    view = pool.decode.update_(bs, *b.tensors())
    calls: list[dict[str, Any]] = []
    produced = 2 * bs + 1  # smaller than the slice: the rest must be zeroed

    def get(**kw: Any) -> torch.Tensor:
        calls.append(kw)
        return torch.arange(100, 100 + produced, dtype=torch.int32)

    md = fa.scheduler_metadata_(pool, view, num_heads_q=4, num_heads_kv=2, head_dim=D,
                                qkv_dtype=torch.bfloat16, fn=get)
    size = -(-bs // 4) * 4 * 4 + 1
    assert md.shape == (size,) and md.data_ptr() == buf.data_ptr()
    assert md[:produced].tolist() == list(range(100, 100 + produced))
    assert md[produced:].eq(0).all()
    kw = calls[0]
    assert kw["batch_size"] == bs and kw["cache_seqlens"] is view.cache_seqlens
    assert kw["cu_seqlens_q"] is view.cu_seqlens_q and kw["page_size"] == 16
    assert (kw["num_heads_q"], kw["num_heads_kv"], kw["headdim"]) == (4, 2, D)
    k, v = _cache(pool)
    assert fa.fa3_kwargs(view, torch.randn(bs, 4, D), k, v, scheduler_metadata=md)[
        "scheduler_metadata"] is md


def test_scheduler_metadata_errors() -> None:
    pool = _pool(fa3_scheduler_metadata=True)
    view = pool.decode.view(2)
    with pytest.raises(LayoutError, match="at most round_up"):
        fa.scheduler_metadata_(pool, view, num_heads_q=4, num_heads_kv=2, head_dim=D,
                               qkv_dtype=torch.float16, fn=lambda **_: torch.zeros(100))
    with pytest.raises(LayoutError, match="fa3_scheduler_metadata=True"):
        fa.scheduler_metadata_(_pool(), view, num_heads_q=4, num_heads_kv=2, head_dim=D,
                               qkv_dtype=torch.float16, fn=lambda **_: torch.zeros(1))


def test_importing_adapters_imports_no_kernel_and_no_cuda() -> None:
    code = ("import sys, torch, attnpool.adapters.flash_attn, attnpool.adapters.flashinfer\n"
            "bad = [m for m in ('flash_attn', 'flash_attn_interface', 'flashinfer', 'triton')"
            " if m in sys.modules]\n"
            "assert not bad, bad\nassert not torch.cuda.is_initialized()\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---- real kernels (GPU) -------------------------------------------------------------------------


def _gpu_case(page: int, c: int, **kw: Any) -> tuple[BufferPool, Any, torch.Tensor, torch.Tensor]:
    cfg = PoolConfig(max_bs=4, max_context_len=c, page_size=page, device="cuda", pad_page=0, **kw)
    pool = BufferPool(cfg, poison=True)
    b = make_batch(cfg, 3, random.Random(5), extra=cfg.num_draft_tokens)
    seq, rpi, table = b.tensors("cuda")
    k, v = (torch.randn(12 * cfg.max_pages + 2, page, 2, 64, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    if cfg.num_draft_tokens:
        mask = _tree_mask(3, cfg.num_draft_tokens).cuda() if cfg.topk > 1 else None
        return pool, pool.verify.update_(4, seq, rpi, table, tree_mask=mask), k, v
    return pool, pool.decode.update_(4, seq, rpi, table), k, v


def _assert_bf16_close(got: sdpa.Attn, want: sdpa.Attn, rows: int) -> None:
    # bf16 inputs, fp32 accumulation in both: outputs agree to a few bf16 ulps (2^-8 relative).
    torch.testing.assert_close(got.out[:rows].float(), want.out[:rows].float(), atol=2e-2,
                               rtol=2e-2)
    torch.testing.assert_close(got.lse[:rows], want.lse[:rows], atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("topk", [1, 2])
def test_fa3_kernel_matches_sdpa(topk: int) -> None:
    pytest.importorskip("flash_attn_interface")
    pool, view, k, v = _gpu_case(16, 512, num_draft_tokens=4, topk=topk,
                                 fa3_scheduler_metadata=True)
    q = torch.randn(16, 4, 64, device="cuda", dtype=torch.bfloat16)
    md = fa.scheduler_metadata_(pool, view.prefix, num_heads_q=4, num_heads_kv=2, head_dim=64,
                                qkv_dtype=torch.bfloat16)
    got = fa.attention(view, q, k, v, scheduler_metadata=md)
    _assert_bf16_close(got, sdpa.attention(view, q, k, v), 12)


@pytest.mark.cuda
def test_fa2_kernel_matches_sdpa() -> None:
    pytest.importorskip("flash_attn")
    _, view, k, v = _gpu_case(256, 1024)
    q = torch.randn(4, 4, 64, device="cuda", dtype=torch.bfloat16)
    got = fa.attention(view, q, k, v, version=fa.FlashAttnVersion.FA2)
    _assert_bf16_close(got, sdpa.attention(view, q, k, v), 3)
