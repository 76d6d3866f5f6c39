"""SDPA adapter end to end: paged attention over the pool's views == dense attention without pages.

Every test builds a poison-mode pool, refills a phase from a random batch (padded rows, GQA, page
sizes 1 and 16), runs :mod:`attnpool.adapters.sdpa` over the view in each layout it has, and
compares the real queries with :func:`dense.dense_attention`, which is given each query's KV token
slots straight from ``req_to_token`` and the phase's definition (docs/design.md, Phases), never
from the view.

Tolerance: the adapter computes in float32 and the oracle in float64. Rows attend to at most
C + N = 132 keys with D = 8 and unit-normal K/V, so softmax weights and outputs are O(1) and the
float32 rounding of a dot product, exp and weighted sum is a few ulp (~1e-7 each); 2e-5 absolute
leaves two orders of margin while still catching a single wrong or missing key (which moves an
output by ~1/L >= 1e-2).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpool import BufferPool, InputError, Layout, LayoutError, PagedView, Phase, PoolConfig
from attnpool.adapters.sdpa import (
    attention,
    attention_out,
    merge_by_lse,
    paged_attention,
    plan,
    run_plan,
)

from tests.helpers.batches import Batch, make_batch, tree_mask
from tests.helpers.dense import dense_attention

C, ND, TOPK, STEPS, D = 128, 4, 3, 3, 8
ATOL, RTOL = 2e-5, 1e-4
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADS = [(4, 2), (2, 2), (4, 1)]  # (H, H_kv): GQA, MHA, MQA
common = {
    "page": st.sampled_from([1, 16]),
    "heads": st.sampled_from(HEADS),
    "n": st.integers(1, 6),
    "pad": st.integers(0, 3),
    "host": st.booleans(),
    "seed": st.integers(0, 2**16),
    "pad_seq_len": st.sampled_from([1, 3]),
}


def _pool(page: int, pad_seq_len: int = 1, **kw: object) -> BufferPool:
    cfg = PoolConfig(max_bs=6, max_context_len=C, page_size=page, device="cpu",
                     layout=Layout.BOTH, pad_seq_len=pad_seq_len, pad_page=2, **kw)  # type: ignore[arg-type]
    return BufferPool(cfg, poison=True)


def _sizes(n: int, pad: int) -> tuple[int, int]:
    bs = min(6, n + pad)
    return min(n, bs), bs


def _kv(table: torch.Tensor, page: int, h_kv: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache big enough for every slot in ``table``, random K/V (the pad page included)."""
    tokens = int(table.max()) + 1
    pages = -(-tokens // page) + 1
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(pages, page, h_kv, D, generator=g),
            torch.randn(pages, page, h_kv, D, generator=g))


def _q(total: int, h: int, seed: int) -> torch.Tensor:
    return torch.randn(total, h, D, generator=torch.Generator().manual_seed(seed + 1))


def _layouts(view: object) -> list[Layout]:
    """The layouts every paged part of ``view`` carries."""
    parts = [view] if isinstance(view, PagedView) else [view.prefix, view.expand]  # type: ignore[attr-defined]
    parts = [p for p in parts if p is not None]
    out = []
    if all(p.page_table is not None for p in parts):
        out.append(Layout.FLASH_ATTN)
    if all(p.kv_indptr is not None for p in parts):
        out.append(Layout.FLASHINFER)
    return out


def _check(view: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           keys: Sequence[Sequence[int]], layouts: int = 2) -> None:
    """The adapter over ``view`` matches dense attention for the first ``len(keys)`` queries, in
    every layout its parts carry (``layouts`` of them); every output is finite."""
    want_o, want_lse = dense_attention(q, k, v, keys)
    layouts_ = _layouts(view)
    assert len(layouts_) == layouts
    for lay in layouts_:
        got = attention(view, q, k, v, layout=lay)
        assert got.out.shape == q.shape and got.lse.shape == q.shape[:2]
        assert torch.isfinite(got.out).all(), lay  # padded rows too: nothing to poison a model
        m = len(keys)
        torch.testing.assert_close(got.out[:m].double(), want_o, atol=ATOL, rtol=RTOL, msg=str(lay))
        torch.testing.assert_close(got.lse[:m].double(), want_lse, atol=ATOL, rtol=RTOL)
        # the output alone (a tree: one pass over prefix and expand lanes, sdpa.tree), and a
        # plan built once with the additive mask, as every layer of a forward reads it
        out = attention_out(view, q, k, v, layout=lay)
        h, h_kv = q.shape[1], k.shape[2]
        pl = plan(view, num_q=q.shape[0], num_heads=h, num_kv_heads=h_kv, layout=lay,  # type: ignore[arg-type]
                  dtype=q.dtype)
        for o in (out, run_plan(pl, q, k, v)):
            assert o.shape == q.shape and torch.isfinite(o).all(), lay
            torch.testing.assert_close(o[:m].double(), want_o, atol=ATOL, rtol=RTOL)


