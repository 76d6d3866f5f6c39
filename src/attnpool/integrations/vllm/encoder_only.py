"""Encoder-only attention (BERT-style embedding and classification models) on a CPU.

An encoder-only layer (``AttentionType.ENCODER_ONLY``) attends without causality over each
request's own tokens, which all arrive in one step, and keeps no KV cache between steps: vLLM
gives such a group no cache at all. That is an extend step of requests without a cached prefix
(``seq_lens = extend_lens``), so attnpool serves it with ``pool.extend``, its own phase for
packed variable-length rows, rather than ``pool.encoder`` (cross-attention: decoder rows that
read an encoder's cached tokens), and vLLM's CPU kernel attends non-causally over the view.

The kernel reads keys and values from paged blocks, so each step stores them into a scratch
cache of its own: :class:`EncoderOnlySteps` owns one, allocated (and zeroed) once for the most
tokens a step can hold, with blocks handed out in order per step: request ``i`` of a step owns
``ceil(len_i / P)`` consecutive blocks from ``1 + sum(blocks before it)`` (block 0 is the pool's
pad page), which is the block table the pool is refilled from, and token ``j`` of request
``i`` goes to slot ``first_block_i * P + j``. Every layer of the step stores its own keys and
values there before it attends (layers run one after another), as vLLM's own CPU backend does
with a cache it allocates per step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...config import ceil_div
from .step import StepFiller, StepMetadata


def scratch_blocks(max_num_batched_tokens: int, block_size: int, max_num_seqs: int) -> int:
    """Blocks of the scratch cache: every request of a step rounds its tokens up to whole
    blocks, and block 0 is the pad page."""
    return ceil_div(max_num_batched_tokens, block_size) + max_num_seqs + 1


class EncoderOnlySteps:
    """A group of encoder-only layers: the scratch cache and the per-step refill.

    Args:
        filler: the group's pool and refill (its sizes: ``block_size`` tokens per block,
            ``max_num_batched_tokens`` per step, ``max_num_seqs`` requests).
        num_kv_heads, head_size, dtype: the layers' key/value shape, the cache's dtype.
    """

    def __init__(self, filler: StepFiller, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype) -> None:
        s = filler.sizes
        self.filler, self.page = filler, s.block_size
        self.num_blocks = scratch_blocks(s.max_num_batched_tokens, s.block_size, s.max_num_seqs)
        #: ``[blocks, H_kv, P, 2 * D]``: vLLM's CPU cache layout (K then V per block and head);
        #: zeroed once, so lanes the kernel masks hold numbers, never NaN bit patterns
        self.cache = torch.zeros(  # ok: once per engine; masked lanes must hold numbers
            self.num_blocks, num_kv_heads, s.block_size, 2 * head_size, dtype=dtype,
            device=s.device)
        self._cols = torch.arange(ceil_div(s.max_model_len, s.block_size), dtype=torch.int32,
                                  device=s.device)

    def fill(self, *, num_reqs: int, num_actual_tokens: int, max_query_len: int,
             query_start_loc: Tensor, seq_lens: Tensor) -> StepMetadata:
        """Refill the pool from one encoder-only step: ``seq_lens [>= num_reqs]`` are the
        requests' token counts (no cached prefix), ``query_start_loc [>= num_reqs + 1]`` their
        packed offsets; the step's scratch block table and slots are computed here."""
        n, p, t = num_reqs, self.page, num_actual_tokens
        lens = seq_lens[:n]
        blocks = torch.div(lens + (p - 1), p, rounding_mode="floor")
        first = torch.cumsum(blocks, 0, dtype=torch.int32)
        first -= blocks - 1  # (exclusive sum, past the pad block)
        table = first[:, None] + self._cols[None, :]
        tokens = torch.arange(t, dtype=torch.int64, device=lens.device)
        row = torch.searchsorted(query_start_loc[1 : n + 1], tokens, right=True)
        slots = (first.to(torch.int64) * p - query_start_loc[:n]).index_select(0, row) + tokens
        md = self.filler.fill(num_reqs=n, num_actual_tokens=t, max_query_len=max_query_len,
                              query_start_loc=query_start_loc, seq_lens=lens, block_table=table,
                              slot_mapping=slots)
        return StepMetadata(md.view, md.run, md.blocks, md.offsets, md.num_actual_tokens,
                            md.kernel, encoder_cache=self.cache, encoder_slots=slots)
