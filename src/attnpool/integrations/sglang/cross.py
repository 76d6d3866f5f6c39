"""Encoder-decoder models (mllama, whisper) through attnpool's ``pool.encoder`` (importing this
module imports SGLang).

How SGLang 0.5.23 lays such a request out: its table row (``req_to_token``) holds the encoder
tokens first (``encoder_lens[i]`` of them: an image's vision tokens, the audio frames), then
the decoder tokens; ``seq_lens``, ``extend_prefix_lens`` and ``extend_seq_lens`` count decoder
tokens only. A decoder (self-attention) layer stores its K/V at ``out_cache_loc`` (the slots
after the encoder's) and reads the request's decoder tokens, causally; a cross layer
(``layer.is_cross_attention``) stores the encoder's K/V at ``encoder_out_cache_loc`` in the
forward that encodes it (``k`` is None afterwards: ``encoder_cached``) and reads the first
``encoder_lens[i]`` slots, all of them for every query. That is ``pool.encoder``'s
:class:`attnpool.EncoderView`: ``decoder`` (the decode part, its page rows starting at
column ``encoder_lens[i]``) and ``cross`` (non-causal over the encoder's slots), read in the
same forward. :class:`AttnpoolCrossBackend` refills it once per forward and routes each layer
to its part; an extend batch is one row per new token
(:meth:`.step.BatchFiller.encoder`), so the phase's ``max_bs`` covers the prefill budget.

On a CPU each batch's ``out_cache_loc`` and ``encoder_out_cache_loc`` are checked against the
table slots the views read (a layout this backend does not expect is refused, never served
wrong). Refused at engine start (:func:`cross_refusals`): cross-attention layers in a model
SGLang does not run as an encoder-decoder model (its Transformers fallback marks encoder-only
layers so), pages of more than one token (an encoder's last page would hold decoder
tokens), sliding windows, decoder and cross layers of different head counts or sizes, and any
device but a CPU (checked there only; no CUDA graphs). A batch mixing requests with and
without an encoder input (mllama's text-only requests beside image ones) goes through the
encoder view too: a text-only request's cross row has no keys, and attends nothing (output 0,
as SGLang's ``torch_native`` gives it; the model then masks that row's cross output with its
own ``full_text_row_masked_out_mask``). A batch where no request has one (mllama's text-only
batches, whose cross layers the model skips) is the base's decode or extend batch.

This module imports :mod:`.backend` (the base), never the reverse.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from ...adapters.binding import Run
from ...errors import LayoutError
from .backend import AttnpoolAttnBackend, Extra, Served
from .step import NAME, RunnerSizes

__all__ = ["AttnpoolCrossBackend", "cross_refusals", "encoder_decoder"]


def encoder_decoder(layers: list[RadixAttention]) -> bool:
    """Whether the model has cross-attention layers (an encoder-decoder model)."""
    return any(layer.is_cross_attention for layer in layers)


def cross_refusals(model_runner: Any, layers: list[RadixAttention]) -> list[str]:
    """What of an encoder-decoder runner the backend does not serve (see the module doc)."""
    out: list[str] = []
    if not getattr(getattr(model_runner, "model_config", None), "is_encoder_decoder", False):
        # (SGLang's Transformers fallback marks an encoder-only model's layers so, to make
        # them non-causal: no encoder tokens, no encoder_lens)
        out.append("cross-attention layers in a model SGLang does not run as an "
                   "encoder-decoder model (model_config.is_encoder_decoder is False)")
    if int(model_runner.page_size) > 1:
        out.append(f"cross attention with page_size={model_runner.page_size} (SGLang starts "
                   "a request's decoder tokens right after its encoder tokens, on the same "
                   "page: attnpool's encoder view needs pages of 1 token here)")
    if any(layer.sliding_window_size > -1 for layer in layers):
        out.append("cross attention with sliding-window layers")
    shapes = {(layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim)
              for layer in layers}
    if len(shapes) > 1:
        out.append(f"decoder and cross layers of different heads or head sizes "
                   f"({sorted(shapes)})")
    if torch.device(model_runner.device).type != "cpu":
        out.append(f"cross attention on {model_runner.device} (attnpool's encoder view is "
                   "checked against SGLang on a CPU only; no encoder-decoder CUDA graphs)")
    return out


class AttnpoolCrossBackend(AttnpoolAttnBackend):
    """The ``attnpool`` backend of an encoder-decoder runner (see the module doc): one
    ``pool.encoder`` refill per forward, decoder layers through its ``decoder`` part, cross
    layers through its ``cross`` part."""

    SERVES = frozenset({Extra.CROSS})

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        #: the forward's cross layers' call (None: the forward has no encoder rows)
        self.cross_run: Run | None = None

    @classmethod
    def served_layers(cls, model_runner: Any) -> list[RadixAttention]:
        """The decoder's layers: an encoder's own layers (whisper's, ``ENCODER_ONLY``) attend
        by themselves, never through the backend (:meth:`_attend` refuses them if they
        did)."""
        return [layer for layer in super().served_layers(model_runner)
                if layer.attn_type is not AttentionType.ENCODER_ONLY]

    @classmethod
    def refusals(cls, model_runner: Any, layers: list[RadixAttention]) -> list[str]:
        return super().refusals(model_runner, layers) + cross_refusals(model_runner, layers)

    @classmethod
    def runner_sizes(cls, model_runner: Any, layers: list[RadixAttention]) -> RunnerSizes:
        """The base's sizes with the encoder phase: encoder inputs up to the table's width
        less one (a request keeps at least one decoder token), and rows for one extend batch's
        new tokens (:meth:`.step.BatchFiller.encoder`: one row per token)."""
        got = super().runner_sizes(model_runner, layers)
        return dataclasses.replace(
            got, max_requests=max(got.max_requests, got.max_extend_tokens),
            max_encoder_len=got.max_context_len - 1)

    def refill(self, forward_batch: ForwardBatch) -> Run:
        """Decode and extend batches with encoder rows through ``pool.encoder``; a batch
        without any encoder input as the base's (its cross layers are not run)."""
        fb = forward_batch
        mode = fb.forward_mode
        self.cross_run = None
        enc = getattr(fb, "encoder_lens_cpu", None)
        if not enc or not any(enc):
            return super().refill(fb)
        if not (mode.is_decode() or mode.is_extend_or_draft_extend_or_mixed()) \
                or mode.is_split_prefill() or mode.is_target_verify() \
                or mode.is_draft_extend_v2():
            raise LayoutError(f"attention_backend={NAME!r} serves decode and extend batches "
                              f"of an encoder-decoder model, got {mode.name}")
        decode = mode.is_decode()
        self._check_slots(fb, list(enc), decode)
        run, self.cross_run = self.filler.encoder(
            req_pool_indices=fb.req_pool_indices, req_to_token=self.req_to_token,
            seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu, encoder_lens=fb.encoder_lens,
            encoder_lens_cpu=enc, extend_seq_lens=None if decode else fb.extend_seq_lens,
            extend_seq_lens_cpu=None if decode else fb.extend_seq_lens_cpu)
        self._count(Served.ENCODER)
        return run

    def _check_slots(self, fb: ForwardBatch, enc: list[int], decode: bool) -> None:
        """On a CPU: the batch's decoder tokens are stored (``out_cache_loc``) at the table
        slots after each request's encoder tokens and decoder prefix, and its encoder tokens
        (``encoder_out_cache_loc``, requests whose encoder is not cached) at the row's first
        slots: where the encoder view reads them. A host check (the tables are on the
        host)."""
        if not self.filler.host or fb.out_cache_loc is None:
            return
        table, rpi = self.req_to_token, fb.req_pool_indices.to(torch.int64)
        n = rpi.shape[0]
        seq = (fb.seq_lens if fb.seq_lens_cpu is None else fb.seq_lens_cpu).to(torch.int64)
        q = (torch.ones(n, dtype=torch.int64) if decode
             else torch.as_tensor(list(fb.extend_seq_lens_cpu), dtype=torch.int64))
        tokens = int(q.sum())
        # token t of request i: column enc + seq - 1 - (its place from the request's end)
        back = torch.repeat_interleave(torch.cumsum(q, 0), q) - torch.arange(1, tokens + 1)
        cols = torch.repeat_interleave(torch.as_tensor(enc) + seq - 1, q) - back
        want = table[torch.repeat_interleave(rpi, q), cols]
        if not torch.equal(want, fb.out_cache_loc[:tokens].to(want.dtype)):
            raise LayoutError(f"attention_backend={NAME!r}: the encoder-decoder batch stores "
                              "its decoder K/V at out_cache_loc slots that are not the table's "
                              "slots after each request's encoder tokens and prefix")
        cached = fb.encoder_cached or [True] * n
        loc = fb.encoder_out_cache_loc
        if decode or loc is None or all(cached):
            return
        want = torch.cat([table[r, :e] for r, e, c in
                          zip(rpi.tolist(), enc, cached, strict=True) if not c])
        if not torch.equal(want, loc[:want.shape[0]].to(want.dtype)) \
                or loc.shape[0] != want.shape[0]:
            raise LayoutError(f"attention_backend={NAME!r}: the batch stores its encoder K/V "
                              "at encoder_out_cache_loc slots that are not the first slots of "
                              "each request's table row")

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool,
                run: Run | None = None, loc: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        """A cross layer reads the encoder view's ``cross`` part and stores the encoder's K/V
        (when this forward encodes it) at ``encoder_out_cache_loc``; a decoder layer its
        ``decoder`` part, as the base."""
        if layer.attn_type is AttentionType.ENCODER_ONLY:
            raise LayoutError(f"attention_backend={NAME!r}: an encoder's own layer "
                              f"({layer.layer_id}) reached the backend; attnpool serves the "
                              "decoder's self and cross attention only")
        if not layer.is_cross_attention:
            return super()._attend(q, k, v, layer, forward_batch, save_kv_cache, run, loc,
                                   **kwargs)
        if self.cross_run is None:
            raise LayoutError(f"attention_backend={NAME!r}: a cross layer ran in a forward "
                              "without encoder rows (encoder_lens all 0)")
        return super()._attend(q, k, v, layer, forward_batch, save_kv_cache,
                               self.cross_run, forward_batch.encoder_out_cache_loc, **kwargs)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Refused: encoder-decoder forwards run eagerly (see the module doc)."""
        raise LayoutError(f"attention_backend={NAME!r} does not capture encoder-decoder "
                          "CUDA graphs: start SGLang with disable_cuda_graph=True")
