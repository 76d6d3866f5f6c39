"""Decode phase: one query token per request (docs/design.md, Decode)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..arena import Arena
from ..config import Phase
from ..errors import InputError
from ..views import DecodeView
from ._views import part_view
from .base import Inputs, KeyedPhase, Replay, Shared, UpdatePath, new_record
from .host_lane import HostLane

if TYPE_CHECKING:
    from typing import Unpack


class DecodeValues(NamedTuple):
    """One decode update's values, as its part reads them (by these names).

    Attributes:
        inputs: the checked shared inputs (:class:`attnpool.phases.inputs_pass.Inputs`).
        keep: ``[bs]`` int8 device flags of the incremental page table, else None.
        width: page columns the real rows need (host bound; the reference path's gather).
    """

    inputs: Inputs
    keep: Tensor | None
    width: int


class DecodePhase(KeyedPhase[DecodeView]):
    """``pool.decode``: ``view(bs)`` for capture, ``update_(...)`` before each replay.

    Row ``i < n`` is request ``req_pool_indices[i]`` with ``cache_seqlens[i] = seq_lens[i]`` and
    page row ``i`` = its live page ids; rows ``n..bs`` are padding (docs/design.md, Padding).
    ``cu_seqlens_q`` is the pool's constant ``arange`` (never overwritten: it lives outside the
    overlay).

    Incremental page table (fused path, ``request_ids``): a request's page ``p`` keeps its id for
    the request's life, so a row serving the same request as at the previous decode update
    already holds its old pages and only the pages added since are written. The phase falls back
    to a full write by itself whenever those bytes may have changed in between (another overlaid
    phase, a capture state, poison, the encoder's decoder rows): it compares the arena's write
    epoch. Once any update of the pool has run in capturable mode (``num_real``), it may be
    replayed from the engine's graph without the arena seeing it, so every later update is a full
    one. The caller's part of the contract: ``request_ids`` are host values unique per live
    request (never a reused pool slot index) and the table entries (``req_to_token`` or
    ``block_table``) of positions a request already had do not change. Cost per incremental
    step: the host flags (a small host tensor) and one host-to-device copy of ``bs`` bytes, from
    pageable memory.
    """

    phase = Phase.DECODE

    def __init__(self, arena: Arena) -> None:
        super().__init__(arena)
        self._b = self._paged()
        self._keep = arena.buffer(self.phase, "keep")
        #: the host route of a CPU pool (:mod:`.host_lane`), else None
        self._lane: HostLane | None = HostLane.maybe(self, self._b)
        #: whether ``host_step`` is one C call here (a CPU pool on the reference path with
        #: page tables, and the C step built at install); else it is ``update_``
        self.host_route = self._lane is not None and self._lane._module is not None
        #: ``host_step(bs, seq_lens, block_table) -> DecodeView``: the host route, public (see
        #: :meth:`_host_step`); one C call with no Python frame where the C step is built
        #: (:meth:`HostLane.bind <attnpool.phases.host_lane.HostLane.bind>`)
        self.host_step: Callable[[int, Tensor, Tensor], DecodeView] = \
            self._host_step if self._lane is None else self._lane.bind(self._host_step)
        #: (request ids, arena epoch) right after the last decode update, for ``request_ids``.
        self._last: tuple[list[Hashable], int] | None = None

    def update_(
        self,
        bs: int,
        *,
        seq_lens: Tensor,
        request_ids: Sequence[Hashable] | None = None,
        **shared: Unpack[Shared],
    ) -> DecodeView:
        """Refill the ``bs``-row view in place from ``n = len(seq_lens)`` real requests.

        Every input after ``bs`` is keyword-only, so one phase's extra inputs can never land
        in the position another phase gives to ``req_pool_indices``.

        Args:
            bs: the captured batch size to replay (``n <= bs <= max_bs``).
            seq_lens: ``[n]`` int32/int64 on the pool's device, each in ``[1, C]``.
            req_pool_indices: ``[n]`` int32/int64 on the pool's device, each request's row of
                the request table. Optional with ``block_table``: row ``i`` of the batch is then
                table row ``i``.
            req_to_token: ``[num_req_slots, >= C]`` int32/int64 on the pool's device, the token
                slot of each position (SGLang's table). Exactly one of ``req_to_token`` and
                ``block_table`` is given.
            block_table: ``[num_rows, >= max_pages]`` int32/int64 on the pool's device, rows
                contiguous: the page id of each page of a request (vLLM's and transformers'
                table), pages of ``page_size`` tokens. Same bytes as the token-level table
                ``req_to_token[r, t] = block_table[r, t // P] * P + t % P``, on both paths.
            seq_lens_cpu: optional host copy of ``seq_lens``: enables bounds checks, a tight
                ``max_seqlen_k``, and page writes limited to the longest row's live pages.
                Without it the page block spans ``max_pages`` columns and ``max_seqlen_k = C``.
            request_ids: optional host ids of the ``n`` requests (unique per live request): turns
                on the incremental page table on the fused path (see the class docstring); costs
                one host-to-device copy of ``bs`` bytes. The reference path writes every live page
                anyway (the same bytes).
            num_real: capturable mode (fused path): a ``[1]`` device count of real rows; all
                inputs then have ``bs`` rows and the update can be recorded in the engine's own
                CUDA graph (see :mod:`attnpool.update.triton`). Call once before capture: the
                first call compiles the kernel.
            window_req_to_token, window_block_table: with ``PoolConfig(sliding_window=W)``, the
                table the window part reads (the sliding-window layers' own KV: SGLang's SWA
                pool, vLLM's KV cache group), of the request table's kind, dtype, device and
                width, rows picked by the same ``req_pool_indices``; default: the request table.
                Entries before a row's window may hold anything (freed pages, -1): nothing reads
                them.

        Returns:
            the refilled view (same tensors as ``view(bs)``; host ints reflect this batch).
        """
        cfg = self.cfg
        x = self.input_pass.check(bs, seq_lens, shared, cfg.max_context_len)
        n = x.n
        ids = None
        if request_ids is not None:
            if x.num_real is not None:
                raise InputError("request_ids cannot be combined with num_real (the real rows "
                                 "are not known on the host), got both")
            if isinstance(request_ids, Tensor):
                raise InputError("request_ids must be host values (a list of ids), got a "
                                 f"{request_ids.device} tensor: comparing it would sync")
            ids = list(request_ids)
            if len(ids) != n:
                raise InputError(f"request_ids must have n={n} values, got {len(ids)}")
        if self.validate:  # (the value lists are built only then)
            self._check_values(x, cfg.max_context_len)
        flags = self._keep_flags(ids, bs)
        keep = None if flags is None else self._keep[:bs]
        # --- writes start here (a part's first build repeats the checks above) ---
        if keep is not None and flags is not None:
            keep.copy_(flags, non_blocking=True)
        self._run((bs, x.launch_key, keep is None), bs,
                  new_record(DecodeValues, (x, keep, self._width(x.seq_lens_host))))
        return self._done(bs, n, x.seq_lens_host, ids)

    def _host_step(self, bs: int, seq_lens: Tensor, block_table: Tensor) -> DecodeView:
        """The host route of a decode step: ``update_(bs, seq_lens=seq_lens,
        block_table=block_table, seq_lens_cpu=seq_lens)``, the same bytes and the same view,
        for an engine's builder on a CPU pool whose lengths live on the host.

        Args:
            bs: the captured batch size (``n <= bs <= max_bs``).
            seq_lens: ``[n]`` int32 CPU tensor, each in ``[1, C]``: the lengths and their own
                host copy (nothing is copied to read them).
            block_table: ``[>= n, >= max_pages]`` int32 CPU tensor, rows contiguous: row ``i``
                is request ``i``'s page ids (vLLM's and transformers' table).

        The C step (:mod:`attnpool.update.host`) checks every value and then writes, in one
        call; a call it does not take (no C step built, a pool off the host route's shape,
        validation on, int64 inputs, non-contiguous rows, a bad value) goes to :meth:`update_`
        before anything is written, whose input pass raises the precise
        :class:`attnpool.PoolError` for bad input. The arena's record of the write
        (``_mark``) retires the incremental page table's last state too (``_last`` holds the
        epoch of its own update, which no longer matches).
        """
        lane = self._lane
        got = None if lane is None else lane.native(bs, seq_lens, block_table, None)
        if got is None:
            return self.update_(bs, seq_lens=seq_lens, block_table=block_table,
                                seq_lens_cpu=seq_lens)
        self._mark(bs)
        return lane.first(self._view(bs, got[1])) if type(got) is tuple else got  # type: ignore[union-attr,return-value]

    def _parts(self, ops: UpdatePath, bs: int, values: DecodeValues) -> tuple[Replay, ...]:
        """One paged part (``keep``: the incremental page table, see the class docstring), then
        FlashMLA's schedule of its lengths when the pool keeps it."""
        x = values.inputs
        return (self._paged_launch(ops, self._b, bs, x, keep=values.keep, width=values.width,
                                   **self._window(x)),
                *self._flashmla_launch(ops, self._b, bs, x))

    def _capture_values(self) -> DecodeValues:
        return DecodeValues(inputs=self._capture_inputs(), keep=None, width=0)

    def _keep_flags(self, ids: list[Hashable] | None, bs: int) -> Tensor | None:
        """Host ``keep`` flags, or None when no row can keep its pages (or bytes changed since)."""
        last = self._last
        if (ids is None or last is None or self.arena.recorded
                or last[1] != self.arena.epoch(self.phase)):
            return None
        flags = self.ops.keep_flags(last[0], ids, bs)
        return torch.tensor(flags, dtype=torch.int8) if any(flags) else None

    def _done(self, bs: int, n: int, host: list[int] | None, ids: list[Hashable] | None
              ) -> DecodeView:
        self._mark(bs)
        self._last = None if ids is None else (ids, self.arena.epoch(self.phase))
        return self._view(bs, self._max_k(host, 0, n, bs, self.cfg.max_context_len))

    # ---- internals ----------------------------------------------------------------------------

    def _make_view(self, bs: int, max_seqlen_k: int) -> DecodeView:
        return self._rebound(bs, 1, max_seqlen_k, lambda: part_view(
            self._b, bs, self._arange, max_q=1, max_k=max_seqlen_k,
            page_size=self.cfg.page_size, causal=True, cls=DecodeView, stamp=self._stamp,
            window=self._window_view(bs, self._arange, 1, max_seqlen_k, cls=DecodeView),
            flashmla=self._flashmla_view(bs, 1)))
