"""Counters for the hot path of an update: aten ops (a ``TorchDispatchMode``) and Triton launches.

``count(fn)`` runs ``fn`` once under both counters and returns :class:`Counts`:

* ``launches``: Triton kernel launches. On a GPU they are counted by triton's own launch hook
  (``knobs.runtime.launch_enter_hook``, called by the compiled launcher for every launch); in
  interpret mode (``TRITON_INTERPRET=1``, no GPU) by wrapping ``InterpretedFunction.run``, the
  function a ``kernel[grid](...)`` call ends in (warmup calls, which launch nothing, excluded).
* ``ops``: every aten op dispatched while ``fn`` ran (allocations, copies, views and compute
  alike), *except* those dispatched from inside a Triton launch. Those go to ``launch_ops``: the
  interpreter emulates a kernel on the host with tensor ops of its own (mapping the arguments'
  storages, copying them back), which a compiled launch does not do.

Both counters count what actually happens; nothing is inferred from the code under test.

:class:`OpRecorder` is the one ``TorchDispatchMode`` of the tests and benchmarks: ``count`` uses it,
allocation tests use it alone (``with OpRecorder() as rec:`` then ``rec.ops``, ``rec.storages``),
and ``benchmarks/dispatch_count.py`` subclasses it to classify each op.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_VIEWS = frozenset({"aten.slice.Tensor", "aten.alias.default", "aten.view.default",
                    "aten.select.int", "aten.as_strided.default"})


@dataclass
class Counts:
    launches: int = 0
    kernels: list[str] = field(default_factory=list)  # name of each launched kernel, in order
    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    launch_ops: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def made(self) -> set[str]:
        """The ops that made a new tensor: all but views and ops that write in place
        (``aten.x_``) or into a given tensor (an ``out`` overload). An allocation-free step
        has none."""
        return {op for op in self.ops if op not in _VIEWS and not op.split(".")[1].endswith("_")
                and "out" not in op.split(".")[2]}

    @property
    def host_reads(self) -> list[str]:
        """The ops that read a device value back to the host (``item`` / ``tolist``)."""
        return [op for op in self.ops if "_local_scalar_dense" in op or "item" in op]


class LaunchState:
    def __init__(self) -> None:
        self.counts = Counts()
        self.in_launch = 0


class OpRecorder(TorchDispatchMode):
    """Records every aten op dispatched under it, in order (``ops``), and the storages of the
    non-empty tensors those ops return (``storages``, data pointers: what an allocation test
    compares with the pool's one storage). Ops dispatched while ``in_launch()`` is true (the
    Triton interpreter emulating a kernel on the host) go to ``launch_ops`` instead and are not
    passed to :meth:`record`; subclasses override :meth:`record` to look at each op further."""

    def __init__(self, in_launch: Callable[[], bool] = lambda: False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.in_launch = in_launch
        self.ops: list[str] = []
        self.launch_ops: list[str] = []
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.in_launch():
            self.launch_ops.append(str(func))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self.ops.append(str(func))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                self.storages.add(t.untyped_storage().data_ptr())
        self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """Called after each op outside a launch has run (``out`` is what it returned)."""


@contextlib.contextmanager
def launch_counter(state: LaunchState) -> Iterator[None]:
    """Count Triton launches into ``state`` (see the module docstring for how)."""
    from triton import knobs
    from triton.runtime.interpreter import InterpretedFunction

    orig_run = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        if not warmup:
            state.counts.launches += 1
            state.counts.kernels.append(self.__name__)
        state.in_launch += 1
        try:
            return orig_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            state.in_launch -= 1

    def hook(metadata: Any) -> None:
        state.counts.launches += 1
        name = "?"
        with contextlib.suppress(Exception):
            name = str(metadata.get()["name"])
        state.counts.kernels.append(name)

    InterpretedFunction.run = run  # type: ignore[method-assign]
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        yield
    finally:
        InterpretedFunction.run = orig_run  # type: ignore[method-assign]
        knobs.runtime.launch_enter_hook.remove(hook)


def count(fn: Callable[[], object]) -> Counts:
    """Run ``fn`` once under both counters (without triton installed nothing can launch a Triton
    kernel: only aten ops are counted, and ``launches`` stays 0)."""
    state = LaunchState()
    has_triton = importlib.util.find_spec("triton") is not None
    rec = OpRecorder(lambda: state.in_launch > 0)
    with launch_counter(state) if has_triton else contextlib.nullcontext(), rec:
        fn()
    state.counts.ops.update(rec.ops)
    state.counts.launch_ops.update(rec.launch_ops)
    return state.counts
