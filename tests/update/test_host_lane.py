"""The host lane (:mod:`attnpool.phases.host_lane`): a CPU engine's step, straight through.

Two pools of one config, one with its lanes turned off (every call the general way), take the
same calls: their arenas hold the same bytes after every step, their views the same host
bounds, and a bad input gets the same error from both with nothing written. Each test runs the
lane twice: with its native step (:mod:`attnpool.update.native`, compiled here with the
system's C compiler) and with the torch lane alone."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnpool import BufferPool, Impl, Layout, PoolConfig, PoolError
from attnpool.phases.host_lane import HostLane
from attnpool.update import native

PAGE, T, C, BS = 16, 64, 1024, 16


@pytest.fixture(params=[True, False], ids=["native", "torch"])
def use_native(request: pytest.FixtureRequest) -> bool:
    """Whether the lanes run their native step (the torch lane alone otherwise)."""
    if request.param and native.load() is None:
        pytest.skip(f"the native step is not built here: {native.why()}")
    return bool(request.param)


def _pools(window: int | None, monkeypatch: pytest.MonkeyPatch, use_native: bool
           ) -> tuple[BufferPool, BufferPool, list[int]]:
    """(with lanes, without, [calls the lanes took: torch lane, native step]): same config,
    both poisoned."""
    cfg = PoolConfig(max_bs=BS, max_context_len=C, page_size=PAGE, device="cpu",
                     layout=Layout.FLASH_ATTN, max_extend_tokens=T, pad_page=0, num_pages=512,
                     impl=Impl.REFERENCE, sliding_window=window)
    lane, general = BufferPool(cfg, poison=True), BufferPool(cfg, poison=True)
    taken = [0, 0]
    assert lane.decode._lane is not None and lane.extend._lane is not None
    write: Callable[..., None] = HostLane.write

    def counted(self: HostLane, *a: Any, **k: Any) -> None:
        taken[0] += 1
        write(self, *a, **k)

    def counting(step: Callable[..., Any]) -> Callable[..., Any]:
        def counted_step(*a: Any) -> Any:  # (every native step goes through host_step)
            got = step(*a)
            taken[1] += got is not None
            return got
        return counted_step

    monkeypatch.setattr(HostLane, "write", counted)
    if use_native:
        assert lane.decode._lane._step is not None and lane.extend._lane._step is not None
    else:  # (the torch lane only: no C step, bound or not)
        lane.decode._lane._step = lane.extend._lane._step = None
        lane.decode.host_step, lane.extend.host_step = (lane.decode._host_step,
                                                        lane.extend._host_step)
    lane.decode.host_step = counting(lane.decode.host_step)  # type: ignore[method-assign]
    lane.extend.host_step = counting(lane.extend.host_step)  # type: ignore[method-assign]
    general.decode._lane = general.extend._lane = None
    return lane, general, taken


def _step(rng: random.Random, kind: str, n: int, dtype: torch.dtype, in_order: bool
          ) -> dict[str, Any]:
    """One step's inputs: ``n`` rows of a 24-row block table (in batch order, or picked by
    ``req_pool_indices``), host copies the inputs themselves."""
    ext = [1] * n
    if kind == "extend":
        for i in rng.sample(range(n), k=min(n, 2)):
            ext[i] = rng.randint(1, (T - n) // 2 + 1)
    seq = [rng.randint(e, C) for e in ext]
    table = torch.randint(1, 512, (24, C // PAGE), dtype=dtype)
    lens = torch.tensor(seq, dtype=dtype)
    s: dict[str, Any] = {"seq_lens": lens, "seq_lens_cpu": lens}
    if in_order:
        s["block_table"] = table[:n]
    else:
        s["block_table"] = table
        s["req_pool_indices"] = torch.tensor(rng.sample(range(24), k=n), dtype=dtype)
    if kind == "extend":
        e = torch.tensor(ext, dtype=dtype)
        s["extend_lens"] = s["extend_lens_cpu"] = e
    return s


def _update(pool: BufferPool, kind: str, bs: int, s: dict[str, Any]) -> Any:
    return (pool.decode if kind == "decode" else pool.extend).update_(bs, **s)


def _bytes(pool: BufferPool) -> torch.Tensor:
    return pool.arena.storage.view(torch.uint8).clone()


def _bounds(view: Any) -> tuple[int, ...]:
    return (view.max_seqlen_q, view.max_seqlen_k)


@pytest.mark.parametrize("window", [None, 40])
def test_the_lane_writes_the_general_paths_bytes(window: int | None, use_native: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Random decode and mixed steps (``n == bs`` and padded, rows in order and picked, int32
    and int64 inputs), interleaved: the same arena bytes and view bounds after every step, and
    the lanes took every one of them; with the native step, every step of its shape (int32,
    rows in order) natively, the others by the torch lane."""
    lane, general, taken = _pools(window, monkeypatch, use_native)
    rng = random.Random(0)
    steps = natives = 0
    for _ in range(60):
        kind = rng.choice(["decode", "extend"])
        n = rng.randint(1, BS)
        bs = n if rng.random() < 0.6 else rng.randint(n, BS)
        dtype, in_order = rng.choice([torch.int32, torch.int64]), rng.random() < 0.7
        s = _step(rng, kind, n, dtype, in_order)
        got, want = _update(lane, kind, bs, s), _update(general, kind, bs, s)
        steps += 1
        natives += use_native and dtype is torch.int32 and in_order
        assert torch.equal(_bytes(lane), _bytes(general)), (kind, n, bs)
        assert _bounds(got) == _bounds(want)
        assert got.is_current and want.is_current
        assert type(got) is type(want)
    assert taken == [steps - natives, natives]
    assert natives > 10 or not use_native


