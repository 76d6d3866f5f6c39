"""Encoder-decoder (cross) attention. docs/design.md, Encoder."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ..arena import Arena
from ..config import Phase
from ..inputs import host_lens
from ..views import DecodeView, EncoderView, PagedView
from ._views import part_view
from .base import PhaseBase, Shared

if TYPE_CHECKING:
    from typing import Unpack


class EncoderPhase(PhaseBase[EncoderView]):
    """``pool.encoder``: each request's table row (``req_to_token`` or ``block_table``) holds its
    encoder tokens first, then its decoder tokens. One update writes both parts of a decode step:

    * ``cross``: non-causal rows over the first ``encoder_lens[i]`` slots (own buffers, outside
      the overlay, since they are read in the same forward as the decoder part);
    * ``decoder``: the decode phase's buffers, page rows starting at column ``encoder_lens[i]``.

    Batches mix encoder lengths freely. With ``page_size > 1`` the engine must start each
    request's decoder tokens on a fresh page (the slot at column ``encoder_lens[i]`` is the first
    of a page), as paged kernels address whole pages; with a ``block_table`` (position ``t`` on
    page ``t // P``) that means whole encoder pages: ``encoder_lens[i]`` a multiple of P.
    """

    phase = Phase.ENCODER
    NAMES = ("n", "seq_lens", "req_pool_indices", "req_to_token", "block_size", "num_real",
             "encoder_lens", "width", "enc_width")
    #: the cross part reads the encoder lengths as its lengths, the decoder part as offsets
    ALIASES = ({"seq_lens": "encoder_lens", "width": "enc_width"},
               {"token_offset": "encoder_lens"})

    def __init__(self, arena: Arena) -> None:
        super().__init__(arena)
        self._b = self._paged("cross_")
        #: the decode phase's buffers, where this phase writes its decoder rows (under its own
        #: ownership of those bytes: see ``PHASE_FACTS``' ``writes_decode``)
        self._dec = self._paged(phase=Phase.DECODE)
        self._pad = min(self.cfg.pad_seq_len, self.cfg.max_encoder_len)

    def _capture_view(self, bs: int) -> EncoderView:
        """Both parts' ``bs``-row view for capture (the decoder part's capture state is written
        into the decode phase's buffers under this phase's ownership)."""
        return self._both(bs, self.cfg.max_encoder_len, self.cfg.max_context_len)

    def update_(
        self,
        bs: int,
        *,
        seq_lens: Tensor,
        encoder_lens: Tensor,
        encoder_lens_cpu: Tensor | Sequence[int] | None = None,
        **shared: Unpack[Shared],
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
        x = self._inputs(bs, seq_lens, shared, cfg.max_context_len, encoder_lens_cpu)
        seq_lens, n, rpi, table, blk, host, _, num_real, _ = x
        enc, enc_host = self._lens("encoder_lens", encoder_lens, encoder_lens_cpu, n,
                                   cfg.max_encoder_len)
        if host is not None and enc_host is not None:
            host_lens("encoder_lens_cpu + seq_lens_cpu",
                      [a + b for a, b in zip(enc_host, host, strict=True)], n, 2,
                      cfg.max_context_len)
        if self.validate:  # (the value lists are built only then)
            self._check_values(x, cfg.max_context_len, [("encoder_lens", enc, 1, cfg.max_encoder_len)],
                               [("encoder_lens_cpu", encoder_lens_cpu, "encoder_lens")],
                               sum_pair_at_most=("encoder_lens", "seq_lens", cfg.max_context_len))
        # (the cross part caps its width at its own capacity, ceil(max_encoder_len / P))
        enc_width, width = self._width(enc_host), self._width(host)
        # --- writes start here (both parts' inputs were checked above) ---
        self._run((bs, blk, table.shape, table.stride(0), num_real is None), bs,
                  (n, seq_lens, rpi, table, blk, num_real, enc, width, enc_width))
        # One write of the overlay: the encoder now owns it, decoder rows included (decode's own
        # view of those buffers is not valid until decode writes them again).
        self._mark(bs)
        return self._both(bs, self._max_k(enc_host, 0, n, bs, cfg.max_encoder_len),
                          self._max_k(host, 0, n, bs, cfg.max_context_len))

    def _both(self, bs: int, max_k: int, dec_k: int) -> EncoderView:
        """The view of both parts; the decoder part carries this phase's stamp (its bytes are
        this phase's write, not a decode update's)."""
        key = ("enc", bs, max_k, dec_k)
        return self._views.get(key) or self._memo(key, lambda: EncoderView(
            bs, self._view(bs, max_k),
            part_view(self._dec, bs, self._arange, max_q=1, max_k=dec_k,
                      page_size=self.cfg.page_size, causal=True, cls=DecodeView,
                      stamp=self._stamp),
            stamp=self._stamp))

    def _parts(self, ops: ModuleType, bs: int, vals: tuple[Any, ...]) -> tuple[Any, ...]:
        """The cross part over the encoder tokens, then the decoder rows after them."""
        _, seq_lens, rpi, table, blk, num_real, enc, width, enc_width = vals
        cross = self._paged_launch(ops, self._b, bs, enc, rpi, table, blk,
                                   pad_seq_len=self._pad, max_len=self.cfg.max_encoder_len,
                                   num_real=num_real, width=enc_width)
        dec = self._paged_launch(ops, self._dec, bs, seq_lens, rpi, table, blk,
                                 token_offset=enc, num_real=num_real, width=width)
        return cross, dec

    def _capture_vals(self) -> tuple[Any, ...]:
        none = self._arange[:0]
        return (0, none, none, self._empty_pages(), None, None, none, 0, 0)

    def _view(self, bs: int, max_k: int) -> PagedView:
        key = (bs, max_k)
        return self._views.get(key) or self._memo(key, lambda: self._make_view(bs, max_k))

    def _make_view(self, bs: int, max_k: int) -> PagedView:
        return part_view(self._b, bs, self._arange, max_q=1, max_k=max_k,
                         page_size=self.cfg.page_size, causal=False, stamp=self._stamp)
