"""Pool init: per-buffer ``torch.zeros`` (engine style) vs per-buffer ``torch.empty`` vs the arena.

The buffer list is whatever :func:`attnpool.plan_arena` reports for each config, so new phases
join the benchmark by themselves. Bytes go to ``extra_info``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from attnpool import PoolConfig
from attnpool.tools import bench


@pytest.mark.parametrize("impl", bench.INIT_IMPLS, ids=lambda i: i.name.replace(" ", "-"))
@pytest.mark.parametrize("name", list(bench.INIT_CONFIGS))
def test_init(record: Callable[..., None], timed: Callable[..., None], device: torch.device,
              name: str, impl: bench.InitImpl) -> None:
    cfg = PoolConfig(device=device, **bench.INIT_CONFIGS[name])
    record("init", name, impl.name, cfg, baseline=impl.baseline, nbytes=impl.nbytes(cfg))
    timed(impl.prepare(cfg), budget_s=0.2)
