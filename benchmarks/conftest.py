"""Shared fixtures of the benchmark suite (pytest-benchmark).

The cases and the implementations compared come from :mod:`attnpool.bench`, so
``pytest benchmarks --benchmark-only`` and ``python -m attnpool bench`` measure the same things.
Every benchmark records the machine (device, torch version) and the pool config in ``extra_info``.
Benchmarks run on CUDA when a GPU is present, else on the CPU; Triton's interpret mode is never
timed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnpool import PoolConfig, bench


@pytest.fixture(scope="session")
def device() -> torch.device:
    return bench.device_of("auto")


@pytest.fixture(scope="session")
def machine(device: torch.device) -> dict[str, Any]:
    return bench.machine_info(device)


Record = Callable[..., None]


@pytest.fixture
def record(benchmark: Any, machine: dict[str, Any]) -> Record:
    """``record(group, cfg, **extra)``: name the group and fill ``extra_info``."""

    def rec(group: str, cfg: PoolConfig, **extra: Any) -> None:
        benchmark.group = group
        benchmark.extra_info.update(machine)
        benchmark.extra_info["config"] = bench.config_info(cfg)
        benchmark.extra_info.update(extra)

    return rec


def run_timed(benchmark: Any, fn: Callable[[], object], device: torch.device,
              budget_s: float = 0.25) -> None:
    """Time ``fn`` (synchronised on CUDA) for about ``budget_s``, a modest fixed round count."""
    fn = bench.synced(fn, device)
    rounds = bench.rounds_for(fn, budget_s, lo=5, hi=100)
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)
