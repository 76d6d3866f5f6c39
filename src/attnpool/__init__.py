"""attnpool: preallocated, CUDA-graph-safe buffer pools for attention backends.

Importing attnpool initialises no CUDA context and imports neither triton nor flash_attn nor
flashinfer; adapters and fused kernels import them lazily. The public names below are loaded on
first use (PEP 562), so ``import attnpool`` (and ``python -m attnpool --help``) does not even
import torch until a name is used; ``from attnpool import BufferPool`` works as usual.

Layout (imports only point down this list, never up; docs/design.md, Layout): the core
(``errors``, ``config``, ``inputs``, ``specs``, ``arena``, ``views``, ``check``), ``update/``,
``phases/``, ``pool``, ``kv/``, then ``lora``, ``graphs``, ``adapters/``, ``integrations/`` and
``tools/`` (the command line, demos and benchmarks) on top.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Where each public name lives: ``attnpool.<name>`` imports ``attnpool.<module>`` on first use.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "arena": ("ArenaPlan", "plan_arena"),
    "check": ("ReadRegionError", "check_view"),
    "config": ("FlashMLAConfig", "Impl", "Layout", "Phase", "PoolConfig", "SchedLayout"),
    "errors": ("CapacityError", "InputError", "LayoutError", "MissingPhaseError", "PoolError",
               "StaleViewError"),
    "kv": ("KVCacheConfig", "KVCachePool", "KVKind", "KVLayout"),
    "lora": ("LoRABatchPool", "LoRABatchView", "LoRAConfig", "lora_reference"),
    "phases": ("BoundUpdate",),
    "pool": ("BufferPool",),
    "views": ("DecodeView", "DraftExtendView", "DraftStepView", "DraftView", "EncoderView",
              "ExtendView", "FlashMLAMetadata", "LocalView", "PagedView", "VerifyView"),
}
_MODULE_OF = {name: mod for mod, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from .arena import ArenaPlan, plan_arena
    from .check import ReadRegionError, check_view
    from .config import FlashMLAConfig, Impl, Layout, Phase, PoolConfig, SchedLayout
    from .errors import (
        CapacityError,
        InputError,
        LayoutError,
        MissingPhaseError,
        PoolError,
        StaleViewError,
    )
    from .kv import KVCacheConfig, KVCachePool, KVKind, KVLayout
    from .lora import LoRABatchPool, LoRABatchView, LoRAConfig, lora_reference
    from .phases import BoundUpdate
    from .pool import BufferPool
    from .views import (
        DecodeView,
        DraftExtendView,
        DraftStepView,
        DraftView,
        EncoderView,
        ExtendView,
        FlashMLAMetadata,
        LocalView,
        PagedView,
        VerifyView,
    )
else:

    def __getattr__(name: str) -> Any:
        """Load a public name (or a submodule, ``attnpool.adapters``) on first access."""
        mod = _MODULE_OF.get(name)
        if mod is not None:
            value = getattr(importlib.import_module(f".{mod}", __name__), name)
            globals()[name] = value  # later lookups skip this function
            return value
        if not name.startswith("_"):
            try:
                return importlib.import_module(f".{name}", __name__)
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":
                    raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "ArenaPlan",
    "BoundUpdate",
    "BufferPool",
    "CapacityError",
    "DecodeView",
    "DraftExtendView",
    "DraftStepView",
    "DraftView",
    "EncoderView",
    "ExtendView",
    "FlashMLAConfig",
    "FlashMLAMetadata",
    "Impl",
    "InputError",
    "KVCacheConfig",
    "KVCachePool",
    "KVKind",
    "KVLayout",
    "Layout",
    "LayoutError",
    "LoRABatchPool",
    "LoRABatchView",
    "LoRAConfig",
    "LocalView",
    "MissingPhaseError",
    "PagedView",
    "Phase",
    "PoolConfig",
    "PoolError",
    "ReadRegionError",
    "SchedLayout",
    "StaleViewError",
    "VerifyView",
    "__version__",
    "check_view",
    "lora_reference",
    "plan_arena",
]
