"""Extend (prefill with a cached prefix): variable new tokens per request, causal.

docs/design.md, Extend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from ..arena import Arena
from ..config import INT_DTYPES, Phase
from ..errors import CapacityError, InputError, LayoutError
from ..inputs import check_tensor
from ..views import ExtendView
from ._views import part_view
from .base import Inputs, PhaseBase, Replay, Shared, UpdatePath, new_record
from .host_lane import HostLane

if TYPE_CHECKING:
    from typing import Unpack


class ExtendValues(NamedTuple):
    """One extend update's values, as its part reads them (by these names).

    Attributes:
        inputs: the checked shared inputs (:class:`attnpool.phases.inputs_pass.Inputs`).
        q_lens: ``[n]`` int device new tokens per request (``extend_lens``).
        out_slots: ``[L]`` int device slot mapping to write, else None.
        width: page columns the real rows need (host bound; the reference path's gather).
        window_out_slots: ``[L]`` int device slot mapping of the window table, else None.
        tokens: the real query tokens from ``extend_lens_cpu`` (host), else None: the reference
            path's token buffers are computed over those alone (``PagedPart.tokens``).
        exact_tokens: ``extend_lens_cpu`` is ``extend_lens`` itself (a CPU pool given its own
            input as the host copy), so ``tokens`` is exact (``PagedPart.exact_tokens``).
    """

    inputs: Inputs
    q_lens: Tensor
    out_slots: Tensor | None
    width: int
    window_out_slots: Tensor | None
    tokens: int | None
    exact_tokens: bool


class ExtendPhase(PhaseBase[ExtendView]):
    """``pool.extend``: request ``i`` appends ``extend_lens[i]`` tokens to a cached prefix of
    ``seq_lens[i] - extend_lens[i]`` tokens; its queries attend causally over ``cache_seqlens =
    seq_lens`` (the caller stores the new tokens' K/V before attention).

    One update writes the paged part (lengths, cumsum, page table and/or CSR, like decode), the
    packed query offsets ``cu_seqlens_q``, the per-token ``positions`` and, when asked, the new
    tokens' KV slots (``out_slots``), so a prefill step is one metadata call: one launch on the
    fused path. Padded rows and the fixed query total ``T = max_extend_tokens`` of padded batches
    are described in :class:`attnpool.ExtendView`; the capture state (every row padded) has
    ``cu_seqlens_q = [0, T, T, ...]``, valid for every ``bs``.
    """

    phase = Phase.EXTEND

    def __init__(self, arena: Arena) -> None:
        super().__init__(arena)
        self._b = self._paged()
        self._cu_q = arena.buffer(self.phase, "cu_seqlens_q")
        self._pos = arena.buffer(self.phase, "positions")
        #: T: packed query tokens of one batch, and the query total of a padded one.
        self.max_tokens = arena.cfg.max_extend_tokens
        #: the host route of a CPU pool (:mod:`.host_lane`), else None
        self._lane: HostLane | None = HostLane.maybe(self, self._b,
                                                     (self._cu_q, self._pos, self.max_tokens))
        #: ``host_step(bs, seq_lens, extend_lens, block_table) -> ExtendView``: the extend
        #: step's host route (see :meth:`_host_step`)
        self.host_step: Callable[[int, Tensor, Tensor, Tensor], ExtendView] = \
            self._host_step if self._lane is None else self._lane.bind(self._host_step)
        #: whether ``host_step`` and ``host_step_offsets`` are one C call here (a CPU pool on
        #: the reference path with page tables, and the C step built at install); else they
        #: are ``update_``
        self.host_route = self._lane is not None and self._lane._module is not None
        #: ``host_step_offsets(bs, seq_lens, cu_seqlens_q, block_table) -> ExtendView``: the
        #: host route with the queries as packed offsets (see :meth:`_host_step_offsets`)
        self.host_step_offsets: Callable[[int, Tensor, Tensor, Tensor], ExtendView] = (
            self._host_step_offsets if self._lane is None
            else self._lane.bind(self._host_step_offsets, offsets=True))

    def _capture_view(self, bs: int) -> ExtendView:
        """The ``bs``-row view for capture: every row padded, static host bounds
        (``max_seqlen_q = T``, ``max_seqlen_k = max_context_len``)."""
        return self._view(bs, self.max_tokens, self.cfg.max_context_len)

    def update_(
        self,
        bs: int,
        *,
        seq_lens: Tensor,
        extend_lens: Tensor,
        extend_lens_cpu: Tensor | Sequence[int] | None = None,
        out_slots: Tensor | None = None,
        window_out_slots: Tensor | None = None,
        **shared: Unpack[Shared],
    ) -> ExtendView:
        """Refill the ``bs``-row view in place for ``n = len(seq_lens)`` requests.

        Args:
            bs: the captured batch size (``n <= bs <= max_bs``).
            seq_lens: ``[n]`` int, total KV length of each request *including* its new tokens,
                in ``[1, C]``.
            extend_lens: ``[n]`` int, new tokens per request, in ``[1, seq_lens[i]]``, summing
                to at most ``T = max_extend_tokens``.
            req_pool_indices, req_to_token, block_table: as in :meth:`DecodePhase.update_`
                (exactly one table).
            seq_lens_cpu, extend_lens_cpu: optional host copies: bounds checks (``seq_lens_cpu
                <= C``, ``1 <= extend_lens_cpu[i] <= seq_lens_cpu[i]``, ``sum <= T``), tight
                ``max_seqlen_k`` / ``max_seqlen_q``, and page writes limited to the live pages.
                Without them the values are the caller's contract (nothing is read back).
            num_real: capturable mode (fused path): a ``[1]`` device count of real rows, every
                input padded to ``bs`` rows; see :meth:`DecodePhase.update_`.
            out_slots: optional ``[L]`` int32/int64 device tensor (e.g. ``kv.slot_view(T)`` of a
                :class:`attnpool.KVCachePool`) that receives the new tokens' KV slots in packed
                order: token ``j`` of request ``i`` gets the table's slot at ``prefix_i + j``
                and the tail ``[sum(extend_lens), L)`` gets -1 (stores skip it). ``L`` must be
                ``>= sum(extend_lens_cpu)`` when that is given, else ``>= T``.
            window_req_to_token, window_block_table: the window part's table, as in
                :meth:`DecodePhase.update_` (``PoolConfig(sliding_window=W)``).
            window_out_slots: like ``out_slots``, the same tokens' slots in the window table
                (the sliding-window KV group's slot mapping: -1 past the real tokens, written
                every step), by the same launch; needs a window part.

        Returns:
            the refilled :class:`attnpool.ExtendView` (same tensors as ``view(bs)``).
        """
        cfg, t_max = self.cfg, self.max_tokens
        x = self.input_pass.check(bs, seq_lens, shared, cfg.max_context_len, extend_lens_cpu)
        n, host = x.n, x.seq_lens_host
        ext, ehost = self.input_pass.lens("extend_lens", extend_lens, extend_lens_cpu, n,
                                          cfg.max_context_len)
        total = self._check_host(host, ehost)
        slots = None if out_slots is None else self._out_slots(out_slots, total)
        window_slots = None
        if window_out_slots is not None:
            if x.window_table is None:
                raise LayoutError("window_out_slots needs PoolConfig(sliding_window=...), got "
                                  "one from a pool without a window")
            window_slots = self._out_slots(window_out_slots, total, "window_out_slots")
            if slots is not None and _overlap(slots, window_slots):
                raise InputError("out_slots and window_out_slots must not overlap (two groups' "
                                 "slot mappings written by one update), got overlapping tensors")
        if self.validate:  # (the value lists are built only then)
            self._check_values(x, cfg.max_context_len, [("extend_lens", ext, 1, cfg.max_context_len)],
                               [("extend_lens_cpu", extend_lens_cpu, "extend_lens")],
                               at_most=[("extend_lens", "seq_lens")], sum_at_most=("extend_lens", t_max))
        exact = ehost is not None and _same_tensor(extend_lens_cpu, ext)
        # --- writes start here ---
        self._run((bs, x.launch_key, None if slots is None else slots.shape[0],
                   None if window_slots is None else window_slots.shape[0], exact), bs,
                  new_record(ExtendValues, (x, ext, slots, self._width(host), window_slots,
                                            total, exact)))
        self._mark(bs)
        return self._view(bs, self._max_q(ehost, n, bs),
                          self._max_k(host, 0, n, bs, cfg.max_context_len))

    def _host_step(self, bs: int, seq_lens: Tensor, extend_lens: Tensor, block_table: Tensor
                   ) -> ExtendView:
        """The host route of an extend step: ``update_(bs, seq_lens=seq_lens,
        extend_lens=extend_lens, block_table=block_table, seq_lens_cpu=seq_lens,
        extend_lens_cpu=extend_lens)``, the same bytes and the same view. ``extend_lens``:
        ``[n]`` int32 CPU tensor, new tokens per request (their own host copy); the rest as
        :meth:`attnpool.phases.decode.DecodePhase._host_step`, which says what goes to
        :meth:`update_` instead (and raises there)."""
        lane = self._lane
        got = None if lane is None else lane.native(bs, seq_lens, block_table, extend_lens)
        if got is None:
            return self.update_(bs, seq_lens=seq_lens, extend_lens=extend_lens,
                                block_table=block_table, seq_lens_cpu=seq_lens,
                                extend_lens_cpu=extend_lens)
        self._mark(bs)
        return lane.first(self._view(bs, *got)) if type(got) is tuple else got  # type: ignore[union-attr,misc,return-value]

    def _host_step_offsets(self, bs: int, seq_lens: Tensor, cu_seqlens_q: Tensor,
                           block_table: Tensor) -> ExtendView:
        """:meth:`_host_step` with the queries given as packed offsets, flash-attn's
        ``cu_seqlens_q``: ``[>= n + 1]`` int32 CPU, request ``i``'s new tokens being
        ``cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1`` (so ``extend_lens = cu_seqlens_q[1:n +
        1] - cu_seqlens_q[:n]``; rows past ``n + 1`` are not read). The form an engine's
        builder holds (vLLM's ``query_start_loc``): the C step reads the lengths off the
        offsets itself, where a separate op to make them would be the step's one dispatched
        torch op (the first op after a forward costs several small ops' time).

        A call the C step does not take goes to :meth:`update_` with the lengths computed
        from the offsets (checked first: a bad ``cu_seqlens_q`` gets the input pass's
        :class:`attnpool.PoolError`); that fallback allocates the lengths, the host route
        does not."""
        lane = self._lane
        got = None if lane is None else lane.native(bs, seq_lens, block_table, cu_seqlens_q,
                                                    True)
        if got is None:
            # (a bad seq_lens: update_ names it, before the lengths it is given)
            n = seq_lens.shape[0] if isinstance(seq_lens, Tensor) and seq_lens.dim() == 1 else 0
            cu = check_tensor("cu_seqlens_q", cu_seqlens_q, None, 1, INT_DTYPES, None,
                              self.cfg.torch_device, True, self.input_pass.arena_span)
            if cu.shape[0] < n + 1:
                raise InputError(f"cu_seqlens_q must have >= n + 1 = {n + 1} rows, got "
                                 f"{cu.shape[0]}")
            ext = cu[1:n + 1] - cu[:n]
            return self.update_(bs, seq_lens=seq_lens, extend_lens=ext, block_table=block_table,
                                seq_lens_cpu=seq_lens, extend_lens_cpu=ext)
        self._mark(bs)
        return lane.first(self._view(bs, *got)) if type(got) is tuple else got  # type: ignore[union-attr,misc,return-value]

    def _max_q(self, ehost: list[int] | None, n: int, bs: int) -> int:
        """Host bound of the query lengths: tight from ``extend_lens_cpu`` (a padded batch's
        first padded row takes the slack up to ``T``), else ``T``."""
        t_max = self.max_tokens
        if ehost is None:
            return t_max
        return max(max(ehost, default=0), t_max - sum(ehost) if n < bs else 0)

    # ---- checks --------------------------------------------------------------------------------
    def _check_host(self, host: list[int] | None, ehost: list[int] | None) -> int | None:
        """Bounds of the host copies; the batch's token total when ``extend_lens_cpu`` is given."""
        if ehost is None:
            return None
        if host is not None:
            for i, (e, s) in enumerate(zip(ehost, host, strict=True)):
                if e > s:
                    raise CapacityError(f"extend_lens_cpu[{i}] must be <= seq_lens_cpu[{i}]="
                                        f"{s} (the new tokens are part of the sequence), got {e}")
        total = sum(ehost)
        if total > self.max_tokens:
            raise CapacityError(f"sum(extend_lens_cpu) must be <= max_extend_tokens="
                                f"{self.max_tokens}, got {total}")
        return total

    def _out_slots(self, t: object, total: int | None, name: str = "out_slots") -> Tensor:
        """``out_slots``: a 1-D contiguous int device tensor long enough for every real token."""
        slots = self.input_pass.tensor(name, t, 1)
        need = self.max_tokens if total is None else total
        if slots.shape[0] < need:
            what = "sum(extend_lens_cpu)" if total is not None else (
                "max_extend_tokens (no extend_lens_cpu given)")
            raise CapacityError(f"{name} must have >= {what} = {need} elements, "
                                f"got {slots.shape[0]}")
        return slots

    def _parts(self, ops: UpdatePath, bs: int, values: ExtendValues) -> tuple[Replay, ...]:
        """One paged part with its query part (padded rows: the first takes the slack up to
        ``T``, the others none) and the packed tokens' positions (and ``out_slots``)."""
        x = values.inputs
        window = self._window(x)
        if window:
            window["window_out_slots"] = values.window_out_slots
        return (self._paged_launch(ops, self._b, bs, x, q_lens=values.q_lens,
                                   max_q=self.max_tokens, cu_seqlens_q=self._cu_q,
                                   q_total=self.max_tokens, positions=self._pos,
                                   out_slots=values.out_slots, width=values.width,
                                   tokens=values.tokens, exact_tokens=values.exact_tokens,
                                   **window),)

    def _capture_values(self) -> ExtendValues:
        return ExtendValues(inputs=self._capture_inputs(), q_lens=self._arange[:0],
                            out_slots=None, width=0, window_out_slots=None, tokens=0,
                            exact_tokens=False)

    def _view(self, bs: int, max_q: int, max_k: int) -> ExtendView:
        key = (bs, max_q, max_k)
        return self._views.get(key) or self._memo(key, lambda: self._make_view(bs, max_q, max_k))

    def _make_view(self, bs: int, max_q: int, max_k: int) -> ExtendView:
        return self._rebound(bs, max_q, max_k, lambda: part_view(
            self._b, bs, self._cu_q, max_q=max_q, max_k=max_k, page_size=self.cfg.page_size,
            causal=True, cls=ExtendView, positions=self._pos, stamp=self._stamp,
            window=self._window_view(bs, self._cu_q, max_q, max_k, cls=ExtendView,
                                     positions=self._pos)))


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two 1-D contiguous tensors share any byte."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _same_tensor(host: object, t: Tensor) -> bool:
    """Whether a host copy is the device input itself (a CPU pool's caller passing one tensor
    as both): then the host checks read the very values the update writes from."""
    return host is t or (isinstance(host, Tensor) and host.device == t.device
                         and host.data_ptr() == t.data_ptr() and host.dtype == t.dtype
                         and host.shape == t.shape and host.stride() == t.stride())
