"""Decode phase: one query token per request (DESIGN §4, "decode")."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..arena import Arena
from ..config import Phase
from ..update import reference as ref
from ..views import DecodeView
from ._checks import check_bs, check_req_to_token, check_tensor, host_lens
from .base import PhaseBase


class DecodePhase(PhaseBase):
    """``pool.decode``: ``view(bs)`` for capture, ``update_(...)`` before each replay.

    Row ``i < n`` is request ``req_pool_indices[i]`` with ``cache_seqlens[i] = seq_lens[i]`` and
    page row ``i`` = its live page ids; rows ``n..bs`` are padding (DESIGN §1). ``cu_seqlens_q``
    is the pool's constant ``arange`` (never overwritten: it lives outside the overlay).
    """

    phase = Phase.DECODE

    #: Extra KV tokens per row on top of ``seq_lens`` (verify/draft reuse this class's logic).
    extra_len = 0

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
            seq_lens: ``[n]`` int32/int64 on the pool's device, each in ``[1, C - extra]``.
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
        extra = self.extra_len
        lens = host_lens("seq_lens_cpu", seq_lens_cpu, n, 1, cfg.max_context_len - extra)
        if lens is None:
            width, max_k = cfg.max_pages, cfg.max_context_len
        else:
            longest = max(lens, default=0) + extra
            width = -(-longest // cfg.page_size)
            max_k = max(longest, cfg.pad_seq_len if n < bs else 0)
        pages = ref.gather_pages(req_to_token, req_pool_indices, cfg.page_size, width)
        # --- writes start here: everything above is validation or a temporary ---
        b = self._b
        ref.lengths_(b.cache_seqlens, seq_lens, extra, bs, cfg.pad_seq_len)
        self._write_pages(b, bs, pages)
        self.arena.mark_written(self.phase, bs)
        return self._view(bs, max_k)

    # ---- internals -----------------------------------------------------------------------------
    def _write_pages(self, b: ref.PagedBuffers, bs: int, pages: Tensor) -> None:
        cfg = self.cfg
        ref.paged_(b, bs=bs, pages=pages, page_size=cfg.page_size, pad_page=cfg.pad_page,
                   pad_pages=cfg.pad_pages, arange=self._arange)

    def _write_capture_state(self) -> None:
        b = self._b
        bs = self.cfg.max_bs
        ref.lengths_(b.cache_seqlens, self._arange[:0], 0, bs, self.cfg.pad_seq_len)
        self._write_pages(b, bs, self._empty_pages())

    def _view(self, bs: int, max_seqlen_k: int) -> DecodeView:
        b = self._b
        return DecodeView(
            bs=bs,
            cache_seqlens=b.cache_seqlens[:bs],
            cu_seqlens_q=self._arange[: bs + 1],
            cu_seqlens_k=b.cu_seqlens_k[: bs + 1],
            page_table=None if b.page_table is None else b.page_table[:bs],
            kv_indptr=None if b.kv_indptr is None else b.kv_indptr[: bs + 1],
            kv_indices=b.kv_indices,
            kv_last_page_len=None if b.kv_last_page_len is None else b.kv_last_page_len[:bs],
            max_seqlen_q=1,
            max_seqlen_k=max_seqlen_k,
            page_size=self.cfg.page_size,
            causal=True,
        )
