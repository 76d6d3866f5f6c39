"""SGLang's LoRA metadata served from one attnpool arena: the LoRA backend ``attnpool``.

**Seam.** SGLang's ``LoRAManager`` builds its LoRA backend from the name ``lora_backend``
through the registry of ``sglang.srt.lora.backend.lora_registry``; attnpool's plugin
(:func:`attnpool.integrations.sglang.register`) adds :class:`AttnpoolLoRABackend` under the name
``attnpool`` (``sglang.Engine(..., lora_backend="attnpool")``). It is SGLang's ``torch_native``
LoRA backend (its math, unchanged) whose ``LoRABatchInfo`` tensors are views of one
:class:`attnpool.lora.LoRABatchPool`: ``seg_lens``, ``seg_indptr``, ``weight_indices``,
``lora_ranks``, ``scalings`` and their ``*_cpu`` twins (the host values the torch ops walk in
Python; on a CPU device they are the same views, on CUDA the views of the image the last update
sent, :meth:`attnpool.lora.LoRABatchPool.host_view`).

**Sizes, and when.** The arena is allocated once, at ``init_decode_cuda_graph_batch_info`` or
the first batch, whichever comes first (SGLang tells the graph's token rows only after it built
the backend, and they share the arena), from the server arguments the backend is built with:
``max_running_requests`` (segments of one batch; without it, the forward's token bound, since
every request brings at least one token), the forward's token bound (the prefill budget, the
largest of ``chunked_prefill_size``, ``max_prefill_tokens`` and ``context_length``, plus one
decode row per request for mixed chunks), ``max_loras_per_batch`` and ``max_lora_rank``
(required: it bounds every rank the pool accepts). The graph batch's per-token indices need
``max_bs * num_tokens_per_req`` rows; the arena covers both. A batch beyond these bounds is
refused (:class:`attnpool.PoolError`), never truncated.

**Refill.** Eager batches: consecutive requests on one adapter are merged into one segment (as
``torch_native`` does), and the pool is refilled in place with the segments, ranks and scalings
(:meth:`LoRABatchPool.update_`: every value checked on the host first, a
:class:`attnpool.PoolError` naming the bound and the value before any byte changes: an adapter
slot past ``max_loras_per_batch``, a rank above ``max_lora_rank``, more segments or tokens than
the arena holds). Graph batches: one segment per token (the graph kernels read the per-token
slot), into the same arena, bound to one persistent ``LoRABatchInfo`` whose tensors never move.
Nothing is allocated per step: both infos are built once, and a refill only rebinds cached
views.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from sglang.srt.lora.backend.torch_backend import (
    TorchNativeLoRABackend,
    TorchNativeLoRABatchInfo,
)

from ...errors import CapacityError, PoolError
from ...lora import LoRABatchPool, LoRABatchView, LoRAConfig

#: set to a path: each engine process writes its LoRA refill counts to ``<path>.<pid>``
#: (:class:`LoRAServed`); off by default (nothing is counted)
REPORT = "ATTNPOOL_SGLANG_LORA_REPORT"


class LoRAServed:
    """What one engine process's LoRA arena served, in a file another process can read (SGLang
    runs the backend in its spawned scheduler): three int64, eager refills, graph refills and
    the arena's bytes, memory-mapped once, so a refill costs one store."""

    EAGER, GRAPH, BYTES = range(3)

    def __init__(self, path: str, nbytes: int) -> None:
        self.counts = np.memmap(f"{path}.{os.getpid()}", dtype=np.int64, mode="w+", shape=(3,))
        self.counts[:] = 0
        self.counts[self.BYTES] = nbytes
        self.counts.flush()

    @staticmethod
    def read(path: str) -> tuple[int, int, int]:
        """The counts of every process that wrote ``<path>.<pid>``, summed."""
        import glob

        total = [0, 0, 0]
        for name in glob.glob(f"{glob.escape(path)}.*"):
            got = np.fromfile(name, dtype=np.int64, count=3)
            for i in range(min(3, got.shape[0])):
                total[i] += int(got[i])
        return total[0], total[1], total[2]


