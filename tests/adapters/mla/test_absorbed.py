"""Absorbed MLA over a latent KVCachePool == the expanded per-head computation.

Each test fills a poison-mode pool's phase from a random batch (padded rows: ``bs > n``), stores
random latents (``c_kv``, ``k_pe``) for exactly the token slots the batch's rows read in a
poison-mode latent :class:`KVCachePool` (every other slot is NaN), and checks, in float64:

    unabsorb_out(mla.attention(view, absorb_q(q_nope, W_UK), kv_cache, shape, q_pe=q_pe), W_UV)
    == dense attention of [q_nope | q_pe] over the expanded keys [c_kv W_UK^T | k_pe] and
       values c_kv W_UV,

where the dense oracle (:func:`tests.helpers.dense.dense_attention`) is given each query's key
slots straight from ``req_to_token`` and the phase's definition, never from the view. The two
sides differ only in the order of float64 sums (the absorbed dot product runs over ``L + R``
products, the expanded one over ``nope + rope``), so they agree to ~1e-14; 1e-12 is the bound.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import BufferPool, Impl, InputError, Layout, LayoutError, PagedView, PoolConfig
from attnpool.adapters import mla
from attnpool.adapters.mla import fa4 as mla_fa4
from attnpool.adapters.mla import flashinfer as mla_fi
from attnpool.adapters.mla.absorb import absorb_q, expand_kv, split_kv_b_proj, unabsorb_out
from attnpool.kv import KVCachePool
from attnpool.kv.mla_shape import MLAShape

from tests.helpers.batches import Batch, make_batch
from tests.helpers.dense import dense_attention
from tests.helpers.fakes_fa4_mla import FA4
from tests.helpers.fakes_flashinfer_mla import BatchMLAPagedAttentionWrapper as FakeMLA

SHAPE = MLAShape(num_heads=4, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                 kv_lora_rank=16)
C, ND, TOPK, STEPS, T_EXT = 128, 4, 3, 3, 40
TOL = 1e-12
F64 = torch.float64


def _pool(page: int, **kw: Any) -> BufferPool:
    cfg = PoolConfig(max_bs=6, max_context_len=C, page_size=page, device="cpu",
                     layout=Layout.BOTH, pad_page=0, **kw)
    return BufferPool(cfg, poison=True)


def _row(b: Batch, i: int, lo: int, hi: int) -> list[int]:
    return [int(x) for x in b.req_to_token[b.slots[i], lo:hi]]


class Model:
    """One MLA layer's weights and its latent cache, plus the expanded cache they imply."""

    def __init__(self, table: Tensor, page: int, slots: Sequence[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        s = SHAPE
        pages = int(table.max()) // page + 2
        self.pool = KVCachePool(s.latent_config(pages, page, dtype=F64, max_tokens=8),
                                poison=True)
        used = sorted(set(slots))
        lat = torch.randn(len(used), s.kv_lora_rank, generator=g, dtype=F64)
        pe = torch.randn(len(used), s.qk_rope_head_dim, generator=g, dtype=F64)
        self.pool.store_mla_(0, lat, pe, torch.tensor(used), impl=Impl.REFERENCE)
        w = torch.randn(s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank,
                        generator=g, dtype=F64) / s.kv_lora_rank ** 0.5
        self.w_uk, self.w_uv = split_kv_b_proj(w, s)
        row = self.pool.kv_cache(0).reshape(-1, s.latent_row)
        k, v = expand_kv(row[:, : s.kv_lora_rank], row[:, s.kv_lora_rank:], self.w_uk,
                         self.w_uv)
        self.k_exp = k.view(pages, page, s.num_heads, -1)
        self.v_exp = v.view(pages, page, s.num_heads, -1)
        self.gen = g

    def queries(self, total: int) -> tuple[Tensor, Tensor]:
        s = SHAPE
        return (torch.randn(total, s.num_heads, s.qk_nope_head_dim, generator=self.gen,
                            dtype=F64),
                torch.randn(total, s.num_heads, s.qk_rope_head_dim, generator=self.gen,
                            dtype=F64))


def _layouts(view: object) -> list[Layout]:
    parts = [view] if isinstance(view, PagedView) else [view.prefix, view.expand]  # type: ignore[attr-defined]
    parts = [p for p in parts if p is not None]
    out = []
    if all(p.page_table is not None for p in parts):
        out.append(Layout.FLASH_ATTN)
    if all(p.kv_indptr is not None for p in parts):
        out.append(Layout.FLASHINFER)
    return out


def _check(view: object, m: Model, total: int, keys: Sequence[Sequence[int]],
           layouts: int = 2) -> None:
    q_nope, q_pe = m.queries(total)
    want_o, want_lse = dense_attention(torch.cat((q_nope, q_pe), -1), m.k_exp, m.v_exp, keys,
                                       softmax_scale=SHAPE.softmax_scale)
    q_lat = absorb_q(q_nope, m.w_uk)
    kv = m.pool.kv_cache(0)
    lays = _layouts(view)
    assert len(lays) == layouts
    n = len(keys)
    for lay in lays:
        got = mla.attention(view, q_lat, kv, SHAPE, q_pe=q_pe, layout=lay)
        assert got.out.shape == (total, SHAPE.num_heads, SHAPE.kv_lora_rank)
        assert torch.isfinite(got.out).all(), lay  # padded rows too (never a NaN page lane)
        o = unabsorb_out(got.out, m.w_uv)
        torch.testing.assert_close(o[:n], want_o, atol=TOL, rtol=0, msg=str(lay))
        torch.testing.assert_close(got.lse[:n].double(), want_lse, atol=1e-5, rtol=0)
        # the packed query is the same computation, bit for bit
        packed = mla.attention(view, torch.cat((q_lat, q_pe), -1), kv, SHAPE, layout=lay)
        assert torch.equal(packed.out, got.out) and torch.equal(packed.lse, got.lse)
        # the SDPA-only output path agrees (another summation order)
        out = mla.attention_out(view, q_lat, kv, SHAPE, q_pe=q_pe, layout=lay)
        torch.testing.assert_close(unabsorb_out(out, m.w_uv)[:n], want_o, atol=TOL, rtol=0)


PAGES = [1, 64]
SIZES = [(3, 5), (1, 1), (6, 6)]  # (n, bs)


@pytest.mark.parametrize("n, bs", SIZES)
@pytest.mark.parametrize("page", PAGES)
def test_decode(page: int, n: int, bs: int) -> None:
    pool = _pool(page)
    b = make_batch(pool.cfg, n, random.Random(page + n))
    view = pool.decode.update_(bs, **b.inputs())
    pool.check(view)
    keys = [_row(b, i, 0, b.seq_lens[i]) for i in range(n)]
    m = Model(b.req_to_token, page, [s for k in keys for s in k], 1)
    _check(view, m, bs, keys)


@pytest.mark.parametrize("topk", [1, TOPK])
@pytest.mark.parametrize("n, bs", SIZES)
@pytest.mark.parametrize("page", PAGES)
def test_verify(page: int, n: int, bs: int, topk: int) -> None:
    pool = _pool(page, num_draft_tokens=ND, topk=topk)
    rng = random.Random(7 * page + n + topk)
    b = make_batch(pool.cfg, n, rng, extra=ND)
    mask = None
    if topk > 1:  # random trees: ancestors and self
        mask = torch.zeros(n, ND, ND, dtype=torch.bool)
        for i in range(n):
            parent = [-1] + [rng.randrange(-1, j) for j in range(1, ND)]
            for j in range(ND):
                k = j
                while k >= 0:
                    mask[i, j, k] = True
                    k = parent[k]
    view = pool.verify.update_(bs, **b.inputs(), tree_mask=mask)
    pool.check(view)
    keys = []
    for i, length in enumerate(b.seq_lens):
        for j in range(ND):
            if mask is None:
                keys.append(_row(b, i, 0, length + j + 1))
            else:
                drafts = [_row(b, i, length + kk, length + kk + 1)[0] for kk in range(ND)
                          if mask[i, j, kk]]
                keys.append(_row(b, i, 0, length) + drafts)
    m = Model(b.req_to_token, page, [s for k in keys for s in k], 2)
    _check(view, m, bs * ND, keys)


@pytest.mark.parametrize("n, bs", SIZES)
@pytest.mark.parametrize("page", PAGES)
def test_extend_with_cached_prefix(page: int, n: int, bs: int) -> None:
    pool = _pool(page, max_extend_tokens=T_EXT)
    rng = random.Random(11 * page + n)
    b = make_batch(pool.cfg, n, rng)
    budget, ext = T_EXT, []
    for length in b.seq_lens:  # some rows extend a cached prefix, some prefill from 0
        e = max(1, min(length, budget - (n - len(ext) - 1), rng.choice([1, length, 7])))
        ext.append(e)
        budget -= e
    seq, rpi, table = b.tensors()
    view = pool.extend.update_(bs, seq_lens=seq, extend_lens=torch.tensor(ext),
                               req_pool_indices=rpi, req_to_token=table)
    pool.check(view)
    keys = [_row(b, i, 0, length - e + j + 1)
            for i, (length, e) in enumerate(zip(b.seq_lens, ext, strict=True)) for j in range(e)]
    assert any(length > e for length, e in zip(b.seq_lens, ext, strict=True)) or n == 1
    m = Model(b.req_to_token, page, [s for k in keys for s in k], 3)
    _check(view, m, T_EXT, keys)


@pytest.mark.parametrize("page", PAGES)
def test_draft_steps_and_draft_extend(page: int) -> None:
    pool = _pool(page, num_draft_tokens=ND, spec_steps=STEPS)
    rng = random.Random(13 + page)
    n, bs = 3, 5
    b = make_batch(pool.cfg, n, rng, extra=max(STEPS, ND))
    view = pool.draft.update_(bs, **b.inputs())
    keys_all = [_row(b, i, 0, b.seq_lens[i] + max(STEPS, ND)) for i in range(n)]
    m = Model(b.req_to_token, page, [s for k in keys_all for s in k], 4)
    for sv in view.steps:
        _check(sv, m, bs, [_row(b, i, 0, b.seq_lens[i] + sv.step) for i in range(n)],
               layouts=1)
    acc = [rng.randint(1, ND) for _ in range(n)]
    seq = [length + a for length, a in zip(b.seq_lens, acc, strict=True)]
    _, rpi, table = b.tensors()
    de = pool.draft_extend.update_(bs, seq_lens=torch.tensor(seq), accept_lens=torch.tensor(acc),
                                   req_pool_indices=rpi, req_to_token=table)
    keys = [_row(b, i, 0, length - a + j + 1)
            for i, (length, a) in enumerate(zip(seq, acc, strict=True)) for j in range(a)]
    _check(de, m, int(de.cu_seqlens_q[bs]), keys)


def test_plan_once_per_forward() -> None:
    """``plan`` + ``run_plan`` (what a forward over many layers does) == ``attention_out``."""
    pool = _pool(16)
    b = make_batch(pool.cfg, 4, random.Random(5))
    view = pool.decode.update_(6, **b.inputs())
    keys = [_row(b, i, 0, b.seq_lens[i]) for i in range(4)]
    m = Model(b.req_to_token, 16, [s for k in keys for s in k], 6)
    q_nope, q_pe = m.queries(6)
    q_lat = absorb_q(q_nope, m.w_uk)
    pl = mla.plan(view, num_q=6, shape=SHAPE)
    kv = m.pool.kv_cache(0)
    got = mla.run_plan(pl, q_lat, kv, SHAPE, q_pe=q_pe)
    assert torch.equal(got, mla.attention_out(view, q_lat, kv, SHAPE, q_pe=q_pe))


def test_values_are_a_view_of_the_cache() -> None:
    kv = KVCachePool(SHAPE.latent_config(4, 4, dtype=F64)).kv_cache(0)
    k, v = mla.latent_kv(kv, SHAPE)
    assert k is kv and v.data_ptr() == kv.data_ptr() and v.shape[-1] == SHAPE.kv_lora_rank
    assert v.stride() == kv.stride()


def test_scale_is_the_unabsorbed_heads() -> None:
    assert SHAPE.softmax_scale == 1 / math.sqrt(8 + 4)
    v3 = MLAShape(128, 128, 64, 128, 512)
    assert v3.softmax_scale == 1 / math.sqrt(192) and v3.latent_row == 576


def test_refusals() -> None:
    pool = _pool(4)
    b = make_batch(pool.cfg, 2, random.Random(0))
    view = pool.decode.update_(2, **b.inputs())
    kv = KVCachePool(SHAPE.latent_config(80, 4, dtype=F64)).kv_cache(0)
    q = torch.zeros(2, 4, SHAPE.latent_row, dtype=F64)
    with pytest.raises(InputError, match=r"latent cache \[num_pages, page_size, 1, 20\]"):
        mla.attention(view, q, kv[..., :16], SHAPE)
    with pytest.raises(InputError, match=r"packed absorbed query must be \[T, 4, 20\]"):
        mla.attention(view, q[..., :16], kv, SHAPE)
    with pytest.raises(InputError, match=r"q_pe must be \[2, 4, 4\]"):
        mla.attention(view, q[..., :16], kv, SHAPE, q_pe=q[..., :3])
    with pytest.raises(InputError, match="q must be"):
        mla.attention(view, q[:, :2], kv, SHAPE)
    with pytest.raises(InputError, match="MLAShape"):
        mla.attention(view, q, kv, (4, 8, 4, 6, 16))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="kv_b_proj weight must be a floating tensor of shape"):
        split_kv_b_proj(torch.zeros(4 * 14, 15), SHAPE)


# ---- FlashInfer's MLA wrapper (a fake built from its source: fakes_flashinfer_mla.py) ----------
F32 = torch.float32


def _fi(shape: MLAShape = SHAPE) -> mla_fi.MLAGraphWrappers:
    return mla_fi.MLAGraphWrappers(torch.zeros(256, dtype=torch.uint8), shape,
                                   wrapper_cls=FakeMLA)


@pytest.mark.parametrize("phase", ["decode", "chain", "tree", "draft_extend"])
@pytest.mark.parametrize("page", [1, 16])
def test_flashinfer_wrapper_matches_sdpa(page: int, phase: str) -> None:
    topk = TOPK if phase == "tree" else 1
    pool = _pool(page, num_draft_tokens=ND, topk=topk)
    rng = random.Random(page * 31 + len(phase))
    n, bs = 3, 5
    b = make_batch(pool.cfg, n, rng, extra=ND)
    mask = None
    if phase == "tree":
        mask = torch.tril(torch.ones(ND, ND, dtype=torch.bool))[None].repeat(n, 1, 1)
        mask[:, 2, 1] = False  # draft 2 branches from draft 0
    w = _fi()
    if phase == "decode":
        views = [pool.decode.view(bs)]
        update: Any = lambda: pool.decode.update_(bs, **b.inputs())  # noqa: E731
    elif phase == "draft_extend":
        views = [pool.draft_extend.view(bs)]
        acc = [rng.randint(1, ND) for _ in range(n)]
        seq = torch.tensor([s + a for s, a in zip(b.seq_lens, acc, strict=True)])
        _, rpi, table = b.tensors()
        update = lambda: pool.draft_extend.update_(  # noqa: E731
            bs, seq_lens=seq, accept_lens=torch.tensor(acc), req_pool_indices=rpi,
            req_to_token=table)
    else:
        cap = pool.verify.view(bs)
        views = [p for p in (cap.prefix, cap.expand) if p is not None]
        update = lambda: pool.verify.update_(bs, **b.inputs(), tree_mask=mask)  # noqa: E731
    for v in views:  # before capture: one wrapper per part, on the part's buffers
        wr = w.wrapper(v)
        assert wr._kv_indptr_buf.data_ptr() == v.kv_indptr.data_ptr()
        assert wr._kv_indices_buf.data_ptr() == v.kv_indices.data_ptr()
        assert wr._qo_indptr_buf.data_ptr() == v.cu_seqlens_q.data_ptr()
    assert len(w) == len(views)
    view = update()
    parts = [view] if isinstance(view, PagedView) else [p for p in (view.prefix, view.expand)
                                                         if p is not None]
    for part in parts:
        w.plan(part, q_dtype=F32)
    keys_slots = [s for i in range(n) for s in _row(b, i, 0, b.seq_lens[i] + ND)]
    m = Model(b.req_to_token, page, keys_slots, 9)
    kv = m.pool.kv_cache(0).float()  # (a copy: float32 for the fake's dtype checks)
    total = int(parts[0].cu_seqlens_q[bs]) if phase != "decode" else bs
    q = torch.randn(total, SHAPE.num_heads, SHAPE.latent_row, dtype=F32)
    got = w.attention(view, q, kv)
    want = mla.attention(view, q, kv, SHAPE, layout=Layout.FLASHINFER)
    rows = int(view.cu_seqlens_q[n]) if isinstance(view, PagedView) else n * ND
    torch.testing.assert_close(got.out[:rows], want.out[:rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.lse[:rows], want.lse[:rows].float(), atol=1e-5, rtol=1e-5)
    # the split query form is the same call; the caches are views of the pool's row
    got2 = w.attention(view, q[..., :16], kv, q_pe=q[..., 16:])
    assert torch.equal(got2.out, got.out)
    wr = w.wrapper(parts[0])
    call = wr.runs[-1]
    assert call["ckv_cache"].data_ptr() == kv.data_ptr()
    assert call["kpe_cache"].data_ptr() == kv.data_ptr() + 16 * kv.element_size()


def test_flashinfer_kv_len_of_padded_rows_is_zero() -> None:
    """Padded rows own no CSR pages: their kv_len_arr entry is 0, not pad_seq_len (a kernel
    would read pages past the row's own)."""
    pool = _pool(4)
    b = make_batch(pool.cfg, 2, random.Random(3))
    w = _fi()
    w.wrapper(pool.decode.view(4))
    view = pool.decode.update_(4, **b.inputs())
    w.plan(view, q_dtype=F32)
    wr = w.wrapper(view)
    assert wr._kv_len_arr_buf.tolist() == [*b.seq_lens, 0, 0]
    assert view.cache_seqlens.tolist()[2:] == [1, 1]  # what the page-table layout pads with
    # a wrapper fed cache_seqlens instead reads pages the padded rows do not own
    wr.plan(qo_indptr=view.cu_seqlens_q, kv_indptr=view.kv_indptr, kv_indices=view.kv_indices,
            kv_len_arr=view.cache_seqlens.clone(), num_heads=4, head_dim_ckv=16,
            head_dim_kpe=4, page_size=4, causal=False, sm_scale=1.0, q_data_type=F32,
            kv_data_type=F32)
    kv = KVCachePool(SHAPE.latent_config(int(b.req_to_token.max()) // 4 + 2, 4, dtype=F32)
                     ).kv_cache(0)
    with pytest.raises(RuntimeError, match=r"kv_len_arr\[2\] = 1 needs 1 pages, the row owns 0"):
        wr.run(q_nope=torch.zeros(4, 4, 16), q_pe=torch.zeros(4, 4, 4), ckv_cache=kv[:, :, 0, :16],
               kpe_cache=kv[:, :, 0, 16:])


def test_flashinfer_refusals() -> None:
    pool = _pool(4, sliding_window=8)
    b = make_batch(pool.cfg, 2, random.Random(4))
    w = _fi()
    view = pool.decode.update_(2, **b.inputs())
    with pytest.raises(LayoutError, match="no wrapper was created"):
        w.plan(view, q_dtype=F32)
    w.wrapper(view)
    kv = KVCachePool(SHAPE.latent_config(80, 4, dtype=F32)).kv_cache(0)
    with pytest.raises(LayoutError, match="never planned"):
        w.run(view, torch.zeros(2, 4, 20), kv)
    with pytest.raises(LayoutError, match="no sliding window"):
        w.wrapper(view.window)
    w.plan(view, q_dtype=F32)
    with pytest.raises(InputError, match="at least the 2 query rows"):
        w.run(view, torch.zeros(1, 4, 20), kv)
    pt_only = BufferPool(PoolConfig(max_bs=2, max_context_len=C, page_size=4, device="cpu",
                                    layout=Layout.FLASH_ATTN), poison=True)
    v2 = pt_only.decode.update_(2, **b.inputs())
    with pytest.raises(LayoutError, match="reads CSR page lists"):
        w.wrapper(v2)
    # the fake's own checks, as FlashInfer makes them
    with pytest.raises(ValueError, match="reserved kv_len_arr buffer has insufficient"):
        FakeMLA(torch.zeros(8), use_cuda_graph=True, qo_indptr=view.cu_seqlens_q,
                kv_indptr=view.kv_indptr, kv_indices=view.kv_indices,
                kv_len_arr=torch.zeros(3, dtype=torch.int32)).plan(
            view.cu_seqlens_q, view.kv_indptr, view.kv_indices, torch.zeros(2, dtype=torch.int32),
            4, 16, 4, 4, False, 1.0, F32, F32)


# ---- flash-attn 4's qv path (a fake built from its source: fakes_fa4_mla.py) -------------------
V3ISH = MLAShape(num_heads=2, qk_nope_head_dim=8, qk_rope_head_dim=64, v_head_dim=6,
                 kv_lora_rank=512)  # flash-attn 4's qv path takes rope 64 / latent 512 only


@pytest.mark.parametrize("phase", ["decode", "chain", "tree"])
def test_fa4_qv_matches_sdpa(phase: str) -> None:
    page = 16
    pool = _pool(page, num_draft_tokens=ND, topk=TOPK if phase == "tree" else 1)
    rng = random.Random(len(phase))
    n, bs = 3, 4
    b = make_batch(pool.cfg, n, rng, extra=ND)
    if phase == "decode":
        view: Any = pool.decode.update_(bs, **b.inputs())
        total = bs
    else:
        mask = None
        if phase == "tree":
            mask = torch.tril(torch.ones(ND, ND, dtype=torch.bool))[None].repeat(n, 1, 1)
            mask[:, 3, 2] = False
        view = pool.verify.update_(bs, **b.inputs(), tree_mask=mask)
        total = bs * ND
    pages = int(b.req_to_token.max()) // page + 2
    kvp = KVCachePool(V3ISH.latent_config(pages, page, dtype=torch.bfloat16, max_tokens=8))
    g = torch.Generator().manual_seed(3)
    slots = torch.arange(page, pages * page)
    kvp.store_mla_(0, torch.randn(len(slots), 512, generator=g).bfloat16(),
                   torch.randn(len(slots), 64, generator=g).bfloat16(), slots,
                   impl=Impl.REFERENCE)
    kv = kvp.kv_cache(0)
    q = (torch.randn(total, 2, 576, generator=g) / 8).bfloat16()
    fake = FA4()
    got = mla_fa4.attention(view, q, kv, V3ISH, fn=fake.flash_attn_varlen_func)
    want = mla.attention(view, q.float(), kv.float(), V3ISH)
    rows = n * (1 if phase == "decode" else ND)
    torch.testing.assert_close(got.out[:rows].float(), want.out[:rows].float(), atol=2e-2,
                               rtol=2e-2)
    torch.testing.assert_close(got.lse[:rows], want.lse[:rows].float(), atol=1e-3, rtol=1e-3)
    call = fake.calls[0]
    assert call["softmax_scale"] == V3ISH.softmax_scale  # never FA4's (64 + 512) ** -0.5
    assert call["v"].data_ptr() == kv.data_ptr()  # column views of the cache: no copy
    assert call["k"].data_ptr() == kv.data_ptr() + 512 * kv.element_size()
    assert call["page_table"].data_ptr() == (view if phase == "decode" else view.prefix
                                             ).page_table.data_ptr()


def test_fa4_refusals() -> None:
    fake = FA4()
    fi_only = BufferPool(PoolConfig(max_bs=2, max_context_len=C, page_size=16, device="cpu",
                                    layout=Layout.FLASHINFER, sliding_window=8), poison=True)
    b = make_batch(fi_only.cfg, 2, random.Random(1))
    view = fi_only.decode.update_(2, **b.inputs())
    kv = KVCachePool(V3ISH.latent_config(4, 16, dtype=torch.bfloat16)).kv_cache(0)
    q = torch.zeros(2, 2, 576, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="reads a page table"):
        mla_fa4.attention(view, q, kv, V3ISH, fn=fake.flash_attn_varlen_func)
    pool = _pool(16, sliding_window=8)
    view = pool.decode.update_(2, **make_batch(pool.cfg, 2, random.Random(1)).inputs())
    with pytest.raises(LayoutError, match="no sliding window"):
        mla_fa4.attention(view.window, q, kv, V3ISH, fn=fake.flash_attn_varlen_func)
    assert not fake.calls
    # the fake's own checks: Blackwell only, and FA4's head sizes for qv
    with pytest.raises(AssertionError, match="only support Blackwell arch with qv"):
        mla_fa4.attention(view, q, kv, V3ISH, fn=FA4(arch=90).flash_attn_varlen_func)
