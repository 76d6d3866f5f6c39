"""Test setup: Triton kernels run in interpret mode when there is no GPU; tests of them (the
``triton`` marker) skip when triton is not installed (it is the optional extra ``triton``)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The long adversarial run takes many minutes: only when asked for (pytest -m fuzz).
    if "fuzz" not in (config.option.markexpr or ""):
        long = pytest.mark.skip(reason="long fuzz run: select it with pytest -m fuzz")
        for item in items:
            if "fuzz" in item.keywords:
                item.add_marker(long)
    if not HAS_TRITON:
        no_triton = pytest.mark.skip(reason="triton is not installed (pip install 'attnpool[triton]')")
        for item in items:
            if item.get_closest_marker("triton") is not None:
                item.add_marker(no_triton)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: a second intra-op thread only waits for a busy core (CI shares them). For the
    transformers tests: ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama() -> Any:
    """The tiny random GQA Llama of tests/hf_tiny.py (one per module: some tests change it)."""
    import hf_tiny

    return hf_tiny.llama()


@pytest.fixture(scope="module")
def llama_ref(llama: Any) -> list[list[int]]:
    """``model.generate`` greedy outputs of :func:`llama` on hf_tiny's prompts."""
    import hf_tiny

    return hf_tiny.greedy(llama, hf_tiny.prompts())


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, Any], None]]:
    """No real flash-attn module is importable; ``install(name, module)`` puts a fake in place
    (the flash-attn adapter's module loader is reset around each change)."""
    from attnpool.adapters import flash_attn as fa

    for name in [*(n for n, _ in fa.FA3_MODULES), "flash_attn"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    fa.clear_kernel_cache()

    def put(name: str, module: Any) -> None:
        monkeypatch.setitem(sys.modules, name, module)
        fa.clear_kernel_cache()

    yield put
    fa.clear_kernel_cache()
