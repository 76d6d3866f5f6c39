"""Memory: overlaid (one arena) vs separate (one allocation per buffer) bytes per config.

The figures are arithmetic on :func:`attnpool.plan_arena` (what the pool allocates); the timed
call is the planning itself. On CUDA the bytes the arena and the per-buffer allocation actually
take from the caching allocator are measured too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnpool import BufferPool, PoolConfig, plan_arena
from attnpool.tools import bench
from attnpool.tools.baseline import Fill, alloc_per_buffer


def _allocated(device: torch.device, make: Any) -> int:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    keep = make()
    torch.cuda.synchronize(device)
    used = torch.cuda.memory_allocated(device) - before
    del keep
    return used


@pytest.mark.parametrize("name", list(bench.INIT_CONFIGS))
def test_memory(record: Callable[..., None], timed: Callable[..., None], device: torch.device,
                name: str) -> None:
    cfg = PoolConfig(device=device, **bench.INIT_CONFIGS[name])
    plan = plan_arena(cfg)
    extra: dict[str, Any] = {"overlaid_nbytes": plan.nbytes, "separate_nbytes": plan.separate_nbytes,
                             "overlaid_over_separate": plan.nbytes / plan.separate_nbytes}
    if device.type == "cuda":
        extra["cuda_allocated_arena"] = _allocated(device, lambda: BufferPool(cfg))
        extra["cuda_allocated_per_buffer"] = _allocated(
            device, lambda: alloc_per_buffer(cfg, Fill.ZEROS))
    record("memory", name, "plan_arena", cfg, **extra)
    timed(lambda: plan_arena(cfg), budget_s=0.05)
    assert plan.nbytes <= plan.separate_nbytes
