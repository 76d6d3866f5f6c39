"""Test setup: Triton kernels run in interpret mode when there is no GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The long adversarial run takes many minutes: only when asked for (pytest -m fuzz).
    if "fuzz" not in (config.option.markexpr or ""):
        long = pytest.mark.skip(reason="long fuzz run: select it with pytest -m fuzz")
        for item in items:
            if "fuzz" in item.keywords:
                item.add_marker(long)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
