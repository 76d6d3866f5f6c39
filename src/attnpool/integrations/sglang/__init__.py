"""attnpool inside SGLang: an attention backend named ``attnpool`` whose metadata lives in
attnpool's pool.

Installed with attnpool, :func:`register` sits under SGLang's plugin entry point group
``sglang.srt.plugins``, which SGLang calls in each of its processes (engine, scheduler,
detokenizer). It adds the name ``attnpool`` to the accepted ``--attention-backend`` choices and
registers the backend's factory; nothing else in SGLang changes, and SGLang uses it only when
asked: ``sglang.Engine(..., attention_backend="attnpool")`` or ``--attention-backend attnpool``.

Speculative decoding (NGRAM, EAGLE, EAGLE3, STANDALONE): the target's verify batches and the
draft model's extends go through the same backend (``pool.verify``, ``pool.draft_extend``); the
draft model's decode steps through a multi-step draft backend
(:class:`.spec.AttnpoolDraftSteps`, ``pool.draft``). SGLang does not look those up in its
attention-backend registry: its ``DraftBackendFactory`` builds them from a dict of backend
names to constructors made inside ``create_decode_backend`` / ``create_draft_extend_backend``
each time they run (a local variable, so there is nothing to add a name to), and refuses any
other name. :func:`register` therefore wraps those two methods: for the backend name
``attnpool`` they return attnpool's objects, for every other name they call SGLang's own method
unchanged.

The backend classes are in :mod:`.backend` and :mod:`.spec` (importing SGLang); the pool sizing
and per-batch refill, plain torch, in :mod:`.step`.
"""

from __future__ import annotations

from typing import Any

from .step import NAME

__all__ = ["NAME", "register"]


def _create(model_runner: Any) -> Any:
    from .factory import backend_for

    return backend_for(model_runner)


def _draft_name(factory: Any, decode: bool) -> str:
    """The attention backend SGLang's ``DraftBackendFactory`` picks for the draft's decode
    steps (``decode``) or its extend, as the factory itself picks it: the draft runner's own
    ``draft_attention_backend`` if set, else the configured decode or prefill backend (the
    extend uses the decode one under ``speculative_attention_mode="decode"``)."""
    from sglang.srt.runtime_context import attention_backends, get_spec

    own = getattr(factory, "draft_attn_backend", None)
    if own:
        return str(own)
    prefill, dec = attention_backends()
    if not decode:
        decode = get_spec().speculative_attention_mode == "decode"
    return str(dec if decode else prefill)


def _stamp(backend: Any) -> Any:
    backend.prefill_attention_backend_str = NAME
    backend.decode_attention_backend_str = NAME
    return backend


def _wrap_draft_factory() -> None:
    """Route SGLang's draft backend factory to attnpool for the name ``attnpool`` (see the
    module doc; idempotent)."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory as F

    if getattr(F.create_decode_backend, "_attnpool", False):
        return
    decode, extend = F.create_decode_backend, F.create_draft_extend_backend

    def create_decode_backend(self: Any) -> Any:
        if _draft_name(self, True) != NAME:
            return decode(self)
        if self.speculative_num_steps <= 1:  # (SGLang's rule: one step needs no backend)
            return None
        from .spec import AttnpoolDraftSteps

        steps = _stamp(AttnpoolDraftSteps(self.draft_model_runner, self.topk,
                                          self.speculative_num_steps))
        for child in steps.attn_backends:
            _stamp(child)
        return steps

    def create_draft_extend_backend(self: Any) -> Any:
        if _draft_name(self, False) != NAME:
            return extend(self)
        from .spec import spec_backend_for

        return _stamp(spec_backend_for(self.draft_model_runner))

    for new, old in ((create_decode_backend, decode), (create_draft_extend_backend, extend)):
        new.__doc__, new.__wrapped__ = old.__doc__, old  # type: ignore[attr-defined]
        new._attnpool = True  # type: ignore[attr-defined]
        setattr(F, old.__name__, new)


def _lora_backend() -> type:
    from .lora import AttnpoolLoRABackend

    return AttnpoolLoRABackend


def register() -> None:
    """SGLang's plugin hook: accept ``attnpool`` as an attention backend, register its
    factory and route the draft backend factory's ``attnpool`` to it, and register the LoRA
    backend ``attnpool`` (:mod:`.lora`; idempotent; the backend modules are imported only when
    SGLang builds them)."""
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    register_attention_backend(NAME)(_create)
    _wrap_draft_factory()
    from sglang.srt.lora.backend.lora_registry import register_lora_backend

    register_lora_backend(NAME)(_lora_backend)
