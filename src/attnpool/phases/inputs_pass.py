"""The input pass every phase update starts with: the shared keywords, checked in one cheap pass.

Every ``update_`` takes ``bs``, ``seq_lens`` and the :class:`Shared` keywords besides its own.
:class:`InputPass` checks them (tensor metadata only, through :mod:`attnpool.inputs`, the one
place that checks caller tensors), resolves the request table and the window table, and hands
the phase an :class:`Inputs` record, which becomes the first field of the phase's value record.
Nothing here reads a device value or writes a pool byte: a rejected call changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict, TypeVar

import torch
from torch import Tensor

from ..arena import Arena
from ..config import INT_DTYPES
from ..errors import CapacityError, InputError, LayoutError
from ..inputs import (
    check_block_table,
    check_bs,
    check_req_to_token,
    check_shaped,
    check_table_layout,
    check_tensor,
    host_lens,
)


class Shared(TypedDict, total=False):
    """The keyword inputs every phase's ``update_`` takes besides its own (documented once, in
    :meth:`attnpool.phases.decode.DecodePhase.update_`): the request rows and table (exactly
    one of ``req_to_token`` and ``block_table``), the host copy of ``seq_lens``, the capturable
    mode's real count and, with a sliding window, the window table. Typed for checkers through
    ``**shared: Unpack[Shared]``; checked by name at run time (:meth:`InputPass.check`)."""

    req_pool_indices: Tensor | None
    req_to_token: Tensor | None
    block_table: Tensor | None
    seq_lens_cpu: Tensor | Sequence[int] | None
    num_real: Tensor | None
    window_req_to_token: Tensor | None
    window_block_table: Tensor | None


_SHARED = frozenset(Shared.__annotations__)
R = TypeVar("R", bound=tuple[Any, ...])

if TYPE_CHECKING:
    def new_record(cls: type[R], values: tuple[Any, ...], /) -> R:
        """See below."""
else:
    #: ``new_record(Record, (v0, v1, ...))``: the NamedTuple ``Record(v0, v1, ...)``, built
    #: without the class's generated ``__new__`` (a Python frame of its own that costs twice
    #: the tuple). Every update builds two records (:class:`Inputs` and the phase's values) on
    #: its hot path; the values go in field order, as the positional constructor takes them.
    new_record = tuple.__new__


class Inputs(NamedTuple):
    """What the input pass hands a phase: checked tensors and host values. The names are the
    update functions' parameter names, so a part reads its inputs from here by name.

    Attributes:
        n: real rows (``len(seq_lens)``; with ``num_real``, ``bs``).
        seq_lens: ``[n]`` int device lengths.
        req_pool_indices: ``[n]`` int device rows of the request table (the caller's, or
            ``arange[:n]`` for a block table given without them).
        req_to_token: the request table, ``[rows, cols]`` int: token slots, or with
            ``block_size`` the page ids of a block table.
        block_size: None for token slots, ``page_size`` for a block table.
        num_real: the capturable mode's ``[1]`` device count, else None.
        window_table: the table the window part reads (the request table when none is given),
            None without a window part.
        seq_lens_host: the checked host copy of ``seq_lens`` as ints, else None.
        seq_lens_cpu: the host copy as given (validation mode compares it), else None.
        launch_key: what of these inputs a part's assembled launch depends on (the request
            table's kind, shape and row stride, the capturable mode, a window table's own
            shape): the shared part of a phase's launch cache key.
    """

    n: int
    seq_lens: Tensor
    req_pool_indices: Tensor
    req_to_token: Tensor
    block_size: int | None
    num_real: Tensor | None
    window_table: Tensor | None
    seq_lens_host: list[int] | None
    seq_lens_cpu: Tensor | Sequence[int] | None
    launch_key: tuple[object, ...]


class InputPass:
    """A phase's input pass (see the module docstring).

    Args:
        arena: the pool's arena (its device, config, constant ``arange`` and address range: an
            input inside the arena is refused).
        phase_name: the phase in messages.
        window: whether the phase has a window part (a window table is refused otherwise).
        capturable: whether ``num_real`` is taken (the fused path).
        path: the update path's name, for the message refusing ``num_real``.
    """

    def __init__(self, arena: Arena, phase_name: str, window: bool, capturable: bool,
                 path: str) -> None:
        self.cfg = arena.cfg
        self.device = arena.storage.device
        self.phase_name, self.window, self.capturable = phase_name, window, capturable
        self.path = path
        #: the arena's address range, refused as an input's (computed once)
        self.arena_span = (arena.storage.data_ptr(),
                           arena.storage.data_ptr() + arena.storage.numel())
        self._arange = arena.buffer(None, "arange")
        #: ``arange[:n]`` per n: the rows of a block table given without ``req_pool_indices``
        self._in_order: dict[int, Tensor] = {}
        self._max_bs, self._max_context_len = self.cfg.max_bs, self.cfg.max_context_len
        #: set by a capturable update, for the arena (see Arena.recorded)
        self.arena = arena

    def tensor(self, name: str, t: object, ndim: int,
               dtypes: tuple[torch.dtype, ...] = INT_DTYPES, rows: int | None = None) -> Tensor:
        """A phase's own device input: :func:`attnpool.inputs.check_tensor` on the arena's
        device, outside the arena."""
        return check_tensor(name, t, None, ndim, dtypes, rows, self.device, True,
                            self.arena_span)

    def shaped(self, name: str, t: object, shape: tuple[int, ...],
               dtypes: tuple[torch.dtype, ...] = INT_DTYPES) -> tuple[Tensor, tuple[int, ...]]:
        """A phase's own device input of a fully known ``shape``, and its strides (for the
        launch key): :func:`attnpool.inputs.check_shaped` on the arena's device, outside the
        arena."""
        return check_shaped(name, t, shape, dtypes, self.device, self.arena_span)

    def lens(self, name: str, t: object, cpu: Tensor | Sequence[int] | None, n: int, hi: int,
             lo: int = 1) -> tuple[Tensor, list[int] | None]:
        """A phase's own per-request lengths (``accept_lens``, ``encoder_lens``,
        ``extend_lens``): the ``[n]`` device tensor and its optional host copy ``name_cpu``,
        each value in ``[lo, hi]``."""
        lens = check_tensor(name, t, None, 1, INT_DTYPES, n, self.device, True, self.arena_span)
        return lens, None if cpu is None else host_lens(f"{name}_cpu", cpu, n, lo, hi)

    def check(self, bs: int, seq_lens: object, shared: Shared, hi: int,
              *host: Tensor | Sequence[int] | None) -> Inputs:
        """The :class:`Shared` keywords (an unknown one is refused: ``**shared`` must not
        swallow a misspelt input), ``bs`` and ``seq_lens`` (``host``: the phase's other host
        copies, refused with ``num_real``), the request table (:meth:`request_table`), the
        window table (:meth:`window_table`) and the host lengths, each in ``[1, hi]``."""
        if not _SHARED.issuperset(shared):
            raise InputError(f"{self.phase_name}.update_ got unexpected keyword(s) "
                             f"{sorted(set(shared) - _SHARED)}; besides its own inputs it takes "
                             f"{sorted(_SHARED)}")
        num_real, cpu = shared.get("num_real"), shared.get("seq_lens_cpu")
        seq_lens = check_tensor("seq_lens", seq_lens, None, 1, INT_DTYPES, None, self.device,
                                True, self.arena_span)
        n = seq_lens.shape[0]
        if num_real is not None:
            self._capturable(bs, n, num_real, (cpu, *host))
        elif not (type(bs) is int and n <= bs <= self._max_bs and bs >= 1):
            check_bs(self.cfg, bs, n)  # (raises, naming what is wrong)
        req_pool_indices, req_to_token = shared.get("req_pool_indices"), shared.get("req_to_token")
        block_size: int | None
        if req_to_token is not None and req_pool_indices is not None \
                and shared.get("block_table") is None:
            # SGLang's form, the common one, without request_table's frame (same checks)
            rows = check_tensor("req_pool_indices", req_pool_indices, None, 1, INT_DTYPES, n,
                                self.device, True, self.arena_span)
            table, shape, strides = check_table_layout(
                "req_to_token", req_to_token, self.device, self._max_context_len,
                "max_context_len", self.cfg, self.arena_span)
            block_size = None
        else:
            rows, table, block_size, shape, strides = self.request_table(
                n, req_pool_indices, req_to_token, shared.get("block_table"))
        window_table = None
        if self.window or "window_req_to_token" in shared or "window_block_table" in shared:
            window_table = self.window_table(table, block_size,
                                             shared.get("window_req_to_token"),
                                             shared.get("window_block_table"))
            if (window_table is not None and req_pool_indices is None
                    and window_table.shape[0] < n):
                raise CapacityError(f"window_block_table without req_pool_indices needs a row "
                                    f"per input row (row i of the batch is table row i): >= {n} "
                                    f"rows, got {window_table.shape[0]}")
        key = (block_size, shape, strides, num_real is None,
               None if window_table is None or window_table is table
               else (window_table.shape, window_table.stride()))
        return new_record(Inputs, (
            n, seq_lens, rows, table, block_size, num_real, window_table,
            None if cpu is None else host_lens("seq_lens_cpu", cpu, n, 1, hi), cpu, key))

    def _capturable(self, bs: int, n: int, num_real: object,
                    host: tuple[Tensor | Sequence[int] | None, ...]) -> None:
        """Capturable updates (``num_real``, a ``[1]`` device count; fused path only): every
        input has ``bs`` rows, values past the real count are never read, and host copies are
        refused (the count is not known on the host, so the view keeps its static bounds, as a
        captured view must)."""
        if not self.capturable:
            raise InputError(f"num_real (a capturable update) needs the fused path, "
                             f"impl=TRITON; this pool runs impl={self.path}")
        check_bs(self.cfg, bs)
        if n != bs:
            raise InputError(f"with num_real, inputs are padded to bs={bs} rows, got {n}")
        self.tensor("num_real", num_real, 1, rows=1)
        if any(h is not None for h in host):
            raise InputError("host copies (*_cpu) cannot be combined with num_real: the real "
                             "count lives on the device, got a host copy")
        # May be replayed from a graph: see Arena.recorded. Host bookkeeping only (no pool byte
        # changes), and it only turns an optimisation off, so setting it before the remaining
        # input checks of the phase is harmless even if one of them rejects the call.
        self.arena.recorded = True

    def request_table(self, n: int, req_pool_indices: object, req_to_token: object,
                      block_table: object
                      ) -> tuple[Tensor, Tensor, int | None, torch.Size, tuple[int, ...]]:
        """Check the request table: ``(rows, table, block_size, shape, strides)`` for ``n``
        input rows (the table's shape and strides as its check read them, for the launch key).

        Exactly one table: ``req_to_token`` (token slots, SGLang's layout; ``block_size``
        None) or ``block_table`` (page ids, vLLM's and transformers' layout; ``block_size =
        page_size``), which both update paths read as the token table ``block_table[r, t // P]
        * P + t % P``, so the two write the same bytes. ``rows`` picks each input row's table
        row: the caller's ``req_pool_indices``, which a block table may omit (input row ``i``
        is then table row ``i``: a slice of the pool's constant ``arange``, no allocation; it
        is substituted only here, after the aliasing checks that refuse pool buffers as caller
        inputs).
        """
        cfg, span = self.cfg, self.arena_span
        if block_table is None:
            if req_to_token is None:
                raise InputError("pass exactly one request table, req_to_token (token slots) or "
                                 "block_table (page ids), got neither")
            if req_pool_indices is None:
                raise InputError("req_pool_indices is required with req_to_token (only a "
                                 "block_table's rows may default to the batch order), got None")
            rows = check_tensor("req_pool_indices", req_pool_indices, None, 1, INT_DTYPES, n,
                                self.device, True, span)
            table, shape, strides = check_table_layout("req_to_token", req_to_token, self.device,
                                                       cfg.max_context_len, "max_context_len",
                                                       cfg, span)
            return rows, table, None, shape, strides
        if req_to_token is not None:
            raise InputError("pass exactly one request table, req_to_token (token slots) or "
                             "block_table (page ids), got both")
        table, shape, strides = check_table_layout("block_table", block_table, self.device,
                                                   cfg.max_pages, "max_pages", cfg, span)
        if req_pool_indices is not None:
            return (check_tensor("req_pool_indices", req_pool_indices, None, 1, INT_DTYPES, n,
                                 self.device, True, span), table, cfg.page_size, shape, strides)
        if shape[0] < n:
            raise CapacityError(f"block_table without req_pool_indices needs a row per input row "
                                f"(row i of the batch is table row i): >= {n} rows, got "
                                f"{shape[0]}")
        return self.in_order(n), table, cfg.page_size, shape, strides

    def in_order(self, n: int) -> Tensor:
        """``arange[:n]``, the rows of a block table given without ``req_pool_indices`` (made
        once per ``n``: a slice is a dispatched op of its own)."""
        in_order = self._in_order.get(n)
        if in_order is None:
            in_order = self._in_order[n] = self._arange[:n]
        return in_order

    def window_table(self, table: Tensor, block_size: int | None, window_req_to_token: object,
                     window_block_table: object) -> Tensor | None:
        """The table the window part reads: None without a window part; else the caller's
        window table (an engine's sliding-window KV group: SGLang's SWA pool, vLLM's KV cache
        group), or the request table itself when none is given.

        A window table is of the request table's kind (``window_req_to_token`` with
        ``req_to_token``, ``window_block_table`` with ``block_table``: the window part reads
        the same rows, ``req_pool_indices``), dtype and device, and covers every position (its
        entries before a row's window may hold anything: nothing reads them)."""
        given = window_block_table if window_req_to_token is None else window_req_to_token
        if not self.window:
            if given is not None:
                raise LayoutError(f"a window table needs PoolConfig(sliding_window=...) and a "
                                  f"phase with a window part; {self.phase_name} of this pool "
                                  f"has none, got one")
            return None
        if given is None:
            return table
        if window_req_to_token is not None and window_block_table is not None:
            raise InputError("pass at most one window table, window_req_to_token or "
                             "window_block_table, got both")
        kind = "req_to_token" if block_size is None else "block_table"
        window_kind = "req_to_token" if window_block_table is None else "block_table"
        if kind != window_kind:
            raise InputError(f"the window table must be of the request table's kind: "
                             f"window_{kind} with {kind}, got window_{window_kind}")
        window_table = (
            check_req_to_token(given, self.cfg, self.device, "window_req_to_token",
                               self.arena_span) if block_size is None
            else check_block_table(given, self.cfg, self.device, "window_block_table",
                                   self.arena_span))
        if window_table.dtype != table.dtype:
            raise InputError(f"window_{kind} must have {kind}'s dtype {table.dtype}, got "
                             f"{window_table.dtype}")
        return window_table
