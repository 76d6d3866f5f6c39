"""attnpool: preallocated, CUDA-graph-safe buffer pools for attention backends.

Importing attnpool initialises no CUDA context and imports neither triton nor flash_attn nor
flashinfer; adapters and fused kernels import them lazily.

Module layering (imports only point down this list, never up): ``errors``, ``config``, ``specs``,
``arena``, ``views``, ``check``, ``update``, ``phases``, ``pool``, then ``adapters``, ``graphs``,
``kv``, ``lora`` and ``cli`` on top.
"""

from .arena import ArenaPlan, plan_arena
from .check import ReadRegionError, check_view
from .config import Impl, Layout, Phase, PoolConfig
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
    LocalView,
    PagedView,
    VerifyView,
)

__version__ = "0.1.0"

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
    "StaleViewError",
    "VerifyView",
    "__version__",
    "check_view",
    "lora_reference",
    "plan_arena",
]
