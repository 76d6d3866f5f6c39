"""Where the Triton kernels under test run: the GPU when there is one, else Triton's interpreter.

conftest.py turns on ``TRITON_INTERPRET=1`` only on a machine without CUDA; on a GPU machine the
kernels compile for the GPU and refuse CPU tensors. Tests that build their cases as CPU tensors
call the kernels through :func:`on_device`: every tensor argument (also inside dataclasses such as
``PagedBuffers``, lists and dicts) is moved to :func:`kernel_device` a whole storage at a time, so
offsets, strides and aliasing survive (a buffer that is an interior slice of a larger tensor is
still one, and a write past it lands in the neighbouring bytes the test inspects), and every
storage is copied back after the call. On CPU the module is used as it is.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import Tensor


def kernel_device() -> torch.device:
    """CUDA when available and the interpreter is not forced, else CPU (interpret mode)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return torch.device("cuda")
    return torch.device("cpu")


class _Mover:
    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.storages: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def move(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            return self._tensor(obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: self.move(getattr(obj, f.name))
                                               for f in dataclasses.fields(obj)})
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.move(x) for x in obj)
        if isinstance(obj, dict):
            return {k: self.move(x) for k, x in obj.items()}
        return obj

    def _tensor(self, t: Tensor) -> Tensor:
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in self.storages:
            host = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)  # the bytes
            self.storages[key] = (host, host.to(self.dev, copy=True))
        moved = self.storages[key][1]
        out = torch.empty(0, dtype=t.dtype, device=self.dev)
        return out.set_(moved.untyped_storage(), t.storage_offset(), t.shape, t.stride())

    def back(self) -> None:
        for host, moved in self.storages.values():
            host.copy_(moved)


class _OnDevice:
    def __init__(self, module: Any, dev: torch.device) -> None:
        self._module, self._dev = module, dev

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            m = _Mover(self._dev)
            args, kw = m.move(args), m.move(kw)
            try:
                return attr(*args, **kw)
            finally:
                m.back()

        return call


def on_device(module: Any, dev: torch.device | None = None, force: bool = False) -> Any:
    """``module`` whose functions run on ``dev`` (default :func:`kernel_device`); ``force`` moves
    through copies even when ``dev`` is the CPU (tests of this helper)."""
    dev = kernel_device() if dev is None else dev
    if dev.type == "cpu" and not force:
        return module
    return _OnDevice(module, dev)
