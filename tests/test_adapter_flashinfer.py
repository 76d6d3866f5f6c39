"""FlashInfer adapter: wrappers built on the pool's CSR buffers (one per part and batch size),
planning from views, and the call path, on CPU through stand-in wrapper classes; the real
wrappers on a GPU.

The stand-ins keep what a CUDA-graph FlashInfer wrapper keeps (the buffers handed to the
constructor, the plan's page size and mask) and compute attention only from those buffers at run
time, as a replayed graph would: so a stand-in built on a capture view and run after an
``update_`` sees the update only if the wrapper really sits on the pool's memory.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from attnpool import BufferPool, Layout, LayoutError, PagedView, Phase, PoolConfig
from attnpool.adapters import flashinfer as fi
from attnpool.adapters import sdpa

from batches import make_batch

D, ND = 8, 4


class _StandIn:
    """Records construction and plan; ``run`` computes from the constructor's buffers only."""

    kind = fi.WrapperKind.DECODE

    def __init__(self, workspace: torch.Tensor, kv_layout: str, **kw: Any) -> None:
        self.workspace, self.kv_layout, self.init = workspace, kv_layout, kw
        self.plans: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def _bufs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        kw = self.init
        last = kw["paged_kv_last_page_len_buffer"]
        qo = torch.arange(last.shape[0] + 1, dtype=torch.int32)
        return qo, kw["paged_kv_indptr_buffer"], kw["paged_kv_indices_buffer"], last

    def plan(self, *args: Any, **kw: Any) -> None:
        self.plans.append((args, kw))

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
            return_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        args, kw = self.plans[-1]
        qo, indptr, indices, last = self._bufs()
        page = args[-1]
        bs = last.shape[0]
        pages = (indptr[1:] - indptr[:-1]).max().item()
        view = PagedView(bs=bs, cache_seqlens=torch.zeros(bs, dtype=torch.int32),
                         cu_seqlens_q=qo, cu_seqlens_k=torch.zeros(bs + 1, dtype=torch.int32),
                         page_table=None, kv_indptr=indptr, kv_indices=indices,
                         kv_last_page_len=last, max_seqlen_q=int((qo[1:] - qo[:-1]).max()),
                         max_seqlen_k=int(pages) * page, page_size=page,
                         causal=kw.get("causal", False))
        assert kv[0].shape[1] == page
        got = sdpa.paged_attention(view, q, kv[0], kv[1], softmax_scale=kw["sm_scale"])
        return got.out, got.lse / math.log(2.0)  # FlashInfer's LSE is base 2


class _PrefillStandIn(_StandIn):
    kind = fi.WrapperKind.PREFILL

    def _bufs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        kw = self.init
        return (kw["qo_indptr_buf"], kw["paged_kv_indptr_buf"], kw["paged_kv_indices_buf"],
                kw["paged_kv_last_page_len_buf"])


def _pool(page: int = 16, **kw: Any) -> BufferPool:
    cfg = PoolConfig(max_bs=6, max_context_len=128, page_size=page, device="cpu",
                     layout=kw.pop("layout", Layout.FLASHINFER), pad_page=2, **kw)
    return BufferPool(cfg, poison=True)


def _cache(pool: BufferPool) -> tuple[torch.Tensor, torch.Tensor]:
    pages = 12 * pool.cfg.max_pages + 2
    p = pool.cfg.page_size
    return torch.randn(pages, p, 2, D), torch.randn(pages, p, 2, D)


def _wrappers() -> fi.GraphWrappers:
    return fi.GraphWrappers(torch.empty(16, dtype=torch.uint8), decode_cls=_StandIn,
                            prefill_cls=_PrefillStandIn)


def _plan(w: fi.GraphWrappers, view: PagedView) -> Any:
    return w.plan(view, num_qo_heads=4, num_kv_heads=2, head_dim=D, q_dtype=torch.float32)


