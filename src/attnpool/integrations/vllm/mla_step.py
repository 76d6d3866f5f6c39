"""vLLM's latent (MLA) cache seen by attnpool, and one KV-cache group's decode refill.

DeepSeek-style models (multi-head latent attention) cache one row per token and layer,
``[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]``: vLLM hands its MLA backend a tensor
``[num_blocks, block_size, L + R]`` per layer (one KV head, squeezed away), the rows of a block
contiguous, which is exactly a :class:`attnpool.KVCachePool` latent cache
``[num_pages, P, 1, L + R]`` (:func:`latent_cache`, a view). So attnpool stores the rows there
(:func:`store_latent_`) and attends over them with its absorbed-MLA adapter
(:mod:`attnpool.adapters.mla`): the query ``[q_nope · W_UK | q_pe]`` against the whole row,
values its first ``L`` columns, output the latent ``[T, H, L]`` that vLLM's own code turns into
``[T, H, v]`` with ``W_UV``. The absorption (splitting ``kv_b_proj``, the two batched products)
stays vLLM's.

vLLM's MLA scaffolding splits each step into decode rows (one query, placed first by its batch
reorder), whose absorbed queries go to the backend's decode call, and prefill rows, which it expands
through ``kv_b_proj`` and hands to its prefill path. :class:`LatentFiller` owns the group's
:class:`attnpool.BufferPool` (sized like the other groups': :meth:`.step.EngineSizes.pool`) and
refills it from vLLM's lengths and block table (``block_table=``, vLLM's block 0 the pad page), with
the layer-independent half of the SDPA pass computed once per step
(:func:`attnpool.adapters.mla.plan`), which every layer of the group then reads. Which rows attnpool
attends is :class:`MLAPrefill`'s choice:

- ``VLLM`` (the default): the decode rows only (a decode update); prefill rows run vLLM's own
  prefill (the new latents expanded per head, a cached prefix gathered and merged by vLLM);
- ``ATTNPOOL``: every row, absorbed, as one extend update (a decode row is an extend row of one
  query); a prefill chunk reads its cached prefix straight from the latent cache.

Nothing here imports vLLM: the views, the store and the refill are plain torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

from ...adapters import mla
from ...adapters.sdpa.planning import Plan
from ...errors import CapacityError, InputError
from ...kv.mla_shape import MLAShape
from ...pool import BufferPool
from ...views import DecodeView, ExtendView
from ..engine import pool_config
from .cache import slot_index_
from .step import EngineSizes, query_lens_


class MLAPrefill(enum.Enum):
    """Who attends an MLA step's prefill rows (see the module docstring)."""

    VLLM = "vllm"
    ATTNPOOL = "attnpool"


def prefill_mode(setting: str) -> MLAPrefill:
    """The :class:`MLAPrefill` named by ``setting`` (``"vllm"``, the default, or
    ``"attnpool"``; any case)."""
    try:
        return MLAPrefill(setting.strip().lower())
    except ValueError:
        raise InputError(f"the MLA prefill setting must be 'vllm' or 'attnpool', got "
                         f"{setting!r}") from None


def latent_cache(kv_cache: Tensor, shape: MLAShape) -> Tensor:
    """``[num_blocks, block_size, 1, L + R]`` (a view, no copy) of one layer's latent cache as
    vLLM's MLA layers hold it: ``[num_blocks, block_size, L + R]`` (or with the head axis of
    size one still present, ``[num_blocks, 1, block_size, L + R]``)."""
    row = shape.latent_row
    if kv_cache.dim() == 4 and kv_cache.shape[1] == 1:
        kv_cache = kv_cache.squeeze(1)
    if kv_cache.dim() != 3 or kv_cache.shape[2] != row or kv_cache.stride(2) != 1 \
            or kv_cache.stride(1) != row:
        raise InputError(f"vLLM's latent cache must be [num_blocks, block_size, {row}] with "
                         f"dense rows (kv_lora_rank {shape.kv_lora_rank} + rope "
                         f"{shape.qk_rope_head_dim}), got shape {tuple(kv_cache.shape)} "
                         f"strides {kv_cache.stride()}")
    return kv_cache.unsqueeze(2)


def store_latent_(cache: Tensor, kv_c: Tensor, k_pe: Tensor, blocks: Tensor,
                  offsets: Tensor) -> None:
    """Write each new token's row ``[kv_c [T, L] | k_pe [T, R]]`` at ``(blocks[:T],
    offsets[:T])`` (:func:`.cache.slot_index_`: padded slots land in vLLM's null block 0) of a
    :func:`latent_cache` view: two ``index_put_``, no host read of the slots."""
    t, lat = kv_c.shape[0], kv_c.shape[-1]
    at = (blocks[:t], offsets[:t])
    rows = cache[:, :, 0]
    c, pe = kv_c.reshape(t, lat), k_pe.reshape(t, -1)
    rows[..., :lat].index_put_(at, c if c.dtype == rows.dtype else c.to(rows.dtype))
    rows[..., lat:].index_put_(at, pe if pe.dtype == rows.dtype else pe.to(rows.dtype))


