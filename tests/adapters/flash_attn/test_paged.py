"""flash-attn adapter on CPU against fakes that enforce the real kernels' checks
(``fakes_fa3.py``), and the real kernels on a GPU.

CPU tests: the arguments built from views (shapes, dtypes, aliasing of the pool's memory), the
call path into FA3 (every accepted module and call style) and FA2, FA3's scheduler metadata
(exact length, planned for the kernel's own KV bound), flash-attn's ``+inf`` log-sum-exp of empty
rows through a tree merge, and which module :func:`load_fa3` picks. The fakes compute in float32
with the SDPA adapter, whose correctness is checked against dense attention in
``tests/adapters/sdpa/test_paged.py``; results are compared on bfloat16 inputs as the real kernels
take them.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnpool import BufferPool, InputError, Layout, LayoutError, PagedView, Phase, PoolConfig
from attnpool.adapters import flash_attn as fa
from attnpool.adapters import sdpa

from tests.helpers.batches import Batch, make_batch, make_table, tree_mask
from tests.helpers.fakes_fa3 import (
    FA2,
    FA3,
    assert_close,
    effective_causal,
    metadata_size,
    split_heuristic,
)

D = 8
BF16 = torch.bfloat16
FA3_NAMES = [name for name, _ in fa.FA3_MODULES]


def _pool(page: int = 16, c: int = 128, max_bs: int = 6, **kw: Any) -> BufferPool:
    cfg = PoolConfig(max_bs=max_bs, max_context_len=c, page_size=page, device="cpu",
                     layout=kw.pop("layout", Layout.FLASH_ATTN), pad_page=2, **kw)
    return BufferPool(cfg, poison=True)


def _cache(pool: BufferPool, h_kv: int = 2, seed: int = 0, d: int = D,
           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    pages = 12 * pool.cfg.max_pages + 2  # covers make_table's page ids for 12 request slots
    g = torch.Generator().manual_seed(seed)
    p = pool.cfg.page_size
    return (torch.randn(pages, p, h_kv, d, generator=g).to(dtype),
            torch.randn(pages, p, h_kv, d, generator=g).to(dtype))


def _want(view: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> sdpa.Attn:
    return sdpa.attention(view, q.float(), k.float(), v.float())


# ---- arguments ----------------------------------------------------------------------------------
def test_fa3_kwargs_alias_the_pool_and_have_kernel_dtypes() -> None:
    pool = _pool()
    b = make_batch(pool.cfg, 3, random.Random(0))
    view = pool.decode.update_(4, **b.inputs(), seq_lens_cpu=b.seq_lens)
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
    view = pool.verify.update_(2, **b.inputs(), tree_mask=tree_mask(2, 4))
    assert view.expand is not None
    k, v = _cache(pool)
    kw = fa.fa3_kwargs(view.expand, torch.randn(8, 4, D), k, v, softmax_scale=0.5)
    assert kw["k_cache"].shape == (k.shape[0] * 16, 1, 2, D)
    assert kw["k_cache"].data_ptr() == k.data_ptr() and kw["v_cache"].data_ptr() == v.data_ptr()
    assert kw["causal"] is False and kw["softmax_scale"] == 0.5
    assert kw["page_table"].shape[0] == 8  # bs * N one-query rows


def test_flashinfer_only_view_is_refused() -> None:
    pool = _pool(layout=Layout.FLASHINFER)
    k, v = _cache(pool)
    with pytest.raises(LayoutError, match="page_table"):
        fa.fa3_kwargs(pool.decode.view(2), torch.randn(2, 4, D), k, v)


# ---- FA3 through every accepted module ----------------------------------------------------------
@pytest.mark.parametrize("module", FA3_NAMES)
@pytest.mark.parametrize("topk", [1, 2])
def test_fa3_call_path_matches_sdpa(install: Callable[[str, Any], None], module: str,
                                    topk: int) -> None:
    fake = FA3()
    install(module, fake.module(module, varlen=module == "vllm.vllm_flash_attn"))
    kernel = fa.load_fa3()
    assert kernel.name == module  # says which module runs
    pool = _pool(num_draft_tokens=4, topk=topk)
    b = make_batch(pool.cfg, 3, random.Random(2), extra=4)
    mask = tree_mask(3, 4) if topk > 1 else None
    view = pool.verify.update_(5, **b.inputs(), tree_mask=mask)
    k, v = _cache(pool, dtype=BF16)
    q = torch.randn(20, 4, D).to(BF16)
    got = fa.attention(view, q, k, v, kernel=kernel)
    want = _want(view, q, k, v)
    assert_close(got.out, want.out, 12)  # real rows (padded ones may have no keys: +inf lse)
    assert_close(got.lse, want.lse, 12)
    name, kw = fake.calls[-1]
    if module == "vllm.vllm_flash_attn":  # vLLM's names, FA3 selected explicitly
        assert name == "flash_attn_varlen_func" and kw["fa_version"] == 3
        assert kw["max_seqlen_k"] == kw["block_table"].shape[1] * kw["k"].shape[1]
    else:
        assert name == "flash_attn_with_kvcache"


def test_load_fa3_order_and_errors(install: Callable[[str, Any], None]) -> None:
    with pytest.raises(ImportError) as e:
        fa.load_fa3()
    for name in FA3_NAMES:  # every module tried, each with its reason
        assert name in str(e.value)
    install("vllm.vllm_flash_attn", FA3().module("vllm.vllm_flash_attn", varlen=True))
    k = fa.load_fa3()
    assert (k.name, k.style) == ("vllm.vllm_flash_attn", fa.CallStyle.VARLEN)
    install("sgl_kernel.flash_attn", FA3().module("sgl_kernel.flash_attn"))
    assert fa.load_fa3().name == "sgl_kernel.flash_attn"  # earlier in FA3_MODULES
    assert fa.load_fa3("vllm.vllm_flash_attn").name == "vllm.vllm_flash_attn"
    install("flash_attn_interface", FA3().module("x", varlen=True))  # no flash_attn_with_kvcache
    assert fa.load_fa3().name == "sgl_kernel.flash_attn"
    with pytest.raises(ImportError, match="flash_attn_interface: has no flash_attn_with_kvcache"):
        fa.load_fa3("flash_attn_interface")
    with pytest.raises(InputError, match="must be one of"):
        fa.load_fa3("fa3_fwd_interface")


# ---- FA3 scheduler metadata ---------------------------------------------------------------------
@pytest.mark.parametrize("bs", [1, 3, 4, 6])
@pytest.mark.parametrize(("part", "topk", "d"), [
    ("decode", 1, D),           # causal view, one query per row: FA3 plans it as non-causal
    ("decode", 1, 128),         # ... except for head dims in (64, 128] with a page table
    ("verify-prefix", 1, D),    # chain verify: causal, N queries per row
    ("verify-prefix", 2, D),    # tree prefix pass: non-causal
])
def test_scheduler_metadata_has_the_length_fa3_checks(bs: int, part: str, topk: int,
                                                      d: int) -> None:
    fake = FA3()
    kernel = fa.FlashKernel("fake", fa.FlashAttnVersion.FA3, fa.CallStyle.KVCACHE,
                            fake.flash_attn_with_kvcache, fake.get_scheduler_metadata)
    pool = _pool(num_draft_tokens=4, topk=topk, fa3_scheduler_metadata=True)
    buf = pool.arena.buffer(None, "scheduler_metadata")
    rng = random.Random(bs)
    n = max(1, bs - 1)
    b = make_batch(pool.cfg, n, rng, extra=4)
    if part == "decode":
        view: PagedView = pool.decode.update_(bs, **b.inputs())
        q = torch.randn(bs, 4, d).to(BF16)
    else:
        mask = tree_mask(n, 4) if topk > 1 else None
        view = pool.verify.update_(bs, **b.inputs(), tree_mask=mask).prefix
        q = torch.randn(bs * 4, 4, d).to(BF16)
    k, v = _cache(pool, d=d, dtype=BF16)
    md = fa.scheduler_metadata_(pool, view, num_heads_q=4, num_heads_kv=2, head_dim=d,
                                qkv_dtype=BF16, kernel=kernel)
    causal = effective_causal(view.causal, view.max_seqlen_q, d, True)
    splits = split_heuristic(2, fa.kernel_seqlen_k(view))
    assert md.numel() == metadata_size(bs, causal, splits, 90)  # FA3's own length, no padding
    assert md.data_ptr() == buf.data_ptr() and md.dtype == torch.int32
    got = fa.run(view, q, k, v, scheduler_metadata=md, kernel=kernel)  # FA3 checks the length
    want = _want(view, q, k, v)
    rows = int(view.cu_seqlens_q[view.bs])
    assert_close(got.out, want.out, rows)
    b2 = make_batch(pool.cfg, n, rng, extra=4)  # next step: same part, same bs, same slice
    view2 = pool.decode.update_(bs, **b2.inputs()) if part == "decode" else view
    md2 = fa.scheduler_metadata_(pool, view2, num_heads_q=4, num_heads_kv=2, head_dim=d,
                                 qkv_dtype=BF16, kernel=kernel)
    assert (md2.data_ptr(), md2.numel()) == (md.data_ptr(), md.numel())


@pytest.mark.parametrize("arch", [80, 90])
def test_scheduler_plans_for_the_kernels_kv_bound(arch: int) -> None:
    """With host lengths the view's max_seqlen_k is tight (384 here), while FA3 plans its splits
    for page_table width x page size (2048): the planner must get the kernel's bound."""
    fake = FA3(arch=arch)
    kernel = fa.FlashKernel("fake", fa.FlashAttnVersion.FA3, fa.CallStyle.KVCACHE,
                            fake.flash_attn_with_kvcache, fake.get_scheduler_metadata)
    pool = _pool(c=2048, fa3_scheduler_metadata=True)
    table = make_table(pool.cfg, 4, random.Random(0))
    b = Batch([384, 40], [0, 3], table)
    view = pool.decode.update_(2, **b.inputs(), seq_lens_cpu=b.seq_lens)
    assert view.max_seqlen_k == 384 and fa.kernel_seqlen_k(view) == 2048
    md = fa.scheduler_metadata_(pool, view, num_heads_q=4, num_heads_kv=2, head_dim=D,
                                qkv_dtype=BF16, kernel=kernel)
    assert fake.calls[-1][1]["max_seqlen_k"] == 2048
    k, v = _cache(pool, dtype=BF16)
    q = torch.randn(2, 4, D).to(BF16)
    got = fa.run(view, q, k, v, scheduler_metadata=md, kernel=kernel)
    assert_close(got.out, _want(view, q, k, v).out, 2)


