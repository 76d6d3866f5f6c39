"""Sliding-window parts through the attention adapters.

The SDPA adapter over a view's ``.window`` part equals dense float64 attention restricted to the
window (a query at position ``p`` sees the keys at ``p - W + 1 .. p``, read from the window
table) for every phase with a window part and both layouts; a key at distance exactly ``W`` is
excluded and one at ``W - 1`` included. The flash-attn and FlashInfer adapters pass the
window as the libraries take it (``window_size=(W - 1, 0)``, ``window_left=W - 1`` at plan
time), plan FA3's scheduler for the window part into its own buffer, and their fakes (which
apply the window as the kernels do) agree with the SDPA adapter.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import BufferPool, Layout, LayoutError, PagedView, Phase, PoolConfig
from attnpool.adapters import flash_attn as fa
from attnpool.adapters import flashinfer as fi
from attnpool.adapters import sdpa

from tests.helpers.dense import dense_attention
from tests.helpers.fakes_fa3 import FA2, FA3, assert_close, metadata_size, split_heuristic
from tests.helpers.fakes_flashinfer import BatchDecodeWithPagedKVCacheWrapper as Decode
from tests.helpers.fakes_flashinfer import BatchPrefillWithPagedKVCacheWrapper as Prefill

C, ROWS, ND, STEPS, T, H, H_KV, D = 64, 6, 3, 2, 24, 4, 2, 8
PHASES = ["decode", "verify", "draft", "draft_extend", "extend"]


def _pool(page: int, w: int, layout: Layout = Layout.BOTH, **kw: Any) -> BufferPool:
    steps = STEPS if layout & Layout.FLASH_ATTN else 0  # chain drafts need a page table
    cfg = PoolConfig(max_bs=4, max_context_len=C, page_size=page, device="cpu", layout=layout,
                     num_draft_tokens=ND, spec_steps=steps, max_extend_tokens=T,
                     sliding_window=w, **kw)
    return BufferPool(cfg, poison=True)


def _tables(page: int, rng: random.Random) -> tuple[Tensor, Tensor]:
    """Token tables of the full and the window group: distinct pages of one cache."""
    cols = C // page
    ids = list(range(1, 2 * ROWS * cols + 1))
    rng.shuffle(ids)
    out = []
    for part in (ids[: ROWS * cols], ids[ROWS * cols :]):
        bt = torch.tensor(part, dtype=torch.int64).view(ROWS, cols)
        out.append((bt.repeat_interleave(page, 1) * page + torch.arange(C) % page).to(torch.int32))
    return out[0], out[1]


def _cache(page: int, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    pages = 2 * ROWS * (C // page) + 1
    g = torch.Generator().manual_seed(page)
    return (torch.randn(pages, page, H_KV, D, generator=g).to(dtype),
            torch.randn(pages, page, H_KV, D, generator=g).to(dtype))


def _update(pool: BufferPool, phase: str, seq: list[int], q: list[int], rows: list[int],
            full: Tensor, win: Tensor, bs: int) -> Any:
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    kw: dict[str, Any] = {"seq_lens": t(seq), "req_pool_indices": t(rows),
                          "req_to_token": full, "window_req_to_token": win}
    if phase == "draft_extend":
        kw["accept_lens"] = t(q)
    if phase == "extend":
        kw["extend_lens"] = t(q)
    return pool.phase(phase).update_(bs, **kw)


def _queries(phase: str, seq: list[int], q: list[int], step: int) -> list[tuple[int, int]]:
    """(request index, absolute position) of each packed query of the real rows."""
    if phase == "verify":
        return [(i, s + j) for i, s in enumerate(seq) for j in range(ND)]
    if phase == "draft":
        return [(i, s + step - 1) for i, s in enumerate(seq)]
    if phase in ("draft_extend", "extend"):
        return [(i, s - qi + j) for i, (s, qi) in enumerate(zip(seq, q, strict=True))
                for j in range(qi)]
    return [(i, s - 1) for i, s in enumerate(seq)]


def _batch(phase: str, rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    hi = C - (ND if phase == "verify" else STEPS if phase == "draft" else 0)
    seq = [rng.randint(1, hi) for _ in range(n)]
    if phase == "extend":
        return seq, [rng.randint(1, min(s, T // n)) for s in seq]
    if phase == "draft_extend":
        return seq, [rng.randint(1, min(s, ND)) for s in seq]
    return seq, [1] * n


def _parts(view: Any) -> list[PagedView]:
    return [s.window for s in view.steps] if hasattr(view, "steps") else [view.window]


@pytest.mark.parametrize("layout", [Layout.FLASH_ATTN, Layout.FLASHINFER])
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("phase", PHASES)
def test_sdpa_window_equals_dense_attention_in_the_window(phase: str, page: int,
                                                          layout: Layout) -> None:
    rng = random.Random(f"{phase}{page}{layout}")
    w = rng.choice([1, 3, 9])
    pool = _pool(page, w)
    full, win = _tables(page, rng)
    k, v = _cache(page)
    n = 3
    seq, q = _batch(phase, rng, n)
    rows = rng.sample(range(ROWS), n)
    view = _update(pool, phase, seq, q, rows, full, win, bs=4)
    lay = Layout.FLASH_ATTN if phase == "draft" else layout  # chain drafts: a page table only
    for step, part in enumerate(_parts(view), start=1):
        assert part.window_left == w - 1
        qs = _queries(phase, seq, q, step)
        total = int(part.cu_seqlens_q[part.bs])
        x = torch.randn(max(total, len(qs)), H, D, dtype=torch.float64)
        keys = [[int(win[rows[i], kk]) for kk in range(max(0, p - w + 1), p + 1)] for i, p in qs]
        want, want_lse = dense_attention(x, k, v, keys)
        got = sdpa.attention(part, x, k, v, layout=lay)
        out = sdpa.attention_out(part, x, k, v, layout=lay)
        torch.testing.assert_close(got.out[: len(qs)], want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got.lse[: len(qs)].double(), want_lse, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[: len(qs)], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", [Layout.FLASH_ATTN, Layout.FLASHINFER])
def test_a_key_at_distance_w_is_excluded_and_w_minus_one_included(layout: Layout) -> None:
    """One value vector per key: the output tells exactly which keys a decode query read."""
    w, page, pos = 5, 4, 20
    pool = _pool(page, w)
    full, win = _tables(page, random.Random(0))
    k = torch.zeros(2 * ROWS * (C // page) + 1, page, H_KV, D, dtype=torch.float64)
    v = torch.zeros_like(k)
    flat_v = v.view(-1, H_KV, D)
    for dist in range(pos + 1):  # value of the key at distance `dist`: 2**dist in channel 0
        flat_v[int(win[0, pos - dist]), :, 0] = 2.0**dist
    view = _update(pool, "decode", [pos + 1], [1], [0], full, win, bs=1)
    x = torch.zeros(1, H, D, dtype=torch.float64)  # equal scores: a plain mean of the values
    out = sdpa.attention_out(view.window, x, k, v, layout=layout)[0, 0, 0].item()
    assert out == sum(2.0**d for d in range(w)) / w  # distances 0 .. W-1, not W
    wide = sdpa.attention_out(view, x, k, v, layout=layout)[0, 0, 0].item()
    assert wide != out  # the full part reads the rest


def test_sdpa_refuses_a_window_on_a_non_causal_view() -> None:
    pool = _pool(4, 3)
    view = pool.decode.view(2).window
    assert view is not None
    bad = PagedView(bs=2, cache_seqlens=view.cache_seqlens, cu_seqlens_q=view.cu_seqlens_q,
                    cu_seqlens_k=view.cu_seqlens_k, page_table=view.page_table, kv_indptr=None,
                    kv_indices=None, kv_last_page_len=None, max_seqlen_q=1,
                    max_seqlen_k=view.max_seqlen_k, page_size=4, causal=False, window_left=2)
    k, v = _cache(4)
    with pytest.raises(LayoutError, match="causal"):
        sdpa.attention(bad, torch.zeros(2, H, D, dtype=torch.float64), k, v)


@pytest.mark.parametrize("phase", ["decode", "verify", "extend"])
def test_fa3_takes_the_window_and_plans_it_apart(phase: str) -> None:
    fake = FA3()
    kernel = fa.FlashKernel("fake", fa.FlashAttnVersion.FA3, fa.CallStyle.KVCACHE,
                            fake.flash_attn_with_kvcache, fake.get_scheduler_metadata)
    w, page = 7, 4
    pool = _pool(page, w, Layout.FLASH_ATTN, fa3_scheduler_metadata=True)
    rng = random.Random(phase)
    full, win = _tables(page, rng)
    k, v = _cache(page, torch.bfloat16)
    seq, q = _batch(phase, rng, 3)
    view = _update(pool, phase, seq, q, rng.sample(range(ROWS), 3), full, win, bs=4)
    part = view.window
    kw = fa.fa3_kwargs(part, torch.zeros(1, H, D, dtype=torch.bfloat16), k, v)
    assert kw["window_size"] == (w - 1, 0) and kw["page_table"] is part.page_table
    assert "window_size" not in fa.fa3_kwargs(view if phase != "verify" else view.prefix,
                                              torch.zeros(1, H, D, dtype=torch.bfloat16), k, v)
    md = fa.scheduler_metadata_(pool, part, num_heads_q=H, num_heads_kv=H_KV, head_dim=D,
                                qkv_dtype=torch.bfloat16, kernel=kernel)
    assert md.data_ptr() == pool.arena.buffer(None, "window_scheduler_metadata").data_ptr()
    splits = split_heuristic(H_KV, fa.kernel_seqlen_k(part))
    assert md.numel() == metadata_size(4, False, splits, 90, local=True)
    assert fake.calls[-1][1]["window_size"] == (w - 1, 0)
    total = int(part.cu_seqlens_q[part.bs])
    x = torch.randn(total, H, D).to(torch.bfloat16)
    got = fa.run(part, x, k, v, scheduler_metadata=md, kernel=kernel)
    want = sdpa.attention(part, x.float(), k.float(), v.float())
    real = int(part.cu_seqlens_q[3])
    assert_close(got.out, want.out, real)
    assert_close(got.lse, want.lse, real)


def test_fa2_takes_the_window() -> None:
    fake = FA2()
    w, page = 300, 256
    cfg = PoolConfig(max_bs=2, max_context_len=1024, page_size=page, device="cpu",
                     sliding_window=w)
    pool = BufferPool(cfg, poison=True)
    table = torch.arange(2 * 1024, dtype=torch.int32).view(2, 1024) + page
    view = pool.decode.update_(2, seq_lens=torch.tensor([700, 90]),
                               req_pool_indices=torch.tensor([0, 1]), req_to_token=table)
    k = torch.randn(12, page, H_KV, D).to(torch.bfloat16)
    v = torch.randn_like(k)
    x = torch.randn(2, H, D).to(torch.bfloat16)
    got = fa.run(view.window, x, k, v, version=fa.FlashAttnVersion.FA2,
                 fn=fake.flash_attn_with_kvcache)
    assert fake.calls[-1]["window_size"] == (w - 1, 0)
    want = sdpa.attention(view.window, x.float(), k.float(), v.float())
    assert_close(got.out, want.out, 2)


@pytest.mark.parametrize("phase", ["decode", "verify", "draft_extend"])
def test_flashinfer_plans_the_window_on_its_own_wrapper(phase: str) -> None:
    w, page = 6, 4
    pool = _pool(page, w, Layout.FLASHINFER)
    rng = random.Random(phase)
    full, win = _tables(page, rng)
    k, v = _cache(page, torch.bfloat16)
    wrappers = fi.GraphWrappers(torch.empty(256, dtype=torch.uint8), decode_cls=Decode,
                                prefill_cls=Prefill)
    cap = pool.phase(phase).view(4)
    main = cap.prefix if phase == "verify" else cap
    for part in (main, cap.window):
        wrappers.wrapper(part)
        wrappers.plan(part, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D, q_dtype=torch.bfloat16)
    assert len(wrappers) == 2  # the window part never shares the full part's plan
    seq, q = _batch(phase, rng, 3)
    view = _update(pool, phase, seq, q, rng.sample(range(ROWS), 3), full, win, bs=4)
    part = view.window
    wr = wrappers.plan(part, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D,
                       q_dtype=torch.bfloat16)
    assert wr._window_left == w - 1
    total = int(part.cu_seqlens_q[part.bs])
    x = torch.randn(total, H, D).to(torch.bfloat16)
    got = wrappers.run(part, x, k, v)
    want = sdpa.attention(part, x.float(), k.float(), v.float())
    real = int(part.cu_seqlens_q[3])
    assert_close(got.out, want.out, real)
    assert_close(got.lse, want.lse, real)


@pytest.mark.parametrize("verify", [False, True])
def test_window_and_chunked_parts_follow_transformers_masks(verify: bool) -> None:
    """The keys each query reads, as transformers' own mask functions decide them:
    ``sliding_window_causal_mask_function(W)`` for the window part and
    ``chunked_causal_mask_function(A)`` (chunks from position 0) for the local phase."""
    masking = pytest.importorskip("transformers.masking_utils")
    w, chunk, page = 6, 8, 4
    cfg = PoolConfig(max_bs=4, max_context_len=C, page_size=page, device="cpu",
                     num_draft_tokens=ND, sliding_window=w, attention_chunk_size=chunk)
    pool = BufferPool(cfg, poison=True)
    rng = random.Random(int(verify))
    full, _ = _tables(page, rng)
    k, v = _cache(page)
    seq = [rng.randint(1, C - ND) for _ in range(3)]
    rows = rng.sample(range(ROWS), 3)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    inputs = {"seq_lens": t(seq), "req_pool_indices": t(rows), "req_to_token": full}
    qpos = [[s + j for j in range(ND)] if verify else [s - 1] for s in seq]
    window = (pool.verify.update_(4, **inputs).window if verify
              else pool.decode.update_(4, **inputs).window)
    local = pool.local.update_(4, **inputs, for_phase=Phase.VERIFY if verify else Phase.DECODE)
    pad = torch.zeros(1, dtype=torch.int64)
    for part, fn in ((window, masking.sliding_window_causal_mask_function(w)),
                     (local, masking.chunked_causal_mask_function(chunk, pad))):
        flat = [(i, p) for i, ps in enumerate(qpos) for p in ps]
        zero = torch.tensor(0)
        keys = [[int(full[rows[i], kk]) for kk in range(p + 1)
                 if bool(fn(zero, zero, torch.tensor(p), torch.tensor(kk)))] for i, p in flat]
        total = int(part.cu_seqlens_q[part.bs])
        x = torch.randn(max(total, len(flat)), H, D, dtype=torch.float64)
        want, _ = dense_attention(x, k, v, keys)
        got = sdpa.attention_out(part, x, k, v)
        torch.testing.assert_close(got[: len(flat)], want, rtol=1e-10, atol=1e-10)


def test_flash_attn_2_refuses_the_draft_extend_window_part() -> None:
    """The window part has its phase's class, so FA2 refuses rows of varying query counts in
    it as in the full part."""
    cfg = PoolConfig(max_bs=2, max_context_len=1024, page_size=256, device="cpu",
                     num_draft_tokens=ND, sliding_window=300)
    view = BufferPool(cfg).draft_extend.view(2)
    assert type(view.window) is type(view)
    k = torch.zeros(6, 256, H_KV, D, dtype=torch.bfloat16)
    fa2 = fa.fa2_kwargs  # (the full part is refused for the same reason)
    for part in (view, view.window):
        with pytest.raises(LayoutError, match="same query count"):
            fa2(part, torch.zeros(2 * ND, H, D, dtype=torch.bfloat16), k, k)