def _row(b: Batch, i: int, lo: int, hi: int) -> list[int]:
    return [int(x) for x in b.req_to_token[b.slots[i], lo:hi]]


def _total_q(part: PagedView) -> int:
    return int(part.cu_seqlens_q[part.bs])


@SETTINGS
@given(**common)
def test_decode(page: int, heads: tuple[int, int], n: int, pad: int, host: bool, seed: int,
                pad_seq_len: int) -> None:
    pool = _pool(page, pad_seq_len)
    n, bs = _sizes(n, pad)
    b = make_batch(pool.cfg, n, random.Random(seed))
    view = pool.decode.update_(bs, **b.inputs(), seq_lens_cpu=b.seq_lens if host else None)
    pool.check(view)
    k, v = _kv(b.req_to_token, page, heads[1], seed)
    q = _q(bs, heads[0], seed)
    _check(view, q, k, v, [_row(b, i, 0, b.seq_lens[i]) for i in range(n)])


@SETTINGS
@given(**common, topk=st.sampled_from([1, TOPK]))
def test_verify(page: int, heads: tuple[int, int], n: int, pad: int, host: bool, seed: int,
                pad_seq_len: int, topk: int) -> None:
    pool = _pool(page, pad_seq_len, num_draft_tokens=ND, topk=topk)
    n, bs = _sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(pool.cfg, n, rng, extra=ND)
    mask = tree_mask(n, ND, rng) if topk > 1 else None
    view = pool.verify.update_(bs, **b.inputs(), seq_lens_cpu=b.seq_lens if host else None,
                               tree_mask=mask)
    pool.check(view)
    keys = []
    for i, length in enumerate(b.seq_lens):
        for j in range(ND):
            if mask is None:  # chain: causal over the prefix and drafts 0..j
                keys.append(_row(b, i, 0, length + j + 1))
            else:  # tree: the prefix, then the drafts the mask allows
                drafts = [_row(b, i, length + kk, length + kk + 1)[0] for kk in range(ND)
                          if mask[i, j, kk]]
                keys.append(_row(b, i, 0, length) + drafts)
    k, v = _kv(b.req_to_token, page, heads[1], seed)
    _check(view, _q(bs * ND, heads[0], seed), k, v, keys)


@SETTINGS
@given(**common, topk=st.sampled_from([1, 2]))
def test_draft_steps(page: int, heads: tuple[int, int], n: int, pad: int, host: bool, seed: int,
                     pad_seq_len: int, topk: int) -> None:
    pool = _pool(page, pad_seq_len, spec_steps=STEPS, topk=topk)
    n, bs = _sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(pool.cfg, n, rng, extra=STEPS)
    k, v = _kv(b.req_to_token, page, heads[1], seed)
    tokens = k.shape[0] * page
    loc = None
    if topk > 1:
        loc = torch.tensor([rng.randrange(page, tokens) for _ in range(n * STEPS * topk)],
                           dtype=torch.int64).view(n, STEPS, topk)
    view = pool.draft.update_(bs, **b.inputs(), seq_lens_cpu=b.seq_lens if host else None,
                              out_cache_loc=loc)
    pool.check(view)
    q = _q(bs * topk, heads[0], seed)
    for sv in view.steps:
        d = sv.step
        if loc is None:  # chain: decode over seq_len + d (drafts read from req_to_token)
            keys = [_row(b, i, 0, b.seq_lens[i] + d) for i in range(n)]
        else:  # tree: the prefix plus branch k's first d drafts
            keys = [_row(b, i, 0, b.seq_lens[i]) + [int(x) for x in loc[i, :d, kk]]
                    for i in range(n) for kk in range(topk)]
        _check(sv, q, k, v, keys, layouts=1 if loc is None else 2)


@SETTINGS
@given(**common)
def test_draft_extend(page: int, heads: tuple[int, int], n: int, pad: int, host: bool,
                      seed: int, pad_seq_len: int) -> None:
    pool = _pool(page, pad_seq_len, num_draft_tokens=ND)
    n, bs = _sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(pool.cfg, n, rng)
    acc = [rng.randint(1, min(ND, s)) for s in b.seq_lens]
    seq, rpi, table = b.tensors()
    view = pool.draft_extend.update_(bs, seq_lens=seq, accept_lens=torch.tensor(acc),
                                     req_pool_indices=rpi, req_to_token=table,
                                     seq_lens_cpu=b.seq_lens if host else None,
                                     accept_lens_cpu=acc if host else None)
    pool.check(view)
    keys = [_row(b, i, 0, length - a + j + 1)
            for i, (length, a) in enumerate(zip(b.seq_lens, acc, strict=True)) for j in range(a)]
    k, v = _kv(b.req_to_token, page, heads[1], seed)
    _check(view, _q(_total_q(view), heads[0], seed), k, v, keys)