def test_scheduler_metadata_errors() -> None:
    pool = _pool(fa3_scheduler_metadata=True)
    view = pool.decode.view(2)
    with pytest.raises(LayoutError, match="holds 33"):
        fa.scheduler_metadata_(pool, view, num_heads_q=4, num_heads_kv=2, head_dim=D,
                               qkv_dtype=BF16, fn=lambda **_: torch.zeros(100, dtype=torch.int32))
    with pytest.raises(LayoutError, match="1-D int32"):
        fa.scheduler_metadata_(pool, view, num_heads_q=4, num_heads_kv=2, head_dim=D,
                               qkv_dtype=BF16, fn=lambda **_: torch.zeros(9))
    with pytest.raises(LayoutError, match="fa3_scheduler_metadata=True"):
        fa.scheduler_metadata_(_pool(), view, num_heads_q=4, num_heads_kv=2, head_dim=D,
                               qkv_dtype=BF16, fn=lambda **_: torch.zeros(1, dtype=torch.int32))
    kernel = fa.FlashKernel("m", fa.FlashAttnVersion.FA3, fa.CallStyle.KVCACHE, print, None)
    with pytest.raises(LayoutError, match="m has no get_scheduler_metadata"):
        fa.scheduler_metadata_(pool, view, num_heads_q=4, num_heads_kv=2, head_dim=D,
                               qkv_dtype=BF16, kernel=kernel)


