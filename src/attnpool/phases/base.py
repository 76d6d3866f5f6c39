"""What every phase shares: its update path, its parts' launch cache, capture state and overlay
bookkeeping. The input pass is :mod:`.inputs_pass`; views of parts are :mod:`._views`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import partial
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from ..arena import Arena
from ..config import PHASE_FACTS, Impl, Phase, ceil_div, resolve_impl
from ..errors import InputError, PoolError
from ..inputs import check_bs
from ..update.buffers import PagedBuffers
from ..update.launch_cache import LaunchCache
from ..update.parts import FlashMLAPart, PagedPart
from ..update.paths import Replay, UpdatePath, update_path
from ..views import FlashMLAMetadata, PagedView
from ._validate import Values, validate
from ._views import rebound, window_view
from .bound import BoundUpdate
from .inputs_pass import InputPass, Inputs, Shared, new_record


class _Lane(Protocol):
    """What this module asks of a phase's host lane (:class:`.host_lane.HostLane`)."""

    def first(self, view: Any) -> Any: ...

    def validating(self, on: bool) -> None: ...

__all__ = ["Inputs", "PhaseBase", "Replay", "Shared", "UpdatePath", "capturing", "new_record"]

#: cached views per phase before the cache is dropped
_MAX_VIEWS = 4096
T = TypeVar("T")
#: a phase's view type (``DecodeView`` for ``pool.decode`` etc.)
ViewT = TypeVar("ViewT")


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

    A phase's update hands its parts one *value record* (a NamedTuple per phase, ``Values`` in
    its module): the checked shared :class:`Inputs` as its first field, then the phase's own
    values. Its field names are the part functions' parameter names, so each part reads its
    inputs from it by name (:meth:`_run`); :attr:`ALIASES` covers the few that differ. An
    update builds its record positionally, in field order: a keyword call of a NamedTuple costs
    about twice as much, and the record is built on every update.
    """

    phase: Phase
    #: the phase's host lane (:mod:`.host_lane`): decode's and extend's on a CPU pool, else None
    _lane: _Lane | None = None
    #: per part (in :meth:`_parts` order), parameter -> the name its input has in the phase's
    #: value record where the two differ (e.g. the encoder's cross part reads ``encoder_lens``
    #: as lengths)
    ALIASES: ClassVar[tuple[dict[str, str], ...]] = ()

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.cfg = arena.cfg
        #: the update path this phase runs (:func:`attnpool.config.resolve_impl`; never AUTO).
        self.impl = resolve_impl(arena.cfg.impl, arena.cfg.torch_device)
        self.fused = self.impl is Impl.TRITON
        #: the update path's part functions: :mod:`attnpool.update.triton` or
        #: :mod:`attnpool.update.reference`, both an :class:`UpdatePath`
        self.ops: UpdatePath = update_path(self.fused)
        self._dev = arena.storage.device
        self._arange = arena.buffer(None, "arange")
        self._validate = False
        #: the arena regions this phase's updates write (see Arena.mark)
        self._regions = arena.regions(self.phase)
        #: the producer every view of this phase carries (``view.is_current``, stale checks)
        self._stamp = arena.stamp(self.phase)
        #: ``_mark(rows)`` records this phase's write of ``rows`` rows (the overlay bookkeeping
        #: of every update)
        self._mark = partial(arena.mark, self._regions, self.phase)
        #: assembled parts per batch shape (see :meth:`_run`)
        self._launches = LaunchCache()
        #: views handed out, per phase-specific key (see :meth:`_memo`)
        self._views: dict[Hashable, Any] = {}
        #: the first view sliced per row count, whose tensors later bounds reuse (_rebound)
        self._sliced: dict[int, Any] = {}
        #: a window part's key bound: its table's width in tokens (0 without a window)
        self._window_k = (self.cfg.window_pages(self.phase) * self.cfg.page_size
                          if self.cfg.sliding_window else 0)
        #: the config's sizes every update reads (``max_pages`` is a computed property)
        self._max_pages = self.cfg.max_pages
        #: the window part's buffers (a sliding window and a phase that reads the KV cache,
        #: docs/design.md, Sliding windows), else None; written by the main part's launch
        self._window_buffers = (self._paged("window_") if self.cfg.sliding_window is not None
                                and PHASE_FACTS[self.phase].window_queries is not None else None)
        #: FlashMLA's scheduler metadata of the main part (``PoolConfig(flashmla=...)``: decode
        #: and verify), ``(tile_scheduler_metadata, num_splits)``, else None
        md = arena.maybe(self.phase, "tile_scheduler_metadata")
        self._sched = None if md is None else (md, arena.buffer(self.phase, "num_splits"))
        #: the input pass every update starts with
        self.input_pass = InputPass(arena, self.phase.value, self._window_buffers is not None,
                                    self.fused, str(self.impl))

    @property
    def validate(self) -> bool:
        """Debug validation of device values (``BufferPool(validate=True)``, see ._validate).
        A property so that the host lane's bound step (one C call, no Python frame) holds the
        flag itself, set here, instead of looking it up on every step."""
        return self._validate

    @validate.setter
    def validate(self, on: bool) -> None:
        self._validate = bool(on)
        if self._lane is not None:
            self._lane.validating(self._validate)

    def view(self, bs: int) -> ViewT:
        """The ``bs``-row view for capture: valid padded values (the capture state, written
        first when the bytes do not hold it: see the class docstring) and static host bounds."""
        check_bs(self.cfg, bs)
        self._ready(bs)
        return self._capture_view(bs)

    def prepare_views(self, sizes: Iterable[int]) -> None:
        """Slice the views of these batch sizes now; nothing is written. An update's first
        view of a size slices a dozen tensors of the phase's buffers, every later one reuses
        them (:meth:`_rebound`): an engine whose builder runs between two forwards on a CPU,
        where that first slicing costs several later steps, calls this once at start with
        every size it may step with, so the first step of each size costs what the others do
        (and the native rebind of a host lane is checked here, not in a step).
        """
        lane = self._lane
        for bs in sizes:
            check_bs(self.cfg, bs)
            view = self._capture_view(bs)
            if lane is not None:
                lane.first(view)

    def _capture_view(self, bs: int) -> ViewT:
        """The view :meth:`view` hands out once its bytes are valid (static host bounds)."""
        raise NotImplementedError

    # ---- parts and their launches --------------------------------------------------------------
    def _parts(self, ops: UpdatePath, bs: int, values: Any) -> tuple[Replay, ...]:
        """The phase's parts for ``bs`` rows: one ``*_launch`` of ``ops`` per part, built from
        the value record ``values``. Declared once per phase; both update paths and the capture
        state run them."""
        raise NotImplementedError

    def _capture_values(self) -> tuple[Any, ...]:
        """The value record of the capture state: no real row (every row padding)."""
        raise NotImplementedError

    def _capture_inputs(self) -> Inputs:
        """The shared inputs of the capture state: no real row, an empty page block (sliced
        from a constant) as the request table and, with a window part, as its table too."""
        none, empty = self._arange[:0], self._arange[:0].view(0, 0)
        return Inputs(n=0, seq_lens=none, req_pool_indices=none, req_to_token=empty,
                      block_size=None, num_real=None,
                      window_table=None if self._window_buffers is None else empty,
                      seq_lens_host=None, seq_lens_cpu=None, launch_key=())

    def _run(self, key: Hashable, bs: int, values: tuple[Any, ...]) -> None:
        """Run the parts of an update with the value record ``values``: built and checked on
        the first update of ``key`` (the batch shape: ``bs``, the inputs' ``launch_key`` and
        which of the phase's own optional inputs are given), only replayed with new inputs
        after (:mod:`attnpool.update.launch_cache`)."""
        launches = self._launches
        plan = launches.get(key)
        if plan is None:
            plan = launches.add(key, self._parts(self.ops, bs, values), values, self.ALIASES)
        if launches.recording is not None:
            launches.record(key, values)
        for replay in plan:
            replay(values)

    @staticmethod
    def _rows(bs: int, x: Inputs) -> dict[str, Any]:
        """The :class:`attnpool.update.parts.RowsPart` fields every part of an update shares:
        ``bs`` rows over the shared inputs ``x`` (keywords of any part record)."""
        return {"bs": bs, "seq_lens": x.seq_lens, "req_pool_indices": x.req_pool_indices,
                "req_to_token": x.req_to_token, "num_real": x.num_real,
                "block_size": x.block_size}

    def _paged_launch(self, ops: UpdatePath, b: PagedBuffers, bs: int, x: Inputs,
                      **kw: Any) -> Replay:
        """One ``paged_launch`` of ``ops`` for part ``b`` over the shared inputs ``x``, with this
        pool's padding and bounds (other :class:`PagedPart` fields pass through)."""
        cfg = self.cfg
        fields: dict[str, Any] = {**self._rows(bs, x), "page_size": cfg.page_size,
                                  "pad_seq_len": cfg.pad_seq_len, "pad_page": cfg.pad_page,
                                  "max_len": cfg.max_context_len}
        fields.update(kw)
        return ops.paged_launch(b, PagedPart(**fields))

    def _flashmla_launch(self, ops: UpdatePath, b: PagedBuffers, bs: int, x: Inputs
                         ) -> tuple[Replay, ...]:
        """The FlashMLA scheduler part over part ``b``'s ``cache_seqlens`` (so it runs after
        ``b``'s own part, in stream order): one launch, or none without the metadata."""
        fm = self.cfg.flashmla
        if self._sched is None or fm is None:
            return ()
        md, ns = self._sched
        return (ops.flashmla_launch(b, FlashMLAPart(
            bs=bs, n=x.n, tile_scheduler_metadata=md, num_splits=ns, num_parts=md.shape[0],
            num_real=x.num_real, layout=fm.layout)),)

    def _flashmla_view(self, bs: int, s_q: int) -> FlashMLAMetadata | None:
        """The metadata's view for ``bs`` rows (``s_q`` query rows per request), else None."""
        fm = self.cfg.flashmla
        if self._sched is None or fm is None:
            return None
        md, ns = self._sched
        return FlashMLAMetadata(md, ns[: bs + 1], md.shape[0], s_q, fm, stamp=self._stamp)

    def _window(self, x: Inputs) -> dict[str, Any]:
        """The window keywords of the part that carries the window part (none without one)."""
        if x.window_table is None or self._window_buffers is None:
            return {}
        return {"window": self._window_buffers, "window_size": self.cfg.sliding_window,
                "window_table": x.window_table}

    # ---- capture state and overlay bookkeeping -------------------------------------------------
    def _write_capture_state(self) -> None:
        """The padded state of ``max_bs`` rows: the phase's parts over no real row, written by
        the reference path (the same bytes; it runs once, before capture, never per step)."""
        for part in self._parts(update_path(False), self.cfg.max_bs, self._capture_values()):
            part()

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

    def _after_write(self, bs: int) -> Callable[[], None]:
        """What a bound update's call records after its launches: this phase's write of ``bs``
        rows (a phase with more state of its own extends it)."""
        return partial(self._mark, bs)

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
        recording: list[Callable[[], object]] | None = [] if self.fused else None
        self._launches.recording = recording
        try:
            view = self.update_(bs, **inputs)  # type: ignore[attr-defined]
        finally:
            self._launches.recording = None
        return BoundUpdate(self.arena, view, recording,
                           lambda: self.update_(bs, **inputs),  # type: ignore[attr-defined]
                           self._after_write(bs))

    # ---- validation mode -----------------------------------------------------------------------
    def _check_values(self, x: Inputs, hi: int, ranges: Sequence[Any] = (),
                      hosts: Sequence[Any] = (), **more: Any) -> None:
        """Validation mode (``validate=True``): the inputs every phase shares (``seq_lens`` in
        ``[1, hi]``, ``req_pool_indices`` inside both tables, ``seq_lens_cpu`` equal to the
        device values), plus the phase's own ``ranges``, ``hosts`` and ``more`` checks
        (:class:`._validate.Values`). Nothing is gathered unless the pool validates; skipped
        during a capture, where a host read is illegal. Called after the metadata checks,
        before any write."""
        if not self.validate or capturing(self._dev):
            return
        table_rows = x.req_to_token.shape[0]
        if x.window_table is not None:  # rows req_pool_indices may pick: in both tables
            table_rows = min(table_rows, x.window_table.shape[0])
        validate(Values(x.n, x.num_real, table_rows,
                        [("seq_lens", x.seq_lens, 1, hi), *ranges,
                         ("req_pool_indices", x.req_pool_indices, 0, 0)],
                        [("seq_lens_cpu", x.seq_lens_cpu, "seq_lens"), *hosts], **more))

    # ---- views ---------------------------------------------------------------------------------
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

    def _rebound(self, bs: int, max_q: int, max_k: int, make: Callable[[], T]) -> T:
        """The view of ``bs`` rows with the host bounds ``max_q`` and ``max_k``: the first one
        of ``bs`` rows is sliced (``make``), every later one reuses its tensors
        (:func:`._views.rebound`)."""
        base = self._sliced.get(bs)
        if base is None:
            base = self._sliced[bs] = make()
            return base
        return rebound(base, max_q, max_k, self._window_k)  # type: ignore[no-any-return]

    def _window_view(self, rows: int, cu_seqlens_q: Tensor, max_q: int, max_k: int,
                     b: PagedBuffers | None = None, cls: type[PagedView] = PagedView,
                     **extra: Any) -> PagedView | None:
        """The window part's view (:func:`._views.window_view`) of ``rows`` rows: ``b``, a
        draft step's buffers, or by default the phase's window part; None without one."""
        buffers = self._window_buffers if b is None else b
        if buffers is None or self.cfg.sliding_window is None:
            return None
        return window_view(buffers, rows, cu_seqlens_q, max_q=max_q, max_k=max_k,
                           window=self.cfg.sliding_window, page_size=self.cfg.page_size,
                           pages=self.cfg.window_pages(self.phase), stamp=self._stamp, cls=cls,
                           **extra)

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


class KeyedPhase(PhaseBase[ViewT]):
    """A phase whose views are keyed by the batch size and one host bound, the keys' width
    ``max_k`` (decode, verify, draft extend): capture hands out the view at the full context
    (the static bound a graph was captured with), an update the view of its host-tight bound.
    The memo's hit needs no Python frame beyond this method's: it runs on every update."""

    def _capture_view(self, bs: int) -> ViewT:
        return self._view(bs, self.cfg.max_context_len)

    def _view(self, bs: int, max_k: int) -> ViewT:
        key = (bs, max_k)
        return self._views.get(key) or self._memo(key, lambda: self._make_view(bs, max_k))

    def _make_view(self, bs: int, max_k: int) -> ViewT:
        """The ``bs``-row view whose keys are bounded by ``max_k`` (slices of the phase's
        buffers; built once per key by :meth:`_view`)."""
        raise NotImplementedError
