"""Hooks for the SGLang tests and benchmark, loaded by every Python process started with this
folder on ``PYTHONPATH`` (SGLang's scheduler included). Without their variables nothing is
imported or changed.

- ``ATTNPOOL_SGLANG_CORRUPT=1`` (the tests' negative control): each decode refill of
  attnpool's pool is followed by one wrong value, the first row's ``cache_seqlens`` shortened
  by one (its newest key dropped), so that tokens change if and only if attention reads the
  pool.
- ``ATTNPOOL_SGLANG_TIMES=<file>`` (the benchmark): the host time of the attention backend's
  ``init_forward_metadata`` (SGLang's ``torch_native`` or attnpool's), per batch: the file
  holds ``{"<decode|extend> <requests>": [calls, seconds]}``, rewritten after every call (the
  scheduler process is stopped, not exited, so nothing is left for an exit hook). The classes
  are wrapped when their modules are first imported (an import hook), so SGLang is not
  imported any earlier than it would be.
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


def _time_metadata(cls: Any, path: str) -> None:
    orig = cls.init_forward_metadata
    totals: dict[str, list[float]] = {}

    def timed(self: Any, forward_batch: Any) -> Any:
        t = time.perf_counter()
        out = orig(self, forward_batch)
        dt = time.perf_counter() - t
        mode = forward_batch.forward_mode
        kind = "decode" if mode.is_decode() else "extend"
        row = totals.setdefault(f"{kind} {forward_batch.batch_size}", [0, 0.0])
        row[0] += 1
        row[1] += dt
        with open(path, "w") as f:
            json.dump(totals, f)
        return out

    cls.init_forward_metadata = timed


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
                _time_metadata(getattr(module, _TIMED[name]), path)

        spec.loader = Timed()
        return spec


if os.environ.get("ATTNPOOL_SGLANG_TIMES"):
    import importlib.util

    sys.meta_path.insert(0, _Wrap(os.environ["ATTNPOOL_SGLANG_TIMES"]))
