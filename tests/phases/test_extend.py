"""Extend (prefill with a cached prefix): loop reference, fused == reference, capture states,
errors, KV slots in the same call, and attention equal to dense causal attention."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from attnpool import (
    BufferPool,
    CapacityError,
    ExtendView,
    Impl,
    InputError,
    KVCacheConfig,
    KVCachePool,
    Layout,
    LayoutError,
    MissingPhaseError,
    Phase,
    PoolConfig,
    PoolError,
    ReadRegionError,
    plan_arena,
)
from attnpool.adapters import sdpa
from attnpool.graphs import GraphRunner, query_rows, rows_per_request

from tests.helpers.batches import make_batch
from tests.helpers.dense import dense_attention
from tests.helpers.loopref import ExtendRows, assert_paged_equal, extend_rows

C, T, MAX_BS = 256, 96, 6
LAYOUTS = [Layout.FLASH_ATTN, Layout.FLASHINFER, Layout.BOTH]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
common = {
    "page": st.sampled_from([1, 16, 64]),
    "layout": st.sampled_from(LAYOUTS),
    "n": st.integers(0, MAX_BS),
    "pad": st.integers(0, 3),
    "seed": st.integers(0, 2**16),
    "pad_seq_len": st.sampled_from([1, 3]),
}


def make_pool(page: int = 16, layout: Layout = Layout.BOTH, impl: Impl = Impl.REFERENCE,
              pad_seq_len: int = 1, total: int = T, pad_page: int = 2, **kw: object
              ) -> BufferPool:
    cfg = PoolConfig(max_bs=MAX_BS, max_context_len=C, page_size=page, device="cpu",
                     layout=layout, pad_seq_len=pad_seq_len, pad_page=pad_page, impl=impl,
                     max_extend_tokens=total, **kw)  # type: ignore[arg-type]
    return BufferPool(cfg, poison=True)


def extend_lens(seq_lens: list[int], rng: random.Random, total: int = T) -> list[int]:
    """New tokens per request: in [1, seq_len], some whole sequences, summing to <= total."""
    out: list[int] = []
    for i, s in enumerate(seq_lens):
        budget = total - sum(out) - (len(seq_lens) - i - 1)  # leave >= 1 for each later request
        hi = max(1, min(s, budget))
        out.append(rng.choice([1, hi, rng.randint(1, hi)]))
    return out


def sizes(n: int, pad: int) -> tuple[int, int]:
    bs = max(1, min(MAX_BS, n + pad))
    return min(n, bs), bs


def inputs(pool: BufferPool, n: int, seed: int) -> tuple[dict[str, Tensor], list[int], list[int],
                                                          list[int]]:
    rng = random.Random(seed)
    b = make_batch(pool.cfg, n, rng)
    ext = extend_lens(b.seq_lens, rng)
    seq, rpi, table = b.tensors()
    kw = {"seq_lens": seq, "extend_lens": torch.tensor(ext, dtype=torch.int32),
          "req_pool_indices": rpi, "req_to_token": table}
    return kw, b.seq_lens, ext, b.slots


def assert_extend_equal(view: ExtendView, slots: Tensor | None, exp: ExtendRows) -> None:
    assert_paged_equal(view, exp.rows)
    assert view.positions.tolist() == exp.positions
    if slots is not None:
        assert slots.tolist() == exp.slots


@SETTINGS
@given(**common, host=st.booleans(), slot_extra=st.integers(0, 5))
def test_matches_loop_reference(page: int, layout: Layout, n: int, pad: int, seed: int,
                                pad_seq_len: int, host: bool, slot_extra: int) -> None:
    pool = make_pool(page, layout, pad_seq_len=pad_seq_len)
    n, bs = sizes(n, pad)
    kw, seq, ext, slots = inputs(pool, n, seed)
    out = torch.full((T + slot_extra,), 12345, dtype=torch.int64)
    hkw = {"seq_lens_cpu": seq, "extend_lens_cpu": ext} if host else {}
    view = pool.extend.update_(bs, **kw, out_slots=out, **hkw)  # type: ignore[arg-type]
    pool.check(view)
    assert isinstance(view, ExtendView) and view.causal
    exp = extend_rows(seq, ext, slots, kw["req_to_token"], bs, page, T, out.shape[0],
                      pad_seq_len, 2)
    assert_extend_equal(view, out, exp)
    assert int(view.cu_seqlens_q[bs]) == (T if n < bs else sum(ext))
    if host:
        assert view.max_seqlen_q == max([*ext, T - sum(ext) if n < bs else 0])
        assert view.max_seqlen_k == max([*seq, pad_seq_len if n < bs else 0])
    else:
        assert (view.max_seqlen_q, view.max_seqlen_k) == (T, C)
    assert (view.qo_indptr is view.cu_seqlens_q) == bool(layout & Layout.FLASHINFER)


def test_tight_out_slots_and_whole_sequences() -> None:
    """out_slots sized to the batch (host lengths given); a prefill of whole prompts (prefix 0)."""
    pool = make_pool()
    kw, seq, _, slots = inputs(pool, 3, 1)
    ext = list(seq)
    while sum(ext) > T:
        ext[ext.index(max(ext))] //= 2
    kw["seq_lens"] = torch.tensor(ext)
    kw["extend_lens"] = torch.tensor(ext)
    out = torch.empty(sum(ext), dtype=torch.int32)
    view = pool.extend.update_(3, **kw, out_slots=out, seq_lens_cpu=ext, extend_lens_cpu=ext)
    exp = extend_rows(ext, ext, slots, kw["req_to_token"], 3, 16, T, out.shape[0], 1, 2)
    assert_extend_equal(view, out, exp)
    assert view.positions[: sum(ext)].tolist() == [j for e in ext for j in range(e)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_capture_state_valid_for_every_bs(layout: Layout) -> None:
    pool = make_pool(layout=layout, pad_seq_len=3)
    for bs in (MAX_BS, 1, 4):
        view = pool.extend.view(bs)
        pool.check(view)
        assert view.cu_seqlens_q.tolist() == [0] + [T] * bs
        assert view.positions.tolist() == [0] * T
        assert (view.max_seqlen_q, view.max_seqlen_k) == (T, C)
    # after another overlaid phase wrote the shared bytes, view() pads again
    pool.decode.update_(MAX_BS, **make_batch(pool.cfg, 2, random.Random(0)).inputs())
    view = pool.extend.view(MAX_BS)
    pool.check(view)
    assert view.cu_seqlens_q.tolist() == [0] + [T] * MAX_BS


def test_checker_catches_unwritten_or_wrong_positions() -> None:
    pool = make_pool()
    kw, _, _, _ = inputs(pool, 3, 4)
    kw["seq_lens"], kw["extend_lens"] = torch.tensor([10, 5, 7]), torch.tensor([3, 5, 2])
    view = pool.extend.update_(4, **kw)
    pool.check(view)
    assert view.positions[:10].tolist() == [7, 8, 9, 0, 1, 2, 3, 4, 5, 6]
    good = view.positions.clone()
    view.positions[T - 1] = 2**31 - 1  # the poison sentinel: a graph would read it
    with pytest.raises(ReadRegionError, match=f"token {T - 1}"):
        pool.check(view)
    view.positions.copy_(good)
    view.positions[4] = 3  # a real row's positions must be consecutive up to its KV length
    with pytest.raises(ReadRegionError, match="row 1"):
        pool.check(view)


def test_overlay_and_report() -> None:
    """Extend overlays decode/verify/draft/draft extend; report and plan list its buffers."""
    pool = make_pool(num_draft_tokens=4)
    start = {ph: min(p.offset for p in pool.plan.placements if p.spec.phase is ph)
             for ph in (Phase.DECODE, Phase.VERIFY, Phase.DRAFT_EXTEND, Phase.EXTEND)}
    assert len(set(start.values())) == 1, start  # all overlaid phases start at the same byte
    assert pool.plan.nbytes < pool.plan.separate_nbytes
    assert "extend" in pool.report() and "positions" in pool.report()
    rows = [r for r in plan_arena(pool.cfg).as_dict()["buffers"]  # type: ignore[attr-defined]
            if r["phase"] == "extend"]
    assert {r["name"] for r in rows} >= {"cu_seqlens_q", "positions", "page_table"}
    assert {r["region"] for r in rows} == {"overlay"}
    kw, seq, ext, slots = inputs(pool, 4, 3)
    for _ in range(2):  # each update clobbers the other phase; the next one rewrites its bytes
        view = pool.extend.update_(5, **kw)
        pool.check(view)
        assert_extend_equal(view, None, extend_rows(seq, ext, slots, kw["req_to_token"], 5, 16,
                                                    T, 0, 1, 2))
        dec = pool.decode.update_(5, seq_lens=kw["seq_lens"], req_pool_indices=kw["req_pool_indices"],
                                  req_to_token=kw["req_to_token"])
        pool.check(dec)


def test_missing_phase_and_row_facts() -> None:
    plain = BufferPool(PoolConfig(max_bs=4, max_context_len=64, device="cpu"))
    with pytest.raises(MissingPhaseError, match="max_extend_tokens > 0"):
        _ = plain.extend
    pool = make_pool()
    assert Phase.EXTEND in pool.phases
    assert query_rows(pool, Phase.EXTEND, 1) == query_rows(pool, Phase.EXTEND, MAX_BS) == T
    assert rows_per_request(pool, Phase.EXTEND) == T
    assert query_rows(pool, Phase.DECODE, 4) == 4


# ---- errors: rejected before any write -------------------------------------------------------
def _bad() -> list[tuple[str, type[PoolError], Callable[[dict[str, object]], None]]]:
    def drop(*keys: str) -> Callable[[dict[str, object]], None]:
        return lambda kw: [kw.pop(k) for k in keys] and None

    def put(**upd: object) -> Callable[[dict[str, object]], None]:
        return lambda kw: kw.update({k: v(kw) if callable(v) else v for k, v in upd.items()})

    t = torch.tensor
    return [
        ("bs > max_bs", CapacityError, put(bs=MAX_BS + 1)),
        ("n > bs", CapacityError, put(bs=2)),
        ("extend_lens rows", InputError, put(extend_lens=lambda kw: kw["extend_lens"][:2])),
        ("float extend_lens", InputError, put(extend_lens=lambda kw: kw["extend_lens"].float())),
        ("extend_lens_cpu zero", CapacityError, put(extend_lens_cpu=[0, 1, 1])),
        ("extend_lens_cpu > seq_lens_cpu", CapacityError,
         put(seq_lens_cpu=[5, 5, 5], extend_lens_cpu=[1, 6, 1])),
        ("sum > max_extend_tokens", CapacityError, put(extend_lens_cpu=[T, 1, 1])),
        ("seq_lens_cpu > C", CapacityError, put(seq_lens_cpu=[1, C + 1, 1])),
        ("extend_lens_cpu count", InputError, put(extend_lens_cpu=[1, 1])),
        ("out_slots short (host)", CapacityError,
         put(extend_lens_cpu=[2, 2, 2], out_slots=t([0] * 5))),
        ("out_slots short (no host)", CapacityError, put(out_slots=t([0] * (T - 1)))),
        ("out_slots float", InputError, put(out_slots=torch.zeros(T))),
        ("out_slots 2-D", InputError, put(out_slots=torch.zeros(2, T, dtype=torch.int64))),
        ("out_slots strided", InputError,
         put(out_slots=torch.zeros(2 * T, dtype=torch.int64)[::2])),
        ("out_slots on meta", InputError,
         put(out_slots=torch.zeros(T, dtype=torch.int64, device="meta"))),
        ("req_to_token narrow", InputError, put(req_to_token=lambda kw: kw["req_to_token"][:, :9])),
        ("num_real with host copies", InputError,
         put(num_real=t([3]), extend_lens_cpu=[1, 1, 1])),
        ("missing extend_lens", PoolError, drop("extend_lens")),
    ]


@pytest.mark.parametrize("impl", [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)])
@pytest.mark.parametrize(("what", "err", "edit"), _bad(), ids=[c[0] for c in _bad()])
def test_rejected_update_changes_nothing(what: str, err: type[PoolError],
                                         edit: Callable[[dict[str, object]], None],
                                         impl: Impl) -> None:
    pool = make_pool(impl=impl)
    kw, _, _, _ = inputs(pool, 3, 0)
    pool.extend.update_(4, **kw)
    call: dict[str, object] = {"bs": 4, **kw, "out_slots": torch.full((T,), 7)}
    edit(call)
    slots = call["out_slots"]
    before = pool.arena.storage.clone()
    slots_before = slots.clone() if isinstance(slots, Tensor) and slots.device.type == "cpu" \
        else None
    with pytest.raises((err, TypeError)) as info:
        pool.extend.update_(**call)  # type: ignore[arg-type]
    if what == "missing extend_lens":
        assert info.type is TypeError  # a missing keyword argument is Python's error
    else:
        msg = str(info.value)
        assert isinstance(info.value, err) and ("got" in msg or "runs impl=" in msg), msg
    assert torch.equal(pool.arena.storage.view(torch.uint8), before.view(torch.uint8)), what
    if slots_before is not None and isinstance(slots, Tensor):
        assert torch.equal(slots, slots_before), what  # ints or zeros: never NaN


def test_num_real_needs_fused_path() -> None:
    pool = make_pool()
    kw, _, _, _ = inputs(pool, 3, 0)
    with pytest.raises(InputError, match="fused path"):
        pool.extend.update_(3, **kw, num_real=torch.tensor([3]))


def test_config_validation() -> None:
    with pytest.raises(PoolError, match="max_extend_tokens must be >= 0"):
        PoolConfig(max_bs=4, max_context_len=64, device="cpu", max_extend_tokens=-1)
    with pytest.raises(PoolError, match="2\\*\\*31"):
        PoolConfig(max_bs=4, max_context_len=64, device="cpu", max_extend_tokens=2**30)
    with pytest.raises(PoolError, match="must be an int"):
        PoolConfig(max_bs=4, max_context_len=64, device="cpu",
                   max_extend_tokens=1.5)  # type: ignore[arg-type]


# ---- KV cache: slots in the same call, cross-checked configs, attention == dense --------------
H, H_KV, D = 4, 2, 8


def _kv(pool: BufferPool, table: Tensor, max_tokens: int = T) -> KVCachePool:
    cfg = pool.cfg
    num_pages = int(table.max()) // cfg.page_size + 1
    return KVCachePool(KVCacheConfig(num_pages=num_pages, page_size=cfg.page_size,
                                     max_tokens=max_tokens, num_kv_heads=H_KV, head_dim=D,
                                     dtype=torch.float64, device="cpu"), poison=True)


def test_kv_config_cross_check() -> None:
    pool = make_pool(page=16, pad_page=0)
    table = make_batch(pool.cfg, 2, random.Random(0)).req_to_token
    kv = _kv(pool, table)
    kv.check_pool_config(pool.cfg)
    with pytest.raises(LayoutError, match="page_size must be the KV cache's 16, got 64"):
        kv.check_pool_config(make_pool(page=64, pad_page=0).cfg)
    with pytest.raises(LayoutError, match="pad_page must be the KV cache's 0, got 2"):
        kv.check_pool_config(PoolConfig(max_bs=2, max_context_len=64, page_size=16,
                                        device="cpu", pad_page=2))
    with pytest.raises(CapacityError, match=f"max_tokens must be >= {T} .*got {T - 1}"):
        _kv(pool, table, max_tokens=T - 1).check_pool_config(pool.cfg)
    with pytest.raises(LayoutError, match="num_pages"):
        kv.check_pool_config(PoolConfig(max_bs=2, max_context_len=64, page_size=16, device="cpu",
                                        pad_page=0, num_pages=kv.cfg.num_pages + 1))
    with pytest.raises(InputError, match="PoolConfig"):
        kv.check_pool_config(kv.cfg)


def _dense_keys(seq: list[int], ext: list[int], slots: list[int], table: Tensor) -> list[list[int]]:
    """Slots each packed query attends: its request's positions 0 .. prefix + j."""
    keys = []
    for i, (s, e) in enumerate(zip(seq, ext, strict=True)):
        row = [int(x) for x in table[slots[i], :s]]
        keys += [row[: s - e + j + 1] for j in range(e)]
    return keys


