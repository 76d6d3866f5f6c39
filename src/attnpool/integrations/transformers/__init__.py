"""Hugging Face transformers (>= 5) models generating through attnpool (extra ``hf``).

Importing this module registers :func:`attnpool_attention` in transformers' ``AttentionInterface``
under the name ``"attnpool"``; :class:`PagedGenerator` switches a model to it while generating::

    from transformers import AutoModelForCausalLM
    from attnpool.integrations.transformers import PagedGenerator

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).eval()
    gen = PagedGenerator(model, max_bs=8, max_context_len=2048, page_size=16)
    new_tokens = gen.generate(prompts, max_new_tokens=64)   # list[list[int]], greedy
    print(gen.stats.tokens_per_s, gen.stats.metadata_us_per_step)

Speculative decoding: ``PagedGenerator(model, ..., draft_model=small, num_draft_tokens=4)``; the
output is the target's greedy output, ``gen.stats.acceptance_rate`` says how much the draft saved.

The modules: :mod:`.attention` (the attention function, :class:`StepContext`), :mod:`.generator`
(:class:`PagedGenerator`), :mod:`.model` (a model's checked layout), :mod:`.runner` (one model's
pool, cache and graphs), :mod:`.sizing` (the pool sized from the model), :mod:`.spec` (speculative
rounds), :mod:`.state` (requests, tables, :class:`GenerationStats`), :mod:`.paging` and
:mod:`.window_paging` (the host-side page allocators of the full and the sliding-window layers'
caches), :mod:`.tiny` (tiny random models for the demo and the benchmark).
"""

from __future__ import annotations

import transformers as _transformers

from ...adapters.backends import Backend
from .attention import ATTN_NAME, StepContext, attnpool_attention
from .generator import PagedGenerator
from .model import ModelSpec, attnpool_attention_on, model_spec
from .state import GenerationStats


def register() -> None:
    """Register :func:`attnpool_attention` as ``attn_implementation="attnpool"`` (idempotent;
    done on import)."""
    _transformers.AttentionInterface.register(ATTN_NAME, attnpool_attention)


register()

__all__ = [
    "ATTN_NAME",
    "Backend",
    "GenerationStats",
    "ModelSpec",
    "PagedGenerator",
    "StepContext",
    "attnpool_attention",
    "attnpool_attention_on",
    "model_spec",
    "register",
]
