"""The host route (:mod:`attnpool.phases.host_lane`, :mod:`attnpool.update.host`): a CPU
engine's step in one C call, against the general path, which is its oracle.

Two pools of one config, both poisoned, take the same steps: one through ``host_step`` (the C
step where it takes the call, the general path where it does not), the other through
``update_`` (the general path). Their whole arenas hold the same bytes after every step and
their views the same host bounds; a bad input gets the same :class:`attnpool.PoolError` from
both, with nothing written."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch

from attnpool import BufferPool, Impl, Layout, PoolConfig, PoolError
from attnpool.phases._views import rebound
from attnpool.phases.host_lane import _rebind_offsets, _same_fields
from attnpool.update import host

PAGE, T, C, BS = 16, 64, 1024, 16


def _built() -> None:
    if host.load() is None:
        pytest.skip(f"the C step is not built here: {host.why()}")


def _cfg(window: int | None = None) -> PoolConfig:
    return PoolConfig(max_bs=BS, max_context_len=C, page_size=PAGE, device="cpu",
                      layout=Layout.FLASH_ATTN, max_extend_tokens=T, pad_page=0, num_pages=512,
                      impl=Impl.REFERENCE, sliding_window=window)


def _pools(window: int | None, monkeypatch: pytest.MonkeyPatch
           ) -> tuple[BufferPool, BufferPool, list[int]]:
    """(host route, general path, [calls of the route pool's ``update_``]): same config, both
    poisoned. Every ``host_step`` the C step does not write goes to ``update_``, so the C step
    wrote the others."""
    route, general = BufferPool(_cfg(window), poison=True), BufferPool(_cfg(window), poison=True)
    assert route.decode._lane is not None and route.extend._lane is not None
    general_calls = [0]
    for phase in (route.decode, route.extend):
        def counted(*a: Any, _update: Any = phase.update_, **k: Any) -> Any:
            general_calls[0] += 1
            return _update(*a, **k)

        monkeypatch.setattr(phase, "update_", counted)
    return route, general, general_calls


def _step(rng: random.Random, kind: str, n: int, dtype: torch.dtype, strided: bool = False
          ) -> dict[str, Any]:
    """One step's inputs: ``n`` rows of a 24-row block table; ``strided``: all 24 rows of a
    column slice of a wider table (rows contiguous, the row stride past the width, more rows
    than requests: vLLM's persistent table)."""
    ext = [1] * n
    if kind == "extend":
        for i in rng.sample(range(n), k=min(n, 2)):
            ext[i] = rng.randint(1, (T - n) // 2 + 1)
    seq = [rng.randint(e, C) for e in ext]
    width = C // PAGE
    table = torch.randint(1, 512, (24, 2 * width if strided else width), dtype=dtype)
    s: dict[str, Any] = {"seq_lens": torch.tensor(seq, dtype=dtype),
                         "block_table": (table[:, :width] if strided else table[:n])}
    if kind == "extend":
        s["extend_lens"] = torch.tensor(ext, dtype=dtype)
    return s


def _offsets(ext: torch.Tensor, base: int = 0, extra: int = 0) -> torch.Tensor:
    """Packed query offsets of ``ext`` (``cu_seqlens_q``), from ``base``, with ``extra`` rows
    past ``n + 1`` (vLLM's persistent buffer is taller than a step)."""
    cu = torch.zeros(ext.shape[0] + 1 + extra, dtype=ext.dtype)
    cu[1:ext.shape[0] + 1] = torch.cumsum(ext, 0)
    cu[ext.shape[0] + 1:] = cu[ext.shape[0]]
    return cu + base


def _host_step(pool: BufferPool, kind: str, bs: int, s: dict[str, Any]) -> Any:
    if kind == "decode":
        return pool.decode.host_step(bs, s["seq_lens"], s["block_table"])
    if "cu_seqlens_q" in s:
        return pool.extend.host_step_offsets(bs, s["seq_lens"], s["cu_seqlens_q"],
                                             s["block_table"])
    return pool.extend.host_step(bs, s["seq_lens"], s["extend_lens"], s["block_table"])


def _update(pool: BufferPool, kind: str, bs: int, s: dict[str, Any]) -> Any:
    """The general path with the host copies the tensors themselves (``host_step``'s
    meaning)."""
    if kind == "decode":
        return pool.decode.update_(bs, seq_lens=s["seq_lens"], block_table=s["block_table"],
                                   seq_lens_cpu=s["seq_lens"])
    if "cu_seqlens_q" in s:  # (host_step_offsets' meaning: the lengths off the offsets)
        cu, n = s["cu_seqlens_q"], s["seq_lens"].shape[0]
        if not (isinstance(cu, torch.Tensor) and cu.dtype in (torch.int32, torch.int64)
                and cu.shape[0] >= n + 1):
            return pool.extend.host_step_offsets(bs, s["seq_lens"], cu, s["block_table"])
        ext = cu[1:n + 1] - cu[:n]
        return pool.extend.update_(bs, seq_lens=s["seq_lens"], extend_lens=ext,
                                   block_table=s["block_table"], seq_lens_cpu=s["seq_lens"],
                                   extend_lens_cpu=ext)
    return pool.extend.update_(bs, seq_lens=s["seq_lens"], extend_lens=s["extend_lens"],
                               block_table=s["block_table"], seq_lens_cpu=s["seq_lens"],
                               extend_lens_cpu=s["extend_lens"])


def _bytes(pool: BufferPool) -> torch.Tensor:
    return pool.arena.storage.view(torch.uint8).clone()


@pytest.mark.parametrize("window", [None, 40])
def test_the_host_route_writes_the_general_paths_bytes(window: int | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Random decode and mixed steps (``n == bs`` and padded, int32 and int64, contiguous and
    taller and wider tables), interleaved: the same arena bytes and view bounds after every
    step; the C step wrote every int32 step, and none of the int64 ones."""
    _built()
    route, general, general_calls = _pools(window, monkeypatch)
    rng = random.Random(0)
    int64_steps = 0
    for _ in range(80):
        kind = rng.choice(["decode", "extend"])
        n = rng.randint(1, BS)
        bs = n if rng.random() < 0.6 else rng.randint(n, BS)
        dtype, strided = rng.choice([torch.int32, torch.int64]), rng.random() < 0.2
        s = _step(rng, kind, n, dtype, strided)
        if kind == "extend" and rng.random() < 0.5:  # (the queries as packed offsets)
            s["cu_seqlens_q"] = _offsets(s["extend_lens"], rng.choice([0, 5]), rng.randint(0, 3))
        got, want = _host_step(route, kind, bs, s), _update(general, kind, bs, s)
        int64_steps += dtype is torch.int64
        assert torch.equal(_bytes(route), _bytes(general)), (kind, n, bs, dtype, strided)
        assert (got.max_seqlen_q, got.max_seqlen_k) == (want.max_seqlen_q, want.max_seqlen_k)
        assert type(got) is type(want) and got.bs == want.bs
        assert got.is_current and want.is_current
        assert route.arena._own == general.arena._own  # (the same record of who wrote what)
    assert general_calls[0] == int64_steps and 80 - int64_steps > 20


def _bad_calls(pool: BufferPool) -> list[tuple[str, str, int, dict[str, Any]]]:
    """(label, kind, bs, inputs): one input wrong in each, the rest a good step."""
    rng = random.Random(1)
    out: list[tuple[str, str, int, dict[str, Any]]] = []
    for kind in ("decode", "extend"):
        def good(kind: str = kind) -> dict[str, Any]:
            return _step(rng, kind, 4, torch.int32)

        s = good()
        s["seq_lens"] = s["seq_lens"].float()
        out.append(("float seq_lens", kind, 4, s))
        s = good()
        s["seq_lens"] = torch.tensor([1, 2, 0, 3], dtype=torch.int32)
        out.append(("a zero length", kind, 4, s))
        s = good()
        s["seq_lens"] = torch.tensor([C + 1, 9, 9, 9], dtype=torch.int32)
        out.append(("a length past max_context_len", kind, 4, s))
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
        s["seq_lens"] = pool.decode.view(4).cache_seqlens
        out.append(("seq_lens inside the arena", kind, 4, s))
        s = good()
        s["block_table"] = s["block_table"].to_sparse()
        out.append(("a sparse table", kind, 4, s))
    s = _step(rng, "extend", 4, torch.int32)
    s["extend_lens"] = s["seq_lens"] + 1
    out.append(("more new tokens than the sequence", "extend", 4, s))
    s = _step(rng, "extend", 4, torch.int32)
    s["seq_lens"] = torch.full((4,), T, dtype=torch.int32)
    s["extend_lens"] = torch.full((4,), T, dtype=torch.int32)
    out.append(("more tokens than max_extend_tokens", "extend", 4, s))
    s = _step(rng, "extend", 4, torch.int32)
    s["extend_lens"] = s["extend_lens"][:3]
    out.append(("extend_lens of the wrong length", "extend", 4, s))
    s = _step(rng, "extend", 4, torch.int32)
    s["cu_seqlens_q"] = _offsets(s["extend_lens"])[:4]
    out.append(("cu_seqlens_q of n rows", "extend", 4, s))
    s = _step(rng, "extend", 4, torch.int32)
    s["cu_seqlens_q"] = _offsets(s["extend_lens"]).flip(0)
    out.append(("decreasing cu_seqlens_q", "extend", 4, s))
    s = _step(rng, "extend", 4, torch.int32)
    s["cu_seqlens_q"] = _offsets(s["extend_lens"]).float()
    out.append(("float cu_seqlens_q", "extend", 4, s))
    s = _step(rng, "extend", 4, torch.int32)
    s["cu_seqlens_q"] = _offsets(s["seq_lens"] + 1)
    out.append(("offsets of more new tokens than the sequence", "extend", 4, s))
    return out


@pytest.mark.parametrize("window", [None, 40])
def test_bad_input_gets_the_general_paths_error_before_any_write(
        window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bad call: the same error type and message from ``host_step`` as from
    ``update_``, and the arena's bytes as they were (the C step declines and writes nothing;
    the input pass raises)."""
    route, general, general_calls = _pools(window, monkeypatch)
    for pool in (route, general):  # (a written state first: a rejected call must keep it)
        _update(pool, "decode", 4, _step(random.Random(2), "decode", 4, torch.int32))
    for (label, kind, bs, s), (_, _, _, s2) in zip(_bad_calls(route), _bad_calls(general),
                                                   strict=True):
        before = _bytes(route)
        with pytest.raises(PoolError) as got:
            _host_step(route, kind, bs, s)
        with pytest.raises(PoolError) as want:
            _update(general, kind, bs, s2)
        assert type(got.value) is type(want.value), label
        assert str(got.value) == str(want.value).replace(
            str(general.decode.view(4).cache_seqlens.data_ptr()),
            str(route.decode.view(4).cache_seqlens.data_ptr())), label
        assert torch.equal(_bytes(route), before), label
    # (every bad call goes to update_, but for a cu_seqlens_q that is no int tensor of n + 1
    # rows: the offsets' own check refuses it first)
    assert general_calls[0] == 1 + len(_bad_calls(general)) - 2


def test_validation_and_a_missing_c_step_take_the_general_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation mode (read per call, by the bound step too) and a pool built while the C
    step is turned off (``ATTNPOOL_NATIVE=0``): ``host_step`` is ``update_``, the same bytes,
    nothing written by the C step."""
    rng = random.Random(3)
    route, general, general_calls = _pools(None, monkeypatch)
    route.decode.validate = general.decode.validate = True
    s = _step(rng, "decode", 4, torch.int32)
    _host_step(route, "decode", 4, s)
    _update(general, "decode", 4, s)
    assert general_calls[0] == 1 and torch.equal(_bytes(route), _bytes(general))
    monkeypatch.setattr(host, "_state", [None])
    monkeypatch.setenv(host.ENV, "0")
    off = BufferPool(_cfg(), poison=True)
    assert "turned off" in host.why()
    assert off.decode.host_step == off.decode._host_step  # (the Python step, no C call)
    plain = BufferPool(_cfg(), poison=True)
    e = _step(rng, "extend", 5, torch.int32)
    got, want = _host_step(off, "extend", 6, e), _update(plain, "extend", 6, e)
    assert torch.equal(_bytes(off), _bytes(plain))
    assert (got.max_seqlen_q, got.max_seqlen_k) == (want.max_seqlen_q, want.max_seqlen_k)


def test_a_missing_c_step_is_logged_once(monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """Where the install built no C step, the first load says so once, with what runs
    instead; later loads are silent."""
    monkeypatch.setattr(host, "_state", [None])
    monkeypatch.delenv(host.ENV, raising=False)
    monkeypatch.setitem(sys.modules, "attnpool.update.host._lane", None)  # (import fails)
    monkeypatch.delattr(host, "_lane", raising=False)
    with caplog.at_level(logging.INFO, logger="attnpool"):
        assert host.load() is None
        assert host.load() is None
    records = [r for r in caplog.records if r.name == "attnpool"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "general path" in records[0].getMessage() and "not built" in host.why()


def test_a_gpu_or_fused_pool_has_no_host_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The route serves a CPU pool on the reference path with page tables only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a fused pool on CPU (set on GPU machines too)
    pytest.importorskip("triton")
    for cfg in (replace(_cfg(), impl=Impl.TRITON), replace(_cfg(), layout=Layout.FLASHINFER)):
        pool = BufferPool(cfg)
        assert pool.decode._lane is None and pool.extend._lane is None
        s = _step(random.Random(4), "decode", 3, torch.int32)
        view = pool.decode.host_step(3, s["seq_lens"], s["block_table"])
        assert view.max_seqlen_k == int(s["seq_lens"].max())


@pytest.mark.parametrize("window", [None, 40])
def test_the_c_rebind_makes_rebounds_view(window: int | None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The C step's view of a step is :func:`attnpool.phases._views.rebound`'s, field by field
    (window part included), and the bound ``host_step`` is one C call once a size has its
    sliced view."""
    _built()
    route, _, _ = _pools(window, monkeypatch)
    module = host.load()
    rng = random.Random(5)
    for kind in ("decode", "extend"):
        phase = route.decode if kind == "decode" else route.extend
        assert type(phase.host_step) is not type(phase._host_step)
        # the bound step's fallbacks (its Python form: a size's first step, which slices the
        # view the C step rebinds from then on), counted
        state = phase._lane._state  # type: ignore[union-attr]
        fallbacks = [0]
        for i in (-2, -1):
            if state[i] is not None:
                def counted(*a: Any, _f: Any = state[i], _n: list[int] = fallbacks) -> Any:
                    _n[0] += 1
                    return _f(*a)

                state[i] = counted
        for bs, first in ((3, True), (3, False), (7, True), (7, False), (3, False)):
            before = fallbacks[0]
            s = _step(rng, kind, bs, torch.int32)
            got = _host_step(route, kind, bs, s)
            assert fallbacks[0] - before == (1 if first else 0), (kind, bs)
            offsets = phase._lane._offsets  # type: ignore[union-attr]
            assert type(offsets) is tuple
            base = phase._sliced[bs]
            want = rebound(base, got.max_seqlen_q, got.max_seqlen_k, phase._window_k)
            assert _same_fields(got, want)
            assert _rebind_offsets(module, base, phase._window_k) == offsets


def test_with_slots_copies_a_slotted_object_with_some_slots_set() -> None:
    """``with_slots``: a new object of the template's class, every field the template's but
    the ones named, which hold the values given; bad offsets, a count that does not match and
    an object with a ``__dict__`` are refused, the template untouched."""
    import struct
    from dataclasses import dataclass, fields

    _built()
    module = host.load()
    assert module is not None

    @dataclass(slots=True)
    class Rec:
        a: object
        b: object
        c: object = None

    template = Rec([1], "x")
    offsets = struct.pack("<2q", module.slot_offset(Rec.a), module.slot_offset(Rec.c))
    got = module.with_slots(template, offsets, 7, (8,))
    assert type(got) is Rec and got is not template
    assert (got.a, got.b, got.c) == (7, "x", (8,)) and got.b is template.b
    assert (template.a, template.c) == ([1], None)
    assert [f.name for f in fields(got)] == ["a", "b", "c"]
    for bad, err in ((struct.pack("<2q", 0, 16), ValueError),   # inside the object header
                     (struct.pack("<2q", 16, 4096), ValueError),  # past the object
                     (struct.pack("<2q", 16, 20), ValueError),    # not a slot's start
                     (struct.pack("<1q", 16), TypeError)):         # one offset, two values
        with pytest.raises(err):
            module.with_slots(template, bad, 1, 2)
    with pytest.raises(TypeError):
        module.with_slots(object.__new__(type("Plain", (), {})), struct.pack("<1q", 16), 1)

    class Raw(float):  # (slots past a built-in's raw C fields: never copied as references)
        __slots__ = ("a",)

    for obj, offsets_, values in ((1.5, b"", ()),
                                  (Raw(2.0), struct.pack("<1q", module.slot_offset(Raw.a)), (3,))):
        with pytest.raises(TypeError):
            module.with_slots(obj, offsets_, *values)
        with pytest.raises((TypeError, ValueError)):
            module.rebind(obj, struct.pack("<3q", 16, 16, 16), 1, 2, 0)
    assert (template.a, template.b, template.c) == ([1], "x", None)


def test_first_updates_in_a_fresh_process_compile_nothing(tmp_path: Any) -> None:
    """A fresh process, with no compiler on its ``PATH`` and an empty home: its first decode
    and extend steps run on the C step that the install built (nothing is compiled or
    written at run time)."""
    _built()
    code = ("import torch; from attnpool import BufferPool, PoolConfig; "
            "from attnpool.update import host; "
            "p = BufferPool(PoolConfig(max_bs=4, max_context_len=256, page_size=16, "
            "device='cpu', max_extend_tokens=64)); "
            "t = torch.arange(1, 33, dtype=torch.int32).view(2, 16); "
            "l = torch.tensor([20, 30], dtype=torch.int32); "
            "p.decode.host_step(2, l, t); "
            "p.extend.host_step(2, l, torch.ones(2, dtype=torch.int32), t); "
            "print(host.why())")
    env = {**os.environ, "PATH": str(tmp_path), "HOME": str(tmp_path)}
    env.pop(host.ENV, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.startswith("in use"), done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_install_built_the_c_step_in_ci() -> None:
    """On CI (a compiler present at install), the C step is built and loads."""
    if not os.environ.get("CI"):
        pytest.skip("checked on CI, whose install has a C compiler")
    assert host.load() is not None, host.why()
