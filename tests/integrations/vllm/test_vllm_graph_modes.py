"""The CUDA graph support attnpool's vLLM builder declares per kernel, and the phase it refills in
each of vLLM's graph modes, read the way vLLM's GPU runner reads them (its classmethod
``get_cudagraph_support(vllm_config, kv_cache_spec)`` over the layers of the forward context,
and the resolved ``compilation_config.cudagraph_mode``). Runs in vLLM's environment; no engine
is started (vLLM's CUDA runner cannot run here): the config holds only what the builder reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport

from attnpool.adapters.backends import Backend
from attnpool.integrations.vllm.backend import (
    AttnpoolMetadataBuilder,
)

from tests.helpers import vllm_engine as ve


def _config(backends: list[Backend], device: str, mode: CUDAGraphMode) -> SimpleNamespace:
    cfg: SimpleNamespace = ve.config_stub(backends, device, mode=mode)
    return cfg


def _builder(cfg: SimpleNamespace, device: str) -> AttnpoolMetadataBuilder:
    b = object.__new__(AttnpoolMetadataBuilder)
    b.vllm_config, b.kv_cache_spec = cfg, None  # type: ignore[assignment]
    b.filler = SimpleNamespace(sizes=SimpleNamespace(device=torch.device(device)))  # type: ignore[assignment]
    return b


@pytest.mark.parametrize(("backends", "device", "want"), [
    ([Backend.FA4, Backend.FA4], "cuda", AttentionCGSupport.ALWAYS),
    ([Backend.FA3], "cuda", AttentionCGSupport.ALWAYS),
    ([Backend.FLASHINFER], "cuda", AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
    ([Backend.FA2], "cuda", AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
    ([Backend.SDPA], "cuda", AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
    ([Backend.FA4, Backend.SDPA], "cuda", AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
    ([Backend.SDPA], "cpu", AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
    ([], "cuda", AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),  # before the layers exist
])
def test_graph_support_per_kernel(backends: list[Backend], device: str,
                                  want: AttentionCGSupport) -> None:
    cfg = _config(backends, device, CUDAGraphMode.FULL)
    assert AttnpoolMetadataBuilder.get_cudagraph_support(cfg, None) is want  # type: ignore[arg-type]


@pytest.mark.parametrize(("mode", "backend", "device", "one_phase"), [
    (CUDAGraphMode.FULL, Backend.FA4, "cuda", True),  # one graph per size for every batch
    (CUDAGraphMode.FULL_AND_PIECEWISE, Backend.FA4, "cuda", False),  # decode graphs apart
    (CUDAGraphMode.FULL_DECODE_ONLY, Backend.FA4, "cuda", False),
    (CUDAGraphMode.PIECEWISE, Backend.FA4, "cuda", False),
    (CUDAGraphMode.NONE, Backend.FA4, "cuda", False),
    (CUDAGraphMode.FULL, Backend.FLASHINFER, "cuda", False),  # (vLLM downgrades the mode)
    (CUDAGraphMode.FULL, Backend.SDPA, "cpu", False),
])
def test_every_batch_is_an_extend_update_only_in_full_mode(
        mode: CUDAGraphMode, backend: Backend, device: str, one_phase: bool) -> None:
    b = _builder(_config([backend], device, mode), device)
    assert b._one_phase() is one_phase
