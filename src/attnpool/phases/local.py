"""Chunked local attention as virtual batches, for decode, verify and prefill. docs/design.md, Local."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from ..arena import Arena
from ..config import Phase
from ..errors import CapacityError, InputError
from ..inputs import check_bs
from ..specs import local_extend_rows, local_rows_per_request
from ..update.parts import LocalExtendPart, LocalPart
from ..views import LocalView
from ._views import part_view
from .base import Inputs, PhaseBase, Replay, Shared, UpdatePath, new_record

if TYPE_CHECKING:
    from typing import Unpack


class LocalValues(NamedTuple):
    """One local update's values, as its part reads them (by these names).

    Attributes:
        inputs: the checked shared inputs (:class:`attnpool.phases.inputs_pass.Inputs`).
        for_phase: the shape written: ``Phase.DECODE``, ``Phase.VERIFY`` or ``Phase.EXTEND``.
        extend_lens: ``[n]`` int device new tokens per request (the prefill shape), else None.
    """

    inputs: Inputs
    for_phase: Phase
    extend_lens: Tensor | None


class LocalPhase(PhaseBase[LocalView]):
    """``pool.local``: the chunked-local-attention view that goes with a decode or verify step.

    Each request's queries are split into virtual rows, one per chunk of size A their positions
    touch; a row attends only to the keys of its chunk up to its queries. Everything is computed
    on the device from the lengths (no host read), and the capacity is fixed by the config:
    ``V = 1`` row per request in decode, ``V = min(N, (N-1)//A + 2)`` in verify, rows of
    ``ceil(A / P)`` pages. ``for_phase`` picks which: the shapes never run in the same forward.

    ``for_phase=Phase.EXTEND`` is the prefill shape (an extend, or a draft extend): request ``i``
    brings ``extend_lens[i]`` new tokens, so its row count varies; the rows of all requests are
    laid out one after the other (``min(T, T//A + 2*bs)`` rows for ``T = max_extend_tokens``),
    padded rows after them. Prefill runs eagerly, so that shape has no capture view, no
    ``num_real``, and no fused kernel: its rows come from a ``searchsorted`` over the per-request
    chunk counts, torch ops on both update paths (:func:`attnpool.update.reference.
    local_extend_launch`), still with no host read.
    """

    phase = Phase.LOCAL

    def __init__(self, arena: Arena) -> None:
        super().__init__(arena)
        self._b = self._paged()
        self._cu_q = arena.buffer(self.phase, "cu_seqlens_q")
        chunk = self.cfg.attention_chunk_size
        self.chunk = chunk if chunk is not None else self.cfg.max_context_len
        self._pad = min(self.cfg.pad_seq_len, self.chunk)  # a padded row must fit in one chunk
        self._state: Phase | None = None  # which for_phase the capture state was written for
        self._for = Phase.DECODE

    def _shape(self, for_phase: Phase) -> tuple[int, int, int]:
        """(queries per request, extra KV tokens, rows per request) of ``for_phase``."""
        if for_phase is Phase.DECODE:
            return 1, 0, 1
        if for_phase is Phase.VERIFY and self.cfg.num_draft_tokens > 0:
            nd = self.cfg.num_draft_tokens
            return nd, nd, local_rows_per_request(self.cfg)
        raise InputError(f"for_phase must be Phase.DECODE, Phase.VERIFY (with num_draft_tokens "
                         f"> 0) or Phase.EXTEND (with max_extend_tokens > 0), got {for_phase}")

    def view(self, bs: int, for_phase: Phase = Phase.DECODE) -> LocalView:
        check_bs(self.cfg, bs)
        if for_phase is Phase.EXTEND:
            raise InputError("the prefill shape of pool.local has no capture view (prefill runs "
                             "eagerly): update_(..., for_phase=Phase.EXTEND) returns its view")
        self._shape(for_phase)
        if self._state is not for_phase:
            self.arena.mark_written(self.phase, 0)  # the other shape's state is not valid here
        self._for = for_phase
        self._ready(bs)
        self._state = for_phase
        return self._view(bs, for_phase)

    def update_(
        self,
        bs: int,
        *,
        seq_lens: Tensor,
        for_phase: Phase = Phase.DECODE,
        extend_lens: Tensor | None = None,
        extend_lens_cpu: Sequence[int] | None = None,
        **shared: Unpack[Shared],
    ) -> LocalView:
        """Refill for ``n`` requests (fused path: one launch, ``cu_seqlens_q`` included).

        Args:
            seq_lens: ``[n]`` as the matching phase takes them: decode lengths (including the
                token being decoded) or verify's committed lengths (drafts excluded).
            for_phase: ``Phase.DECODE`` (one query, KV length ``seq_lens``), ``Phase.VERIFY``
                (N queries, KV length ``seq_lens + N``) or ``Phase.EXTEND`` (``extend_lens``
                queries, KV length ``seq_lens``: as :meth:`ExtendPhase.update_` takes them).
            extend_lens, extend_lens_cpu: the prefill shape's new tokens per request (device
                ``[n]``, optional host copy), each in ``[1, seq_lens[i]]``, at most
                ``max_extend_tokens`` in all; only with ``for_phase=Phase.EXTEND``.
            num_real: capturable mode, as in :meth:`DecodePhase.update_` (a count of requests).
            (other arguments as in :meth:`DecodePhase.update_`.)
        """
        cfg = self.cfg
        if for_phase is Phase.EXTEND:
            return self._extend(bs, seq_lens, extend_lens, extend_lens_cpu, shared)
        if extend_lens is not None or extend_lens_cpu is not None:
            raise InputError(f"extend_lens go with for_phase=Phase.EXTEND, got {for_phase}")
        _, extra, _ = self._shape(for_phase)
        x = self.input_pass.check(bs, seq_lens, shared, cfg.max_context_len - extra)
        if self.validate:  # (the value lists are built only then)
            self._check_values(x, cfg.max_context_len - extra)
        # --- writes start here ---
        self._run((bs, x.launch_key, for_phase), bs,
                  new_record(LocalValues, (x, for_phase, None)))
        self._mark(bs)
        self._state = for_phase
        return self._view(bs, for_phase)

    def _extend(self, bs: int, seq_lens: Tensor, extend_lens: Tensor | None,
                extend_cpu: Sequence[int] | None, shared: Shared) -> LocalView:
        """The prefill shape (see the class docstring): checks, then one write of its rows."""
        cfg = self.cfg
        t_max = cfg.max_extend_tokens
        if not t_max:
            raise InputError("for_phase=Phase.EXTEND needs a pool with max_extend_tokens > 0")
        if shared.get("num_real") is not None:
            raise InputError("the prefill shape of pool.local is eager: num_real (capturable "
                             "updates) is not taken")
        if extend_lens is None:
            raise InputError("for_phase=Phase.EXTEND needs extend_lens ([n] new tokens per "
                             "request)")
        x = self.input_pass.check(bs, seq_lens, shared, cfg.max_context_len, extend_cpu)
        host = x.seq_lens_host
        ext, ehost = self.input_pass.lens("extend_lens", extend_lens, extend_cpu, x.n,
                                          cfg.max_context_len)
        if ehost is not None:
            if sum(ehost) > t_max:
                raise CapacityError(f"extend_lens_cpu sum to {sum(ehost)} tokens, more than "
                                    f"max_extend_tokens={t_max}")
            if host is not None and any(e > s for e, s in zip(ehost, host, strict=True)):
                raise InputError(f"extend_lens_cpu must be <= seq_lens_cpu per request, got "
                                 f"{ehost} and {host}")
        if self.validate:
            self._check_values(x, cfg.max_context_len,
                               [("extend_lens", ext, 1, cfg.max_context_len)],
                               [("extend_lens_cpu", extend_cpu, "extend_lens")],
                               at_most=[("extend_lens", "seq_lens")],
                               sum_at_most=("extend_lens", t_max))
        # --- writes start here ---
        self._run((bs, x.launch_key, Phase.EXTEND), bs,
                  new_record(LocalValues, (x, Phase.EXTEND, ext)))
        self._mark(bs)
        self._state = Phase.EXTEND
        max_q = min(self.chunk, t_max if ehost is None else max(ehost, default=1))
        return self._view(bs, Phase.EXTEND, max_q)

    def _after_write(self, bs: int) -> Callable[[], None]:
        """A bound call also restores which shape (decode or verify) the bytes now hold, so a
        later ``view`` of the other shape rewrites its capture state."""
        state = self._state

        def after() -> None:
            self._mark(bs)
            self._state = state

        return after

    def _parts(self, ops: UpdatePath, bs: int, values: LocalValues) -> tuple[Replay, ...]:
        """One part of ``bs * rows_per_request`` virtual rows, ``cu_seqlens_q`` included."""
        x, cfg = values.inputs, self.cfg
        if values.extend_lens is not None:  # the prefill shape: torch ops on both paths
            return (ops.local_extend_launch(self._b, LocalExtendPart(
                **self._rows(local_extend_rows(cfg, bs), x), extend_lens=values.extend_lens,
                cu_seqlens_q=self._cu_q, chunk=self.chunk, page_size=cfg.page_size,
                pad_len=self._pad, pad_page=cfg.pad_page)),)
        q, extra, per = self._shape(values.for_phase)
        return (ops.local_launch(self._b, LocalPart(
            **self._rows(bs, x), cu_seqlens_q=self._cu_q, extra=extra, num_queries=q,
            rows_per_request=per, chunk=self.chunk, page_size=cfg.page_size, pad_len=self._pad,
            pad_page=cfg.pad_page)),)

    def _capture_values(self) -> LocalValues:
        return LocalValues(inputs=self._capture_inputs(), for_phase=self._for, extend_lens=None)

    def _view(self, bs: int, for_phase: Phase, max_q: int = 0) -> LocalView:
        key = (bs, for_phase, max_q)
        return self._views.get(key) or self._memo(
            key, lambda: self._make_view(bs, for_phase, max_q))

    def _make_view(self, bs: int, for_phase: Phase, max_q: int) -> LocalView:
        max_k = min(self.chunk, self.cfg.max_context_len)
        if for_phase is Phase.EXTEND:  # rows_per_request 0: rows vary per request
            return part_view(self._b, local_extend_rows(self.cfg, bs), self._cu_q, max_q=max_q,
                             max_k=max_k, page_size=self.cfg.page_size, causal=True,
                             cls=LocalView, rows_per_request=0,
                             stamp=_ShapeStamp(self, for_phase))
        q, _, per = self._shape(for_phase)
        return part_view(self._b, bs * per, self._cu_q, max_q=q, max_k=max_k,
                         page_size=self.cfg.page_size, causal=True, cls=LocalView,
                         rows_per_request=per, stamp=_ShapeStamp(self, for_phase))


class _ShapeStamp:
    """A local view's producer: the local phase *and* the shape (decode or verify) it was made
    for. Both shapes share the part's bytes, so a view of one is stale once the other is written."""

    __slots__ = ("_local", "_shape")

    def __init__(self, local: LocalPhase, shape: Phase) -> None:
        self._local, self._shape = local, shape

    def current(self) -> bool:
        return self._local._stamp.current() and self._local._state is self._shape

    def describe(self) -> str:
        if not self._local._stamp.current():
            return self._local._stamp.describe()
        return (f"a local view shaped for {self._shape.value}, but its bytes now hold the "
                f"{self._local._state.value if self._local._state else 'no'} shape")

