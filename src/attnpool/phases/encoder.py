"""Encoder-decoder (cross) attention. docs/design.md, Encoder."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..arena import Arena
from ..config import Phase
from ..update import reference as ref
from ..views import EncoderView, PagedView
from ._checks import check_bs, host_lens
from .base import PhaseBase, part_view
from .decode import DecodePhase


class EncoderPhase(PhaseBase):
    """``pool.encoder``: each request's ``req_to_token`` row holds its encoder tokens first, then
    its decoder tokens. One update writes both parts of a decode step:

    * ``cross``: non-causal rows over the first ``encoder_lens[i]`` slots (own buffers, outside
      the overlay, since they are read in the same forward as the decoder part);
    * ``decoder``: the decode phase's buffers, page rows starting at column ``encoder_lens[i]``.

    Batches mix encoder lengths freely. With ``page_size > 1`` the engine must start each
    request's decoder tokens on a fresh page (the slot at column ``encoder_lens[i]`` is the first
    of a page), as paged kernels address whole pages.
    """

    phase = Phase.ENCODER

    def __init__(self, arena: Arena, decode: DecodePhase) -> None:
        super().__init__(arena)
        self._b = self._paged("cross_")
        self._decode = decode
        self._pad = min(self.cfg.pad_seq_len, self.cfg.max_encoder_len)

    def view(self, bs: int) -> EncoderView:
        check_bs(self.cfg, bs)
        self._ready(bs)
        return EncoderView(bs, self._view(bs, self.cfg.max_encoder_len), self._decode.view(bs))

    def update_(
        self,
        bs: int,
        seq_lens: Tensor,
        encoder_lens: Tensor,
        req_pool_indices: Tensor,
        req_to_token: Tensor,
        seq_lens_cpu: Tensor | Sequence[int] | None = None,
        encoder_lens_cpu: Tensor | Sequence[int] | None = None,
        *,
        num_real: Tensor | None = None,
    ) -> EncoderView:
        """Refill both parts for ``n`` requests (fused path: one launch per part).

        Args:
            seq_lens: ``[n]`` decoder lengths (decoder tokens only), each ``>= 1`` and with
                ``encoder_lens[i] + seq_lens[i] <= C``.
            encoder_lens: ``[n]`` encoder lengths, each in ``[1, max_encoder_len]``.
            num_real: capturable mode, as in :meth:`DecodePhase.update_`.
            (other arguments as in :meth:`DecodePhase.update_`.)
        """
        cfg = self.cfg
        seq_lens, n = self._batch(bs, seq_lens, num_real, seq_lens_cpu, encoder_lens_cpu)
        enc = self._tensor("encoder_lens", encoder_lens, 1, rows=n)
        rpi = self._tensor("req_pool_indices", req_pool_indices, 1, rows=n)
        table = self._req_to_token(req_to_token)
        enc_host = host_lens("encoder_lens_cpu", encoder_lens_cpu, n, 1, cfg.max_encoder_len)
        host = host_lens("seq_lens_cpu", seq_lens_cpu, n, 1, cfg.max_context_len)
        if host is not None and enc_host is not None:
            host_lens("encoder_lens_cpu + seq_lens_cpu",
                      [a + b for a, b in zip(enc_host, host, strict=True)], n, 2,
                      cfg.max_context_len)
        dec = self._decode
        if self.fused:
            # --- writes start here (both launches' inputs were checked above) ---
            self._fused_part(self._b, bs, enc, rpi, table, pad_len=self._pad,
                             max_len=cfg.max_encoder_len, num_real=num_real)
            dec._fused_part(dec._b, bs, seq_lens, rpi, table, token_offset=enc,
                            num_real=num_real)
        else:
            cap = -(-cfg.max_encoder_len // cfg.page_size)
            width = self._width(enc_host, 0, cfg.page_size, cap)
            pages = ref.gather_pages(table, rpi, cfg.page_size, width)
            # --- writes start here (the decoder gather writes its page table) ---
            dec_pages = dec._gather(rpi, table, host, token_offset=enc)
            self._write(bs, enc, pages)
            dec._write_part(dec._b, bs, seq_lens, dec_pages)
        self.arena.mark_written(self.phase, bs)
        decoder = dec._done(bs, n, host, None)
        max_k = self._max_k(enc_host, 0, n, bs, cfg.max_encoder_len)
        return EncoderView(bs, self._view(bs, max_k), decoder)

    def _write(self, bs: int, enc: Tensor, pages: Tensor) -> None:
        self._write_part(self._b, bs, enc, pages, pad_len=self._pad,
                         max_len=self.cfg.max_encoder_len)

    def _write_capture_state(self) -> None:
        self._write(self.cfg.max_bs, self._arange[:0], self._empty_pages())

    def _view(self, bs: int, max_k: int) -> PagedView:
        return part_view(self._b, bs, self._arange, max_q=1, max_k=max_k,
                         page_size=self.cfg.page_size, causal=False)
