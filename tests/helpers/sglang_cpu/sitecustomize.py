"""Hooks for the SGLang tests and benchmark, loaded by every Python process started with this
folder on ``PYTHONPATH`` (SGLang's scheduler included). Without their variables nothing is
imported or changed.

- ``ATTNPOOL_SGLANG_CORRUPT=1`` (the tests' negative control): each decode refill of
  attnpool's pool is followed by one wrong value, the first row's ``cache_seqlens`` shortened
  by one (its newest key dropped), so that tokens change if and only if attention reads the
  pool.
- ``ATTNPOOL_SGLANG_TIMES=<file>`` (the benchmark): the host time of the attention backend
  (SGLang's ``torch_native`` or attnpool's) per forward: its ``init_forward_metadata`` and its
  layers' ``forward_decode`` / ``forward_extend`` (K/V store and attention). The file holds
  ``{"<metadata|attention> <decode|extend> <requests>": [calls, seconds]}``, totals since the
  engine started, rewritten after every metadata call (the scheduler process is stopped, not
  exited, so nothing is left for an exit hook; a reader diffs two readings). The classes are
  wrapped when their modules are first imported (an import hook), so SGLang is not imported
  any earlier than it would be.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import time
from types import ModuleType
from typing import Any

if os.environ.get("ATTNPOOL_SGLANG_CORRUPT") == "1":
    from attnpool.integrations.sglang import step as _step

    _fill = _step.BatchFiller.fill

    def _corrupted(self: Any, **kw: Any) -> Any:
        run = _fill(self, **kw)
        if kw["decode"]:
            run.view.cache_seqlens[0] -= 1
        return run

    _step.BatchFiller.fill = _corrupted  # type: ignore[method-assign]

_TIMED = {"sglang.srt.layers.attention.torch_native_backend": "TorchNativeAttnBackend",
          "attnpool.integrations.sglang.backend": "AttnpoolAttnBackend"}


def _time_backend(cls: Any, path: str) -> None:
    totals: dict[str, list[float]] = {}

    def add(what: str, forward_batch: Any, dt: float) -> None:
        kind = "decode" if forward_batch.forward_mode.is_decode() else "extend"
        row = totals.setdefault(f"{what} {kind} {forward_batch.batch_size}", [0, 0.0])
        row[0] += 1
        row[1] += dt

    metadata = cls.init_forward_metadata

    def timed_metadata(self: Any, forward_batch: Any) -> Any:
        t = time.perf_counter()
        out = metadata(self, forward_batch)
        add("metadata", forward_batch, time.perf_counter() - t)
        with open(path, "w") as f:
            json.dump(totals, f)
        return out

    cls.init_forward_metadata = timed_metadata
    def timing(orig: Any) -> Any:
        def timed_layer(self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                        *args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = orig(self, q, k, v, layer, forward_batch, *args, **kw)
            add("attention", forward_batch, time.perf_counter() - t)
            return out

        return timed_layer

    for name in ("forward_decode", "forward_extend"):
        setattr(cls, name, timing(getattr(cls, name)))


class _Wrap(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds nothing itself: for a module of :data:`_TIMED` it lets the real finder load it,
    then wraps the class."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name: str, target: Any = None, target2: Any = None) -> Any:
        if name not in _TIMED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        path = self.path

        class Timed(importlib.abc.Loader):
            def create_module(self, s: Any) -> ModuleType | None:
                return loader.create_module(s)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                _time_backend(getattr(module, _TIMED[name]), path)

        spec.loader = Timed()
        return spec


if os.environ.get("ATTNPOOL_SGLANG_TIMES"):
    import importlib.util

    sys.meta_path.insert(0, _Wrap(os.environ["ATTNPOOL_SGLANG_TIMES"]))
