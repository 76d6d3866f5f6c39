"""Encoder-decoder (cross) attention. docs/design.md, Encoder."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from ..arena import Arena
from ..config import Phase
from ..inputs import host_lens
from ..views import DecodeView, EncoderView, PagedView
from ._views import part_view
from .base import Inputs, PhaseBase, Replay, Shared, UpdatePath, new_record

if TYPE_CHECKING:
    from typing import Unpack


class EncoderValues(NamedTuple):
    """One encoder update's values, as its parts read them (by these names, or through
    :attr:`EncoderPhase.ALIASES`).

    Attributes:
        inputs: the checked shared inputs (:class:`attnpool.phases.inputs_pass.Inputs`).
        encoder_lens: ``[n]`` int device encoder lengths: the cross part's lengths, the
            decoder part's token offsets.
        width: page columns the decoder rows need (host bound; the reference path's gather).
        encoder_width: page columns the cross rows need (likewise).
    """

    inputs: Inputs
    encoder_lens: Tensor
    width: int
    encoder_width: int


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
    #: the cross part reads the encoder lengths as its lengths, the decoder part as offsets
    ALIASES = ({"seq_lens": "encoder_lens", "width": "encoder_width"},
               {"token_offset": "encoder_lens"})

    def __init__(self, arena: Arena) -> None:
        super().__init__(arena)
        self._b = self._paged("cross_")
        #: the decode phase's buffers, where this phase writes its decoder rows (under its own
        #: ownership of those bytes: see ``PHASE_FACTS``' ``writes_decode``)
        self._decoder = self._paged(phase=Phase.DECODE)
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
            encoder_lens: ``[n]`` encoder lengths, each in ``[0, max_encoder_len]``. A request
                of no encoder tokens (mllama's text-only request beside image ones) gets a
                cross row of no keys (the decoder row starts at column 0): the SDPA adapter
                gives it output 0 (checked); a GPU kernel's handling of a row of no keys is
                its own (flash-attn's has changed between versions) and is not checked here.
            num_real: capturable mode, as in :meth:`DecodePhase.update_`.
            (other arguments as in :meth:`DecodePhase.update_`.)
        """
        cfg = self.cfg
        x = self.input_pass.check(bs, seq_lens, shared, cfg.max_context_len, encoder_lens_cpu)
        n, host = x.n, x.seq_lens_host
        enc, enc_host = self.input_pass.lens("encoder_lens", encoder_lens, encoder_lens_cpu, n,
                                             cfg.max_encoder_len, lo=0)
        if host is not None and enc_host is not None:
            host_lens("encoder_lens_cpu + seq_lens_cpu",
                      [a + b for a, b in zip(enc_host, host, strict=True)], n, 1,
                      cfg.max_context_len)
        if self.validate:  # (the value lists are built only then)
            self._check_values(x, cfg.max_context_len, [("encoder_lens", enc, 0, cfg.max_encoder_len)],
                               [("encoder_lens_cpu", encoder_lens_cpu, "encoder_lens")],
                               sum_pair_at_most=("encoder_lens", "seq_lens", cfg.max_context_len))
        # --- writes start here (both parts' inputs were checked above) ---
        # (the cross part caps its width at its own capacity, ceil(max_encoder_len / P))
        self._run((bs, x.launch_key), bs,
                  new_record(EncoderValues, (x, enc, self._width(host), self._width(enc_host))))
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
            part_view(self._decoder, bs, self._arange, max_q=1, max_k=dec_k,
                      page_size=self.cfg.page_size, causal=True, cls=DecodeView,
                      stamp=self._stamp),
            stamp=self._stamp))

    def _parts(self, ops: UpdatePath, bs: int, values: EncoderValues) -> tuple[Replay, ...]:
        """The cross part over the encoder tokens, then the decoder rows after them."""
        x = values.inputs
        cross = self._paged_launch(ops, self._b, bs, x._replace(seq_lens=values.encoder_lens),
                                   pad_seq_len=self._pad, max_len=self.cfg.max_encoder_len,
                                   width=values.encoder_width)
        decoder = self._paged_launch(ops, self._decoder, bs, x,
                                     token_offset=values.encoder_lens, width=values.width)
        return cross, decoder

    def _capture_values(self) -> EncoderValues:
        return EncoderValues(inputs=self._capture_inputs(), encoder_lens=self._arange[:0],
                             width=0, encoder_width=0)

    def _view(self, bs: int, max_k: int) -> PagedView:
        key = (bs, max_k)
        return self._views.get(key) or self._memo(key, lambda: self._make_view(bs, max_k))

    def _make_view(self, bs: int, max_k: int) -> PagedView:
        return part_view(self._b, bs, self._arange, max_q=1, max_k=max_k,
                         page_size=self.cfg.page_size, causal=False, stamp=self._stamp)