def test_one_wrapper_per_bs_on_slices_of_the_same_buffers() -> None:
    pool = _pool()
    w = _wrappers()
    indptr = pool.arena.buffer(Phase.DECODE, "kv_indptr")
    indices = pool.arena.buffer(Phase.DECODE, "kv_indices")
    last = pool.arena.buffer(Phase.DECODE, "kv_last_page_len")
    for bs in (1, 2, 4, 6):
        wr = w.wrapper(pool.decode.view(bs))
        assert isinstance(wr, _StandIn) and not isinstance(wr, _PrefillStandIn)
        assert wr.init["use_cuda_graph"] is True and wr.kv_layout == "NHD"
        assert wr.init["paged_kv_indptr_buffer"].shape == (bs + 1,)
        assert wr.init["paged_kv_last_page_len_buffer"].shape == (bs,)
        assert wr.init["paged_kv_indptr_buffer"].data_ptr() == indptr.data_ptr()
        assert wr.init["paged_kv_last_page_len_buffer"].data_ptr() == last.data_ptr()
        assert wr.init["paged_kv_indices_buffer"] is not None
        assert wr.init["paged_kv_indices_buffer"].data_ptr() == indices.data_ptr()
        assert wr.init["paged_kv_indices_buffer"].numel() == indices.numel()  # full capacity
        assert w.wrapper(pool.decode.view(bs)) is wr  # created once per size
    assert len(w) == 4


@pytest.mark.parametrize("page", [1, 16])
def test_capture_then_update_plan_run_matches_sdpa(page: int) -> None:
    """Wrappers made on capture views read each later update (they sit on the pool's memory)."""
    pool = _pool(page)
    w = _wrappers()
    for bs in (2, 4):
        w.wrapper(pool.decode.view(bs))
    k, v = _cache(pool)
    rng = random.Random(page)
    for step in range(4):
        n = rng.randint(1, 4)
        bs = 2 if n <= 2 else 4
        b = make_batch(pool.cfg, n, rng)
        view = pool.decode.update_(bs, *b.tensors())
        wr = _plan(w, view)
        args, kw = wr.plans[-1]
        assert args[3:] == (4, 2, D, page) and kw["q_data_type"] is torch.float32
        assert kw["sm_scale"] == pytest.approx(1 / math.sqrt(D))
        q = torch.randn(bs, 4, D)
        got = w.run(view, q, k, v)
        want = sdpa.paged_attention(view, q, k, v, layout=Layout.FLASHINFER)
        torch.testing.assert_close(got.out, want.out, msg=f"step {step}")
        torch.testing.assert_close(got.lse, want.lse)


@pytest.mark.parametrize("topk", [1, 2])
def test_verify_parts_get_their_own_wrappers(topk: int) -> None:
    pool = _pool(num_draft_tokens=ND, topk=topk)
    w = _wrappers()
    cap = pool.verify.view(3)
    w.wrapper(cap.prefix)
    pre = w.wrapper(cap.prefix)
    assert isinstance(pre, _PrefillStandIn)
    assert pre.init["qo_indptr_buf"].data_ptr() == pool.arena.buffer(None, "arange_n").data_ptr()
    if cap.expand is not None:
        exp = w.wrapper(cap.expand)
        assert type(exp) is _StandIn  # one query per expand row: decode wrapper
        assert exp.init["paged_kv_indptr_buffer"].data_ptr() == pool.arena.buffer(
            Phase.VERIFY, "expand_kv_indptr").data_ptr()
    assert len(w) == (2 if topk > 1 else 1)
    rng = random.Random(topk)
    b = make_batch(pool.cfg, 2, rng, extra=ND)
    mask = torch.ones(2, ND, ND, dtype=torch.bool).tril() if topk > 1 else None
    view = pool.verify.update_(3, *b.tensors(), tree_mask=mask)
    k, v = _cache(pool)
    q = torch.randn(3 * ND, 4, D)
    parts = [view.prefix] + ([view.expand] if view.expand is not None else [])
    outs = []
    for part in parts:
        wr = _plan(w, part)
        args, kw = wr.plans[-1]
        if part is view.prefix:  # prefill plan: qo_indptr first, mask from the view
            assert args[0] is part.cu_seqlens_q and kw["causal"] is (topk == 1)
        else:  # token-slot rows: the cache is read as pages of one token
            assert args[-1] == 1
        outs.append(w.run(part, q, k, v))
    got = outs[0] if len(outs) == 1 else sdpa.merge_by_lse(outs[0].out, outs[0].lse,
                                                          outs[1].out, outs[1].lse)
    want = sdpa.attention(view, q, k, v, layout=Layout.FLASHINFER)
    torch.testing.assert_close(got.out, want.out)
    torch.testing.assert_close(got.lse, want.lse)


