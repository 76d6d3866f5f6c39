"""Which adapter attends in vLLM, per device: the fastest one installed that serves the model.

On a CPU attnpool's own attention is the SDPA adapter (vLLM's CPU kernel, the default there,
is chosen by the builder: :mod:`.cpu_kernel`). On CUDA the backend drives, fastest first,
FlashInfer (its decode wrapper for uniform decode steps, its paged prefill wrapper for mixed
ones, planned by the builder once per step: :class:`attnpool.adapters.flashinfer_step.StepPlans`),
flash-attn (FA3 through ``flash_attn_interface``, FA4 through ``flash_attn.cute``, FA2 through
``flash_attn``) and SDPA, through the one per-layer call every integration binds
(:mod:`attnpool.adapters.binding`): each reads vLLM's CUDA cache in place (``[2, num_blocks,
block_size, H_kv, D]``, split into two NHD caches without a copy, :func:`.cache.cuda_views`).
SDPA runs only when none of the others is installed or can serve the model. Models with
attention sinks skip FlashInfer (its wrappers apply sinks only on backends the plans do not
build).

``ATTNPOOL_VLLM_KERNEL=<name>`` (``flashinfer``, ``fa3``, ``fa4``, ``fa2``, ``sdpa``) forces
one; a forced kernel that is not installed, or cannot serve the model, is refused with every
reason.
Nothing here imports vLLM.
"""

from __future__ import annotations

import os

from ...adapters.backends import Backend, Need
from ...adapters.binding import choose, driven

#: The environment variable that forces one adapter.
KERNEL = "ATTNPOOL_VLLM_KERNEL"

#: The adapters this integration drives per device, fastest first.
DRIVEN: dict[str, tuple[Backend, ...]] = {"cpu": driven("cpu"),
                                          "cuda": driven("cuda", planned=True)}


def pick(need: Need) -> Backend:
    """The adapter that attends for a layer of ``need`` (see the module docstring).

    Raises:
        LayoutError: :data:`KERNEL` names no driven adapter, the one it names cannot run here,
            or none can.
    """
    return choose(need, os.environ.get(KERNEL, "").strip().lower(), "attnpool's vLLM backend",
                  KERNEL, planned=not need.sinks)
