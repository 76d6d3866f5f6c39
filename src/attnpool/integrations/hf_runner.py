"""One model served from a pool: its paged KV cache, its attention backend, its decode graphs.

The generator owns one :class:`ModelRunner` per model (target, and the draft when speculative
decoding is on). Both share the generator's :class:`attnpool.BufferPool` and ``req_to_token``:
a request's page ids are the same in both caches, only the bytes behind them differ.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..config import Phase
from ..graphs import GraphRunner
from ..kv import KVCacheConfig, KVCachePool
from ..pool import BufferPool
from .hf_attention import Backend, StepContext, bind, resolve_backend
from .hf_model import ModelSpec, forward_logits


class ModelRunner:
    """A model, its :class:`attnpool.KVCachePool` and the adapter its layers attend with.

    Args:
        model: the transformers model (its attention is switched to ``"attnpool"`` by the
            generator around each call, not here).
        spec: its checked layout (:func:`~attnpool.integrations.hf_model.model_spec`).
        num_pages, page_size: the cache's pages (page 0 is the pad page).
        max_tokens: the most tokens one forward stores (the slot mapping's size).
        backend: :class:`Backend` (``AUTO`` resolves per device, dtype and page size).
    """

    def __init__(self, model: Any, spec: ModelSpec, *, num_pages: int, page_size: int,
                 max_tokens: int, backend: Backend) -> None:
        self.model, self.spec = model, spec
        self.kv = KVCachePool(KVCacheConfig(
            num_pages=num_pages, page_size=page_size, max_tokens=max_tokens,
            num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            dtype=spec.dtype, device=spec.device))
        self.backend = resolve_backend(backend, spec.device, spec.dtype, page_size)
        self.caches = tuple((self.kv.k_cache(i), self.kv.v_cache(i))
                            for i in range(spec.num_layers))

    def context(self, view: object, num_q: int, prefix_free: bool = False) -> StepContext:
        """The forward kwarg for ``num_q`` packed tokens over ``view`` (the attention call bound
        to it: for SDPA, the view's gather plan, computed once for every layer; the KV store
        bound to ``slot_mapping[:num_q]``, so call it after the step's slots are written).
        ``prefix_free``: a prefill of whole prompts (nothing cached before them)."""
        s = self.spec
        run = bind(self.backend, view, num_q, s.num_heads, s.num_kv_heads, s.dtype,
                   prefix_free and not s.variants)
        return StepContext(view, self.kv, run, self.caches, self.kv.step_store(num_q),
                           s.sliding_window)

    def forward(self, ctx: StepContext, ids: Tensor, positions: Tensor,
                keep: Tensor | None = None) -> Tensor:
        """Logits of one packed step whose new-token slots are already in ``kv.slot_mapping``."""
        return forward_logits(self.model, ids, positions, ctx, keep)


class DecodeGraphs:
    """Greedy decode steps of one runner replayed from CUDA graphs, one per padded batch size.

    Built on :class:`attnpool.GraphRunner`: the static input is ``[max_bs, 2]`` int64 (token id,
    position) per row; a replay refills the pool's decode view in place and returns the argmax
    token of every row. Padded rows read the pad page (``update_`` pads the view) and store
    nothing (their slots are -1).
    """

    def __init__(self, runner: ModelRunner, pool: BufferPool,
                 capture_sizes: Sequence[int] | None = None) -> None:
        self.runner, self.pool = runner, pool
        # Capture runs the forward on padded rows only: every token it stores must be skipped.
        runner.kv.update_slots_(torch.empty(0, dtype=torch.int64, device=runner.spec.device),
                                pool.cfg.max_bs)
        self.prepared_at = 0.0

        def forward(view: Any, x: Tensor) -> Tensor:
            return runner.forward(runner.context(view, x.shape[0]), x[:, 0], x[:, 1]).argmax(-1)

        self.graphs = GraphRunner(
            pool, Phase.DECODE, forward,
            torch.zeros(1, 2, dtype=torch.int64),  # ok: example input sizing static buffers, once
            capture_sizes=capture_sizes, use_graphs=True, prepare=self._prepared)

    def _prepared(self, view: object) -> None:
        self.prepared_at = time.perf_counter()  # update_ is done: metadata time ends here

    def padded_size(self, n: int) -> int:
        bs = self.graphs.padded_size(n)
        return n if bs is None else bs

    def run(self, x: Tensor, **inputs: Any) -> Tensor:
        """Tokens ``[n]`` for ``x [n, 2]`` (ids, positions); ``inputs`` as for ``update_``."""
        return self.graphs.run(x, **inputs)
