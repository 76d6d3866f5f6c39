"""Which adapter attends in vLLM per device (:mod:`attnpool.integrations.vllm.choice`): on CUDA
the fastest installed flash-attn that serves the model, SDPA only when none does; a forced
kernel that is not installed is refused with the reason. Installation is simulated by which
modules the capability records find (nothing here imports vLLM or a kernel)."""

from __future__ import annotations

import pytest
import torch

from attnpool import LayoutError
from attnpool.adapters.backends import Backend, Capabilities, Need
from attnpool.integrations.vllm import choice

FA3, FA4, FA2 = "flash_attn_interface", "flash_attn.cute", "flash_attn.flash_attn_interface"
FI = "flashinfer"


def _installed(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    monkeypatch.setattr(Capabilities, "importable",
                        lambda self: self.module is None or self.module in modules)


def _need(**kw: object) -> Need:
    base: dict[str, object] = {"device": "cuda", "dtype": torch.bfloat16, "head_size": 64,
                               "page_size": 16, "varying_queries": True}
    return Need(**(base | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(("modules", "want"), [
    ((), Backend.SDPA),
    ((FA4,), Backend.FA4),
    ((FA3, FA4), Backend.FA3),
    ((FA2,), Backend.SDPA),  # FA2 takes one query count per row: not vLLM's mixed steps
    ((FA2, FA4), Backend.FA4),
    ((FI,), Backend.FLASHINFER),
    ((FI, FA3, FA4), Backend.FLASHINFER),  # planned per step, split-KV decode: first
])
def test_cuda_picks_the_fastest_installed_kernel(modules: tuple[str, ...], want: Backend,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(choice.KERNEL, raising=False)
    _installed(monkeypatch, *modules)
    assert choice.pick(_need()) is want


def test_sdpa_only_when_no_faster_kernel_serves_the_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(choice.KERNEL, raising=False)
    _installed(monkeypatch, FA3, FA4)
    assert choice.pick(_need(dtype=torch.float32)) is Backend.SDPA  # flash-attn: half only
    assert choice.pick(_need(device="cpu")) is Backend.SDPA
    for backend in (Backend.FA3, Backend.FA4):
        assert backend in choice.DRIVEN["cuda"]


def test_a_forced_kernel_runs_or_is_refused_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, FA3)
    monkeypatch.setenv(choice.KERNEL, "SDPA")
    assert choice.pick(_need()) is Backend.SDPA
    monkeypatch.setenv(choice.KERNEL, "fa4")
    with pytest.raises(LayoutError, match=r"FA4 cannot run here: .*'flash_attn.cute'"):
        choice.pick(_need())
    monkeypatch.setenv(choice.KERNEL, "flashmla")
    with pytest.raises(LayoutError, match=r"ATTNPOOL_VLLM_KERNEL must name one of "
                                          r"\['flashinfer', 'fa3', 'fa4', 'fa2', 'sdpa'\] on cuda"):
        choice.pick(_need())


def test_flashinfer_is_skipped_for_sinks_and_forced_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sinks need FlashInfer backends the step plans do not build: flash-attn serves them;
    ``flashinfer`` forces it, refused with the reason when it does not import."""
    monkeypatch.delenv(choice.KERNEL, raising=False)
    _installed(monkeypatch, FI, FA4)
    assert choice.pick(_need(sinks=True)) is Backend.FA4
    monkeypatch.setenv(choice.KERNEL, "fa4")
    assert choice.pick(_need()) is Backend.FA4
    monkeypatch.setenv(choice.KERNEL, "flashinfer")
    assert choice.pick(_need()) is Backend.FLASHINFER
    _installed(monkeypatch, FA4)
    with pytest.raises(LayoutError, match=r"FLASHINFER cannot run here: .*'flashinfer'"):
        choice.pick(_need())