# ---- empty rows: flash-attn's +inf log-sum-exp --------------------------------------------------
def test_merge_reads_plus_inf_as_no_keys() -> None:
    o1, o2 = torch.randn(3, 2, D), torch.randn(3, 2, D)
    lse1 = torch.tensor([[1.0, float("inf")], [float("inf"), float("inf")], [0.5, 2.0]])
    lse2 = torch.tensor([[float("inf"), 0.3], [float("-inf"), float("inf")], [1.5, -1.0]])
    got = sdpa.merge_by_lse(o1, lse1, o2, lse2)
    assert not got.out.isnan().any()
    assert torch.equal(got.out[0, 0], o1[0, 0]) and torch.equal(got.out[0, 1], o2[0, 1])
    assert (got.out[1] == 0).all() and torch.isneginf(got.lse[1]).all()
    want = sdpa.merge_by_lse(o1[2:], lse1[2:], o2[2:], lse2[2:])
    assert torch.equal(got.out[2:], want.out)


def test_fa3_draft_tree_with_empty_prefix_rows_matches_sdpa() -> None:
    """Requests shorter than a page have no whole prefix page: the prefix pass's rows are empty
    and flash-attn reports lse = +inf for them; the merged tree result must be the expand pass."""
    fake = FA3()
    kernel = fa.FlashKernel("fake", fa.FlashAttnVersion.FA3, fa.CallStyle.KVCACHE,
                            fake.flash_attn_with_kvcache, None)
    pool = _pool(spec_steps=2, topk=2)
    table = make_table(pool.cfg, 6, random.Random(3))
    b = Batch([5, 30, 11], [0, 2, 4], table)
    loc = torch.randint(16, 12 * 16, (3, 2, 2), generator=torch.Generator().manual_seed(4))
    view = pool.draft.update_(4, **b.inputs(), out_cache_loc=loc)
    k, v = _cache(pool, dtype=BF16)
    q = torch.randn(8, 4, D).to(BF16)
    for step in view.steps:
        got = fa.attention(step, q, k, v, kernel=kernel)
        want = _want(step, q, k, v)
        assert not got.out[:6].float().isnan().any()
        assert_close(got.out, want.out, 6)
        assert_close(got.lse, want.lse, 6)


