"""One model served from a pool: its paged KV caches, its attention backend, its decode graphs.

The generator owns one :class:`ModelRunner` per model (target, and the draft when speculative
decoding is on). Both share the generator's :class:`attnpool.BufferPool`, ``req_to_token`` and
``window_req_to_token``: a request's page ids are the same in both models' caches, only the
bytes behind them differ.

A model with sliding-window layers keeps their KV in a second cache, ``window_kv``, addressed by
the window table, whose pages the generator frees once every future window has passed them
(:mod:`.window_paging`); its full-attention layers stay in ``kv``. Either cache is None when the
model has no layer of that kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ...adapters.backends import Backend
from ...adapters.binding import bind
from ...config import Phase
from ...graphs import GraphRunner
from ...kv import KVCacheConfig, KVCachePool
from ...pool import BufferPool
from ...views import LocalView
from .attention import StepContext, resolve_backend
from .model import ModelSpec, forward_logits


class ModelRunner:
    """A model, its :class:`attnpool.KVCachePool` and the adapter its layers attend with.

    Args:
        model: the transformers model (its attention is switched to ``"attnpool"`` by the
            generator around each call, not here).
        spec: its checked layout (:func:`~attnpool.integrations.transformers.model.model_spec`).
        num_pages, page_size: the cache's pages (page 0 is the pad page).
        max_tokens: the most tokens one forward stores (the slot mapping's size).
        backend: :class:`Backend` (``AUTO`` resolves per device, dtype and page size).
        window_pages: pages of the sliding-window layers' cache (used when the model has such
            layers).
    """

    def __init__(self, model: Any, spec: ModelSpec, *, num_pages: int, page_size: int,
                 max_tokens: int, backend: Backend, window_pages: int = 2) -> None:
        self.model, self.spec = model, spec

        def cache(pages: int, layers: int) -> KVCachePool | None:
            return None if not layers else KVCachePool(KVCacheConfig(
                num_pages=pages, page_size=page_size, max_tokens=max_tokens, num_layers=layers,
                num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                head_dim_v=spec.head_dim_v, dtype=spec.dtype, device=spec.device))

        full, slid = spec.full_layers, spec.window_layers
        self.kv, self.window_kv = cache(num_pages, len(full)), cache(window_pages, len(slid))
        self.backend = resolve_backend(backend, spec.device, spec.dtype, page_size,
                                       spec.head_dim, spec.head_dim_v)
        # per model layer: (its cache is the window one, its layer in that cache)
        where = {i: (False, j) for j, i in enumerate(full)} | \
            {i: (True, j) for j, i in enumerate(slid)}
        self.route = tuple(where[i] for i in range(spec.num_layers))
        self.caches = tuple((self._cache(w).k_cache(j), self._cache(w).v_cache(j))
                            for w, j in self.route)

    def _cache(self, window: bool) -> KVCachePool:
        kv = self.window_kv if window else self.kv
        assert kv is not None  # route names only caches that exist
        return kv

    @property
    def caches_used(self) -> tuple[KVCachePool, ...]:
        """The caches this model has (full, window), those that exist."""
        return tuple(kv for kv in (self.kv, self.window_kv) if kv is not None)

    def set_slots(self, full: Tensor | None, window: Tensor | None, bs: int | None = None) -> None:
        """Write the step's new-token slots into each cache's slot mapping (``-1`` pads up to
        ``bs``); a cache the model lacks is skipped."""
        if self.kv is not None and full is not None:
            self.kv.update_slots_(full, bs)
        if self.window_kv is not None and window is not None:
            self.window_kv.update_slots_(window, bs)

    def context(self, view: object, num_q: int, prefix_free: bool = False,
                local: LocalView | None = None) -> StepContext:
        """The forward kwarg for ``num_q`` packed tokens over ``view`` (the attention call bound
        to it: for SDPA, the view's gather plan, computed once for every layer; the KV store
        bound to ``slot_mapping[:num_q]``, so call it after the step's slots are written).
        ``prefix_free``: a prefill of whole prompts (nothing cached before them). ``local``: the
        step's ``pool.local`` view, which the model's chunked layers read."""
        s = self.spec
        run = bind(self.backend, view, num_q, s.num_heads, s.num_kv_heads, s.dtype,
                   prefix_free and not s.variants, local)
        kv, window_kv = self.kv, self.window_kv
        full = None if kv is None else kv.step_store(num_q)
        if window_kv is None:
            assert full is not None and kv is not None
            return StepContext(view, kv, run, self.caches, full, s.sliding_window,
                               local_layers=s.chunked_layers)
        store = SplitStore(full, window_kv.step_store(num_q), self.route)
        return StepContext(view, window_kv if kv is None else kv, run, self.caches, store,
                           s.sliding_window, frozenset(s.window_layers), s.chunked_layers)

    def forward(self, ctx: StepContext, ids: Tensor, positions: Tensor,
                keep: Tensor | None = None) -> Tensor:
        """Logits of one packed step whose new-token slots are already in ``kv.slot_mapping``."""
        return forward_logits(self.model, ids, positions, ctx, keep)


class SplitStore:
    """A step's KV store over two caches: each layer stores into its own (full or window)."""

    __slots__ = ("_stores",)

    def __init__(self, full: Callable[[int, Tensor, Tensor], None] | None,
                 window: Callable[[int, Tensor, Tensor], None],
                 route: tuple[tuple[bool, int], ...]) -> None:
        self._stores = tuple((window if w else full, j) for w, j in route)

    def __call__(self, layer: int, k: Tensor, v: Tensor) -> None:
        store, j = self._stores[layer]
        assert store is not None  # a full layer's store exists when the model has full layers
        store(j, k, v)


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
        none = torch.empty(0, dtype=torch.int64, device=runner.spec.device)
        runner.set_slots(none, none, pool.cfg.max_bs)
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
