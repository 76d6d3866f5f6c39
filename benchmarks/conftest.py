"""Shared fixtures of the benchmark suite (pytest-benchmark).

The cases and the implementations compared come from :mod:`attnpool.tools.bench`, so
``pytest benchmarks --benchmark-only`` and ``python -m attnpool bench`` measure the same things.
Every benchmark records the machine (device, torch version) and the pool config in ``extra_info``;
at the end of the run the ``attnpool / baseline`` median ratios are printed (the headline figures).
Helpers are fixtures, not imports: ``tests/`` has a ``conftest.py`` too, and ``import conftest``
would pick whichever directory comes first on ``sys.path``.
Benchmarks run on CUDA when a GPU is present, else on the CPU; Triton's interpret mode is never
timed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnpool import PoolConfig
from attnpool.tools import bench

_RESULTS: list[dict[str, Any]] = []


@pytest.fixture(scope="session")
def device() -> torch.device:
    return bench.device_of("auto")


@pytest.fixture(scope="session")
def machine(device: torch.device) -> dict[str, Any]:
    return bench.machine_info(device)


Record = Callable[..., None]


@pytest.fixture
def record(benchmark: Any, machine: dict[str, Any]) -> Record:
    """``record(group, case, impl, cfg, **extra)``: name the benchmark group, fill
    ``extra_info``."""

    def rec(group: str, case: str, impl: str, cfg: PoolConfig, **extra: Any) -> None:
        benchmark.group = f"{group} {case}"
        benchmark.extra_info.update(machine)
        benchmark.extra_info.update({"group_name": group, "case": case, "impl": impl,
                                     "config": bench.config_info(cfg), **extra})

    return rec


Timed = Callable[..., None]


@pytest.fixture
def timed(benchmark: Any, device: torch.device) -> Timed:
    """``timed(fn, budget_s=0.25)``: time ``fn`` (synchronised on CUDA) for about ``budget_s``,
    a modest, fixed round count, and keep its median for the ratio summary."""

    def run(fn: Callable[[], object], budget_s: float = 0.25) -> None:
        fn = bench.synced(fn, device)
        rounds = bench.rounds_for(fn, budget_s, lo=5, hi=100)
        benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)
        stats = getattr(benchmark, "stats", None)
        if stats is not None and "impl" in benchmark.extra_info:
            info = benchmark.extra_info
            _RESULTS.append({"group": info["group_name"], "case": info["case"],
                             "impl": info["impl"], "median_s": stats.stats.median})

    return run


def pytest_terminal_summary(terminalreporter: Any) -> None:
    rows = bench.ratios(_RESULTS)
    if not rows:
        return
    terminalreporter.section("attnpool / baseline (median ratios; < 1: attnpool faster)")
    for r in rows:
        terminalreporter.write_line(f"{r['group']:<7} {r['case']:<30} {r['impl']:<28} "
                                    f"{r['ratio']:6.2f}  (vs {r['baseline']})")
