"""Absorbed multi-head latent attention (MLA) over a latent cache (``KVKind.MLA``), one kernel
per module, all on the same query, cache and output convention (:mod:`.sdpa` describes it):

* :mod:`.sdpa`: PyTorch SDPA, every view (:func:`attention`, :func:`attention_out`,
  :func:`plan`, :func:`run_plan`), and the shape helpers the kernel modules share,
* :mod:`.flashinfer`: FlashInfer's MLA wrapper (:class:`~.flashinfer.MLAGraphWrappers`),
* :mod:`.fa4`: flash-attn 4's ``qv`` path,
* :mod:`.flashmla`: FlashMLA's dense decode kernel on the pool's schedule,
* :mod:`.sched`: FlashMLA's tile scheduler, for an adapter that schedules by itself,
* :mod:`.absorb`: split ``kv_b_proj``, absorb the query, un-absorb the output.

Importing this package imports no kernel library: each kernel module imports its own on call.
"""

from __future__ import annotations

from .sdpa import (
    attention,
    attention_out,
    check_shape,
    latent_kv,
    packed_q,
    plan,
    run_plan,
    split_q,
)

__all__ = ["attention", "attention_out", "check_shape", "latent_kv", "packed_q", "plan",
           "run_plan", "split_q"]
