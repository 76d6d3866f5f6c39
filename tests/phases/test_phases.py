"""Verify, draft, draft extend, encoder and local phases against the loop reference."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from attnpool import BufferPool, Layout, Phase, PoolConfig

from tests.helpers.batches import make_batch, tree_mask
from tests.helpers.loopref import (
    assert_paged_equal,
    cross_rows,
    decode_rows,
    decoder_rows,
    draft_tree_rows,
    local_rows,
    tree_expand_rows,
)

C = 256
LAYOUTS = [Layout.FLASH_ATTN, Layout.FLASHINFER, Layout.BOTH]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
common = {
    "page": st.sampled_from([1, 16, 64]),
    "layout": st.sampled_from(LAYOUTS),
    "n": st.integers(0, 6),
    "pad": st.integers(0, 3),
    "host": st.booleans(),
    "seed": st.integers(0, 2**16),
    "pad_seq_len": st.sampled_from([1, 3]),
}


def _pool(page: int, layout: Layout, pad_seq_len: int = 1, **kw: object) -> BufferPool:
    cfg = PoolConfig(max_bs=6, max_context_len=C, page_size=page, device="cpu", layout=layout,
                     pad_seq_len=pad_seq_len, pad_page=2, **kw)  # type: ignore[arg-type]
    return BufferPool(cfg, poison=True)


def _sizes(n: int, pad: int) -> tuple[int, int]:
    bs = max(1, min(6, n + pad))
    return min(n, bs), bs


@SETTINGS
@given(**common, topk=st.sampled_from([1, 3]))
def test_verify(page: int, layout: Layout, n: int, pad: int, host: bool, seed: int,
                pad_seq_len: int, topk: int) -> None:
    nd = 4
    pool = _pool(page, layout, pad_seq_len, num_draft_tokens=nd, topk=topk)
    n, bs = _sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(pool.cfg, n, rng, extra=nd)
    seq, rpi, table = b.tensors()
    mask = tree_mask(n, nd, rng) if topk > 1 else None
    view = pool.verify.update_(bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                               seq_lens_cpu=b.seq_lens if host else None,
                               tree_mask=mask)
    pool.check(view)
    if topk == 1:
        assert view.expand is None and view.prefix.causal
        exp = decode_rows(b.seq_lens, b.slots, table, bs, page, pad_seq_len, 2, extra=nd, q_len=nd)
        assert_paged_equal(view.prefix, exp)
    else:
        assert view.expand is not None and not view.prefix.causal
        exp = decode_rows(b.seq_lens, b.slots, table, bs, page, pad_seq_len, 2, q_len=nd)
        assert_paged_equal(view.prefix, exp)
        assert mask is not None
        assert_paged_equal(view.expand, tree_expand_rows(b.seq_lens, b.slots, table, mask, bs,
                                                         nd, pad_seq_len, 2 * page))
    assert view.prefix.max_seqlen_q == nd


@SETTINGS
@given(**common, topk=st.sampled_from([1, 2]))
def test_draft(page: int, layout: Layout, n: int, pad: int, host: bool, seed: int,
               pad_seq_len: int, topk: int) -> None:
    steps = 3
    assume(topk > 1 or layout is not Layout.FLASHINFER)  # chain drafts need FLASH_ATTN (config)
    pool = _pool(page, layout, pad_seq_len, spec_steps=steps, topk=topk)
    n, bs = _sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(pool.cfg, n, rng, extra=steps)
    seq, rpi, table = b.tensors()
    loc = None
    if topk > 1:
        loc = torch.tensor([[[rng.randrange(1, 10_000) for _ in range(topk)]
                             for _ in range(steps)] for _ in range(n)], dtype=torch.int64)
        loc = loc.view(n, steps, topk)
    view = pool.draft.update_(bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                              seq_lens_cpu=b.seq_lens if host else None,
                              out_cache_loc=loc)
    pool.check(view)
    assert len(view.steps) == steps
    for d, sv in enumerate(view.steps, start=1):
        assert sv.step == d
        if topk == 1:
            assert sv.expand is None and sv.prefix.kv_indptr is None
            exp = decode_rows(b.seq_lens, b.slots, table, bs, page, pad_seq_len, 2, extra=d)
            assert_paged_equal(sv.prefix, exp)
        else:
            assert loc is not None and sv.expand is not None
            assert sv.prefix is view.steps[0].prefix  # one prefix pass for the whole round
            pre, exp = draft_tree_rows(b.seq_lens, b.slots, table, loc, bs, page, topk, d,
                                       pad_seq_len, 2)
            assert_paged_equal(sv.prefix, pre)
            assert_paged_equal(sv.expand, exp)


@SETTINGS
@given(**common)
def test_draft_extend(page: int, layout: Layout, n: int, pad: int, host: bool, seed: int,
                      pad_seq_len: int) -> None:
    nd = 4
    pool = _pool(page, layout, pad_seq_len, num_draft_tokens=nd)
    n, bs = _sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(pool.cfg, n, rng)
    acc = [rng.randint(1, min(nd, s)) for s in b.seq_lens]
    seq, rpi, table = b.tensors()
    view = pool.draft_extend.update_(bs, seq_lens=seq, accept_lens=torch.tensor(acc, dtype=torch.int32),
                                     req_pool_indices=rpi, req_to_token=table,
                                     seq_lens_cpu=b.seq_lens if host else None,
                                     accept_lens_cpu=acc if host else None)
    pool.check(view)
    exp = decode_rows(b.seq_lens, b.slots, table, bs, page, pad_seq_len, 2)
    exp.q_lens = acc + [1] * (bs - n)
    assert_paged_equal(view, exp)
    assert view.causal and view.max_seqlen_q == nd


@SETTINGS
@given(**common)
def test_encoder(page: int, layout: Layout, n: int, pad: int, host: bool, seed: int,
                 pad_seq_len: int) -> None:
    max_enc = 100
    pool = _pool(page, layout, pad_seq_len, max_encoder_len=max_enc)
    n, bs = _sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(pool.cfg, n, rng, extra=max_enc)
    enc = [rng.choice([0, 1, max_enc, rng.randint(1, max_enc)]) for _ in range(n)]  # 0: no encoder input
    seq, rpi, table = b.tensors()
    view = pool.encoder.update_(bs, seq_lens=seq, encoder_lens=torch.tensor(enc, dtype=torch.int64),
                                req_pool_indices=rpi, req_to_token=table,
                                seq_lens_cpu=b.seq_lens if host else None,
                                encoder_lens_cpu=enc if host else None)
    pool.check(view)
    assert not view.cross.causal
    assert_paged_equal(view.cross, cross_rows(enc, b.slots, table, bs, page, max_enc,
                                              pad_seq_len, 2))
    assert_paged_equal(view.decoder, decoder_rows(b.seq_lens, enc, b.slots, table, bs, page,
                                                  pad_seq_len, 2))


@SETTINGS
@given(**common, chunk_pages=st.sampled_from([1, 2]), verify=st.booleans())
def test_local(page: int, layout: Layout, n: int, pad: int, host: bool, seed: int,
               pad_seq_len: int, chunk_pages: int, verify: bool) -> None:
    nd = 5
    chunk = max(4, page) * chunk_pages  # small chunks so N=5 queries straddle boundaries
    chunk = chunk - chunk % page
    pool = _pool(page, layout, pad_seq_len, num_draft_tokens=nd, attention_chunk_size=chunk)
    n, bs = _sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(pool.cfg, n, rng, extra=nd)
    seq, rpi, table = b.tensors()
    phase = Phase.VERIFY if verify else Phase.DECODE
    view = pool.local.update_(bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                              for_phase=phase,
                              seq_lens_cpu=b.seq_lens if host else None)
    pool.check(view)
    q = nd if verify else 1
    kv = [s + (nd if verify else 0) for s in b.seq_lens]
    per = view.rows_per_request
    assert per == (min(nd, (nd - 1) // chunk + 2) if verify else 1)
    assert_paged_equal(view, local_rows(kv, b.slots, table, bs, page, chunk, q, per,
                                        pad_seq_len, 2))
    cu = view.cu_seqlens_q.tolist()
    assert [cu[i * per] for i in range(bs + 1)] == [i * q for i in range(bs + 1)]


def test_local_decode_matches_design_formula() -> None:
    """seqused_k = (L-1) % A + 1 and the block table starts at page ((L-1)//A)*A/P."""
    pool = _pool(16, Layout.FLASH_ATTN, attention_chunk_size=64)
    b = make_batch(pool.cfg, 5, random.Random(7))
    view = pool.local.update_(5, **b.inputs())
    for i, length in enumerate(b.seq_lens):
        assert int(view.cache_seqlens[i]) == (length - 1) % 64 + 1
        first = ((length - 1) // 64) * 64 // 16
        assert int(view.page_table[i, 0]) == int(b.req_to_token[b.slots[i], first * 16]) // 16


def test_overlay_phases_stay_correct_when_next_updated() -> None:
    """Overlaid phases share bytes: each update clobbers the others, the next one rewrites."""
    cfg = PoolConfig(max_bs=6, max_context_len=C, page_size=16, device="cpu", layout=Layout.BOTH,
                     num_draft_tokens=4, topk=2, spec_steps=3, attention_chunk_size=32,
                     max_encoder_len=64, max_extend_tokens=24)
    pool = BufferPool(cfg, poison=True)
    plan = {(p.spec.phase, p.spec.name): p for p in pool.plan.placements}
    assert plan[(Phase.DECODE, "page_table")].offset == plan[(Phase.VERIFY, "page_table")].offset
    assert pool.plan.nbytes < pool.plan.separate_nbytes
    rng = random.Random(0)
    for round_ in range(3):
        b = make_batch(cfg, rng.randint(1, 6), rng, extra=64)
        seq, rpi, table = b.tensors()
        n = len(b.seq_lens)
        mask = tree_mask(n, 4, rng)
        loc = torch.randint(1, 1000, (n, 3, 2))
        enc = torch.full((n,), 64)
        ones = torch.ones(n, dtype=torch.int64)
        order = ["decode", "verify", "draft", "draft_extend", "extend"]
        rng.shuffle(order)
        for name in order:
            if name == "decode":
                view: object = pool.decode.update_(6, seq_lens=seq, req_pool_indices=rpi,
                                                   req_to_token=table)
            elif name == "verify":
                view = pool.verify.update_(6, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                                           tree_mask=mask)
            elif name == "draft":
                view = pool.draft.update_(6, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                                          out_cache_loc=loc)
            elif name == "extend":
                view = pool.extend.update_(6, seq_lens=seq, extend_lens=seq.clamp(max=4),
                                           req_pool_indices=rpi, req_to_token=table)
            else:
                view = pool.draft_extend.update_(6, seq_lens=seq, accept_lens=ones, req_pool_indices=rpi,
                                                 req_to_token=table)
            pool.check(view)
        # the decode view read after another phase wrote is stale; the next update fixes it
        dec = pool.decode.update_(6, seq_lens=seq, req_pool_indices=rpi, req_to_token=table)
        pool.check(dec)
        assert_paged_equal(dec, decode_rows(b.seq_lens, b.slots, table, 6, 16))
        # parts used in the same forward never overlap: encoder cross + decoder, local + verify
        ev = pool.encoder.update_(6, seq_lens=seq, encoder_lens=enc, req_pool_indices=rpi,
                                  req_to_token=table)
        lv = pool.local.update_(6, seq_lens=seq, req_pool_indices=rpi, req_to_token=table)
        pool.check(ev)
        pool.check(lv)
        assert round_ >= 0


@pytest.mark.parametrize("phase", ["verify", "draft", "draft_extend", "encoder", "local",
                                   "extend"])
def test_capture_views_valid_before_update(phase: str) -> None:
    cfg = PoolConfig(max_bs=6, max_context_len=C, page_size=16, device="cpu", layout=Layout.BOTH,
                     num_draft_tokens=4, topk=2, spec_steps=3, attention_chunk_size=32,
                     max_encoder_len=64, pad_seq_len=5, max_extend_tokens=24)
    pool = BufferPool(cfg, poison=True)
    for bs in (1, 6):
        pool.check(getattr(pool, phase).view(bs))
    pool.decode.update_(6, **make_batch(cfg, 3, random.Random(1), extra=64).inputs())
    pool.check(getattr(pool, phase).view(6))  # re-padded after another phase wrote


def test_eagle_config_edge_capacity() -> None:
    """Requests at the context limit, bs*N and bs*K rows: no capacity error, valid views."""
    cfg = PoolConfig(max_bs=4, max_context_len=128, page_size=1, device="cpu",
                     num_draft_tokens=8, topk=4, spec_steps=4, layout=Layout.BOTH)
    pool = BufferPool(cfg, poison=True)
    rng = random.Random(3)
    b = make_batch(cfg, 4, rng, extra=8)
    b.seq_lens = [128 - 8] * 4
    seq, rpi, table = b.tensors()
    mask = tree_mask(4, 8)
    pool.check(pool.verify.update_(4, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                                   seq_lens_cpu=b.seq_lens, tree_mask=mask))
    seq4 = seq - 4
    pool.check(pool.draft.update_(4, seq_lens=seq4, req_pool_indices=rpi, req_to_token=table,
                                  seq_lens_cpu=[124] * 4,
                                  out_cache_loc=torch.randint(0, 500, (4, 4, 4))))
