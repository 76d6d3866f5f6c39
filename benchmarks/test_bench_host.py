"""Host cost per update of every phase part (:mod:`attnpool.tools.bench_host`): fused eager and bound
updates with the Triton launch stubbed, the reference path, and the classic per-op replay (the
baseline, decode and chain verify), in one run. Each benchmark times the update and records its
cost in units of one small torch op (``t.fill_(1)``, measured interleaved) in ``extra_info``.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnpool import Impl
from attnpool.tools import bench_host

TRITON = importlib.util.find_spec("triton") is not None
CASES = [(label, phase, topk, bs, col) for label, phase, topk in bench_host.PARTS
         for bs in bench_host.BATCH_SIZES for col in bench_host.COLUMNS
         if col != "classic" or label in ("decode", "verify chain")]


@pytest.mark.parametrize(("label", "phase", "topk", "bs", "column"), CASES,
                         ids=[f"{c[0].replace(' ', '_')}-bs{c[3]}-{c[4].replace(' ', '_')}"
                              for c in CASES])
def test_host_cost(record: Callable[..., None], timed: Callable[..., None],
                   device: torch.device, label: str, phase: str, topk: int, bs: int,
                   column: str) -> None:
    fused = column in ("fused eager", "bound")
    if fused and not TRITON:
        pytest.skip("the fused columns need triton")
    ctx: Any = bench_host.stubbed_launches(device) if fused else contextlib.nullcontext()
    with ctx:
        fn = bench_host._case(label, phase, topk, bs, column, device)
        assert fn is not None
        units = bench_host.units(fn, device, rounds=10)
        impl = Impl.REFERENCE if column in ("reference", "classic") else Impl.TRITON
        record("host", f"{label} bs{bs}", column, bench_host.config(impl, topk, device),
               baseline=column == "classic", units=round(units, 2))
        timed(fn, budget_s=0.05)