def _encoder_table(cfg: PoolConfig, enc: list[int], rng: random.Random) -> torch.Tensor:
    """Rows whose encoder tokens fill pages from column 0 and whose decoder tokens start on a
    fresh page at column ``enc[r]`` (what the encoder phase asks of engines when P > 1)."""
    p = cfg.page_size
    ids = list(range(1, len(enc) * (cfg.max_pages + 2) + 1))
    rng.shuffle(ids)
    rows = []
    for r, e in enumerate(enc):
        own = ids[r * (cfg.max_pages + 2):(r + 1) * (cfg.max_pages + 2)]
        ne = -(-e // p)
        cols = [own[c // p] * p + c % p for c in range(e)]
        cols += [own[ne + j // p] * p + j % p for j in range(cfg.max_context_len - e)]
        rows.append(cols)
    return torch.tensor(rows, dtype=torch.int32)


@SETTINGS
@given(**common)
def test_encoder(page: int, heads: tuple[int, int], n: int, pad: int, host: bool, seed: int,
                 pad_seq_len: int) -> None:
    max_enc = 40
    pool = _pool(page, pad_seq_len, max_encoder_len=max_enc)
    n, bs = _sizes(n, pad)
    rng = random.Random(seed)
    slots = 12
    enc_all = [rng.choice([0, 1, max_enc, rng.randint(1, max_enc)]) for _ in range(slots)]
    table = _encoder_table(pool.cfg, enc_all, rng)
    chosen = rng.sample(range(slots), n)
    enc = [enc_all[s] for s in chosen]
    lens = [rng.randint(1, C - e) for e in enc]
    b = Batch(lens, chosen, table)
    seq, rpi, tab = b.tensors()
    view = pool.encoder.update_(bs, seq_lens=seq, encoder_lens=torch.tensor(enc), req_pool_indices=rpi,
                                req_to_token=tab,
                                seq_lens_cpu=lens if host else None,
                                encoder_lens_cpu=enc if host else None)
    pool.check(view)
    k, v = _kv(table, page, heads[1], seed)
    q = _q(bs, heads[0], seed)
    _check(view.cross, q, k, v, [_row(b, i, 0, enc[i]) for i in range(n)])
    _check(view.decoder, q, k, v,
           [_row(b, i, enc[i], enc[i] + lens[i]) for i in range(n)])


@SETTINGS
@given(**common, verify=st.booleans())
def test_local(page: int, heads: tuple[int, int], n: int, pad: int, host: bool, seed: int,
               pad_seq_len: int, verify: bool) -> None:
    chunk = 8 if page == 1 else 32
    pool = _pool(page, pad_seq_len, num_draft_tokens=ND, attention_chunk_size=chunk)
    n, bs = _sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(pool.cfg, n, rng, extra=ND)
    view = pool.local.update_(bs, **b.inputs(), for_phase=Phase.VERIFY if verify else Phase.DECODE,
                              seq_lens_cpu=b.seq_lens if host else None)
    pool.check(view)
    keys = []
    for i, length in enumerate(b.seq_lens):
        positions = range(length, length + ND) if verify else [length - 1]
        keys += [_row(b, i, (p // chunk) * chunk, p + 1) for p in positions]
    k, v = _kv(b.req_to_token, page, heads[1], seed)
    _check(view, _q(bs * (ND if verify else 1), heads[0], seed), k, v, keys)


def test_capture_view_runs_before_any_update() -> None:
    """Warmup/capture runs attention on view(bs) before any real batch: finite, no error."""
    pool = _pool(16, 3, num_draft_tokens=ND, topk=TOPK)
    k = torch.randn(8, 16, 2, D)
    for view in (pool.decode.view(4), pool.verify.view(4)):
        for lay in _layouts(view):
            got = attention(view, _q(4 * ND, 4, 0), k, k, layout=lay)
            assert torch.isfinite(got.out).all()


def test_q_with_only_the_real_rows() -> None:
    """Queries past q's end (padded rows' positions) are skipped; real rows are unchanged."""
    pool = _pool(16)
    b = make_batch(pool.cfg, 3, random.Random(4))
    view = pool.decode.update_(6, **b.inputs())
    k, v = _kv(b.req_to_token, 16, 2, 4)
    q = _q(6, 4, 4)
    full = paged_attention(view, q, k, v)
    part = paged_attention(view, q[:3], k, v)
    assert part.out.shape == (3, 4, D)
    torch.testing.assert_close(part.out, full.out[:3], atol=0, rtol=0)
    torch.testing.assert_close(part.lse, full.lse[:3], atol=0, rtol=0)


# ---- merge_by_lse -------------------------------------------------------------------------------


def _slot_view(rows: list[list[int]], causal: bool = False) -> PagedView:
    """A hand-made token-slot view (page_size 1), one query per row, FLASH_ATTN layout."""
    bs, width = len(rows), max(1, *(len(r) for r in rows))
    table = torch.zeros(bs, width, dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    return PagedView(bs=bs, cache_seqlens=lens, cu_seqlens_q=torch.arange(bs + 1, dtype=torch.int32),
                     cu_seqlens_k=cu_k, page_table=table, kv_indptr=None, kv_indices=None,
                     kv_last_page_len=None, max_seqlen_q=1, max_seqlen_k=width, page_size=1,
                     causal=causal)


@pytest.mark.parametrize("seed", range(4))
def test_merge_two_passes_equals_one(seed: int) -> None:
    """A row's keys split at a random point (possibly empty on one side), two passes merged by
    log-sum-exp, equal one pass over all of them."""
    rng = random.Random(seed)
    k = torch.randn(50, 4, 2, D)  # 200 slots, paged by 4
    v = torch.randn(50, 4, 2, D)
    rows = [rng.sample(range(200), rng.randint(1, 40)) for _ in range(5)]
    cut = [rng.choice([0, len(r), rng.randint(0, len(r))]) for r in rows]
    q = _q(5, 4, seed)
    one = paged_attention(_slot_view(rows), q, k, v)
    a = paged_attention(_slot_view([r[:c] for r, c in zip(rows, cut, strict=True)]), q, k, v)
    b = paged_attention(_slot_view([r[c:] for r, c in zip(rows, cut, strict=True)]), q, k, v)
    merged = merge_by_lse(a.out, a.lse, b.out, b.lse)
    torch.testing.assert_close(merged.out, one.out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(merged.lse, one.lse, atol=ATOL, rtol=RTOL)
    want, _ = dense_attention(q, k, v, rows)
    torch.testing.assert_close(merged.out.double(), want, atol=ATOL, rtol=RTOL)


def test_merge_of_two_empty_passes_is_zero() -> None:
    o = torch.randn(3, 2, D)
    lse = torch.full((3, 2), float("-inf"))
    got = merge_by_lse(o, lse, o, lse)
    assert torch.equal(got.out, torch.zeros_like(o)) and torch.isneginf(got.lse).all()


# ---- errors -------------------------------------------------------------------------------------


def test_errors_name_expected_and_actual() -> None:
    cfg = PoolConfig(max_bs=2, max_context_len=64, page_size=16, device="cpu")
    view = BufferPool(cfg).decode.view(2)
    k = torch.randn(8, 16, 2, D)
    with pytest.raises(LayoutError, match="FLASH_ATTN"):
        paged_attention(view, _q(2, 4, 0), k, k, layout=Layout.FLASHINFER)
    with pytest.raises(InputError, match="multiple of KV heads"):
        paged_attention(view, _q(2, 3, 0), k, k)
    with pytest.raises(InputError, match="head dim"):
        paged_attention(view, torch.randn(2, 4, D + 1), k, k)
    with pytest.raises(InputError, match="PagedView"):
        attention(object(), _q(2, 4, 0), k, k)
    with pytest.raises(InputError, match="merge_by_lse"):
        merge_by_lse(torch.zeros(2, 2, D), torch.zeros(2, 2), torch.zeros(3, 2, D), torch.zeros(3, 2))


def test_hnd_cache_is_named_as_the_likely_mix_up() -> None:
    """An HND cache ``[pages, H_kv, P, D]`` read as NHD puts the page size where the KV heads
    go: the error says so instead of calling the page size a head count."""
    from attnpool import KVCacheConfig, KVCachePool, KVLayout

    cfg = PoolConfig(max_bs=2, max_context_len=64, page_size=16, device="cpu")
    view = BufferPool(cfg).decode.view(2)
    kv = KVCachePool(KVCacheConfig(num_pages=8, page_size=16, max_tokens=4, num_kv_heads=2,
                                   head_dim=D, dtype=torch.float32, layout=KVLayout.HND,
                                   device="cpu"))
    k, v = kv.k_cache(0), kv.v_cache(0)
    assert tuple(k.shape) == (8, 2, 16, D)
    for fn in (paged_attention, attention):
        with pytest.raises(InputError, match=r"looks HND \[num_pages, H_kv=2, page_size=16, D\]"
                           r".*expects NHD \[num_pages, page_size, H_kv, D\]"):
            fn(view, _q(2, 4, 0), k, v)
    # a plain head-count mismatch on an NHD cache gets no layout hint
    with pytest.raises(InputError, match="multiple of KV heads") as e:
        paged_attention(view, _q(2, 3, 0), torch.randn(8, 16, 2, D), torch.randn(8, 16, 2, D))
    assert "HND" not in str(e.value)
