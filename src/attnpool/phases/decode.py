"""Decode phase: one query token per request (DESIGN §4, "decode")."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..arena import Arena
from ..config import Phase
from ..update import reference as ref
from ..views import DecodeView
from ._checks import check_bs, check_req_to_token, check_tensor, host_lens
from .base import PhaseBase, part_view


class DecodePhase(PhaseBase):
    """``pool.decode``: ``view(bs)`` for capture, ``update_(...)`` before each replay.

    Row ``i < n`` is request ``req_pool_indices[i]`` with ``cache_seqlens[i] = seq_lens[i]`` and
    page row ``i`` = its live page ids; rows ``n..bs`` are padding (DESIGN §1). ``cu_seqlens_q``
    is the pool's constant ``arange`` (never overwritten: it lives outside the overlay).
    """

    phase = Phase.DECODE

    def __init__(self, arena: Arena) -> None:
        super().__init__(arena)
        self._b = self._paged()

    def view(self, bs: int) -> DecodeView:
        """The ``bs``-row view for capture: valid padded values, static host bounds."""
        check_bs(self.cfg, bs)
        self._ready(bs)
        return self._view(bs, self.cfg.max_context_len)

    def update_(
        self,
        bs: int,
        seq_lens: Tensor,
        req_pool_indices: Tensor,
        req_to_token: Tensor,
        seq_lens_cpu: Tensor | Sequence[int] | None = None,
    ) -> DecodeView:
        """Refill the ``bs``-row view in place from ``n = len(seq_lens)`` real requests.

        Args:
            bs: the captured batch size to replay (``n <= bs <= max_bs``).
            seq_lens: ``[n]`` int32/int64 on the pool's device, each in ``[1, C]``.
            req_pool_indices: ``[n]`` int32/int64 on the pool's device, rows of ``req_to_token``.
            req_to_token: ``[num_req_slots, >= C]`` int32/int64, token slot of each position.
            seq_lens_cpu: optional host copy of ``seq_lens``: enables bounds checks, a tight
                ``max_seqlen_k``, and page writes limited to the longest row's live pages.
                Without it the page block spans ``max_pages`` columns and ``max_seqlen_k = C``.

        Returns:
            the refilled view (same tensors as ``view(bs)``; host ints reflect this batch).
        """
        cfg = self.cfg
        seq_lens = check_tensor("seq_lens", seq_lens, cfg, 1)
        n = seq_lens.shape[0]
        check_bs(cfg, bs, n)
        req_pool_indices = check_tensor("req_pool_indices", req_pool_indices, cfg, 1, rows=n)
        req_to_token = check_req_to_token(req_to_token, cfg)
        host = host_lens("seq_lens_cpu", seq_lens_cpu, n, 1, cfg.max_context_len)
        pages = self._gather(req_pool_indices, req_to_token, host)
        # --- writes start here: everything above is validation or a temporary ---
        return self._commit(bs, seq_lens, pages, host)

    # ---- internals (also used by the encoder phase for the decoder part) ----------------------
    def _gather(self, rpi: Tensor, table: Tensor, host: list[int] | None,
                token_offset: Tensor | None = None) -> Tensor:
        """The real rows' page block (a temporary; may raise on a bad index, before any write)."""
        cfg = self.cfg
        width = self._width(host, 0, cfg.page_size, cfg.max_pages)
        return ref.gather_pages(table, rpi, cfg.page_size, width, token_offset)

    def _commit(self, bs: int, seq_lens: Tensor, pages: Tensor, host: list[int] | None
                ) -> DecodeView:
        self._write_part(self._b, bs, seq_lens, pages)
        self.arena.mark_written(self.phase, bs)
        return self._view(bs, self._max_k(host, 0, seq_lens.shape[0], bs,
                                          self.cfg.max_context_len))

    def _write_capture_state(self) -> None:
        self._write_part(self._b, self.cfg.max_bs, self._arange[:0], self._empty_pages())

    def _view(self, bs: int, max_seqlen_k: int) -> DecodeView:
        return part_view(self._b, bs, self._arange, max_q=1, max_k=max_seqlen_k,
                         page_size=self.cfg.page_size, causal=True, cls=DecodeView)
