"""The device helper of the Triton tests: kernels run where the machine can run them."""

from __future__ import annotations

import types

import pytest
import torch

from attnpool.update.reference import PagedBuffers

from tests.helpers.devices import kernel_device, on_device


def test_kernel_device_is_the_gpu_when_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernel_device() == torch.device("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs on host tensors
    assert kernel_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert kernel_device() == torch.device("cpu")


def test_moved_calls_keep_storages_offsets_and_aliasing() -> None:
    """Through copies (as on a GPU): writes land in the caller's storages, an interior slice is
    still one (a write past it shows up in the neighbour), aliased arguments stay aliased."""
    big = torch.zeros(12, dtype=torch.int32)
    b = PagedBuffers(big[2:6], big[6:11], None, None, None, None)
    seen: list[torch.Tensor] = []

    def kernel(buf: PagedBuffers, *, alias: torch.Tensor, lens: list[int]) -> int:
        assert buf.cache_seqlens.data_ptr() != big.data_ptr() + 8  # a copy, not the original
        buf.cache_seqlens.fill_(7)
        buf.cache_seqlens.as_strided((1,), (1,), buf.cache_seqlens.storage_offset() + 4).fill_(9)
        seen.append(alias.clone())  # alias = big[4:8]: sees the fill through the shared storage
        return sum(lens)

    mod = types.ModuleType("m")
    mod.kernel = kernel  # type: ignore[attr-defined]
    mod.CONST = 3  # type: ignore[attr-defined]
    moved = on_device(mod, torch.device("cpu"), force=True)
    assert moved.kernel(b, alias=big[4:8], lens=[1, 2]) == 3
    assert big.tolist() == [0, 0, 7, 7, 7, 7, 9, 0, 0, 0, 0, 0]
    assert seen[0].tolist() == [7, 7, 9, 0]
    assert moved.CONST == 3
    assert on_device(mod, torch.device("cpu")) is mod  # no copies where kernels take host tensors
