"""Test stand-in: page-locked host memory as plain host memory, on a machine without CUDA.

SGLang's LoRA code asks for pinned host tensors (``pin_memory=True`` in ``torch.tensor`` /
``torch.zeros``, ``Tensor.pin_memory()``) whatever the device; without an NVIDIA driver torch
refuses (``RuntimeError: Found no NVIDIA driver``), so SGLang's CPU engine cannot run LoRA at
all. Pinning only speeds host-to-device copies, which a CPU-only run never makes, so dropping
it changes no value. Not part of attnpool: a stand-in for the tests and benchmark only, and
only when CUDA is unavailable:

- :func:`install`: ``Tensor.pin_memory()`` returns the tensor itself, in the whole process;
- :func:`unpin_module`: inside one of SGLang's LoRA modules (:data:`MODULES`), the name
  ``torch`` becomes a proxy of torch whose factories drop ``pin_memory=``. Only there: replacing
  ``torch.tensor`` itself changes what other libraries compute (transformers' greedy tokens
  differ with a wrapped ``torch.tensor``, measured).

``sitecustomize`` applies both under ``ATTNPOOL_SGLANG_NO_PIN=1`` (each module as it is
imported); a test process calls them itself.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

#: the factories SGLang's LoRA code calls with ``pin_memory=True``
FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like",
             "ones_like")
#: SGLang's modules that pin (``grep -rn pin_memory sglang/srt/lora``, 0.5.23)
MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.lora", "sglang.srt.lora.mem_pool",
           "sglang.srt.lora.backend.torch_backend")


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def install() -> bool:
    """``Tensor.pin_memory`` a no-op if CUDA is unavailable; whether it is (idempotent)."""
    import torch

    if _cuda():
        return False
    if not getattr(torch.Tensor.pin_memory, "_attnpool_no_pin", False):
        def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return self

        pin_memory._attnpool_no_pin = True  # type: ignore[attr-defined]
        torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign,assignment]
    return True


def _unpinned(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return f(*args, **kwargs)

    return call


class _Torch(types.ModuleType):
    """torch, with :data:`FACTORIES` dropping ``pin_memory=``; every other name is torch's."""

    def __init__(self, torch: types.ModuleType) -> None:
        super().__init__("torch")
        self._torch = torch
        for name in FACTORIES:
            setattr(self, name, _unpinned(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def unpin_module(module: types.ModuleType) -> None:
    """In ``module``, ``torch`` becomes the unpinning proxy (and :func:`install` runs)."""
    import torch

    if install() and getattr(module, "torch", None) is torch:
        module.torch = _Torch(torch)  # type: ignore[attr-defined]
