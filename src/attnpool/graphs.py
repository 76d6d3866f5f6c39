"""CUDA-graph runner over one pool: capture per batch size, pad, update in place, replay.

The runner is what an engine's model runner does by hand, with the pool's guarantees: every
captured graph reads views whose ``data_ptr()``s never change, ``update_`` writes the whole read
region of the padded batch before each replay, and updates and replays go on the same (current)
stream, so stream order is all the synchronisation the overlay needs. All graphs share one graph
memory pool and are captured largest first, so smaller graphs reuse the largest one's memory.

On CPU (or with ``use_graphs=False``, or for a batch larger than the largest captured size) the
same API runs eagerly: update, then call the forward function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .config import PHASE_FACTS, Phase
from .errors import CapacityError, InputError
from .pool import BufferPool

Forward = Callable[[Any, Tensor], Tensor]


def default_capture_sizes(max_bs: int) -> list[int]:
    """Engine-style sizes: 1, 2, 4, 8, then steps of 8 up to ``max_bs`` (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def rows_per_request(pool: BufferPool, phase: Phase) -> int:
    """Query rows one request contributes to the forward's input of ``phase`` (at most).

    For ``Phase.EXTEND`` a request's count varies (``extend_lens[i]``, up to ``max_extend_tokens``
    for the whole batch): see :func:`query_rows` for the rows of a whole forward.
    """
    return PHASE_FACTS[phase].rows(pool.cfg)


def query_rows(pool: BufferPool, phase: Phase, bs: int) -> int:
    """Packed query rows of a ``bs``-row forward of ``phase``: ``bs * rows_per_request``, except
    ``Phase.EXTEND``, whose padded views always end at ``cu_seqlens_q[bs] = max_extend_tokens``
    (:class:`attnpool.ExtendView`): its graphs take that many rows for every ``bs``."""
    if phase is Phase.EXTEND:
        return pool.cfg.max_extend_tokens
    return bs * rows_per_request(pool, phase)


class GraphRunner:
    """Capture ``forward(view, x)`` once per batch size and replay it for real batches.

    Args:
        pool: the pool whose phase feeds the forward.
        phase: which phase (``pool.phase(phase)`` provides ``view`` and ``update_``).
        forward: ``forward(view, x) -> out``; ``x`` has :func:`query_rows` rows (``bs * r``,
            ``r`` rows per request; ``max_extend_tokens`` for extend) and ``out`` must keep
            that leading dim.
        example: a tensor shaped like one input row block (``[rows, ...]``); its dtype and
            trailing shape size the runner's static input buffer of ``max_bs * r`` rows.
        capture_sizes: batch sizes to capture (default :func:`default_capture_sizes`).
        use_graphs: capture CUDA graphs (default: when the pool lives on CUDA).
        view_kwargs: extra arguments of ``view``/``update_`` (``for_phase`` of the local phase).
        prepare: optional ``prepare(view)``, called with the capture view before warm-up and
            capture, and with the refilled view after every ``update_`` and before the replay
            (or the eager forward): host-side planning a kernel needs per batch, such as
            FlashInfer's ``plan`` (:class:`attnpool.adapters.flashinfer.GraphWrappers`). It must
            not replace tensors the graph reads, only refill them.
    """

    def __init__(
        self,
        pool: BufferPool,
        phase: Phase,
        forward: Forward,
        example: Tensor,
        capture_sizes: Sequence[int] | None = None,
        use_graphs: bool | None = None,
        view_kwargs: dict[str, Any] | None = None,
        prepare: Callable[[Any], object] | None = None,
    ) -> None:
        self.pool, self.phase, self.forward = pool, phase, forward
        self.prepare = prepare
        self._ph: Any = pool.phase(phase)
        self.r = rows_per_request(pool, phase)
        self.view_kwargs = dict(view_kwargs or {})
        cfg = pool.cfg
        sizes = sorted(set(capture_sizes or default_capture_sizes(cfg.max_bs)))
        if not sizes or sizes[0] < 1 or sizes[-1] > cfg.max_bs:
            raise CapacityError(f"capture sizes must lie in [1, max_bs={cfg.max_bs}], got {sizes}")
        self.capture_sizes = sizes
        self.use_graphs = cfg.torch_device.type == "cuda" if use_graphs is None else use_graphs
        # Static input rows: padded rows of a replay read them, so they start initialised
        # (one fill at construction, outside the pool; later steps overwrite the real rows).
        shape = (query_rows(pool, phase, cfg.max_bs), *example.shape[1:])
        self._x = torch.empty(shape, dtype=example.dtype, device=cfg.torch_device)
        self._x.zero_()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        if self.use_graphs:
            self._capture()

    # ---- capture -------------------------------------------------------------------------------
    def _capture(self) -> None:
        mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        main = torch.cuda.current_stream()
        for bs in reversed(self.capture_sizes):  # largest first: the others reuse its memory
            view = self._ph.view(bs, **self.view_kwargs)  # writes the capture state if needed
            if self.prepare is not None:
                self.prepare(view)
            xs = self._x[: query_rows(self.pool, self.phase, bs)]
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(2):  # warm up kernels (autotune, lazy init) outside the capture
                    self.forward(view, xs)
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                out = self.forward(view, xs)
            self._graphs[bs] = (graph, out)

    # ---- run -----------------------------------------------------------------------------------
    def padded_size(self, n: int) -> int | None:
        """The captured size a batch of ``n`` requests replays at (None: runs eagerly)."""
        return next((b for b in self.capture_sizes if b >= n), None)

    def run(self, x: Tensor, **inputs: Any) -> Tensor:
        """Run one step for ``n = len(inputs["seq_lens"])`` requests; returns ``x.shape[0]`` rows.

        ``inputs`` are the phase's ``update_`` arguments except ``bs``. ``x`` holds the real
        rows (``n * r``; for ``Phase.EXTEND`` the packed ``sum(extend_lens) <= max_extend_tokens``
        rows); it is copied into the static buffer (never aliased).
        """
        if "seq_lens" not in inputs:
            raise InputError("run() needs the phase's update_ arguments, including seq_lens")
        n = int(inputs["seq_lens"].shape[0])
        if n < 1:
            raise InputError(f"run() needs at least one request, got n={n}")
        rows = x.shape[0]
        ok = rows <= self._x.shape[0] if self.phase is Phase.EXTEND else rows == n * self.r
        if not ok or x.shape[1:] != self._x.shape[1:]:
            want = f"<= {self._x.shape[0]}" if self.phase is Phase.EXTEND else str(n * self.r)
            raise InputError(f"x must be [{want}, {', '.join(map(str, self._x.shape[1:]))}]"
                             f", got {list(x.shape)}")
        kwargs = {**inputs, **self.view_kwargs}
        bs = self.padded_size(n)
        if bs is None or bs not in self._graphs:  # eager: no padding needed
            view = self._ph.update_(n, **kwargs)
            if self.prepare is not None:
                self.prepare(view)
            return self.forward(view, x)
        view = self._ph.update_(bs, **kwargs)
        if self.prepare is not None:
            self.prepare(view)
        self._x[:rows].copy_(x)
        graph, out = self._graphs[bs]
        graph.replay()
        return out[:rows]
