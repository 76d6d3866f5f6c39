"""Makes triton look uninstalled, to run the test suite as a machine without the ``triton`` extra.

Usage (from the repository root)::

    PYTHONPATH=tests/helpers/hide_triton:src python -m pytest -q

Python imports ``sitecustomize`` at start-up from the path, so every process of the run
(subprocesses included) gets this: the path finder answers "not found" for ``triton`` and its
submodules, so ``importlib.util.find_spec("triton")`` is None and ``import triton`` raises
``ModuleNotFoundError``, exactly as when the package is absent.
"""

from __future__ import annotations

import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType


class _PathFinderWithoutTriton(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "triton" or fullname.startswith("triton."):
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [_PathFinderWithoutTriton if f is importlib.machinery.PathFinder else f
                    for f in sys.meta_path]