@pytest.mark.parametrize("layout", [Layout.FLASH_ATTN, Layout.FLASHINFER])
@pytest.mark.parametrize(("page", "n", "bs", "seed"), [(1, 3, 3, 0), (16, 4, 6, 1),
                                                        (64, 2, 5, 2), (16, 6, 6, 3)])
def test_attention_equals_dense_causal_with_prefix(layout: Layout, page: int, n: int, bs: int,
                                                   seed: int) -> None:
    """The prefix is in the cache; the update writes the new tokens' slots into the KV pool's
    slot mapping; their K/V are stored there; SDPA over the view == dense causal attention."""
    pool = BufferPool(PoolConfig(max_bs=MAX_BS, max_context_len=C, page_size=page, device="cpu",
                                 layout=layout, max_extend_tokens=T), poison=True)
    kw, seq, ext, slots = inputs(pool, n, seed)
    table = kw["req_to_token"]
    kv = _kv(pool, table)
    kv.check_pool_config(pool.cfg)
    gen = torch.Generator().manual_seed(seed)
    prefix_slots = [int(table[slots[i], p]) for i in range(n) for p in range(seq[i] - ext[i])]
    if prefix_slots:
        m = len(prefix_slots)
        kv.store_kv_(0, torch.randn(m, H_KV, D, generator=gen, dtype=torch.float64),
                     torch.randn(m, H_KV, D, generator=gen, dtype=torch.float64),
                     torch.tensor(prefix_slots))
    view = pool.extend.update_(bs, **kw, out_slots=kv.slot_view(T), extend_lens_cpu=ext,
                               seq_lens_cpu=seq)
    # the step's new K/V for all T packed rows; padded rows' slots are -1 and are skipped
    k_new = torch.randn(T, H_KV, D, generator=gen, dtype=torch.float64)
    v_new = torch.randn(T, H_KV, D, generator=gen, dtype=torch.float64)
    kv.store_kv_(0, k_new, v_new)
    kv.check_written(0, torch.tensor(prefix_slots + [s for s in kv.slot_mapping[:T].tolist()
                                                     if s >= 0]))
    q = torch.randn(sum(ext), H, D, generator=gen, dtype=torch.float64)
    got = sdpa.attention(view, q, kv.k_cache(0), kv.v_cache(0)).out
    want, _ = dense_attention(q, kv.k_cache(0), kv.v_cache(0),
                              _dense_keys(seq, ext, slots, table))
    assert torch.allclose(got, want, atol=1e-10, rtol=1e-10)


