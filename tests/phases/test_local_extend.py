"""Chunked local attention for a prefill (``pool.local.update_(..., for_phase=Phase.EXTEND)``).

Three oracles: the row layout against a plain-Python loop over each request's chunks, the SDPA
adapter over the view against dense attention under transformers' chunked mask (a query at
position ``p`` sees the keys ``k <= p`` with ``k // A == p // A``, chunks aligned to multiples of
``A`` from position 0), and both update paths writing the same bytes. Bad input changes nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

from attnpool import (
    BufferPool,
    CapacityError,
    Impl,
    InputError,
    Layout,
    Phase,
    PoolConfig,
    StaleViewError,
)
from attnpool.adapters.sdpa import attention
from attnpool.specs import local_extend_rows

from tests.helpers.batches import make_table
from tests.helpers.dense import dense_attention

C, D, T = 96, 8, 64


def _pool(page: int, chunk: int, impl: Impl = Impl.REFERENCE, **kw: object) -> BufferPool:
    cfg = PoolConfig(max_bs=5, max_context_len=C, page_size=page, device="cpu",
                     layout=Layout.BOTH, pad_page=0, attention_chunk_size=chunk,
                     max_extend_tokens=T, impl=impl, **kw)  # type: ignore[arg-type]
    return BufferPool(cfg, poison=True)


def _batch(rng: random.Random, n: int, chunk: int) -> tuple[list[int], list[int]]:
    """Lengths and new tokens, some starting or ending on a chunk edge, ``sum(ext) <= T``."""
    seq, ext = [], []
    for _ in range(n):
        e = rng.choice([1, chunk, chunk + 1, rng.randint(1, T // n)])
        e = min(e, T // n)
        s = rng.choice([e, e + chunk - 1, rng.randint(e, C)])
        seq.append(min(s, C))
        ext.append(e)
    return seq, ext


def _rows(seq: list[int], ext: list[int], chunk: int) -> list[tuple[int, int, int, int]]:
    """Oracle: per virtual row (request, chunk start, queries, keys), request after request."""
    out = []
    for i, (s, e) in enumerate(zip(seq, ext, strict=True)):
        for c in range((s - e) // chunk, (s - 1) // chunk + 1):
            lo, hi = c * chunk, min((c + 1) * chunk, s)
            out.append((i, lo, hi - max(lo, s - e), hi - lo))
    return out


def _update(pool: BufferPool, seq: list[int], ext: list[int], slots: list[int],
            table: torch.Tensor, bs: int, host: bool = True):  # type: ignore[no-untyped-def]
    return pool.local.update_(
        bs, seq_lens=torch.tensor(seq), extend_lens=torch.tensor(ext),
        req_pool_indices=torch.tensor(slots), req_to_token=table, for_phase=Phase.EXTEND,
        seq_lens_cpu=seq if host else None, extend_lens_cpu=ext if host else None)


@pytest.mark.parametrize("page,chunk", [(1, 4), (4, 8), (16, 32), (4, 96)])
@pytest.mark.parametrize("seed", range(6))
def test_rows_and_attention_follow_the_chunked_mask(page: int, chunk: int, seed: int) -> None:
    rng = random.Random(seed)
    pool = _pool(page, chunk)
    n = rng.randint(1, 5)
    bs = rng.randint(n, 5)
    seq, ext = _batch(rng, n, chunk)
    table = make_table(pool.cfg, 8, rng)
    slots = rng.sample(range(8), n)
    view = _update(pool, seq, ext, slots, table, bs, host=seed % 2 == 0)
    pool.check(view)
    rows = _rows(seq, ext, chunk)
    assert view.bs == local_extend_rows(pool.cfg, bs) >= len(rows)
    cu = view.cu_seqlens_q.tolist()
    lens = view.cache_seqlens.tolist()
    for r, (i, lo, q, k) in enumerate(rows):
        assert cu[r + 1] - cu[r] == q and lens[r] == k, (r, rows)
        if view.page_table is not None:  # the row starts at its chunk's first page
            want = [int(table[slots[i], lo + j * page]) // page for j in range(-(-k // page))]
            assert view.page_table[r, : len(want)].tolist() == want
    assert all(cu[r] == sum(ext) for r in range(len(rows), view.bs + 1))  # padding: no query
    # attention over the view == dense attention under transformers' chunked mask
    g = torch.Generator().manual_seed(seed)
    pages = int(table.max()) // page + 2
    k_cache = torch.randn(pages, page, 2, D, generator=g, dtype=torch.float64)
    v_cache = torch.randn(pages, page, 2, D, generator=g, dtype=torch.float64)
    q = torch.randn(sum(ext), 4, D, generator=g, dtype=torch.float64)
    keys = [[int(table[slots[i], kk]) for kk in range(s + 0) if kk // chunk == p // chunk
             and kk <= p] for i, (s, e) in enumerate(zip(seq, ext, strict=True))
            for p in range(s - e, s)]
    want, _ = dense_attention(q, k_cache, v_cache, keys)
    for lay in (Layout.FLASH_ATTN, Layout.FLASHINFER):
        got = attention(view, q, k_cache, v_cache, layout=lay)
        torch.testing.assert_close(got.out.double(), want, atol=1e-9, rtol=1e-9)


@pytest.mark.triton
@pytest.mark.parametrize("seed", range(4))
def test_both_update_paths_write_the_same_bytes(seed: int) -> None:
    rng = random.Random(seed)
    a, b = _pool(4, 8, Impl.REFERENCE), _pool(4, 8, Impl.TRITON)
    seq, ext = _batch(rng, 4, 8)
    table = make_table(a.cfg, 8, rng)
    slots = rng.sample(range(8), 4)
    va, vb = (_update(p, seq, ext, slots, table, 5) for p in (a, b))
    for name in ("cache_seqlens", "cu_seqlens_q", "cu_seqlens_k", "page_table", "kv_indptr",
                 "kv_last_page_len"):
        assert torch.equal(getattr(va, name), getattr(vb, name)), name


def test_the_decode_shape_still_works_after_a_prefill() -> None:
    """The local part holds one shape at a time: a prefill view is stale after a decode update."""
    pool = _pool(4, 8)
    rng = random.Random(1)
    table = make_table(pool.cfg, 8, rng)
    pre = _update(pool, [20, 9], [20, 9], [1, 2], table, 2)
    dec = pool.local.update_(2, seq_lens=torch.tensor([21, 10]),
                             req_pool_indices=torch.tensor([1, 2]), req_to_token=table)
    assert dec.cache_seqlens.tolist() == [(21 - 1) % 8 + 1, (10 - 1) % 8 + 1]
    with pytest.raises(StaleViewError, match="shaped for extend"):
        pool.check(pre)


def test_bad_prefill_input_changes_nothing() -> None:
    pool = _pool(4, 8)
    table = make_table(pool.cfg, 8, random.Random(2))
    _update(pool, [20, 9], [20, 9], [1, 2], table, 2)
    before = pool.arena.storage.view(torch.uint8).clone()
    cases = [
        (dict(extend_lens_cpu=[40, 30], seq_lens_cpu=[90, 40]), CapacityError, "max_extend_tokens"),
        (dict(extend_lens_cpu=[5, 12], seq_lens_cpu=[20, 9]), InputError, "<= seq_lens_cpu"),
        (dict(extend_lens=None), InputError, "needs extend_lens"),
        (dict(num_real=torch.tensor(1)), InputError, "num_real"),
    ]
    for over, err, msg in cases:
        kw: dict[str, object] = dict(
            seq_lens=torch.tensor(over.get("seq_lens_cpu", [20, 9])),
            extend_lens=torch.tensor(over.get("extend_lens_cpu", [20, 9])),
            req_pool_indices=torch.tensor([1, 2]), req_to_token=table, for_phase=Phase.EXTEND)
        kw.update(over)
        with pytest.raises(err, match=msg):
            pool.local.update_(2, **kw)  # type: ignore[arg-type]
        assert torch.equal(pool.arena.storage.view(torch.uint8), before)
    with pytest.raises(InputError, match="no capture view"):
        pool.local.view(2, Phase.EXTEND)
    with pytest.raises(InputError, match=r"go with for_phase=Phase\.EXTEND"):
        pool.local.update_(2, seq_lens=torch.tensor([3, 4]), extend_lens=torch.tensor([1, 1]),
                           req_pool_indices=torch.tensor([1, 2]), req_to_token=table)
