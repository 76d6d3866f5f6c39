"""The host route: an engine's step on a CPU pool, checked and written by one C call.

An engine's metadata builder calls the pool once per step (and KV-cache group), on the host,
between two forwards. On a CPU its whole cost is host time, spent on code the model's forward
has just pushed out of the caches, so what a step costs is mostly how much code it walks: the
general update (the input pass's record, the launch cache, the bound part and its record
fields) is several times an engine's own builder there even when its torch ops are few.

A CPU step takes one of two routes, no more:

- **the host route**, :attr:`DecodePhase.host_step <attnpool.phases.decode.DecodePhase.host_step>`
  and :attr:`ExtendPhase.host_step <attnpool.phases.extend.ExtendPhase.host_step>`: the C step
  of :mod:`attnpool.update.host` (built at install time) checks every value, then writes every
  field and rebinds the phase's view, in one call;
- **the general path**, ``update_``: the input pass checks the caller's tensors (the one
  checker, which raises :class:`attnpool.PoolError` before any write) and the phase's update
  path writes; it is the oracle the tests compare the host route with, byte for byte.

The host route takes the shape engines step with: a pool in host memory on the reference path,
page tables and no CSR (``Layout.FLASH_ATTN``), no FlashMLA schedule (a window part is served,
its table the request table), int32 CPU tensors with contiguous rows, the host copies being the
tensors themselves, validation off. Every other call, and every bad value, goes to ``update_``
before anything is written, so each route raises the same error with the pool unchanged.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from torch import Tensor

from ..config import Impl, Layout, ceil_div
from ..update import host as _host
from ..update.buffers import PagedBuffers
from ..views import PagedView
from ._views import rebound

if TYPE_CHECKING:
    from .base import PhaseBase

V = TypeVar("V")
PV = TypeVar("PV", bound=PagedView)
#: a query part of an extend phase: ``(cu_seqlens_q, positions, T)``
Queries = tuple[Tensor, Tensor, int]


class HostLane:
    """One phase's host route (see the module docstring): :meth:`maybe` makes it for a phase
    whose pool fits; :meth:`bind` makes the phase's ``host_step``, :meth:`native` is its C
    call."""

    __slots__ = ("_b", "_config", "_max_bs", "_max_len", "_max_pages", "_module", "_offsets",
                 "_pad", "_phase", "_span", "_state", "_step", "_window", "cfg")

    def __init__(self, phase: PhaseBase[Any], b: PagedBuffers,
                 queries: Queries | None = None) -> None:
        self._phase, self.cfg = phase, phase.cfg
        self._b = b
        self._span = phase.input_pass.arena_span
        self._max_bs, self._max_len = self.cfg.max_bs, self.cfg.max_context_len
        self._max_pages = phase._max_pages
        self._pad = (self.cfg.pad_seq_len, self.cfg.pad_page)
        #: (window buffers, W) of a phase with a window part, else None
        w = phase._window_buffers
        self._window = None if w is None or self.cfg.sliding_window is None \
            else (w, self.cfg.sliding_window)
        module = self._module = _host.load()
        #: the C step (:mod:`attnpool.update.host`) and this phase's config of it
        self._step: Callable[..., PagedView | tuple[int, int] | None] | None = \
            None if module is None else module.step_tensors
        self._config = self._native_config(queries)
        #: (view class, the native rebind's slot offsets) once :meth:`first` has checked them
        #: on a view of the phase (False: the rebind does not serve it, :func:`rebound` does)
        self._offsets: tuple[type, bytes] | bool | None = None
        #: what :meth:`bind`'s call reads, in ``host_lane.c``'s order (``phase_step``): the
        #: config (with the rebind's slot offsets and the window part's key bound once
        #: :meth:`first` has checked them), the phase's validation flag (:meth:`validating`),
        #: its sliced views, the view class (None until :meth:`first`), the arena's owners
        #: and generations, the phase's regions and tag (what ``Arena.mark`` records), and the
        #: fallbacks (queries as lengths, as packed offsets)
        own, gens = phase.arena.mark_state()
        self._state: list[Any] = [self._config, phase.validate, phase._sliced, None, own, gens,
                                  phase._regions, phase.phase, None, None]

    def _native_config(self, queries: Queries | None) -> bytes:
        """The native step's static config: the bounds, the pad values and the addresses of
        the phase's buffers (the arena never moves), in ``host_lane.c``'s order."""
        def ptr(t: Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()

        b, p = self._b, self.cfg.page_size
        pt = b.page_table
        assert pt is not None  # (maybe(): a Layout.FLASH_ATTN part has a page table)
        cu_q, pos, t_max = (None, None, 0) if queries is None else queries
        wb, size = (None, 0) if self._window is None else self._window
        wpt = None if wb is None else wb.page_table
        return struct.pack(
            "<27q", self._max_bs, self._max_pages, self._max_len, p, self._pad[0],
            self._pad[1], ceil_div(self._pad[0], p),
            ptr(b.cache_seqlens), ptr(b.cu_seqlens_k), ptr(pt), pt.stride(0),
            ptr(cu_q), ptr(pos), 0 if pos is None else pos.shape[0], t_max,
            ptr(None if wb is None else wb.cache_seqlens),
            ptr(None if wb is None else wb.cu_seqlens_k), ptr(wpt),
            0 if wpt is None else wpt.stride(0), 0 if wpt is None else wpt.shape[1], size,
            *self._span, 0, 0, 0, 0)  # (the rebind's offsets: set by first())

    @classmethod
    def maybe(cls, phase: PhaseBase[Any], b: PagedBuffers, queries: Queries | None = None
              ) -> HostLane | None:
        """The lane of ``phase``, whose paged part is ``b`` (and ``queries`` its query part,
        an extend phase's), when its pool has the lane's shape, else None."""
        cfg = phase.cfg
        if (phase.impl is not Impl.REFERENCE or cfg.torch_device.type != "cpu"
                or cfg.layout is not Layout.FLASH_ATTN or phase._sched is not None):
            return None
        return cls(phase, b, queries)

    def native(self, bs: int, seq_lens: object, block_table: object, q_lens: object,
               offsets: bool = False) -> PagedView | tuple[int, int] | None:
        """A step checked and written by the native step, in one call: the step's view (the
        phase's sliced view of ``bs`` rows rebound with the step's host bounds by the same
        call), or the bounds ``(max_seqlen_q, max_seqlen_k)`` when the phase has no such view
        yet or the rebind does not serve its class (the phase then makes the view and hands it
        to :meth:`first`); None, nothing written, when there is no C step or it does not take
        the call (the general path then checks it, and raises where it is bad).

        ``seq_lens`` is its own host copy (the caller checked that). Taken: every input an
        int32 CPU ``torch.Tensor`` with contiguous rows (``q_lens``: an extend step's query
        lengths, their own host copy too, or with ``offsets`` the packed query offsets
        ``cu_seqlens_q`` of ``>= n + 1`` rows, row ``i``'s queries being ``q_lens[i] ..
        q_lens[i + 1] - 1``; None for decode). The tensors are read in C (type,
        dtype, device, strides, shape, address: a dozen attribute reads that cost several
        times more as Python bytecode on a cold cache), then the shapes, the arena overlap and
        every value, before any write."""
        step = self._step
        if step is None or self._phase.validate:
            return None
        got, phase = self._offsets, self._phase
        base = phase._sliced.get(bs) if type(got) is tuple else None  # (bs: C checks an int)
        if base is None or type(base) is not got[0]:  # type: ignore[index]
            return step(self._config, seq_lens, block_table, q_lens, bs, None, None, 0,
                        offsets)
        return step(self._config, seq_lens, block_table, q_lens, bs, base,
                    got[1], phase._window_k, offsets)  # type: ignore[index]

    def bind(self, fallback: Callable[..., V], offsets: bool = False) -> Callable[..., V]:
        """The phase's ``host_step`` (``fallback``: its Python form, :meth:`native`, the view
        made by the phase, and the general path for a call the C step declines) as one C call
        where the C step is built: the same checks, the step on the phase's sliced view of
        ``bs`` rows, and the arena's record of the write (what ``Arena.mark`` records), with
        no Python frame on the way. A size whose view the rebind does not serve yet (its first
        step, or a class it never serves), a call the C step does not take (another dtype, a
        bad value) and validation mode go to ``fallback``, so that every call is answered as
        ``fallback`` answers it; the fallback itself where there is no C step. ``offsets``:
        the step whose queries are packed offsets (``cu_seqlens_q``), with its own fallback.

        Why: an engine's builder calls this once per step, between two forwards, on caches
        the forward has just evicted; there each Python frame (the method, the lane's call,
        the arena's bookkeeping) costs microseconds, as much as the step's own writes."""
        module = self._module
        if module is None:
            return fallback
        self._state[-1 if offsets else -2] = fallback
        return partial(module.phase_step_offsets if offsets else module.phase_step,
                       self._state)

    def validating(self, on: bool) -> None:
        """The phase's validation flag, as its setter changes it (the bound step declines every
        call while it is on: validation is the general path's)."""
        self._state[1] = on

    def first(self, view: PV) -> PV:
        """``view``, made by the phase from :meth:`native`'s bounds. The first such view
        decides whether the native rebind serves the phase's views from then on: the class
        holds its fields in ``__slots__`` only, its window part is of its own class, and the
        rebind's view equals :func:`attnpool.phases._views.rebound`'s field by field (else
        the phase makes every view itself)."""
        if self._offsets is None and self._module is not None:
            got = self._offsets = _rebind_offsets(self._module, view, self._phase._window_k)
            if type(got) is tuple:
                cls, offsets = got
                self._state[0] = (self._config[:-32] + offsets
                                  + struct.pack("<q", self._phase._window_k))
                self._state[3] = cls
        return view


def _rebind_offsets(module: Any, base: Any, window_k: int) -> tuple[type, bytes] | bool:
    """The native rebind's slot offsets for ``base``'s class (``max_seqlen_q``,
    ``max_seqlen_k``, ``window``), or False when it does not serve that class (see
    :meth:`HostLane.first`)."""
    cls = type(base)
    if not isinstance(base, PagedView):
        return False
    w = base.window
    names = [f.name for f in dataclasses.fields(cls)]
    slots = sorted(n for k in cls.__mro__ for n in k.__dict__.get("__slots__", ()))
    if (cls.__dictoffset__ or cls.__weakrefoffset__ or slots != sorted(names)
            or cls.__basicsize__ != object.__basicsize__ + len(names) * struct.calcsize("P")
            or not (w is None or type(w) is cls)):
        return False
    offsets = struct.pack("<3q", *(module.slot_offset(getattr(cls, name))
                                   for name in ("max_seqlen_q", "max_seqlen_k", "window")))
    try:
        got = module.rebind(base, offsets, 3, 7, window_k)
    except (TypeError, ValueError):
        return False
    return (cls, offsets) if _same_fields(got, rebound(base, 3, 7, window_k)) else False


def _same_fields(a: Any, b: Any) -> bool:
    """Two views of one class with the same field values (tensors: the same objects)."""
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            if not _same_fields(x, y):
                return False
        elif not (x is y or (type(x) is int and x == y)):
            return False
    return True