def _bad_calls(pool: BufferPool) -> list[tuple[str, str, int, dict[str, Any]]]:
    """(label, kind, bs, inputs): one input wrong in each, the rest a good step."""
    rng = random.Random(1)
    out: list[tuple[str, str, int, dict[str, Any]]] = []
    for kind in ("decode", "extend"):
        def good(kind: str = kind) -> dict[str, Any]:
            return _step(rng, kind, 4, torch.int32, True)

        s = good()
        s["seq_lens"] = s["seq_lens"].float()
        out.append(("float seq_lens", kind, 4, s))
        s = good()
        s["seq_lens_cpu"] = torch.tensor([1, 2, 0, 3], dtype=torch.int32)
        out.append(("a zero host length", kind, 4, s))
        s = good()
        s["seq_lens_cpu"] = s["seq_lens"] = torch.tensor([C + 1, 9, 9, 9], dtype=torch.int32)
        out.append(("a length past max_context_len", kind, 4, s))
        s = good()
        s["seq_lens_cpu"] = s["seq_lens"][:3]
        out.append(("a short host copy", kind, 4, s))
        out.append(("bs below n", kind, 3, good()))
        out.append(("bs past max_bs", kind, BS + 1, good()))
        out.append(("bs past int64", kind, 2 ** 70, good()))
        s = good()
        s["block_table"] = s["block_table"][:, :10]
        out.append(("a narrow block table", kind, 4, s))
        s = good()
        s["block_table"] = s["block_table"][:2]
        out.append(("too few table rows", kind, 4, s))
        s = good()
        s["block_table"] = s["block_table"].t().contiguous().t()
        out.append(("a column-major table", kind, 4, s))
        s = good()
        s["req_pool_indices"] = torch.zeros(4)
        out.append(("float req_pool_indices", kind, 4, s))
        s = good()
        s["seq_lens"] = pool.decode.view(4).cache_seqlens
        out.append(("seq_lens inside the arena", kind, 4, s))
        s = good()
        s["seq_lens_cpu"] = [1.5, 2, 3, 4]
        out.append(("a float in the host list", kind, 4, s))
    s = _step(rng, "extend", 4, torch.int32, True)
    s["extend_lens"] = s["extend_lens_cpu"] = s["seq_lens"] + 1
    out.append(("more new tokens than the sequence", "extend", 4, s))
    s = _step(rng, "extend", 4, torch.int32, True)
    s["seq_lens"] = s["seq_lens_cpu"] = torch.tensor([2, 3, 2, 3], dtype=torch.int32)
    s["extend_lens"] = s["extend_lens_cpu"] = torch.tensor([3, 3, 2, 3], dtype=torch.int32)
    out.append(("one row's new tokens past its length, the total inside T", "extend", 4, s))
    s = _step(rng, "extend", 4, torch.int32, True)
    s["extend_lens"] = s["extend_lens_cpu"] = torch.full((4,), T, dtype=torch.int32)
    s["seq_lens"] = s["seq_lens_cpu"] = torch.full((4,), T, dtype=torch.int32)
    out.append(("more tokens than max_extend_tokens", "extend", 4, s))
    s = _step(rng, "extend", 4, torch.int32, True)
    s["extend_lens"] = s["extend_lens_cpu"] = s["extend_lens"][:3]
    out.append(("extend_lens of the wrong length", "extend", 4, s))
    return out