def test_graph_runner_eager_extend_on_cpu() -> None:
    """The runner's eager path on CPU takes the packed rows of the batch (<= T)."""
    pool = make_pool()
    seen: list[int] = []

    def fwd(view: ExtendView, x: Tensor) -> Tensor:
        seen.append(int(view.cu_seqlens_q[view.bs]))
        return x * 2

    runner = GraphRunner(pool, Phase.EXTEND, fwd, torch.empty(1, 3))
    assert runner._x.shape[0] == T
    kw, _, ext, _ = inputs(pool, 3, 5)
    x = torch.randn(sum(ext), 3)
    assert torch.equal(runner.run(x, **kw), x * 2)
    assert seen == [sum(ext)]
    with pytest.raises(InputError, match=f"<= {T}"):
        runner.run(torch.randn(T + 1, 3), **kw)


@pytest.mark.parametrize("impl", [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)])
def test_out_of_contract_inputs_stay_in_bounds(impl: Impl) -> None:
    """Values only a sync could check (lengths past T or the sequence, negative ones, rows
    outside the table) give wrong metadata on both paths: no raw IndexError, never a write
    outside the extend buffers or the caller's out_slots."""
    pool = make_pool(impl=impl, layout=Layout.BOTH)
    table = make_batch(pool.cfg, 1, random.Random(0)).req_to_token
    own = [(p.offset, p.offset + p.nbytes) for p in pool.plan.placements
           if p.spec.phase is Phase.EXTEND]
    outside = torch.ones(pool.nbytes, dtype=torch.bool)
    for lo, hi in own:
        outside[lo:hi] = False
    before = pool.arena.storage.clone()
    big = torch.full((3 * T,), 99, dtype=torch.int64)
    for seq, ext, rpi in (([10**6, -(10**6), 5], [10**6, 3, -(10**6)], [0, 1, 2]),
                          ([2**31 - 5, 7, 7], [2**31 - 5, 7, 7], [5, -3, 2**40]),
                          ([3, 3, 3], [3 * T, 3 * T, 3 * T], [0, 1, 2])):
        pool.extend.update_(5, seq_lens=torch.tensor(seq), extend_lens=torch.tensor(ext),
                            req_pool_indices=torch.tensor(rpi), req_to_token=table,
                            out_slots=big[T : 2 * T])
        assert torch.equal(pool.arena.storage[outside], before[outside])
        assert (big[:T] == 99).all() and (big[2 * T :] == 99).all()
