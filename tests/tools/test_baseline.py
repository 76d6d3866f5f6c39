"""The classic baseline writes what attnpool writes for real rows (like-for-like benchmarks),
allocates exactly the pool's buffers one by one, and has the op profile the benchmarks report."""

from __future__ import annotations

import importlib.util
import pathlib
import random
import sys
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnpool
from attnpool import BufferPool, PoolConfig, plan_arena
from attnpool.tools.baseline import ClassicPaged, ClassicView, Fill, alloc_per_buffer

from tests.helpers.batches import make_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _dispatch_count() -> ModuleType:
    """benchmarks/dispatch_count.py (the op counter BENCHMARKS.md quotes), loaded by path."""
    spec = importlib.util.spec_from_file_location("dispatch_count",
                                                  ROOT / "benchmarks" / "dispatch_count.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("dispatch_count", mod)
    spec.loader.exec_module(mod)
    return mod


def _assert_real_rows_equal(classic: ClassicView, pool_view: Any, seq: list[int], extra: int,
                            page: int) -> None:
    """torch.equal on every real row's read region: lengths, cumsum and live page columns."""
    n = len(seq)
    pv = pool_view.prefix if hasattr(pool_view, "prefix") else pool_view  # verify: prefix part
    assert torch.equal(classic.cache_seqlens[:n], pv.cache_seqlens[:n])
    assert torch.equal(classic.cu_seqlens_k[: n + 1], pv.cu_seqlens_k[: n + 1])
    assert torch.equal(classic.cu_seqlens_q, pv.cu_seqlens_q)
    for i, length in enumerate(seq):
        w = -(-(length + extra) // page)
        assert torch.equal(classic.page_table[i, :w], pv.page_table[i, :w]), f"row {i}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page=st.sampled_from([1, 16, 64]), n=st.integers(0, 10), pad=st.integers(0, 3),
       verify=st.booleans(), seed=st.integers(0, 2**16))
def test_classic_replay_equals_attnpool_on_real_rows(page: int, n: int, pad: int, verify: bool,
                                                     seed: int) -> None:
    nd = 3 if verify else 0
    cfg = PoolConfig(max_bs=10, max_context_len=512, page_size=page, device="cpu",
                     num_draft_tokens=nd)
    pool = BufferPool(cfg, poison=True)
    classic = ClassicPaged(cfg, num_draft_tokens=nd)
    bs = max(1, min(10, n + pad))
    n = min(n, bs)
    b = make_batch(cfg, n, random.Random(seed), extra=nd)
    seq, rpi, table = b.tensors()
    host = torch.tensor(b.seq_lens, dtype=torch.int64)
    phase = pool.verify if verify else pool.decode
    got = phase.update_(bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                        seq_lens_cpu=host)
    want = classic.replay(bs, seq, rpi, table, host)
    _assert_real_rows_equal(want, got, b.seq_lens, nd, page)
    assert want.max_seqlen_q == max(1, nd)


def test_classic_replay_shrinking_batches_still_equal() -> None:
    """Consecutive steps (the baseline reuses its buffers): real rows keep matching."""
    cfg = PoolConfig(max_bs=12, max_context_len=256, page_size=16, device="cpu")
    pool, classic = BufferPool(cfg, poison=True), ClassicPaged(cfg)
    rng = random.Random(7)
    for n, bs in [(12, 12), (3, 8), (0, 4), (7, 7), (1, 12)]:
        b = make_batch(cfg, n, rng)
        seq, rpi, table = b.tensors(dtype=torch.int32)
        host = torch.tensor(b.seq_lens, dtype=torch.int32)
        got = pool.decode.update_(bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                                  seq_lens_cpu=host)
        want = classic.replay(bs, seq, rpi, table, host)
        _assert_real_rows_equal(want, got, b.seq_lens, 0, 16)


def test_classic_padded_rows_read_request_zero() -> None:
    """The baseline's documented difference: padded rows read request slot 0, not a pad page."""
    cfg = PoolConfig(max_bs=4, max_context_len=64, page_size=16, device="cpu")
    b = make_batch(cfg, 1, random.Random(3))
    seq, rpi, table = b.tensors()
    v = ClassicPaged(cfg).replay(4, seq, rpi, table, torch.tensor(b.seq_lens))
    assert v.cache_seqlens[1:].tolist() == [cfg.pad_seq_len] * 3
    assert v.page_table[1:, 0].tolist() == [int(table[0, 0]) // 16] * 3


@pytest.mark.parametrize("fill", list(Fill))
def test_alloc_per_buffer_matches_the_plan(fill: Fill) -> None:
    cfg = PoolConfig(max_bs=8, max_context_len=256, page_size=16, device="cpu",
                     num_draft_tokens=4, topk=2, spec_steps=2, max_encoder_len=32,
                     attention_chunk_size=64)
    plan = plan_arena(cfg)
    bufs = alloc_per_buffer(cfg, fill)
    assert len(bufs) == len(plan.placements)
    for p in plan.placements:
        t = bufs[f"{p.spec.phase.value if p.spec.phase else 'shared'}.{p.spec.name}"]
        assert tuple(t.shape) == p.shape and t.dtype == p.spec.dtype
    ptrs = {t.data_ptr() for t in bufs.values()}
    assert len(ptrs) == len(bufs)  # one allocation each, nothing shared
    assert sum(t.numel() * t.element_size() for t in bufs.values()) <= plan.separate_nbytes
    if fill is Fill.ZEROS:
        assert all(not t.any() for t in bufs.values())


def test_classic_rejects_bad_input_before_writing() -> None:
    cfg = PoolConfig(max_bs=4, max_context_len=64, page_size=16, device="cpu")
    c = ClassicPaged(cfg)
    b = make_batch(cfg, 3, random.Random(1))
    seq, rpi, table = b.tensors()
    before = c.page_table.clone()
    with pytest.raises(attnpool.InputError, match="seq_lens_cpu"):
        c.replay(4, seq, rpi, table, None)  # type: ignore[arg-type]
    with pytest.raises(attnpool.InputError, match=r"shape \(3,\)"):
        c.replay(4, seq, rpi, table, torch.tensor([1, 2]))
    with pytest.raises(attnpool.CapacityError, match="n must be <= bs=2"):
        c.replay(2, seq, rpi, table, torch.tensor(b.seq_lens))
    assert torch.equal(c.page_table, before)


def test_op_counts_classic_reads_the_host_attnpool_syncs_nothing() -> None:
    """The counts BENCHMARKS.md quotes: neither path syncs; the classic one reads host lengths."""
    from attnpool.tools import bench

    dc = _dispatch_count()
    dev = torch.device("cpu")
    case = bench.UpdateCase("decode", 16, bs=8, context=256, max_bs=8)
    x = bench.make_inputs(case, dev)
    got = {}
    for ui in bench.UPDATE_IMPLS:
        if ui.skip(case, dev) is None:
            fn = ui.prepare(case, x, dev)
            fn()
            got[ui.name] = dc.count(fn, dev, host=[x.seq_lens_cpu])
    classic, ref = got["classic"], got["attnpool-reference"]
    assert classic.sync == 0 and ref.sync == 0
    assert classic.host == 2 and classic.ops["aten._local_scalar_dense.default"] == 1
    assert ref.host == 0 and ref.ops["aten._local_scalar_dense.default"] == 0
    assert ref.launch < classic.launch
    # The counter itself can tell a sync: .item() on an untagged (device) tensor.
    assert dc.count(lambda: x.seq_lens.max().item(), dev).sync == 1
