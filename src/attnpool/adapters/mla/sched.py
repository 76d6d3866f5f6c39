"""FlashMLA's tile scheduler for adapters: the exact port lives in
:mod:`attnpool.update.reference.flashmla`, where the pool's updates write it into the pool's
buffers (``PoolConfig(flashmla=...)``); an adapter that schedules by itself imports it here."""

from __future__ import annotations

from ...update.reference.flashmla import (
    BLOCK_N,
    FIXED_OVERHEAD_BLOCKS,
    METADATA_SIZE,
    SchedLayout,
    get_mla_metadata,
    num_sm_parts,
)

__all__ = ["BLOCK_N", "FIXED_OVERHEAD_BLOCKS", "METADATA_SIZE", "SchedLayout",
           "get_mla_metadata", "num_sm_parts"]
