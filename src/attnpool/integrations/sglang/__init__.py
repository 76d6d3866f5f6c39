"""attnpool inside SGLang: an attention backend named ``attnpool`` whose metadata lives in
attnpool's pool.

Installed with attnpool, :func:`register` sits under SGLang's plugin entry point group
``sglang.srt.plugins``, which SGLang calls in each of its processes (engine, scheduler,
detokenizer). It adds the name ``attnpool`` to the accepted ``--attention-backend`` choices and
registers the backend's factory; nothing else in SGLang changes, and SGLang uses it only when
asked: ``sglang.Engine(..., attention_backend="attnpool")`` or ``--attention-backend attnpool``.

The backend class is in :mod:`.backend` (which imports SGLang); the pool sizing and per-batch
refill, plain torch, in :mod:`.step`.
"""

from __future__ import annotations

from typing import Any

from .step import NAME

__all__ = ["NAME", "register"]


def _create(model_runner: Any) -> Any:
    from .backend import AttnpoolAttnBackend

    return AttnpoolAttnBackend(model_runner)


def register() -> None:
    """SGLang's plugin hook: accept ``attnpool`` as an attention backend and register its
    factory (idempotent; the backend module is imported only when SGLang builds it)."""
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    register_attention_backend(NAME)(_create)