# ---- FA2 ----------------------------------------------------------------------------------------
def test_fa2_kwargs_and_call_path(install: Callable[[str, Any], None]) -> None:
    install("flash_attn", FA2().module())
    kernel = fa.load_fa2()
    assert kernel.name == "flash_attn"
    pool = _pool(page=256, c=1024, num_draft_tokens=3)
    b = make_batch(pool.cfg, 2, random.Random(3), extra=3)
    view = pool.verify.update_(3, **b.inputs())
    k, v = _cache(pool, dtype=BF16)
    q = torch.randn(9, 4, D).to(BF16)
    kw = fa.fa2_kwargs(view.prefix, q, k, v)
    assert set(kw) == {"q", "k_cache", "v_cache", "cache_seqlens", "block_table",
                       "softmax_scale", "causal", "return_softmax_lse"}
    assert kw["q"].shape == (3, 3, 4, D) and kw["q"].data_ptr() == q.data_ptr()
    assert kw["block_table"].data_ptr() == pool.arena.buffer(Phase.VERIFY, "page_table").data_ptr()
    assert kw["block_table"].dtype == torch.int32 and kw["block_table"].is_contiguous()
    assert kw["cache_seqlens"].tolist() == [s + 3 for s in b.seq_lens] + [1]
    assert kw["causal"] is True
    got = fa.attention(view, q, k, v, version=fa.FlashAttnVersion.FA2, kernel=kernel)
    want = _want(view, q, k, v)
    assert_close(got.out, want.out, 6)  # the real rows
    assert_close(got.lse, want.lse, 6)


def test_fa2_refuses_what_it_cannot_take() -> None:
    pool = _pool(page=16, num_draft_tokens=3)
    view = pool.decode.view(2)
    k, v = _cache(pool)
    with pytest.raises(LayoutError, match=r"multiple of 256, got 16"):
        fa.fa2_kwargs(view, torch.randn(2, 4, D), k, v)
    with pytest.raises(RuntimeError, match="Paged KV cache block size must be divisible by 256"):
        FA2().flash_attn_with_kvcache(torch.randn(2, 1, 4, D).to(BF16), k.to(BF16), v.to(BF16),
                                      cache_seqlens=view.cache_seqlens,
                                      block_table=view.page_table)
    big = _pool(page=256, c=1024, num_draft_tokens=3)
    kb, vb = _cache(big, dtype=BF16)
    with pytest.raises(LayoutError, match="same query count"):
        fa.fa2_kwargs(big.draft_extend.view(2), torch.randn(6, 4, D), kb, vb)
    with pytest.raises(InputError, match="bs \\* max_seqlen_q = 2 rows, got 3"):
        fa.fa2_kwargs(big.decode.view(2), torch.randn(3, 4, D), kb, vb)
    with pytest.raises(InputError, match="FA3 argument"):
        fa.run(big.decode.view(2), torch.randn(2, 4, D).to(BF16), kb, vb,
               version=fa.FlashAttnVersion.FA2, scheduler_metadata=torch.zeros(9),
               fn=FA2().flash_attn_with_kvcache)


