"""FlashMLA's scheduler metadata as pool buffers: the schedule of the real rows (against the
loop oracle), its invariants, padded rows and ``n = 0``, both update paths byte for byte, poison,
validation, stale views, the config's refusals, and the plan."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch

import attnpool
from attnpool import (
    BufferPool,
    CapacityError,
    FlashMLAConfig,
    Impl,
    Layout,
    LayoutError,
    PoolConfig,
    PoolError,
    ReadRegionError,
    SchedLayout,
    StaleViewError,
)
from attnpool.arena import sentinel
from attnpool.views import FlashMLAMetadata, PagedView

from tests.helpers.batches import make_batch
from tests.helpers.flashmla_loop import loop_schedule

N = 3  # draft tokens of the verify phase


def idle(bs: int) -> list[int]:
    """A part of the empty schedule (``n = 0``): begins at the batch, which every build of the
    kernel skips."""
    return [bs, 0, -1, 0, 0, 0, 0, 0]


ARGS, META = SchedLayout.ARGUMENTS, SchedLayout.DECODING_SCHED_META


def _cfg(impl: Impl = Impl.REFERENCE, max_bs: int = 10, context: int = 2048, sms: int = 12,
         heads: int = 16, layout: SchedLayout = ARGS, **kw: Any) -> PoolConfig:
    return PoolConfig(max_bs=max_bs, max_context_len=context, page_size=64, device="cpu",
                      num_draft_tokens=N, impl=impl, **kw,
                      flashmla=FlashMLAConfig(num_sms=sms, num_heads_q=heads, layout=layout))


def _struct(rows: list[list[int]], splits: list[int], bs: int) -> list[list[int]]:
    """Argument-layout rows in ``DecodingSchedMeta``'s order: an idle part begins at ``bs``; a
    part's flags say whether its first and last requests have more than one split."""
    def cut(r: int) -> int:
        return int(splits[r + 1] - splits[r] > 1)

    return [[bs, er, bb, eb, sp, 0, 0, 0] if br >= bs else
            [br, er, bb, eb, sp, cut(br), cut(er), 0] for br, bb, er, eb, sp, *_ in rows]


def _update(pool: BufferPool, phase: str, bs: int, n: int, rng: random.Random) -> Any:
    b = make_batch(pool.cfg, n, rng, extra=N if phase == "verify" else 0)
    return getattr(pool, phase).update_(bs, **b.inputs())


def _part(view: Any) -> PagedView:
    return view if isinstance(view, PagedView) else view.prefix


def _expected(lens: list[int], n: int, bs: int, parts: int) -> tuple[list[list[int]], list[int]]:
    """The oracle's schedule of the first ``n`` rows, padded: no work for rows ``n..bs``."""
    if n == 0:
        return [idle(bs)] * parts, [0] * (bs + 1)
    rows, splits = loop_schedule(lens[:n], parts, idle=bs)
    return rows, splits + [splits[-1]] * (bs - n)