def _int(args: Any, name: str) -> int:
    v = getattr(args, name, None)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def engine_sizes(server_args: Any) -> tuple[int, int]:
    """``(max segments, max tokens)`` of one forward, from SGLang's server arguments."""
    requests = _int(server_args, "max_running_requests")
    budget = max(_int(server_args, "chunked_prefill_size"), _int(server_args, "max_prefill_tokens"),
                 _int(server_args, "context_length"))
    if not budget:
        raise PoolError("lora_backend='attnpool' needs a prefill budget (chunked_prefill_size "
                        "or max_prefill_tokens) to size its arena")
    tokens = budget + requests  # a mixed chunk adds one decode row per running request
    return (min(requests, tokens) if requests else tokens), tokens


class AttnpoolLoRABackend(TorchNativeLoRABackend):  # type: ignore[misc]
    """SGLang's ``torch_native`` LoRA backend over attnpool's arena (see the module doc)."""

    name = "attnpool"

    def __init__(self, max_loras_per_batch: int, device: torch.device, **kwargs: Any) -> None:
        super().__init__(max_loras_per_batch, device, **kwargs)
        args = kwargs.get("server_args")
        rank = _int(args, "max_lora_rank")
        if not rank:
            raise PoolError("lora_backend='attnpool' needs max_lora_rank (the bound of every "
                            "adapter's rank the arena accepts)")
        self.max_lora_rank = rank
        self.max_segments, self.max_tokens = engine_sizes(args)
        self.graph_tokens = 0
        self.pool: LoRABatchPool | None = None
        self.served: LoRAServed | None = None
        self._eager: TorchNativeLoRABatchInfo | None = None

    # ---- the arena, once ----------------------------------------------------------------------
    def _arena(self) -> LoRABatchPool:
        if self.pool is None:
            cfg = LoRAConfig(max_bs=max(self.max_segments, self.graph_tokens, 1),
                             max_loras_per_batch=self.max_loras_per_batch,
                             max_lora_rank=self.max_lora_rank,
                             max_tokens_per_req=max(self.max_tokens, 1),
                             token_budget=max(self.max_tokens, self.graph_tokens, 1),
                             device=torch.device(self.device))
            self.pool = LoRABatchPool(cfg)
            path = os.environ.get(REPORT)
            if path:
                self.served = LoRAServed(path, self.pool.nbytes)
        return self.pool

    def _info(self, graph: bool, bs: int) -> TorchNativeLoRABatchInfo:
        pool = self._arena()
        v, h = pool.view(bs), pool.host_view(bs)
        info = TorchNativeLoRABatchInfo(
            use_cuda_graph=graph, bs=bs, num_segments=bs, seg_indptr=v.seg_indptr,
            weight_indices=v.weight_indices, lora_ranks=v.lora_ranks, scalings=v.scalings,
            max_len=1, seg_lens=v.seg_lens, permutation=None)
        _bind(info, v, h)
        return info

    def init_decode_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int,
                                          num_tokens_per_req: int) -> None:
        """The graph batch's info: views of the arena (grown to the graph's token rows if the
        arena does not exist yet), bound once; the captured kernels read them at replay."""
        tokens = int(max_bs_in_cuda_graph) * int(num_tokens_per_req)
        if self.pool is not None and tokens > self.pool.cfg.max_bs:
            raise CapacityError(f"a graph batch of {tokens} token rows, more than the LoRA "
                                f"arena's {self.pool.cfg.max_bs}")
        self.graph_tokens = max(self.graph_tokens, tokens)
        self.cuda_graph_batch_info = self._info(True, tokens)
        self.cuda_graph_batch_info.max_len = int(num_tokens_per_req)

    # ---- per batch -----------------------------------------------------------------------------
    def prepare_lora_batch(self, forward_batch: Any, weight_indices: list[int],
                           lora_ranks: list[int], scalings: list[float], use_cuda_graph: bool,
                           use_prefill_cuda_graph: bool = False) -> None:
        pool = self._arena()
        lens = _seq_lens(forward_batch)
        w = np.asarray(weight_indices, dtype=np.int64)
        if lens.shape[0] != w.shape[0]:
            raise CapacityError(f"{w.shape[0]} weight indices for {lens.shape[0]} requests")
        if use_cuda_graph:
            info = getattr(self, "cuda_graph_batch_info", None)
            if info is None:
                raise PoolError("a graph batch before init_decode_cuda_graph_batch_info")
            seg_w = np.repeat(w, lens)
            rows = info.weight_indices.shape[0]
            if seg_w.shape[0] > rows:
                raise CapacityError(f"a graph batch of {seg_w.shape[0]} token rows, more than "
                                    f"the graph's {rows}")
            pool.update_(rows, seg_w, np.ones_like(seg_w), lora_ranks, scalings)
            _bind(info, pool.view(rows), pool.host_view(rows))
            info.bs, info.num_segments = forward_batch.batch_size, int(seg_w.shape[0])
            kind = LoRAServed.GRAPH
        else:
            if w.shape[0]:
                starts = np.flatnonzero(np.r_[True, w[1:] != w[:-1]])
                seg_w, seg = w[starts], np.add.reduceat(lens, starts)
            else:
                seg_w, seg = w, lens
            n = int(seg_w.shape[0])
            if n > pool.cfg.max_bs:
                raise CapacityError(f"a batch of {n} segments, more than the LoRA arena's "
                                    f"max_bs={pool.cfg.max_bs}")
            bs = max(n, 1)
            v = pool.update_(bs, seg_w, seg, lora_ranks, scalings)
            if self._eager is None:
                self._eager = self._info(False, bs)
            info = self._eager
            _bind(info, v, pool.host_view(bs))
            info.bs, info.num_segments = forward_batch.batch_size, n
            info.max_len = int(seg.max()) if n else 0
            kind = LoRAServed.EAGER
        if self.served is not None:
            self.served.counts[kind] += 1
        self.batch_info = self._add_moe_lora_info(forward_batch, info)