def test_importing_adapters_imports_no_kernel_and_no_cuda() -> None:
    code = ("import sys, torch, attnpool.adapters.flash_attn, attnpool.adapters.flashinfer\n"
            "bad = [m for m in ('flash_attn', 'flash_attn_interface', 'flashinfer', 'triton',"
            " 'sgl_kernel', 'vllm') if m in sys.modules]\n"
            "assert not bad, bad\nassert not torch.cuda.is_initialized()\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---- real kernels (GPU) -------------------------------------------------------------------------
def _gpu_case(page: int, c: int, **kw: Any) -> tuple[BufferPool, Any, torch.Tensor, torch.Tensor]:
    cfg = PoolConfig(max_bs=4, max_context_len=c, page_size=page, device="cuda", pad_page=0, **kw)
    pool = BufferPool(cfg, poison=True)
    b = make_batch(cfg, 3, random.Random(5), extra=cfg.num_draft_tokens)
    seq, rpi, table = b.tensors("cuda")
    k, v = (torch.randn(12 * cfg.max_pages + 2, page, 2, 64, device="cuda", dtype=BF16)
            for _ in range(2))
    if cfg.num_draft_tokens:
        mask = tree_mask(3, cfg.num_draft_tokens).cuda() if cfg.topk > 1 else None
        return pool, pool.verify.update_(4, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                                         tree_mask=mask), k, v
    return pool, pool.decode.update_(4, seq_lens=seq, req_pool_indices=rpi, req_to_token=table), k, v


def _assert_bf16_close(got: sdpa.Attn, want: sdpa.Attn, rows: int) -> None:
    # bf16 inputs, fp32 accumulation in both: outputs agree to a few bf16 ulps (2^-8 relative).
    torch.testing.assert_close(got.out[:rows].float(), want.out[:rows].float(), atol=2e-2,
                               rtol=2e-2)
    torch.testing.assert_close(got.lse[:rows], want.lse[:rows], atol=2e-2, rtol=2e-2)


def _fa3_or_skip() -> fa.FlashKernel:
    try:
        return fa.load_fa3()
    except ImportError as e:
        pytest.skip(str(e))


@pytest.mark.cuda
@pytest.mark.parametrize("topk", [1, 2])
def test_fa3_kernel_matches_sdpa(topk: int) -> None:
    kernel = _fa3_or_skip()
    print("FA3 module:", kernel.name)
    pool, view, k, v = _gpu_case(16, 512, num_draft_tokens=4, topk=topk,
                                 fa3_scheduler_metadata=True)
    q = torch.randn(16, 4, 64, device="cuda", dtype=BF16)
    md = fa.scheduler_metadata_(pool, view.prefix, num_heads_q=4, num_heads_kv=2, head_dim=64,
                                qkv_dtype=BF16, kernel=kernel)
    got = fa.attention(view, q, k, v, scheduler_metadata=md, kernel=kernel)
    _assert_bf16_close(got, sdpa.attention(view, q, k, v), 12)


@pytest.mark.cuda
def test_fa2_kernel_matches_sdpa() -> None:
    try:
        fa.load_fa2()  # flash-attn-4 alone also makes `flash_attn` importable (a namespace)
    except ImportError as e:
        pytest.skip(str(e))
    _, view, k, v = _gpu_case(256, 1024)
    q = torch.randn(4, 4, 64, device="cuda", dtype=BF16)
    got = fa.attention(view, q, k, v, version=fa.FlashAttnVersion.FA2)
    _assert_bf16_close(got, sdpa.attention(view, q, k, v), 3)