def _covers_every_block_once(md: list[list[int]], lens: list[int], n: int) -> None:
    """Every 64-token block of every real row in exactly one part; no padded row in any; parts
    with no work marked idle (begin >= n), all after the last part with work."""
    seen: dict[tuple[int, int], int] = {}
    idle_from = None
    for p, (br, bb, er, eb, *_) in enumerate(md):
        if br >= n:
            idle_from = p if idle_from is None else idle_from
            continue
        assert idle_from is None, f"part {p} has work after idle part {idle_from}"
        assert 0 <= br <= er < n, f"part {p} spans rows {br}..{er}, real rows are 0..{n - 1}"
        for r in range(br, er + 1):
            lo = bb if r == br else 0
            hi = eb if r == er else -(-lens[r] // 64)
            for blk in range(lo, hi):
                seen[(r, blk)] = seen.get((r, blk), 0) + 1
    want = {(r, blk) for r in range(n) for blk in range(-(-lens[r] // 64))}
    assert set(seen) == want and all(c == 1 for c in seen.values())


@pytest.mark.parametrize("phase", ["decode", "verify"])
@pytest.mark.parametrize("seed", range(12))
def test_schedule_of_the_real_rows(phase: str, seed: int) -> None:
    rng = random.Random(seed)
    pool = BufferPool(_cfg(sms=rng.choice([1, 4, 12, 40]), heads=rng.choice([16, 128])),
                      poison=True)
    bs = rng.randint(2, 10)
    for n in (rng.randint(1, bs - 1), 0, bs):  # padded rows, none real, none padded
        view = _update(pool, phase, bs, n, rng)
        _check_schedule(pool, view, phase, bs, n)


@pytest.mark.parametrize("phase", ["decode", "verify"])
@pytest.mark.parametrize("seed", range(6))
def test_struct_layout_schedule(phase: str, seed: int) -> None:
    """``DecodingSchedMeta`` rows: the oracle's parts in the struct's order, idle parts at
    ``bs`` (the kernel skips ``begin_req >= b``, never -1), flags from the split counts."""
    rng = random.Random(100 + seed)
    pool = BufferPool(_cfg(sms=rng.choice([1, 4, 12, 40]), heads=rng.choice([16, 128]),
                           layout=META), poison=True)
    bs = rng.randint(2, 10)
    for n in (rng.randint(1, bs - 1), 0, bs):
        view = _update(pool, phase, bs, n, rng)
        f = view.flashmla
        assert f.config.layout is META
        lens = _part(view).cache_seqlens.tolist()
        rows, splits = _expected(lens, n, bs, f.num_sm_parts)
        assert f.num_splits.tolist() == splits
        assert f.tile_scheduler_metadata.tolist() == _struct(rows, splits, bs)
        pool.check(view)
    md = view.flashmla.tile_scheduler_metadata
    md[-1, 0] = -1  # an idle part marked the argument layout's way: the kernel would run it
    with pytest.raises(ReadRegionError, match="tile_scheduler_metadata"):
        pool.check(view)


def _check_schedule(pool: BufferPool, view: Any, phase: str, bs: int, n: int) -> None:
    f = view.flashmla
    assert isinstance(f, FlashMLAMetadata) and f is _part(view).flashmla
    assert f.s_q == (1 if phase == "decode" else N)
    assert f.num_sm_parts == pool.cfg.flashmla.num_sm_parts(f.s_q) == f.tile_scheduler_metadata.shape[0]
    assert f.num_splits.shape == (bs + 1,) and f.num_splits.dtype == torch.int32
    lens = _part(view).cache_seqlens.tolist()
    md, ns = f.tile_scheduler_metadata.tolist(), f.num_splits.tolist()
    assert (md, ns) == _expected(lens, n, bs, f.num_sm_parts)
    _covers_every_block_once(md, lens, n)
    assert all(b >= a for a, b in itertools.pairwise(ns))
    assert ns[n:] == [ns[n]] * (bs + 1 - n)  # padded rows: no split
    pool.check(view)


def test_padded_rows_get_no_work() -> None:
    """Padded rows hold pad_seq_len (a valid row for the other kernels) yet take no part."""
    pool = BufferPool(_cfg(sms=40, pad_seq_len=64 * 9))
    rng = random.Random(3)
    v = _update(pool, "decode", 8, 2, rng)
    assert v.cache_seqlens[2:].tolist() == [64 * 9] * 6
    md = v.flashmla.tile_scheduler_metadata.tolist()
    assert {r[0] for r in md} <= {8, 0, 1} and md[-1][0] == 8
    assert v.flashmla.num_splits[3:].tolist() == [v.flashmla.num_splits[2].item()] * 6


@pytest.mark.parametrize("layout", [ARGS, META])
@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_capture_state_is_the_empty_schedule(phase: str, layout: SchedLayout) -> None:
    pool = BufferPool(_cfg(layout=layout), poison=True)
    v = getattr(pool, phase).view(7)
    # max_bs: the capture state's batch
    empty = idle(10) if layout is ARGS else [10, -1, 0, 0, 0, 0, 0, 0]
    assert v.flashmla.tile_scheduler_metadata.tolist() == [empty] * v.flashmla.num_sm_parts
    assert v.flashmla.num_splits.tolist() == [0] * 8
    pool.check(v)


def test_every_update_writes_the_buffers_and_the_checker_sees_a_gap() -> None:
    pool = BufferPool(_cfg(), poison=True)
    rng = random.Random(0)
    v = _update(pool, "decode", 6, 4, rng)
    pool.poison_()  # a later update rewrites everything a kernel reads
    v = _update(pool, "decode", 6, 4, rng)
    big = int(sentinel(torch.int32))
    assert big not in v.flashmla.tile_scheduler_metadata.flatten().tolist()
    assert big not in v.flashmla.num_splits.tolist()
    pool.check(v)
    for buf, at in ((v.flashmla.tile_scheduler_metadata, (0, 6)), (v.flashmla.num_splits, (6,))):
        old = int(buf[at])
        buf[at] = big  # a byte nothing wrote: the checker must say so
        with pytest.raises(ReadRegionError, match="flashmla"):
            pool.check(v)
        buf[at] = old
    pool.check(v)
    v.flashmla.tile_scheduler_metadata[0, 2] = 6  # a part past the batch
    with pytest.raises(ReadRegionError, match="tile_scheduler_metadata"):
        pool.check(v)


def test_stale_after_another_phase() -> None:
    pool = BufferPool(_cfg(), poison=True)
    rng = random.Random(1)
    d = _update(pool, "decode", 4, 3, rng)
    assert d.flashmla.is_current
    vv = _update(pool, "verify", 4, 3, rng)
    assert not d.flashmla.is_current and not d.is_current and vv.flashmla.is_current
    with pytest.raises(StaleViewError):
        pool.check(d)
    # the two phases keep their own schedules (num_sm_parts depends on s_q)
    assert vv.flashmla.tile_scheduler_metadata.data_ptr() != \
        d.flashmla.tile_scheduler_metadata.data_ptr()


def test_validate_refuses_before_writing() -> None:
    pool = BufferPool(_cfg(), poison=True, validate=True)
    rng = random.Random(2)
    v = _update(pool, "decode", 5, 3, rng)
    before = (v.flashmla.tile_scheduler_metadata.clone(), v.flashmla.num_splits.clone())
    b = make_batch(pool.cfg, 3, rng)
    kw = b.inputs()
    kw["seq_lens"] = kw["seq_lens"].clone()
    kw["seq_lens"][1] = 0
    with pytest.raises(PoolError, match="seq_lens"):
        pool.decode.update_(5, **kw)
    assert torch.equal(v.flashmla.tile_scheduler_metadata, before[0])
    assert torch.equal(v.flashmla.num_splits, before[1])


def test_config_refusals() -> None:
    mla = FlashMLAConfig(num_sms=132, num_heads_q=128)
    with pytest.raises(LayoutError, match=r"page_size=64 .*got page_size=16"):
        PoolConfig(max_bs=4, max_context_len=1024, page_size=16, device="cpu", flashmla=mla)
    with pytest.raises(LayoutError, match="FLASH_ATTN"):
        PoolConfig(max_bs=4, max_context_len=1024, page_size=64, device="cpu",
                   layout=Layout.FLASHINFER, flashmla=mla)
    with pytest.raises(LayoutError, match="max_encoder_len=0"):
        PoolConfig(max_bs=4, max_context_len=1024, page_size=64, device="cpu",
                   max_encoder_len=64, flashmla=mla)
    with pytest.raises(CapacityError, match=r"max_bs <= 4096 .*got max_bs=4097"):
        PoolConfig(max_bs=4097, max_context_len=1024, page_size=64, device="cpu", flashmla=mla)
    with pytest.raises(PoolError, match="FlashMLAConfig"):
        PoolConfig(max_bs=4, max_context_len=1024, page_size=64, device="cpu",
                   flashmla=(132, 128))  # type: ignore[arg-type]
    with pytest.raises(PoolError, match="num_sms must be an int >= 1, got 0"):
        FlashMLAConfig(num_sms=0, num_heads_q=128)
    with pytest.raises(PoolError, match="multiple of num_heads_k=3, got 128"):
        FlashMLAConfig(num_sms=132, num_heads_q=128, num_heads_k=3)
    with pytest.raises(PoolError, match="fp8 must be a bool"):
        FlashMLAConfig(num_sms=132, num_heads_q=128, fp8=1)  # type: ignore[arg-type]
    with pytest.raises(PoolError, match="layout must be a SchedLayout"):
        FlashMLAConfig(num_sms=132, num_heads_q=128, layout="arguments")  # type: ignore[arg-type]
    assert mla.num_sm_parts(1) == 66 and mla.num_sm_parts(4) == 16
    assert FlashMLAConfig(num_sms=132, num_heads_q=128, fp8=True).num_sm_parts(1) == 66


def test_plan_and_report_show_the_buffers() -> None:
    cfg = _cfg(sms=132, heads=128)
    plan = attnpool.plan_arena(cfg).report()
    report = BufferPool(cfg).report()
    for text in (plan, report):
        lines = [ln.split() for ln in text.splitlines()]
        rows = {(ln[0], ln[1]): ln[2] for ln in lines if len(ln) > 2}
        assert rows[("decode", "tile_scheduler_metadata")] == "66x8"
        assert rows[("verify", "tile_scheduler_metadata")] == "22x8"  # s_q = 3: 6 tiles
        assert rows[("decode", "num_splits")] == rows[("verify", "num_splits")] == "11"
    assert "tile_scheduler_metadata" not in attnpool.plan_arena(
        PoolConfig(max_bs=4, max_context_len=1024, page_size=64, device="cpu")).report()


# ---- the fused path: the same bytes ------------------------------------------------------------
def _pair(**kw: Any) -> tuple[BufferPool, BufferPool]:  # (layout=... among kw)
    return (BufferPool(_cfg(Impl.REFERENCE, **kw), poison=True),
            BufferPool(_cfg(Impl.TRITON, **kw), poison=True))


def _same(a: Any, b: Any, bs: int) -> None:
    fa, fb = a.flashmla, b.flashmla
    assert torch.equal(fa.tile_scheduler_metadata, fb.tile_scheduler_metadata)
    assert torch.equal(fa.num_splits[: bs + 1], fb.num_splits[: bs + 1])


@pytest.mark.triton
@pytest.mark.parametrize("layout", [ARGS, META])
@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_fused_writes_the_reference_bytes(phase: str, layout: SchedLayout) -> None:
    rng = random.Random(7)
    for sms, heads in ((12, 16), (132, 128), (3, 64)):
        ref, fused = _pair(sms=sms, heads=heads, layout=layout)
        for _ in range(6):
            bs = rng.randint(2, 10)
            n = rng.choice([0, bs, rng.randint(1, bs - 1), rng.randint(1, bs - 1)])
            b = make_batch(ref.cfg, n, rng, extra=N if phase == "verify" else 0)
            a = getattr(ref, phase).update_(bs, **b.inputs())
            f = getattr(fused, phase).update_(bs, **b.inputs(dtype=torch.int32))
            _same(a, f, bs)
            fused.check(f)
        _same(getattr(ref, phase).view(10), getattr(fused, phase).view(10), 10)


@pytest.mark.triton
@pytest.mark.parametrize("layout", [ARGS, META])
def test_fused_capturable_and_bound(layout: SchedLayout) -> None:
    """``num_real`` (the count on the device, inputs padded to bs) and a bound update write the
    eager update's bytes."""
    rng = random.Random(11)
    ref, fused = _pair(sms=40, layout=layout)
    for n in (0, 1, 4, 6):
        b = make_batch(ref.cfg, n, rng)
        seq, rpi, table = b.tensors()
        a = ref.decode.update_(6, seq_lens=seq, req_pool_indices=rpi, req_to_token=table)
        pad = 6 - n
        padded = {"seq_lens": torch.cat([seq, torch.ones(pad, dtype=seq.dtype)]),
                  "req_pool_indices": torch.cat([rpi, torch.zeros(pad, dtype=rpi.dtype)]),
                  "req_to_token": table, "num_real": torch.tensor([n])}
        f = fused.decode.update_(6, **padded)
        _same(a, f, 6)
        fused.poison_()
        fused.decode.bind(6, **padded)()
        _same(a, fused.decode.view(6), 6)
