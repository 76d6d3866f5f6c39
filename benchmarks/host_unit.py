"""The unit the engine benchmarks report host time in: one small torch op, timed in the same
process (``torch.add`` of two 8-element tensors)."""

from __future__ import annotations

import time


def small_op_s() -> float:
    """Seconds of one small torch op (``torch.add`` of two 8-element tensors)."""
    import torch

    a, b = torch.ones(8), torch.ones(8)
    for _ in range(1000):
        torch.add(a, b)
    t = time.perf_counter()
    for _ in range(20000):
        torch.add(a, b)
    return (time.perf_counter() - t) / 20000
