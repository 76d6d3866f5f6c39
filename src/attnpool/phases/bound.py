"""Bound updates: one phase update over the engine's static input tensors, replayed cheaply.

Engines keep their per-step inputs (``seq_lens``, ``req_pool_indices``, the ``req_to_token``
table, a ``[1]`` real count) in static tensors that their graph runner refills in place. An update
over those tensors always has the same shapes and addresses, so everything but the values can be
fixed once: :meth:`attnpool.phases.PhaseBase.bind` checks the inputs and runs the update once,
and the returned :class:`BoundUpdate` replays it without any check.

* **Fused path** (``Impl.TRITON``): the update's launches are recorded with every argument
  resolved; on CUDA they are captured into a private CUDA graph, so a call is one graph launch.
  On CPU (the Triton interpreter) a call runs the recorded launches. Either way the kernels read
  the inputs' *current values*, exactly as ``update_`` would.
* **Reference path**: a call runs ``update_`` with the bound inputs (checks included): the
  reference update is many small torch ops, so there is nothing to fold.

What cannot be bound: host copies (``*_cpu``) and ``request_ids``, which are host values of one
step (a bound update would keep reusing them). Pass ``num_real`` (a ``[1]`` device count, inputs
padded to ``bs`` rows) for a real count that changes per step; without it the real count is the
bound inputs' length. The view a call returns is the one of the binding call: the same tensors,
static host bounds (``max_seqlen_k`` etc. as for capture).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from ..arena import Arena

V = TypeVar("V")


class BoundUpdate(Generic[V]):
    """A phase update bound to fixed inputs; call it to refill the view (see the module doc)."""

    __slots__ = ("_after", "_arena", "_cuda", "_graph", "_launches", "_redo", "view")

    def __init__(self, arena: Arena, view: V, launches: list[Callable[[], object]] | None,
                 redo: Callable[[], V], after: Callable[[], None]) -> None:
        self._arena = arena
        self._cuda = arena.storage.device.type == "cuda"
        #: the phase's bookkeeping of a write (overlay ownership, its own state), per call
        self._after = after
        #: the view every call refills (the binding call's view)
        self.view = view
        self._launches = launches
        self._redo = redo
        self._graph: Any = None
        if launches is not None and arena.storage.device.type == "cuda":
            self._graph = _capture(launches)

    def __call__(self) -> V:
        """Refill the bound view from the inputs' current values; returns it.

        Called while the engine's own stream captures a graph, the call is recorded there and
        its replays write the pool behind this bookkeeping: the arena is then marked as
        ``recorded`` (as a capturable update marks it), which turns off what relies on seeing
        every write (the incremental page table)."""
        if self._cuda and torch.cuda.is_current_stream_capturing():
            self._arena.recorded = True
        if self._graph is not None:
            self._graph.replay()
        elif self._launches is not None:
            for fn in self._launches:
                fn()
        else:
            return self._redo()
        self._after()
        return self.view

    @property
    def launches(self) -> int:
        """Kernel launches per call on the fused path (0: the reference path, or one CUDA graph
        launch when ``graphed``)."""
        return 0 if self._launches is None or self._graph is not None else len(self._launches)

    @property
    def graphed(self) -> bool:
        """True when a call is one CUDA graph replay."""
        return self._graph is not None


def _capture(launches: list[Callable[[], object]]) -> Any:
    """The recorded launches in a private CUDA graph. They already ran once eagerly (the binding
    update), so every kernel is compiled before capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    return graph