@pytest.mark.parametrize("window", [None, 40])
def test_bad_input_gets_the_general_paths_error_before_any_write(
        window: int | None, use_native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    lane, general, taken = _pools(window, monkeypatch, use_native)
    for pool in (lane, general):  # (a written state first: a rejected call must keep it)
        _update(pool, "decode", 4, _step(random.Random(2), "decode", 4, torch.int32, True))
    for (label, kind, bs, s), (_, _, _, s2) in zip(_bad_calls(lane), _bad_calls(general),
                                                   strict=True):
        before = _bytes(lane)
        with pytest.raises(PoolError) as got:
            _update(lane, kind, bs, s)
        with pytest.raises(PoolError) as want:
            _update(general, kind, bs, s2)
        assert type(got.value) is type(want.value), label
        assert str(got.value).split(",")[0] == str(want.value).split(",")[0], label
        assert torch.equal(_bytes(lane), before), label
    assert taken[1] == use_native  # (the first, good step; no bad one written natively)


def test_calls_outside_the_lanes_shape_go_the_general_way(
        use_native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation mode, ``request_ids``, ``out_slots`` and a host copy that is not the
    tensor itself: the general path (the lane writes nothing), with the same bytes."""
    lane, general, taken = _pools(None, monkeypatch, use_native)
    rng = random.Random(3)
    s = _step(rng, "decode", 4, torch.int32, True)
    e = _step(rng, "extend", 4, torch.int32, True)
    e["extend_lens_cpu"] = e["extend_lens"].tolist()
    f = _step(rng, "extend", 4, torch.int32, True)
    for pool in (lane, general):
        pool.decode.update_(4, request_ids=[1, 2, 3, 4], **s)
        pool.decode.validate = True
        pool.decode.update_(4, **s)
        pool.decode.validate = False
        pool.extend.update_(4, **e)
        pool.extend.update_(4, out_slots=torch.empty(T, dtype=torch.int64), **f)
    assert taken == [0, 0]
    assert torch.equal(_bytes(lane), _bytes(general))


def test_a_gpu_or_fused_pool_has_no_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a fused pool on CPU (set on GPU machines too)
    for cfg in (PoolConfig(max_bs=4, max_context_len=64, page_size=PAGE, device="cpu",
                           layout=Layout.FLASHINFER, max_extend_tokens=T),
                PoolConfig(max_bs=4, max_context_len=64, page_size=PAGE, device="cpu",
                           layout=Layout.FLASH_ATTN, max_extend_tokens=T, impl=Impl.TRITON)):
        pool = BufferPool(cfg)
        assert pool.decode._lane is None and pool.extend._lane is None


@pytest.mark.parametrize("window", [None, 40])
def test_the_native_rebind_makes_rebounds_view(window: int | None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """After a phase's first view of a batch size, the native step also makes the step's view
    (the sliced view rebound with the step's bounds, window part included) in the same call:
    the phase makes none itself, and the view is :func:`rebound`'s field by field. The
    module's ``rebind`` makes the same view for any bounds, holding one reference per field; a
    class it cannot serve is left to :func:`rebound`."""
    from attnpool.phases._views import rebound
    from attnpool.phases.host_lane import _rebind_offsets, _same_fields

    module = native.load()
    if module is None:
        pytest.skip(f"the native step is not built here: {native.why()}")
    lane, general, _ = _pools(window, monkeypatch, True)
    rng = random.Random(4)
    for kind in ("decode", "extend"):
        phase = lane.decode if kind == "decode" else lane.extend
        made = [0]
        view = phase._view

        def counted(*a: Any, view: Any = view, made: list[int] = made) -> Any:
            made[0] += 1
            return view(*a)

        monkeypatch.setattr(phase, "_view", counted)
        for bs in (1, 5, BS):
            for i in range(3):  # (the first slices the view of bs rows, the others rebind it)
                s = _step(rng, kind, bs if i else max(1, bs - 1), torch.int32, True)
                got, want = _update(lane, kind, bs, s), _update(general, kind, bs, s)
                assert _bounds(got) == _bounds(want) and type(got) is type(want)
                assert _same_fields(got, rebound(phase._sliced[bs], *_bounds(got),
                                                 phase._window_k))
                assert (got.window is not None) == (window is not None)
            base, k = phase._sliced[bs], phase._window_k
            offsets = phase._lane._offsets
            assert type(offsets) is tuple and offsets[0] is type(base)
            for q, kk in ((1, 1), (3, 700), (T, C), (9, k + 5)):
                one = module.rebind(base, offsets[1], q, kk, k)
                assert _same_fields(one, rebound(base, q, kk, k)), (kind, bs, q, kk)
            # (references: each view holds one of every field, and gives it back when freed)
            t, before = base.cache_seqlens, sys.getrefcount(base.cache_seqlens)
            many = [module.rebind(base, offsets[1], 2, 9, k) for _ in range(50)]
            assert sys.getrefcount(t) == before + 50
            del many
            assert sys.getrefcount(t) == before
        assert made[0] == 3  # (one view per batch size made by the phase)
    assert _rebind_offsets(module, object(), 0) is False


def test_prepare_views_slices_ahead_and_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare_views`` slices each size's view without writing a byte; the first update of a
    prepared size then reuses those tensors (no slicing in the step); a size past ``max_bs``
    is refused."""
    lane, _, _ = _pools(None, monkeypatch, native.load() is not None)
    before = _bytes(lane)
    for phase in (lane.decode, lane.extend):
        phase.prepare_views(range(1, BS + 1))
        assert sorted(phase._sliced) == list(range(1, BS + 1))
    assert torch.equal(_bytes(lane), before)
    for kind in ("decode", "extend"):
        phase = lane.decode if kind == "decode" else lane.extend
        got = _update(lane, kind, 3, _step(random.Random(5), kind, 3, torch.int32, True))
        assert got.cache_seqlens is phase._sliced[3].cache_seqlens
    with pytest.raises(PoolError):
        lane.decode.prepare_views([BS + 1])


def _host_step(pool: BufferPool, kind: str, bs: int, s: dict[str, Any]) -> Any:
    if kind == "decode":
        return pool.decode.host_step(bs, s["seq_lens"], s["block_table"])
    return pool.extend.host_step(bs, s["seq_lens"], s["extend_lens"], s["block_table"])


@pytest.mark.parametrize("window", [None, 40])
def test_host_step_is_update_in_one_native_call(window: int | None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``host_step`` (an engine builder's first call on a CPU pool) writes what ``update_``
    writes on the general path and returns a view with its bounds, for every step the native
    step takes; every bad call of the adversarial list it returns None for, with nothing
    written, and ``update_`` then raises as ever; so do calls it does not take (int64 inputs,
    a tensor subclass: ``update_`` serves them; strided lengths: ``update_`` refuses them)."""
    if native.load() is None:
        pytest.skip(f"the native step is not built here: {native.why()}")
    lane, general, _ = _pools(window, monkeypatch, True)
    rng = random.Random(7)
    for i in range(40):
        kind = ("decode", "extend")[i % 2]
        n = rng.randint(1, BS)
        bs = n if i % 3 else rng.randint(n, BS)
        s = _step(rng, kind, n, torch.int32, True)
        got = _host_step(lane, kind, bs, s)
        want = _update(general, kind, bs, s)
        assert got is not None and type(got) is type(want)
        assert torch.equal(_bytes(lane), _bytes(general)), (kind, n, bs)
        assert _bounds(got) == _bounds(want) and got.is_current
    s = _step(rng, "decode", 3, torch.int32, True)
    others = {"int64 lengths": (s["seq_lens"].long(), s["block_table"]),
              "a Parameter table": (s["seq_lens"], torch.nn.Parameter(s["block_table"],
                                                                     requires_grad=False)),
              "strided lengths": (s["seq_lens"].repeat_interleave(2)[::2], s["block_table"])}
    for label, (lens, table) in others.items():
        before = _bytes(lane)
        assert lane.decode.host_step(3, lens, table) is None, label
        assert torch.equal(_bytes(lane), before), label
        if label == "strided lengths":  # (refused by every path)
            with pytest.raises(PoolError, match="contiguous"):
                lane.decode.update_(3, seq_lens=lens, block_table=table, seq_lens_cpu=lens)
            continue
        view = lane.decode.update_(3, seq_lens=lens, block_table=table, seq_lens_cpu=lens)
        want = general.decode.update_(3, seq_lens=lens, block_table=table, seq_lens_cpu=lens)
        assert torch.equal(_bytes(lane), _bytes(general)) and _bounds(view) == _bounds(want)
    for label, kind, bs, s in _bad_calls(lane):  # (last: its list writes a capture view)
        if set(s) - {"seq_lens", "extend_lens", "block_table", "seq_lens_cpu",
                     "extend_lens_cpu"} or s.get("seq_lens_cpu") is not s["seq_lens"]:
            continue  # (not a call of host_step's shape)
        before = _bytes(lane)
        assert _host_step(lane, kind, bs, s) is None, label
        assert torch.equal(_bytes(lane), before), label
        with pytest.raises(PoolError):
            _update(lane, kind, bs, s)


def test_the_bound_host_step_is_the_python_step_in_one_call(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """``host_step`` is one C call (``HostLane.bind``) once the phase has a sliced view of
    the size and the native rebind serves its class: before that a step goes to the phase's
    Python step, after it no step enters Python. Either way the arena records the same write
    (a new generation, the phase owning its regions with the step's rows), so views of the
    other phase turn stale and the step's own view is current, as after the Python step."""
    module = native.load()
    if module is None:
        pytest.skip(f"the native step is not built here: {native.why()}")
    (lane, _, _), (py, _, _) = _pools(40, monkeypatch, True), _pools(40, monkeypatch, True)
    for phase in (py.decode, py.extend):  # (the same pool with the Python step only)
        phase.host_step = phase._host_step  # type: ignore[method-assign]
    assert type(lane.decode.host_step) is not type(lane.decode._host_step)
    calls = [0]
    native_step = HostLane.native

    def counted(self: HostLane, *a: Any) -> Any:
        calls[0] += 1
        return native_step(self, *a)

    monkeypatch.setattr(HostLane, "native", counted)
    rng = random.Random(11)
    seen: set[tuple[str, int, bool]] = set()
    for i in range(30):
        kind = ("decode", "extend")[i % 2]
        bs = rng.choice([2, 5, BS])
        s = _step(rng, kind, bs, torch.int32, True)
        other = (lane.extend if kind == "decode" else lane.decode).view(bs)
        (py.extend if kind == "decode" else py.decode).view(bs)  # (a view may pad its rows)
        phase = lane.decode if kind == "decode" else lane.extend
        fresh = bs not in phase._sliced or phase._lane._offsets is None  # type: ignore[union-attr]
        before = calls[0]
        got, want = _host_step(lane, kind, bs, s), _host_step(py, kind, bs, s)
        assert got is not None and want is not None and _bounds(got) == _bounds(want)
        assert torch.equal(_bytes(lane), _bytes(py)), (kind, bs)
        assert calls[0] - before == (2 if fresh else 1)  # (py's: always)
        seen.add((kind, bs, fresh))
        assert lane.arena._own == py.arena._own  # (both arenas: the same generations)
        assert got.is_current and not other.is_current
    assert {f for _, _, f in seen} == {True, False}
    lane.decode.validate = True  # (read per call: validation turns the bound step off)
    s = _step(rng, "decode", 3, torch.int32, True)
    before = _bytes(lane)
    assert lane.decode.host_step(3, s["seq_lens"], s["block_table"]) is None
    assert torch.equal(_bytes(lane), before)
    with pytest.raises(TypeError, match="phase_step"):
        module.phase_step([], 3, s["seq_lens"], s["block_table"])


def test_host_step_declines_a_pool_without_the_lane_or_in_validation() -> None:
    s = _step(random.Random(8), "decode", 2, torch.int32, True)
    for pool in (BufferPool(PoolConfig(max_bs=4, max_context_len=C, page_size=PAGE,
                                       device="cpu", layout=Layout.FLASHINFER,
                                       max_extend_tokens=T)),
                 BufferPool(PoolConfig(max_bs=4, max_context_len=C, page_size=PAGE,
                                       device="cpu", layout=Layout.FLASH_ATTN,
                                       max_extend_tokens=T), validate=True)):
        assert pool.decode.host_step(2, s["seq_lens"], s["block_table"]) is None
        assert pool.extend.host_step(2, s["seq_lens"], s["seq_lens"], s["block_table"]) is None
