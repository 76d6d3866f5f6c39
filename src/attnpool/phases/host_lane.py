"""The host lane: an engine's step on a CPU pool, refilled in a straight line.

An engine's metadata builder calls the pool once per step (and KV-cache group), on the host,
between two forwards. On a CPU its whole cost is host time, spent on code the model's forward
has just pushed out of the caches, so what a step costs is mostly how much code it walks:
the general update (the input pass's record, the launch cache, the bound part and its record
fields) is several times the engine's own builder there even when its torch ops are few.

The lane is that update for the one shape engines step with, as one short path:

- the pool lives in host memory and updates on the reference path (a CPU pool);
- the phase's parts have page tables and no CSR (``Layout.FLASH_ATTN``) and no FlashMLA
  schedule; a window part is served (its table is the request table);
- the call gives a ``block_table`` (rows in batch order, or picked by ``req_pool_indices``),
  the host copy ``seq_lens_cpu`` and, for an extend step, ``extend_lens_cpu`` as the very
  ``extend_lens`` tensor (a CPU pool's caller passing one tensor as both, as vLLM's builder
  does); no ``request_ids``, ``num_real``, ``out_slots`` or window table;
- validation mode is off.

Anything else goes the general way (:meth:`attnpool.phases.decode.DecodePhase.update_`),
before any check. The lane checks its inputs with the input pass's own functions, in the same
order, so a bad input gets the same :class:`attnpool.PoolError` before any write, and it
writes with the lean part's own methods (:class:`attnpool.update.reference_lean.LeanPaged`):
the bytes of the general path in every read region, which the tests compare.

**Native.** Where the native step is built (:mod:`attnpool.update.native`), the lane's usual
call (int32 inputs, as vLLM's builder passes them) is checked and written by one C call,
:meth:`HostLane.native`, instead of the torch lane's ops: on the caches a forward leaves
behind, a dozen dispatched ops and their Python cost several times one call. The C step checks
every value before it writes; an input it does not take, or a bad one, leaves the pool as it
was and goes the torch lane's way, which raises the same error as ever.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from torch import Tensor

from ..config import INT_DTYPES, Impl, Layout, ceil_div
from ..inputs import check_bs, check_tensor, host_lens
from ..update import native as _native
from ..update.buffers import PagedBuffers
from ..update.reference_lean import LeanPaged
from ..views import PagedView
from ._views import rebound

if TYPE_CHECKING:
    from .base import PhaseBase

V = TypeVar("V")
PV = TypeVar("PV", bound=PagedView)
#: the shared keywords a lane call may carry (anything else: the general path)
_KEYS = frozenset(("block_table", "seq_lens_cpu", "req_pool_indices"))
#: a checked call: ``(n, seq_lens, rows, block_table, host lengths, exact, longest)``, rows
#: being the caller's ``req_pool_indices`` or the pool's ``arange[:n]`` (batch order);
#: ``exact``: the host lengths are ``seq_lens``' own values (the host copy is the tensor
#: itself); ``longest``: the largest host length (0 without rows)
Checked = tuple[int, Tensor, Tensor, Tensor, list[int], bool, int]
#: a query part of an extend phase: ``(cu_seqlens_q, positions, T)``
Queries = tuple[Tensor, Tensor, int]


class HostLane:
    """One phase's lane (see the module docstring): :meth:`maybe` makes it for a phase whose
    pool fits; :meth:`check` takes a call (None when it is not the lane's), :meth:`write`
    writes its paged part, :meth:`queries` an extend step's query part."""

    __slots__ = ("_b", "_config", "_dev", "_ip", "_lean", "_max_bs", "_max_len", "_max_pages",
                 "_module", "_offsets", "_pad", "_phase", "_span", "_state", "_step", "_window",
                 "cfg")

    def __init__(self, phase: PhaseBase[Any], b: PagedBuffers,
                 queries: Queries | None = None) -> None:
        self._phase, self.cfg = phase, phase.cfg
        self._ip = phase.input_pass
        self._b = b
        self._lean = LeanPaged()
        self._dev, self._span = self._ip.device, self._ip.arena_span
        self._max_bs, self._max_len = self.cfg.max_bs, self.cfg.max_context_len
        self._max_pages = phase._max_pages
        self._pad = (self.cfg.pad_seq_len, self.cfg.pad_page)
        #: (window buffers, W) of a phase with a window part, else None
        w = phase._window_buffers
        self._window = None if w is None or self.cfg.sliding_window is None \
            else (w, self.cfg.sliding_window)
        module = self._module = _native.load()
        #: the native step (:mod:`attnpool.update.native`) and this phase's config of it
        self._step: Callable[..., PagedView | tuple[int, int] | None] | None = \
            None if module is None else module.step_tensors
        self._config = self._native_config(queries)
        #: (view class, the native rebind's slot offsets) once :meth:`first` has checked them
        #: on a view of the phase (False: the rebind does not serve it, :func:`rebound` does)
        self._offsets: tuple[type, bytes] | bool | None = None
        #: what :meth:`bind`'s call reads, in ``host_lane.c``'s order (``phase_step``): the
        #: config, the phase's validation flag (:meth:`validating`), its sliced views, the
        #: view class and its rebind offsets (None until :meth:`first` has checked them), the
        #: window part's key bound, the arena's owners and generations, the phase's regions
        #: and tag (what ``Arena.mark`` records), and the fallback
        own, gens = phase.arena.mark_state()
        self._state: list[Any] = [self._config, phase.validate, phase._sliced, None, None,
                                  phase._window_k, own, gens, phase._regions, phase.phase, None]

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
            "<23q", self._max_bs, self._max_pages, self._max_len, p, self._pad[0],
            self._pad[1], ceil_div(self._pad[0], p),
            ptr(b.cache_seqlens), ptr(b.cu_seqlens_k), ptr(pt), pt.stride(0),
            ptr(cu_q), ptr(pos), 0 if pos is None else pos.shape[0], t_max,
            ptr(None if wb is None else wb.cache_seqlens),
            ptr(None if wb is None else wb.cu_seqlens_k), ptr(wpt),
            0 if wpt is None else wpt.stride(0), 0 if wpt is None else wpt.shape[1], size,
            *self._span)

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

    def native(self, bs: int, seq_lens: object, block_table: object, q_lens: object
               ) -> PagedView | tuple[int, int] | None:
        """A step checked and written by the native step, in one call: the step's view (the
        phase's sliced view of ``bs`` rows rebound with the step's host bounds by the same
        call), or the bounds ``(max_seqlen_q, max_seqlen_k)`` when the phase has no such view
        yet or the rebind does not serve its class (the phase then makes the view and hands it
        to :meth:`first`); None, nothing written, when there is no native step or it does not
        take the call (the torch lane then checks it, and raises where it is bad).

        ``seq_lens`` is its own host copy (the caller checked that). Taken: every input an
        int32 CPU ``torch.Tensor`` with contiguous rows (``q_lens``: an extend step's query
        lengths, their own host copy too; None for decode). The tensors are read in C (type,
        dtype, device, strides, shape, address: a dozen attribute reads that cost several
        times more as Python bytecode on a cold cache), then the shapes, the arena overlap and
        every value, before any write."""
        step = self._step
        if step is None or self._phase.validate:
            return None
        got, phase = self._offsets, self._phase
        base = phase._sliced.get(bs) if type(got) is tuple else None  # (bs: C checks an int)
        if base is None or type(base) is not got[0]:  # type: ignore[index]
            return step(self._config, seq_lens, block_table, q_lens, bs, None, None, 0)
        return step(self._config, seq_lens, block_table, q_lens, bs, base,
                    got[1], phase._window_k)  # type: ignore[index]

    def bind(self, fallback: Callable[..., V]) -> Callable[..., V]:
        """The phase's ``host_step`` (``fallback``: its Python form, :meth:`native` and the
        view made by the phase) as one C call where the native step is built: the same
        checks, the step on the phase's sliced view of ``bs`` rows, and the arena's record of
        the write (what ``Arena.mark`` records), with no Python frame on the way. A size whose
        view the rebind does not serve yet (its first step, or a class it never serves) goes
        to ``fallback``, so that every call is answered as ``fallback`` answers it; the
        fallback itself where there is no native step.

        Why: an engine's builder calls this once per step, between two forwards, on caches
        the forward has just evicted; there each Python frame (the method, the lane's call,
        the arena's bookkeeping) costs microseconds, as much as the step's own writes."""
        module = self._module
        if module is None:
            return fallback
        self._state[-1] = fallback
        return partial(module.phase_step, self._state)

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
                self._state[3:5] = got
        return view

    def check(self, bs: int, seq_lens: object, shared: dict[str, Any]) -> Checked | None:
        """The shared inputs of a call, checked as the input pass checks them (the same
        errors), or None, nothing checked, when the call is not the lane's.

        The usual call (rows in batch order, the host copy the tensor itself, every input as
        it should be) is accepted by one expression of attribute reads; any other goes through
        the input pass's functions one by one, which raise its errors."""
        if not _KEYS.issuperset(shared) or self._phase.validate:
            return None
        table = shared.get("block_table")
        cpu: Any = shared.get("seq_lens_cpu")
        if table is None or cpu is None:
            return None
        picked = shared.get("req_pool_indices")
        dev, (lo, hi) = self._dev, self._span
        if (picked is None and cpu is seq_lens and type(seq_lens) is Tensor
                and type(table) is Tensor and type(bs) is int
                and seq_lens.dim() == 1 and table.dim() == 2
                and seq_lens.dtype in INT_DTYPES and table.dtype in INT_DTYPES
                and seq_lens.device == dev and table.device == dev and seq_lens.is_contiguous()
                and 1 <= (n := seq_lens.shape[0]) <= bs <= self._max_bs
                and (shape := table.shape)[0] >= n and shape[1] >= self._max_pages
                and table.stride(1) == 1
                and not lo <= seq_lens.data_ptr() < hi and not lo <= table.data_ptr() < hi):
            host: list[int] | None = seq_lens.tolist()
            if host and min(host) >= 1 and (longest := max(host)) <= self._max_len:
                return n, seq_lens, self._ip.in_order(n), table, host, True, longest
        cfg = self.cfg
        lens = check_tensor("seq_lens", seq_lens, None, 1, INT_DTYPES, None, dev, True,
                            self._span)
        n = lens.shape[0]
        if not (type(bs) is int and n <= bs <= self._max_bs and bs >= 1):
            check_bs(cfg, bs, n)
        rows, table, _, _, _ = self._ip.request_table(n, picked, None, table)
        host = host_lens("seq_lens_cpu", cpu, n, 1, cfg.max_context_len)
        return None if host is None else (n, lens, rows, table, host, False,
                                          max(host, default=0))

    def decode(self, bs: int, seq_lens: object, shared: dict[str, Any],
               view: Callable[[int, int], V]) -> V | None:
        """A decode step (:meth:`attnpool.phases.decode.DecodePhase.update_`): its refilled
        view (``view(bs, max_seqlen_k)``, the phase's), or None (nothing checked, nothing
        written) when the call is not the lane's."""
        x = self.check(bs, seq_lens, shared)
        if x is None:
            return None
        self.write(bs, x)
        self._phase._mark(bs)
        n, longest = x[0], x[6]
        return view(bs, longest if n == bs else max(longest, self._pad[0]))

    def write(self, bs: int, x: Checked, q_lens: Tensor | None = None) -> None:
        """Write the paged part of a checked call and its window twin (``q_lens``: an extend
        step's host-checked query lengths; None: one query per row)."""
        n, lens, rows, table, _, exact, longest = x
        cfg, p = self.cfg, self.cfg.page_size
        w = min(self._max_pages, ceil_div(longest, p))
        pad_len, pad_page = self._pad
        real = self._lean.rows_(self._b, lens, rows, table, n, bs, w, cfg.max_context_len, p,
                                pad_len, pad_page, exact)
        if self._window is not None:
            wb, size = self._window
            self._lean.window_(self._b, wb, table, rows, real, n, bs, p, pad_len, pad_page,
                               size, q_lens)

    def queries(self, cu_q: Tensor, positions: Tensor, lens: Tensor, q_lens: Tensor, n: int,
                bs: int, tokens: int, q_total: int) -> None:
        """An extend step's query part and the positions of its ``tokens`` real tokens
        (host-checked ``q_lens``: inside their bounds, summing to ``tokens <= q_total``)."""
        self._lean.queries_(cu_q, q_lens, n, bs, q_total)
        self._lean.positions_(lens, q_lens, cu_q, n, tokens, positions)


def _rebind_offsets(module: Any, base: Any, window_k: int) -> tuple[type, bytes] | bool:
    """The native rebind's slot offsets for ``base``'s class (``max_seqlen_q``,
    ``max_seqlen_k``, ``window``), or False when it does not serve that class (see
    :meth:`HostLane.view`)."""
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
