"""What every phase shares: its arena, capture-state bookkeeping and paged-part plumbing."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import partial
from types import ModuleType
from typing import Any, ClassVar, Generic, NamedTuple, TypedDict, TypeVar

import torch
from torch import Tensor

from ..arena import Arena
from ..config import INT_DTYPES, PHASE_FACTS, Impl, Phase, PoolConfig, ceil_div, resolve_impl
from ..errors import CapacityError, InputError, LayoutError, PoolError
from ..inputs import check_block_table, check_bs, check_req_to_token, check_tensor, host_lens
from ..update import reference as ref
from ..update.reference import PagedBuffers
from ..views import PagedView
from ._validate import Values, validate
from ._views import part_view
from .bound import BoundUpdate


class Shared(TypedDict, total=False):
    """The keyword inputs every phase's ``update_`` takes besides its own (documented once, in
    :meth:`attnpool.phases.decode.DecodePhase.update_`): the request rows and table (exactly
    one of ``req_to_token`` and ``block_table``), the host copy of ``seq_lens``, the capturable
    mode's real count and, with a sliding window, the window table. Typed for checkers through
    ``**shared: Unpack[Shared]``; checked by name at run time (:meth:`PhaseBase._inputs`)."""

    req_pool_indices: Tensor | None
    req_to_token: Tensor | None
    block_table: Tensor | None
    seq_lens_cpu: Tensor | Sequence[int] | None
    num_real: Tensor | None
    window_req_to_token: Tensor | None
    window_block_table: Tensor | None


_SHARED = frozenset(Shared.__annotations__)


class Inputs(NamedTuple):
    """What the input pass hands a phase: checked tensors and host values."""

    seq_lens: Tensor
    n: int
    rows: Tensor
    table: Tensor
    block: int | None
    host: list[int] | None
    window_table: Tensor | None
    num_real: Tensor | None
    seq_lens_cpu: Tensor | Sequence[int] | None


#: cached fused launches per phase before the cache is dropped (a bound on its memory)
_MAX_LAUNCHES = 1024
#: cached views per phase before the cache is dropped
_MAX_VIEWS = 4096
T = TypeVar("T")
#: a phase's view type (``DecodeView`` for ``pool.decode`` etc.)
ViewT = TypeVar("ViewT")


def _triton() -> ModuleType:
    """The fused part functions (importing them does not import triton: the kernels load on
    first launch)."""
    from ..update import triton

    return triton


def capturing(device: torch.device) -> bool:
    """True while the current CUDA stream is capturing a graph (never initialises CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class PhaseBase(Generic[ViewT]):
    """Base of ``pool.<phase>`` objects.

    Capture safety: ``view(bs)`` hands out slices whose read region must already hold valid values,
    because warmup and capture run real kernels. The arena remembers, per phase, how many rows are
    valid now; when another overlaid phase wrote the shared bytes since (or nothing was written
    yet), ``view`` first writes the phase's padded *capture state* for ``max_bs`` rows. That write
    happens on the host's current stream before capture, never inside a capture (it would be
    recorded and replayed over the real metadata), hence the check in :meth:`_ready`.
    """

    phase: Phase
    #: how the phase lays out one update's inputs (the ``vals`` tuple of :meth:`_run`): the
    #: names are the part functions' parameter names, so each part reads its inputs by name
    NAMES: ClassVar[tuple[str, ...]]
    #: per part (in :meth:`_parts` order), parameter -> the name its input has in ``NAMES``
    #: where the two differ (e.g. the encoder's cross part reads ``encoder_lens`` as lengths)
    ALIASES: ClassVar[tuple[dict[str, str], ...]] = ()

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.cfg = arena.cfg
        #: the update path this phase runs (:func:`attnpool.config.resolve_impl`; never AUTO).
        self.impl = resolve_impl(arena.cfg.impl, arena.cfg.torch_device)
        self.fused = self.impl is Impl.TRITON
        #: the update path's part functions: :mod:`attnpool.update.triton` (imported here, on
        #: the first fused pool, so importing attnpool never imports it) or
        #: :mod:`attnpool.update.reference`; both expose the same functions
        self.ops: ModuleType = _triton() if self.fused else ref
        self._dev = arena.storage.device
        self._arange = arena.buffer(None, "arange")
        #: debug validation of device values (``BufferPool(validate=True)``, see ._validate)
        self.validate = False
        #: the arena regions this phase's updates write (see Arena.mark)
        self._regions = arena.regions(self.phase)
        #: the producer every view of this phase carries (``view.is_current``, stale checks)
        self._stamp = arena.stamp(self.phase)
        #: the arena's address range, for the aliasing check of inputs (computed once)
        self._span = (arena.storage.data_ptr(), arena.storage.data_ptr() + arena.storage.numel())
        #: assembled fused launches per (part, batch shape, call site): see :meth:`_fused`
        self._launches: dict[Hashable, Any] = {}
        #: views handed out, per phase-specific key (see :meth:`_memo`)
        self._views: dict[Hashable, Any] = {}
        #: the launches of the update being bound (:meth:`bind`), else None
        self._rec: list[Callable[[], object]] | None = None
        #: the config's sizes every update reads (``max_pages`` is a computed property)
        self._max_len, self._max_pages = self.cfg.max_context_len, self.cfg.max_pages
        self._max_bs = self.cfg.max_bs
        #: ``arange[:n]`` per n: the rows of a block table given without ``req_pool_indices``
        self._in_order: dict[int, Tensor] = {}
        #: the window part's buffers (a sliding window and a phase that reads the KV cache,
        #: docs/design.md, Sliding windows), else None; written by the main part's launch
        self._wbuf = (self._paged("window_") if self.cfg.sliding_window is not None
                      and PHASE_FACTS[self.phase].window_queries is not None else None)

    def view(self, bs: int) -> ViewT:
        """The ``bs``-row view for capture: valid padded values (the capture state, written
        first when the bytes do not hold it: see the class docstring) and static host bounds."""
        check_bs(self.cfg, bs)
        self._ready(bs)
        return self._capture_view(bs)

    def _capture_view(self, bs: int) -> ViewT:
        """The view :meth:`view` hands out once its bytes are valid (static host bounds)."""
        raise NotImplementedError

    # ---- input checks ----------------------------------------------------------------------------
    def _tensor(self, name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...] = INT_DTYPES,
                rows: int | None = None) -> Tensor:
        """``check_tensor`` against the arena's exact device (``cuda`` resolved to ``cuda:i``),
        then :meth:`_not_ours`. The accepted case is one expression of attribute reads; the
        detailed checks (and their messages) run only when it fails."""
        lo, hi = self._span
        # (a 1-D tensor is contiguous iff its stride is 1 or it has at most one element)
        if (type(t) is Tensor and t.dim() == ndim and t.dtype in dtypes and t.device == self._dev
                and (rows is None or t.shape[0] == rows) and (ndim != 1 or t.is_contiguous())
                and not lo <= t.data_ptr() < hi):
            return t
        return self._not_ours(name, check_tensor(name, t, self.cfg, ndim, dtypes, rows, self._dev))

    def _req_to_token(self, t: object, name: str = "req_to_token") -> Tensor:
        return self._checked_table(t, name, self._max_len, check_req_to_token)

    def _block_table(self, t: object, name: str = "block_table") -> Tensor:
        return self._checked_table(t, name, self._max_pages, check_block_table)

    def _checked_table(self, t: object, name: str, cols: int,
               check: Callable[[object, PoolConfig, torch.device, str], Tensor]) -> Tensor:
        """A request table of at least ``cols`` columns, rows contiguous, not in the arena: one
        expression of attribute reads when it is fine; ``check`` names what is wrong."""
        lo, hi = self._span
        if (type(t) is Tensor and t.dim() == 2 and t.dtype in INT_DTYPES and t.device == self._dev
                and t.shape[0] >= 1 and t.shape[1] >= cols
                and t.stride(1) == 1 and not lo <= t.data_ptr() < hi):
            return t
        return self._not_ours(name, check(t, self.cfg, self._dev, name))

    def _rows_table(self, n: int, req_pool_indices: object, req_to_token: object,
                    block_table: object) -> tuple[Tensor, Tensor, int | None]:
        """Check the request table: ``(rows, table, block)`` for ``n`` input rows.

        Exactly one table: ``req_to_token`` (token slots, SGLang's layout; ``block`` None) or
        ``block_table`` (page ids, vLLM's and transformers' layout; ``block = page_size``), which
        both update paths read as the token table ``block_table[r, t // P] * P + t % P``, so the
        two write the same bytes. ``rows`` picks each input row's table row: the caller's
        ``req_pool_indices``, which a block table may omit (input row ``i`` is then table row
        ``i``: a slice of the pool's constant ``arange``, no allocation; it is substituted only
        here, after the aliasing checks that refuse pool buffers as caller inputs).
        """
        if block_table is None:
            if req_to_token is None:
                raise InputError("pass exactly one request table, req_to_token (token slots) or "
                                 "block_table (page ids), got neither")
            if req_pool_indices is None:
                raise InputError("req_pool_indices is required with req_to_token (only a "
                                 "block_table's rows may default to the batch order), got None")
            return (self._tensor("req_pool_indices", req_pool_indices, 1, rows=n),
                    self._req_to_token(req_to_token), None)
        if req_to_token is not None:
            raise InputError("pass exactly one request table, req_to_token (token slots) or "
                             "block_table (page ids), got both")
        table = self._block_table(block_table)
        if req_pool_indices is not None:
            rows = self._tensor("req_pool_indices", req_pool_indices, 1, rows=n)
            return rows, table, self.cfg.page_size
        if table.shape[0] < n:
            raise CapacityError(f"block_table without req_pool_indices needs a row per input row "
                                f"(row i of the batch is table row i): >= {n} rows, got "
                                f"{table.shape[0]}")
        in_order = self._in_order.get(n)
        if in_order is None:
            in_order = self._in_order[n] = self._arange[:n]
        return in_order, table, self.cfg.page_size

    def _window_table(self, table: Tensor, block: int | None, window_req_to_token: object,
                      window_block_table: object) -> Tensor | None:
        """The table the window part reads: None without a window part; else the caller's
        window table (an engine's sliding-window KV group: SGLang's SWA pool, vLLM's KV cache
        group), or the request table itself when none is given.

        A window table is of the request table's kind (``window_req_to_token`` with
        ``req_to_token``, ``window_block_table`` with ``block_table``: the window part reads
        the same rows, ``req_pool_indices``), dtype and device, and covers every position (its
        entries before a row's window may hold anything: nothing reads them)."""
        given = window_block_table if window_req_to_token is None else window_req_to_token
        if self._wbuf is None:
            if given is not None:
                raise LayoutError(f"a window table needs PoolConfig(sliding_window=...) and a "
                                  f"phase with a window part; {self.phase.value} of this pool "
                                  f"has none, got one")
            return None
        if given is None:
            return table
        if window_req_to_token is not None and window_block_table is not None:
            raise InputError("pass at most one window table, window_req_to_token or "
                             "window_block_table, got both")
        kind = "req_to_token" if block is None else "block_table"
        wkind = "req_to_token" if window_block_table is None else "block_table"
        if kind != wkind:
            raise InputError(f"the window table must be of the request table's kind: "
                             f"window_{kind} with {kind}, got window_{wkind}")
        wt = (self._req_to_token(given, "window_req_to_token") if block is None
              else self._block_table(given, "window_block_table"))
        if wt.dtype != table.dtype:
            raise InputError(f"window_{kind} must have {kind}'s dtype {table.dtype}, got "
                             f"{wt.dtype}")
        return wt

    def _win(self, window_table: Tensor | None) -> dict[str, Any]:
        """The window keywords of the part that carries the window part (none without one)."""
        if window_table is None or self._wbuf is None:
            return {}
        return {"window": self._wbuf, "window_size": self.cfg.sliding_window,
                "window_table": window_table}

    def _wkey(self, table: Tensor, wt: Tensor | None) -> Hashable:
        """The window table's part of a launch cache key: its shape when it is its own."""
        return None if wt is None or wt is table else (wt.shape, wt.stride(0))

    @staticmethod
    def _table_rows(table: Tensor, wt: Tensor | None) -> int:
        """Rows ``req_pool_indices`` may pick (validation): in both tables when there are two."""
        return table.shape[0] if wt is None else min(table.shape[0], wt.shape[0])

    def _capture_wt(self) -> Tensor | None:
        """The window table of the capture state (no real row): the empty page block."""
        return None if self._wbuf is None else self._empty_pages()

    def _window_view(self, rows: int, cu_seqlens_q: Tensor, max_q: int, max_k: int,
                     b: PagedBuffers | None = None, cls: type[PagedView] = PagedView,
                     **extra: Any) -> PagedView | None:
        """The window part's view of ``rows`` rows (``b``: a draft step's buffers; default the
        phase's window part), causal with ``window_left = W - 1``; its key bound is the full
        part's, capped by the window table's width in tokens. ``cls`` (and its ``extra``
        fields) is the full part's class, so an adapter that tells parts apart by class (FA2
        refuses rows of varying query counts) treats both parts alike. None without a window
        part."""
        wb = self._wbuf if b is None else b
        if wb is None or self.cfg.sliding_window is None:
            return None
        cap = self.cfg.window_pages(self.phase) * self.cfg.page_size
        return part_view(wb, rows, cu_seqlens_q, max_q=max_q, max_k=min(max_k, cap),
                         page_size=self.cfg.page_size, causal=True, stamp=self._stamp,
                         cls=cls, window_left=self.cfg.sliding_window - 1, **extra)

    def _not_ours(self, name: str, t: Tensor) -> Tensor:
        """Refuse an input that lives inside the pool's own arena (e.g. a view's
        ``cache_seqlens`` passed back as ``seq_lens``). Overlaid phases share those bytes, and the
        fused path reads inputs while it writes the arena, so such an input could be overwritten
        half-way through its own update. One pointer compare; copy the tensor first instead."""
        lo, hi = self._span
        if lo <= t.data_ptr() < hi:
            raise InputError(f"{name} must not alias the pool's own buffers (copy it first), got a "
                             f"tensor at arena offset {t.data_ptr() - lo}")
        return t

    def _batch(self, bs: int, seq_lens: object, num_real: object,
               *host: Tensor | Sequence[int] | None) -> tuple[Tensor, int]:
        """Check ``seq_lens`` and ``bs``; return ``seq_lens`` and the rows every input has.

        Eager updates: ``n = len(seq_lens) <= bs`` real rows. Capturable updates (``num_real``, a
        ``[1]`` device count; fused path only): every input has ``bs`` rows, values past the real
        count are never read, and host copies are refused (the count is not known on the host,
        so the view keeps its static bounds, as a captured view must).
        """
        seq_lens = self._tensor("seq_lens", seq_lens, 1)
        n = seq_lens.shape[0]
        if num_real is None:
            if not (type(bs) is int and n <= bs <= self._max_bs and bs >= 1):
                check_bs(self.cfg, bs, n)  # (raises, naming what is wrong)
            return seq_lens, n
        if not self.fused:
            raise InputError(f"num_real (a capturable update) needs the fused path, impl=TRITON; "
                             f"this pool runs impl={self.impl}")
        check_bs(self.cfg, bs)
        if n != bs:
            raise InputError(f"with num_real, inputs are padded to bs={bs} rows, got {n}")
        self._tensor("num_real", num_real, 1, rows=1)
        if any(h is not None for h in host):
            raise InputError("host copies (*_cpu) cannot be combined with num_real: the real "
                             "count lives on the device, got a host copy")
        # May be replayed from a graph: see Arena.recorded. Host bookkeeping only (no pool byte
        # changes), and it only turns an optimisation off, so setting it before the remaining
        # input checks of the phase is harmless even if one of them rejects the call.
        self.arena.recorded = True
        return seq_lens, n

    def _inputs(self, bs: int, seq_lens: object, shared: Shared, hi: int,
                *host: Tensor | Sequence[int] | None) -> Inputs:
        """The input pass every update starts with: the :class:`Shared` keywords (an unknown
        one is refused: ``**shared`` must not swallow a misspelt input), ``bs`` and ``seq_lens``
        (:meth:`_batch`; ``host``: the phase's other host copies, refused with ``num_real``), the
        request table (:meth:`_rows_table`), the window table (:meth:`_window_table`) and the
        host lengths, each in ``[1, hi]``."""
        if not _SHARED.issuperset(shared):
            raise InputError(f"{self.phase.value}.update_ got unexpected keyword(s) "
                             f"{sorted(set(shared) - _SHARED)}; besides its own inputs it takes "
                             f"{sorted(_SHARED)}")
        num_real, cpu = shared.get("num_real"), shared.get("seq_lens_cpu")
        seq_lens, n = self._batch(bs, seq_lens, num_real, cpu, *host)
        rpi, table, blk = self._rows_table(n, shared.get("req_pool_indices"),
                                           shared.get("req_to_token"), shared.get("block_table"))
        wt = self._window_table(table, blk, shared.get("window_req_to_token"),
                                shared.get("window_block_table"))
        if wt is not None and shared.get("req_pool_indices") is None and wt.shape[0] < n:
            raise CapacityError(f"window_block_table without req_pool_indices needs a row per "
                                f"input row (row i of the batch is table row i): >= {n} rows, "
                                f"got {wt.shape[0]}")
        lens = None if cpu is None else host_lens("seq_lens_cpu", cpu, n, 1, hi)
        return Inputs(seq_lens, n, rpi, table, blk, lens, wt, num_real, cpu)

    def bind(self, bs: int, **inputs: Any) -> BoundUpdate[ViewT]:
        """``update_(bs, **inputs)`` once, bound for cheap replays (see :mod:`.bound`).

        ``inputs`` are the engine's static tensors (keywords of this phase's ``update_``); the
        returned :class:`BoundUpdate` refills the same view from their current values each time
        it is called, with no checks (the fused path) or through ``update_`` (the reference
        path). Host copies (``*_cpu``) and ``request_ids`` cannot be bound: they describe one
        step only.
        """
        host = sorted(k for k, v in inputs.items()
                      if v is not None and (k.endswith("_cpu") or k == "request_ids"))
        if host:
            raise InputError(f"bind takes device inputs only; host values of one step cannot be "
                             f"bound, got {host}")
        if capturing(self._dev):
            raise PoolError(f"{self.phase.value}.bind({bs}) runs the update once and captures "
                            "its own graph; call it before torch.cuda.graph(...) begins")
        self._rec = [] if self.fused else None
        try:
            view = self.update_(bs, **inputs)  # type: ignore[attr-defined]
            rec = self._rec
        finally:
            self._rec = None
        return BoundUpdate(self.arena, view, rec,
                           lambda: self.update_(bs, **inputs),  # type: ignore[attr-defined]
                           self._after_write(bs))

    def _after_write(self, bs: int) -> Callable[[], None]:
        """What a bound update's call records after its launches: this phase's write of ``bs``
        rows (a phase with more state of its own extends it)."""
        return partial(self.arena.mark, self._regions, self.phase, bs)

    def _mark(self, rows: int) -> None:
        """Record this phase's write of ``rows`` rows (the overlay bookkeeping of every update)."""
        self.arena.mark(self._regions, self.phase, rows)

    def _lens(self, name: str, t: object, cpu: Tensor | Sequence[int] | None, n: int, hi: int
              ) -> tuple[Tensor, list[int] | None]:
        """A phase's own per-request lengths (``accept_lens``, ``encoder_lens``,
        ``extend_lens``): the ``[n]`` device tensor and its optional host copy ``name_cpu``,
        each value in ``[1, hi]``."""
        return (self._tensor(name, t, 1, rows=n), host_lens(f"{name}_cpu", cpu, n, 1, hi))

    def _check_values(self, x: Inputs, hi: int, ranges: Sequence[Any] = (),
                      hosts: Sequence[Any] = (), **more: Any) -> None:
        """Validation mode (``validate=True``): the inputs every phase shares (``seq_lens`` in
        ``[1, hi]``, ``req_pool_indices`` inside both tables, ``seq_lens_cpu`` equal to the
        device values), plus the phase's own ``ranges``, ``hosts`` and ``more`` checks
        (:class:`._validate.Values`). Nothing is gathered unless the pool validates."""
        if self.validate:
            self._values(Values(x.n, x.num_real, self._table_rows(x.table, x.window_table),
                                [("seq_lens", x.seq_lens, 1, hi), *ranges,
                                 ("req_pool_indices", x.rows, 0, 0)],
                                [("seq_lens_cpu", x.seq_lens_cpu, "seq_lens"), *hosts], **more))

    def _values(self, v: Values) -> None:
        """Validate ``v`` when this pool validates (one host read; skipped during a capture,
        where a host read is illegal). Called after the metadata checks, before any write."""
        if self.validate and not capturing(self._dev):
            validate(v)

    def _paged_launch(self, ops: ModuleType, b: PagedBuffers, bs: int, seq_lens: Tensor,
                      rpi: Tensor, table: Tensor, block: int | None, **kw: Any) -> Any:
        """One ``paged_launch`` of ``ops`` for part ``b`` with this pool's padding and bounds
        (other keywords pass through). ``block``: see :meth:`_rows_table`."""
        cfg = self.cfg
        args: dict[str, Any] = {"extra": 0, "page_size": cfg.page_size,
                                "pad_seq_len": cfg.pad_seq_len, "pad_page": cfg.pad_page,
                                "max_len": cfg.max_context_len, "block_size": block}
        args.update(kw)
        return ops.paged_launch(b, bs=bs, seq_lens=seq_lens, req_pool_indices=rpi,
                                req_to_token=table, **args)

    def _parts(self, ops: ModuleType, bs: int, vals: tuple[Any, ...]) -> tuple[Any, ...]:
        """The phase's parts for ``bs`` rows: one ``*_launch`` of ``ops`` per part, built from
        ``vals`` (laid out as :attr:`NAMES`). Declared once per phase; both update paths and
        the capture state run them."""
        raise NotImplementedError

    def _capture_vals(self) -> tuple[Any, ...]:
        """:attr:`NAMES` values of the capture state: no real row (every row padding)."""
        raise NotImplementedError

    def _run(self, key: Hashable, bs: int, vals: tuple[Any, ...]) -> None:
        """Run the parts of an update with inputs ``vals`` (laid out as :attr:`NAMES`).

        The parts are built and checked on the first update of a key (the batch shape: bs, the
        request table's kind and shape and which optional inputs are given; the kind must be
        part of the key, as one 2-D shape may be either); every later update only swaps its
        inputs into the cached arguments. While :meth:`bind` builds a bound update, the calls
        are also recorded with ``vals`` fixed.
        """
        plan = self._launches.get(key)
        if plan is None:
            if len(self._launches) >= _MAX_LAUNCHES:  # e.g. a new req_to_token shape per call
                self._launches.clear()
            parts = self._parts(self.ops, bs, vals)
            aliases = self.ALIASES + ({},) * (len(parts) - len(self.ALIASES))
            plan = self._launches[key] = tuple(
                lc.take(self.NAMES, **alias) for lc, alias in zip(parts, aliases, strict=True))
        if self._rec is not None:
            self._rec.extend(lc.bound(vals) for lc in plan)
        for lc in plan:
            lc(vals)

    def _write_capture_state(self) -> None:
        """The padded state of ``max_bs`` rows: the phase's parts over no real row, written by
        the reference path (the same bytes; it runs once, before capture, never per step)."""
        for lc in self._parts(ref, self.cfg.max_bs, self._capture_vals()):
            lc()

    def _memo(self, key: Hashable, build: Callable[[], T]) -> T:
        """The view of ``key`` (bs and host bounds), built once: views are frozen slices of
        fixed buffers, so the same object serves every update of the same shape. Keys that vary
        per call (host-tight bounds) only fill the cache up to a bound, then start it over."""
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            v = self._views[key] = build()
        return v  # type: ignore[no-any-return]

    def _paged(self, prefix: str = "", phase: Phase | None = None) -> PagedBuffers:
        """One paged part's full-size buffers: ``prefix`` names the part, ``phase`` the phase
        whose buffers they are (default: this phase's; the encoder writes decode's rows)."""
        a, ph = self.arena, self.phase if phase is None else phase
        return PagedBuffers(
            cache_seqlens=a.buffer(ph, prefix + "cache_seqlens"),
            cu_seqlens_k=a.buffer(ph, prefix + "cu_seqlens_k"),
            page_table=a.maybe(ph, prefix + "page_table"),
            kv_indptr=a.maybe(ph, prefix + "kv_indptr"),
            kv_indices=a.maybe(ph, prefix + "kv_indices"),
            kv_last_page_len=a.maybe(ph, prefix + "kv_last_page_len"),
            arange=self._arange,
        )

    def _empty_pages(self) -> Tensor:
        """A ``[0, 0]`` page block (capture state: no real rows), sliced from a constant."""
        return self._arange[:0].view(0, 0)

    def _ready(self, bs: int) -> None:
        """Make the read region of a ``bs``-row view valid before handing it out for capture."""
        if self.arena.valid_rows(self.phase) >= bs:
            return
        if capturing(self.cfg.torch_device):
            raise PoolError(
                f"{self.phase.value}.view({bs}) needs to write the capture state, but the stream "
                "is capturing; call view() before torch.cuda.graph(...) begins"
            )
        self._write_capture_state()
        self.arena.mark_written(self.phase, self.cfg.max_bs)

    def _max_k(self, host: list[int] | None, add: int, n: int, bs: int, bound: int) -> int:
        """Host bound of ``cache_seqlens``: tight from host lengths, else the static ``bound``."""
        if host is None:
            return bound
        return max(max(host, default=0) + add, self.cfg.pad_seq_len if n < bs else 0)

    def _width(self, host: list[int] | None, add: int = 0) -> int:
        """Page columns of a page-level part the real rows need (from host lengths, ``add``
        tokens more), else the part's capacity ``max_pages``: the reference path gathers only
        those (see :func:`attnpool.update.reference.paged_update_`)."""
        if host is None:
            return self._max_pages
        return min(self._max_pages, ceil_div(max(host, default=0) + add, self.cfg.page_size))

