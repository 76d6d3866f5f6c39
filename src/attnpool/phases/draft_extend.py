"""Draft extend: a variable number of accepted tokens per request. docs/design.md, Draft extend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from ..arena import Arena
from ..config import Phase
from ..errors import CapacityError
from ..views import DraftExtendView
from ._views import part_view
from .base import Inputs, KeyedPhase, Replay, Shared, UpdatePath, new_record

if TYPE_CHECKING:
    from typing import Unpack


class DraftExtendValues(NamedTuple):
    """One draft extend update's values, as its part reads them (by these names).

    Attributes:
        inputs: the checked shared inputs (:class:`attnpool.phases.inputs_pass.Inputs`).
        q_lens: ``[n]`` int device queries per request (``accept_lens``).
        width: page columns the real rows need (host bound; the reference path's gather).
        pad_q: queries per padded row (1; N in the capture state, see the class docstring).
    """

    inputs: Inputs
    q_lens: Tensor
    width: int
    pad_q: int


class DraftExtendPhase(KeyedPhase[DraftExtendView]):
    """``pool.draft_extend``: request ``i`` runs ``accept_lens[i]`` queries (1..N) causally over
    ``cache_seqlens = seq_lens`` (which include those tokens).

    The captured query buffer holds ``bs*N`` tokens; real requests' queries are packed first
    (``cu_seqlens_q = [0, cumsum(accept_lens)]``) and each padded row gets one query, so
    ``cu_seqlens_q`` stays non-decreasing and never points past the buffer.

    The capture state gives each padded row ``N`` queries instead: a captured view of ``bs`` rows
    then has ``cu_seqlens_q[bs] = bs*N``, the graph's whole query buffer and the most any later
    batch of that size has. Kernels that size their work at capture rely on it (a FlashInfer
    prefill wrapper keeps its first plan's ``qo_indptr[-1]`` as the maximum and checks that ``q``
    has exactly that many rows); later updates have at most as many.
    """

    phase = Phase.DRAFT_EXTEND

    def __init__(self, arena: Arena) -> None:
        super().__init__(arena)
        self._b = self._paged()
        self._cu_q = arena.buffer(self.phase, "cu_seqlens_q")

    def update_(
        self,
        bs: int,
        *,
        seq_lens: Tensor,
        accept_lens: Tensor,
        accept_lens_cpu: Tensor | Sequence[int] | None = None,
        **shared: Unpack[Shared],
    ) -> DraftExtendView:
        """Refill for ``n`` requests (fused path: one launch, ``cu_seqlens_q`` included).

        Args:
            seq_lens: ``[n]`` KV lengths including the accepted tokens, in ``[1, C]``.
            accept_lens: ``[n]`` int queries per request, each in ``[1, min(N, seq_len)]``
                (checked when ``accept_lens_cpu`` is given).
            num_real: capturable mode, as in :meth:`DecodePhase.update_`.
            (other arguments as in :meth:`DecodePhase.update_`.)
        """
        cfg = self.cfg
        x = self.input_pass.check(bs, seq_lens, shared, cfg.max_context_len, accept_lens_cpu)
        host = x.seq_lens_host
        acc, acc_host = self.input_pass.lens("accept_lens", accept_lens, accept_lens_cpu, x.n,
                                             cfg.num_draft_tokens)
        if host is not None and acc_host is not None:
            # the accepted tokens are part of the KV: a request cannot run more queries than keys
            for i, (a, s) in enumerate(zip(acc_host, host, strict=True)):
                if a > s:
                    raise CapacityError(f"accept_lens_cpu[{i}] must be <= seq_lens_cpu[{i}]={s}, "
                                        f"got {a}")
        if self.validate:  # (the value lists are built only then)
            self._check_values(x, cfg.max_context_len, [("accept_lens", acc, 1, cfg.num_draft_tokens)],
                               [("accept_lens_cpu", accept_lens_cpu, "accept_lens")],
                               at_most=[("accept_lens", "seq_lens")])
        # --- writes start here ---
        self._run((bs, x.launch_key), bs,
                  new_record(DraftExtendValues, (x, acc, self._width(host), 1)))
        self._mark(bs)
        return self._view(bs, self._max_k(host, 0, x.n, bs, cfg.max_context_len))

    def _parts(self, ops: UpdatePath, bs: int, values: DraftExtendValues
               ) -> tuple[Replay, ...]:
        """One paged part with its query part: ``cu_seqlens_q`` over ``accept_lens`` (clamped
        into ``[0, N]``: an out-of-contract device value cannot push the packed query offsets
        past the captured buffer), ``pad_q`` queries per padded row."""
        x = values.inputs
        return (self._paged_launch(ops, self._b, bs, x, q_lens=values.q_lens,
                                   cu_seqlens_q=self._cu_q, pad_q=values.pad_q,
                                   max_q=self.cfg.num_draft_tokens, width=values.width,
                                   **self._window(x)),)

    def _capture_values(self) -> DraftExtendValues:
        # N queries per padded row: every captured bs has cu_seqlens_q[bs] = bs*N (class doc)
        return DraftExtendValues(inputs=self._capture_inputs(), q_lens=self._arange[:0],
                                 width=0, pad_q=self.cfg.num_draft_tokens)

    def _make_view(self, bs: int, max_k: int) -> DraftExtendView:
        return part_view(self._b, bs, self._cu_q, max_q=self.cfg.num_draft_tokens, max_k=max_k,
                         page_size=self.cfg.page_size, causal=True, cls=DraftExtendView,
                         stamp=self._stamp, window=self._window_view(
                             bs, self._cu_q, self.cfg.num_draft_tokens, max_k,
                             cls=DraftExtendView))
