"""FlashInfer adapter: wrappers built on the pool's CSR buffers (one per part and batch size),
planning from views, query rows, and the call path, on CPU through fakes that enforce FlashInfer's
checks (``fakes_flashinfer.py``); the real wrappers on a GPU.

The fakes compute from the buffers a wrapper was built on, as a replayed graph does: a wrapper
made on a capture view and run after an ``update_`` sees the update only if it really sits on the
pool's memory. A "capture" here is what an engine does before ``torch.cuda.graph``: plan the
capture view, then run on the graph's whole query buffer.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from attnpool import BufferPool, InputError, Layout, LayoutError, PagedView, Phase, PoolConfig
from attnpool.adapters import flashinfer as fi
from attnpool.adapters import sdpa

from tests.helpers.batches import make_batch, tree_mask
from tests.helpers.fakes_flashinfer import BatchDecodeWithPagedKVCacheWrapper as Decode
from tests.helpers.fakes_flashinfer import BatchPrefillWithPagedKVCacheWrapper as Prefill

D, ND, H, H_KV = 8, 4, 4, 2
BF16 = torch.bfloat16


def _pool(page: int = 16, **kw: Any) -> BufferPool:
    cfg = PoolConfig(max_bs=6, max_context_len=128, page_size=page, device="cpu",
                     layout=kw.pop("layout", Layout.FLASHINFER), pad_page=2, **kw)
    return BufferPool(cfg, poison=True)


def _cache(pool: BufferPool) -> tuple[torch.Tensor, torch.Tensor]:
    pages = 12 * pool.cfg.max_pages + 2
    p = pool.cfg.page_size
    g = torch.Generator().manual_seed(7)
    return (torch.randn(pages, p, H_KV, D, generator=g).to(BF16),
            torch.randn(pages, p, H_KV, D, generator=g).to(BF16))


def _wrappers(workspace: torch.Tensor | None = None, **kw: Any) -> fi.GraphWrappers:
    ws = torch.empty(256, dtype=torch.uint8) if workspace is None else workspace
    return fi.GraphWrappers(ws, decode_cls=Decode, prefill_cls=Prefill, **kw)


def _plan(w: fi.GraphWrappers, view: PagedView) -> Any:
    return w.plan(view, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D, q_dtype=BF16)


def _close(got: sdpa.Attn, want: sdpa.Attn, rows: int) -> None:
    torch.testing.assert_close(got.out[:rows].float(), want.out[:rows].float(), atol=1e-2,
                               rtol=1e-2)
    torch.testing.assert_close(got.lse[:rows], want.lse[:rows], atol=1e-2, rtol=1e-2)


def _want(view: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> sdpa.Attn:
    return sdpa.attention(view, q.float(), k.float(), v.float(), layout=Layout.FLASHINFER)


def test_one_wrapper_per_bs_on_slices_of_the_same_buffers() -> None:
    pool = _pool()
    w = _wrappers()
    indptr = pool.arena.buffer(Phase.DECODE, "kv_indptr")
    indices = pool.arena.buffer(Phase.DECODE, "kv_indices")
    last = pool.arena.buffer(Phase.DECODE, "kv_last_page_len")
    for bs in (1, 2, 4, 6):
        wr = w.wrapper(pool.decode.view(bs))
        assert isinstance(wr, Decode)
        assert wr._use_cuda_graph is True and wr._kv_layout == "NHD"
        assert wr._paged_kv_indptr_buf.shape == (bs + 1,)
        assert wr._paged_kv_last_page_len_buf.shape == (bs,)
        assert wr._paged_kv_indptr_buf.data_ptr() == indptr.data_ptr()
        assert wr._paged_kv_last_page_len_buf.data_ptr() == last.data_ptr()
        assert wr._paged_kv_indices_buf.data_ptr() == indices.data_ptr()
        assert wr._paged_kv_indices_buf.numel() == indices.numel()  # full capacity
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
        view = pool.decode.update_(bs, **b.inputs())
        wr = _plan(w, view)
        assert wr._page_size == page and wr._q_dtype is BF16
        assert wr._sm_scale == pytest.approx(1 / math.sqrt(D))
        q = torch.randn(bs, H, D).to(BF16)
        got = w.run(view, q, k, v)
        _close(got, _want(view, q, k, v), n)
        assert not got.out[:n].isnan().any(), f"step {step}"


@pytest.mark.parametrize("topk", [1, 2])
def test_verify_parts_get_their_own_wrappers(topk: int) -> None:
    pool = _pool(num_draft_tokens=ND, topk=topk)
    w = _wrappers()
    cap = pool.verify.view(3)
    pre = w.wrapper(cap.prefix)
    assert isinstance(pre, Prefill)
    assert pre._qo_indptr_buf.data_ptr() == pool.arena.buffer(None, "arange_n").data_ptr()
    if cap.expand is not None:
        exp = w.wrapper(cap.expand)
        assert isinstance(exp, Decode)  # one query per expand row: decode wrapper
        assert exp._paged_kv_indptr_buf.data_ptr() == pool.arena.buffer(
            Phase.VERIFY, "expand_kv_indptr").data_ptr()
    assert len(w) == (2 if topk > 1 else 1)
    parts = [cap.prefix] + ([cap.expand] if cap.expand is not None else [])
    for part in parts:  # capture: the capture view planned first, run on the whole buffer
        _plan(w, part)
        w.run(part, torch.zeros(3 * ND, H, D, dtype=BF16), *_cache(pool))
    b = make_batch(pool.cfg, 2, random.Random(topk), extra=ND)
    mask = tree_mask(2, ND) if topk > 1 else None
    view = pool.verify.update_(3, **b.inputs(), tree_mask=mask)
    k, v = _cache(pool)
    q = torch.randn(3 * ND, H, D).to(BF16)
    outs = []
    for part in [view.prefix] + ([view.expand] if view.expand is not None else []):
        wr = _plan(w, part)
        if part is not view.prefix:  # token-slot rows: the cache is read as pages of one token
            assert wr._page_size == 1
        else:
            assert wr._causal is (topk == 1)
        outs.append(w.run(part, q, k, v))
    got = outs[0] if len(outs) == 1 else sdpa.merge_by_lse(outs[0].out, outs[0].lse,
                                                          outs[1].out, outs[1].lse)
    _close(got, _want(view, q, k, v), 2 * ND)


# ---- query rows per captured size (prefill parts) -----------------------------------------------
def _capture(w: fi.GraphWrappers, part: PagedView, rows: int, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """What an engine does for one captured size: plan the capture view, run on the graph's whole
    query buffer (warm-up and capture run the kernel on it)."""
    w.wrapper(part)
    _plan(w, part)
    w.run(part, torch.zeros(rows, H, D, dtype=BF16), k, v)


def test_draft_extend_capture_fixes_the_most_rows() -> None:
    """Capture plans bs*N query rows (the graph's buffer); later batches with any accepted
    counts, up to N per request, plan at most that many."""
    pool = _pool(num_draft_tokens=ND)
    w = _wrappers()
    k, v = _cache(pool)
    for bs in (2, 4):
        cap = pool.draft_extend.view(bs)
        assert int(cap.cu_seqlens_q[bs]) == bs * ND
        _capture(w, cap, bs * ND, k, v)
    rng = random.Random(1)
    for step in range(8):
        n = rng.randint(1, 4)
        bs = 2 if n <= 2 else 4
        b = make_batch(pool.cfg, n, rng, extra=ND)
        acc = [ND if step % 2 else rng.randint(1, ND) for _ in range(n)]
        seq = [s + a for s, a in zip(b.seq_lens, acc, strict=True)]
        _, rpi, table = b.tensors()
        view = pool.draft_extend.update_(bs, seq_lens=torch.tensor(seq), accept_lens=torch.tensor(acc),
                                         req_pool_indices=rpi, req_to_token=table)
        assert int(view.cu_seqlens_q[bs]) <= bs * ND
        _plan(w, view)
        q = torch.randn(bs * ND, H, D).to(BF16)  # the graph's query buffer, real queries first
        got = w.run(view, q, k, v)
        assert got.out.shape == (bs * ND, H, D)
        _close(got, _want(view, q, k, v), sum(acc))
        # rows past the plan: the kernel does not write them, the adapter's 0 / -inf stand
        done = int(view.cu_seqlens_q[bs])
        assert (got.out[done:] == 0).all() and torch.isneginf(got.lse[done:]).all()


def test_local_verify_rows_are_constant_per_captured_size() -> None:
    pool = _pool(num_draft_tokens=ND, attention_chunk_size=32)
    w = _wrappers()
    k, v = _cache(pool)
    for bs in (2, 4):
        cap = pool.local.view(bs, for_phase=Phase.VERIFY)
        assert int(cap.cu_seqlens_q[cap.bs]) == bs * ND
        _capture(w, cap, bs * ND, k, v)
    rng = random.Random(2)
    for _ in range(6):
        n = rng.randint(1, 4)
        bs = 2 if n <= 2 else 4
        b = make_batch(pool.cfg, n, rng, extra=ND)
        view = pool.local.update_(bs, **b.inputs(), for_phase=Phase.VERIFY)
        assert int(view.cu_seqlens_q[view.bs]) == bs * ND
        _plan(w, view)
        q = torch.randn(bs * ND, H, D).to(BF16)
        _close(w.run(view, q, k, v), _want(view, q, k, v), n * ND)


def test_a_plan_with_more_rows_than_the_first_is_refused() -> None:
    pool = _pool(num_draft_tokens=ND)
    w = _wrappers()
    k, v = _cache(pool)
    b = make_batch(pool.cfg, 2, random.Random(3), extra=ND)
    seq, rpi, table = b.tensors()
    small = pool.draft_extend.update_(2, seq_lens=seq + ND, accept_lens=torch.tensor([1, 1]),
                                      req_pool_indices=rpi, req_to_token=table)
    _capture(w, small, 2, k, v)  # first plan on 2 rows, not the capture view's 8
    big = pool.draft_extend.update_(2, seq_lens=seq + ND, accept_lens=torch.tensor([3, 2]),
                                    req_pool_indices=rpi, req_to_token=table)
    with pytest.raises(LayoutError, match="5 query rows, more than the 2 of the wrapper's first"):
        _plan(w, big)
    wr = w.wrapper(big)
    with pytest.raises(ValueError, match="cannot exceed the number of rows set during init"):
        fi.plan(wr, big, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D, q_dtype=BF16)


@pytest.mark.parametrize("bs", [1, 2, 3])
def test_q_may_be_the_whole_padded_buffer(bs: int) -> None:
    """A decode wrapper computes exactly bs rows and refuses a q of 2*bs rows or more; the
    adapter passes it q[:bs] and returns every row of q (the rest 0 / -inf)."""
    pool = _pool()
    w = _wrappers()
    k, v = _cache(pool)
    w.wrapper(pool.decode.view(bs))
    b = make_batch(pool.cfg, bs, random.Random(bs))
    view = pool.decode.update_(bs, **b.inputs())
    _plan(w, view)
    q = torch.randn(pool.cfg.max_bs, H, D).to(BF16)
    got = w.run(view, q, k, v)
    assert got.out.shape == (6, H, D) and got.lse.shape == (6, H)
    _close(got, _want(view, q, k, v), bs)
    assert (got.out[bs:] == 0).all() and torch.isneginf(got.lse[bs:]).all()
    with pytest.raises(ValueError, match="only supports q_len_per_req=1"):
        w.wrapper(view).run(q[: 2 * bs], (k, v), return_lse=True)
    with pytest.raises(InputError, match=f"at least the {bs} query rows"):
        w.run(view, q[: bs - 1], k, v)


def test_workspace_is_zeroed_before_first_use() -> None:
    pool = _pool()
    k, v = _cache(pool)
    garbage = torch.full((256,), 0x5A, dtype=torch.uint8)  # what torch.empty may hold
    w = _wrappers(garbage)
    assert (garbage == 0).all()
    view = pool.decode.view(2)
    w.wrapper(view)
    _plan(w, view)
    w.run(view, torch.zeros(2, H, D, dtype=BF16), k, v)
    dirty = _wrappers(torch.full((256,), 1, dtype=torch.uint8), zero_workspace=False)
    dirty.wrapper(view)
    with pytest.raises(RuntimeError, match="initialized to 0 for its first use"):
        _plan(dirty, view)


def test_errors() -> None:
    w = _wrappers()
    fa_only = _pool(layout=Layout.FLASH_ATTN)
    with pytest.raises(LayoutError, match="kv_indptr"):
        w.wrapper(fa_only.decode.view(2))
    pool = _pool()
    with pytest.raises(LayoutError, match="before capturing"):
        w.run(pool.decode.view(2), torch.randn(2, H, D), *_cache(pool))
    with pytest.raises(LayoutError, match="bs=2"):
        _plan(w, pool.decode.view(2))
    w.wrapper(pool.decode.view(2))
    with pytest.raises(LayoutError, match="never planned"):
        w.run(pool.decode.view(2), torch.randn(2, H, D), *_cache(pool))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        w.plan(pool.decode.view(2), num_qo_heads=3, num_kv_heads=2, head_dim=D, q_dtype=BF16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        Decode(torch.zeros(64, dtype=torch.uint8)[1:], "NHD")


@pytest.mark.cuda
@pytest.mark.parametrize("topk", [1, 2])
def test_real_wrappers_match_sdpa(topk: int) -> None:
    pytest.importorskip("flashinfer")
    cfg = PoolConfig(max_bs=4, max_context_len=512, page_size=16, device="cuda",
                     layout=Layout.FLASHINFER, num_draft_tokens=ND, topk=topk)
    pool = BufferPool(cfg, poison=True)
    w = fi.GraphWrappers(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    heads: dict[str, Any] = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64,
                             "q_dtype": torch.bfloat16}
    k, v = (torch.randn(12 * cfg.max_pages + 2, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    cap = pool.verify.view(4)
    for part in (cap.prefix, cap.expand, pool.decode.view(4)):
        if part is not None:  # as before a capture: plan the capture view, run on the buffer
            w.wrapper(part)
            w.plan(part, **heads)
            w.run(part, torch.zeros(4 * ND, 4, 64, device="cuda", dtype=torch.bfloat16), k, v)
    b = make_batch(cfg, 3, random.Random(9), extra=ND)
    seq, rpi, table = b.tensors("cuda")
    # bf16 inputs, fp32 accumulation in both: a few bf16 ulps (2^-8 relative)
    tol: dict[str, Any] = {"atol": 2e-2, "rtol": 2e-2}
    dec = pool.decode.update_(4, seq_lens=seq, req_pool_indices=rpi, req_to_token=table)
    q = torch.randn(4, 4, 64, device="cuda", dtype=torch.bfloat16)
    w.plan(dec, **heads)
    got, want = w.run(dec, q, k, v), sdpa.paged_attention(dec, q, k, v)
    torch.testing.assert_close(got.out[:3].float(), want.out[:3].float(), **tol)
    torch.testing.assert_close(got.lse[:3], want.lse[:3], **tol)
    mask = tree_mask(3, ND, device="cuda") if topk > 1 else None
    ver = pool.verify.update_(4, seq_lens=seq, req_pool_indices=rpi, req_to_token=table, tree_mask=mask)
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
