"""attnpool inside vLLM: an attention backend whose metadata lives in attnpool's pools.

Installed with attnpool, the package registers :func:`register` under vLLM's plugin entry point
group ``vllm.general_plugins``, which vLLM calls in each of its processes (front end, engine
core, workers). It does nothing unless the environment variable ``ATTNPOOL_VLLM`` is ``1``:
with the switch off, vLLM behaves exactly as without attnpool. With it on:

- on CPU, attnpool's backend takes the place of vLLM's ``CPU_ATTN`` (the only backend the CPU
  platform returns for non-MLA models), and its MLA backend that of ``CPU_MLA`` (what the CPU
  platform returns for multi-head latent attention models on CPUs without AMX: :mod:`.mla`);
- on CUDA, it is vLLM's ``CUSTOM`` backend: ``LLM(..., attention_backend="CUSTOM")``;
- with ``enable_lora``, the punica wrapper (vLLM's LoRA metadata and ops) is attnpool's subclass
  of the platform's own, its index tensors views of one pool (:mod:`.lora`): the plugin wraps
  ``current_platform.get_punica_wrapper`` (:func:`redirect_punica`).

The classes are in :mod:`.backend` (which imports vLLM); the pool sizing and per-step refill in
:mod:`.step`, the cache views and store in :mod:`.cache`, the encoder-only steps in
:mod:`.encoder_only` and which adapter attends per device in :mod:`.choice` are plain torch,
and so are the refill counts a test or a demo can ask for (:mod:`.served`).
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import InputError

#: The environment switch each vLLM process reads when it loads the plugin.
SWITCH = "ATTNPOOL_VLLM"
#: Who attends an MLA model's prefill rows: ``vllm`` (default) or ``attnpool``
#: (:class:`attnpool.integrations.vllm.mla_step.MLAPrefill`).
MLA_PREFILL = "ATTNPOOL_VLLM_MLA_PREFILL"
#: Who attends on a CPU: ``vllm`` (default: vLLM's own C++ kernel reading the pool's buffers,
#: :mod:`attnpool.integrations.vllm.cpu_kernel`) or ``attnpool`` (attnpool's torch paths).
CPU_KERNEL = "ATTNPOOL_VLLM_CPU_KERNEL"
#: Where vLLM finds the backends (class paths, imported by vLLM when it selects them).
CPU_BACKEND = "attnpool.integrations.vllm.backend.AttnpoolCPUBackend"
CUDA_BACKEND = "attnpool.integrations.vllm.backend.AttnpoolBackend"
CPU_MLA_BACKEND = "attnpool.integrations.vllm.mla.AttnpoolCPUMLABackend"
#: The platform's punica wrapper class path -> attnpool's subclass of it (:mod:`.lora`).
PUNICA_WRAPPERS = {
    "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU":
        "attnpool.integrations.vllm.lora.AttnpoolPunicaWrapperCPU",
    "vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU":
        "attnpool.integrations.vllm.lora.AttnpoolPunicaWrapperGPU",
}


def enabled() -> bool:
    """Whether ``ATTNPOOL_VLLM=1`` is set in this process's environment."""
    return os.environ.get(SWITCH, "0").strip() == "1"


def cpu_kernel_mode() -> str:
    """:data:`CPU_KERNEL`'s value, ``vllm`` or ``attnpool`` (anything else is refused)."""
    mode = os.environ.get(CPU_KERNEL, "vllm").strip() or "vllm"
    if mode not in ("vllm", "attnpool"):
        raise InputError(f"{CPU_KERNEL} must be 'vllm' or 'attnpool', got {mode!r}")
    return mode


def redirect_punica(platform: Any) -> None:
    """Make ``platform.get_punica_wrapper()`` (the class path vLLM's
    ``vllm.lora.punica_wrapper.get_punica_wrapper`` instantiates) answer attnpool's subclass of
    the platform's wrapper (:data:`PUNICA_WRAPPERS`) while :data:`SWITCH` is on, read at each
    call; other class paths pass through. The method is replaced on the platform instance (vLLM's
    ``current_platform``), once per process; vLLM's files are not changed."""
    native = platform.get_punica_wrapper
    if getattr(native, "_attnpool", False):
        return

    def get_punica_wrapper() -> str:
        name = str(native())
        return PUNICA_WRAPPERS.get(name, name) if enabled() else name

    get_punica_wrapper._attnpool = True  # type: ignore[attr-defined]
    platform.get_punica_wrapper = get_punica_wrapper


def register() -> None:
    """vLLM's plugin hook: register attnpool's backend and punica wrapper when :data:`SWITCH`
    is on, else nothing (the plugin runs in every vLLM process of the machine once attnpool is
    installed)."""
    if not enabled():
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
        register_backend(AttentionBackendEnum.CPU_MLA, CPU_MLA_BACKEND)
    else:
        register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND)
    redirect_punica(current_platform)