@dataclass(frozen=True, slots=True)
class LatentStep:
    """What every layer of a group reads for the rows attnpool attends in one step.

    Fields:
        view: the refilled :class:`attnpool.DecodeView` (rows of one query) or
            :class:`attnpool.ExtendView` (prefill chunks and decode rows together).
        plan: the SDPA pass's layer-independent half for ``view`` with ``H`` query heads over
            the one latent head (:func:`attnpool.adapters.mla.plan`).
        shape: the group's :class:`MLAShape`.
    """

    view: DecodeView | ExtendView
    plan: Plan
    shape: MLAShape

    def run(self, q: Tensor, kv_cache: Tensor, softmax_scale: float,
            q_pe: Tensor | None = None) -> Tensor:
        """The latent output ``[T, H, L]`` of the absorbed query (``[T, H, L + R]``, or the
        latent part ``[T, H, L]`` with ``q_pe [T, H, R]``) over one layer's latent cache
        (vLLM's tensor: :func:`latent_cache`)."""
        out = mla.run_plan(self.plan, q, latent_cache(kv_cache, self.shape), self.shape,
                           q_pe=q_pe, softmax_scale=softmax_scale)
        return out.reshape(q.shape[0], self.shape.num_heads, self.shape.kv_lora_rank)


class LatentFiller:
    """One MLA KV-cache group's pool and per-step refill (see the module doc)."""

    def __init__(self, sizes: EngineSizes, shape: MLAShape, dtype: torch.dtype) -> None:
        self.sizes, self.shape, self.dtype = sizes, shape, dtype
        self.pool = BufferPool(pool_config(sizes.pool()))
        self.host = sizes.device.type == "cpu"
        self._q_lens = torch.empty(sizes.max_num_seqs, dtype=torch.int32, device=sizes.device)

    def refill(self, *, seq_lens: Tensor, block_table: Tensor,
               query_start_loc: Tensor | None = None) -> DecodeView | ExtendView:
        """The view refilled from ``n = len(seq_lens)`` rows (``seq_lens [n]``, ``block_table
        [>= n, >= max_pages]``: vLLM's, read directly; on a CPU the lengths are host tensors,
        passed as the view's host lengths too: the phases' ``host_step``): the decode view
        when every row has one query (``query_start_loc`` None), else one extend update with
        ``extend_lens = diff(query_start_loc [n + 1])`` (a decode row is an extend row of one
        query: :func:`.step.query_lens_`)."""
        n = seq_lens.shape[0]
        if n > self.sizes.max_num_seqs:
            raise CapacityError(f"a step of {n} rows is past the pool's "
                                f"max_num_seqs={self.sizes.max_num_seqs}")
        q_lens = None if query_start_loc is None else query_lens_(query_start_loc,
                                                                  self._q_lens[:n])
        if self.host:  # (the pool's host route: the lengths are their own host copies)
            return (self.pool.decode.host_step(n, seq_lens, block_table) if q_lens is None
                    else self.pool.extend.host_step(n, seq_lens, q_lens, block_table))
        table = block_table[:n]
        return (self.pool.decode.update_(n, seq_lens=seq_lens, block_table=table)
                if q_lens is None else
                self.pool.extend.update_(n, seq_lens=seq_lens, extend_lens=q_lens,
                                         block_table=table))

    def fill(self, *, seq_lens: Tensor, block_table: Tensor, num_tokens: int,
             query_start_loc: Tensor | None = None) -> LatentStep:
        """:meth:`refill`, then the step's plan for ``num_tokens`` packed queries over the
        refilled view (once for all layers)."""
        if num_tokens > self.sizes.max_num_batched_tokens:
            raise CapacityError(f"a step of {num_tokens} tokens is past the pool's "
                                f"max_num_batched_tokens={self.sizes.max_num_batched_tokens}")
        view = self.refill(seq_lens=seq_lens, block_table=block_table,
                           query_start_loc=query_start_loc)
        return LatentStep(view, mla.plan(view, num_q=num_tokens, shape=self.shape,
                                         dtype=self.dtype), self.shape)


class SlotStaging:
    """Each new token's cache block and offset, computed into buffers made once
    (``max_num_batched_tokens`` long) from vLLM's ``slot_mapping``."""

    def __init__(self, tokens: int, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self._blocks = torch.empty(tokens, dtype=torch.int64, device=device)
        self._offsets = torch.empty(tokens, dtype=torch.int64, device=device)

    def index(self, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
        """``(blocks [T], offsets [T])`` views of the staging buffers for ``slot_mapping [T]``."""
        t = slot_mapping.shape[0]
        if t > self._blocks.shape[0]:
            raise CapacityError(f"slot_mapping has {t} tokens, more than the "
                                f"{self._blocks.shape[0]} the store was sized for")
        slot_index_(slot_mapping, self.page_size, self._blocks, self._offsets)
        return self._blocks[:t], self._offsets[:t]