def _bind(info: TorchNativeLoRABatchInfo, v: LoRABatchView, h: LoRABatchView) -> None:
    """Point ``info``'s tensors at a view of the arena and its host twin (no copy)."""
    info.seg_lens, info.seg_indptr, info.weight_indices = v.seg_lens, v.seg_indptr, \
        v.weight_indices
    info.lora_ranks, info.scalings = v.lora_ranks, v.scalings
    info.seg_lens_cpu, info.seg_indptr_cpu, info.weight_indices_cpu = h.seg_lens, \
        h.seg_indptr, h.weight_indices
    info.lora_ranks_cpu, info.scalings_cpu = h.lora_ranks, h.scalings


def _seq_lens(forward_batch: Any) -> np.ndarray:
    """New tokens per request of the batch, on the host (SGLang's ``generate_sequence_lengths``
    without a tensor): 1 per decode row, the draft tokens per verify row, the extend lengths."""
    mode, bs = forward_batch.forward_mode, int(forward_batch.batch_size)
    if mode.is_idle():
        return np.zeros(0, dtype=np.int64)
    if mode.is_decode():
        return np.ones(bs, dtype=np.int64)
    if mode.is_target_verify():
        return np.full(bs, int(forward_batch.spec_info.draft_token_num), dtype=np.int64)
    if mode.is_extend():
        lens = forward_batch.extend_seq_lens_cpu
        if lens is None:
            lens = forward_batch.extend_seq_lens.tolist()
        return np.asarray(lens, dtype=np.int64)
    raise PoolError(f"lora_backend='attnpool': no sequence lengths for forward mode {mode}")