def test_errors() -> None:
    w = _wrappers()
    fa_only = _pool(layout=Layout.FLASH_ATTN)
    with pytest.raises(LayoutError, match="kv_indptr"):
        w.wrapper(fa_only.decode.view(2))
    pool = _pool()
    with pytest.raises(LayoutError, match="before capturing"):
        w.run(pool.decode.view(2), torch.randn(2, 4, D), *_cache(pool))
    with pytest.raises(LayoutError, match="bs=2"):
        _plan(w, pool.decode.view(2))
    w.wrapper(pool.decode.view(2))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        w.plan(pool.decode.view(2), num_qo_heads=3, num_kv_heads=2, head_dim=D,
               q_dtype=torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("topk", [1, 2])
def test_real_wrappers_match_sdpa(topk: int) -> None:
    pytest.importorskip("flashinfer")
    cfg = PoolConfig(max_bs=4, max_context_len=512, page_size=16, device="cuda",
                     layout=Layout.FLASHINFER, num_draft_tokens=ND, topk=topk)
    pool = BufferPool(cfg, poison=True)
    w = fi.GraphWrappers(torch.zeros(128 << 20, dtype=torch.uint8, device="cuda"))
    cap = pool.verify.view(4)
    for part in (cap.prefix, cap.expand):
        if part is not None:
            w.wrapper(part)
    w.wrapper(pool.decode.view(4))
    b = make_batch(cfg, 3, random.Random(9), extra=ND)
    seq, rpi, table = b.tensors("cuda")
    k, v = (torch.randn(12 * cfg.max_pages + 2, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    heads: dict[str, Any] = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64,
                             "q_dtype": torch.bfloat16}
    # bf16 inputs, fp32 accumulation in both: a few bf16 ulps (2^-8 relative)
    tol: dict[str, Any] = {"atol": 2e-2, "rtol": 2e-2}
    dec = pool.decode.update_(4, seq, rpi, table)
    q = torch.randn(4, 4, 64, device="cuda", dtype=torch.bfloat16)
    w.plan(dec, **heads)
    got, want = w.run(dec, q, k, v), sdpa.paged_attention(dec, q, k, v)
    torch.testing.assert_close(got.out[:3].float(), want.out[:3].float(), **tol)
    torch.testing.assert_close(got.lse[:3], want.lse[:3], **tol)
    mask = torch.ones(3, ND, ND, dtype=torch.bool, device="cuda").tril() if topk > 1 else None
    ver = pool.verify.update_(4, seq, rpi, table, tree_mask=mask)
    q = torch.randn(4 * ND, 4, 64, device="cuda", dtype=torch.bfloat16)
    outs = []
    for part in (ver.prefix, ver.expand):
        if part is not None:
            w.plan(part, **heads)
            outs.append(w.run(part, q, k, v))
    got = outs[0] if len(outs) == 1 else sdpa.merge_by_lse(outs[0].out, outs[0].lse,
                                                          outs[1].out, outs[1].lse)
    want = sdpa.attention(ver, q, k, v)
    torch.testing.assert_close(got.out[:3 * ND].float(), want.out[:3 * ND].float(), **tol)
    torch.testing.assert_close(got.lse[:3 * ND], want.lse[:3 * ND], **tol)
