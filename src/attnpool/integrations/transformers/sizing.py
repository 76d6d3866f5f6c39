"""What a :class:`~attnpool.integrations.transformers.PagedGenerator` is built with: its
arguments checked against the models, and every size derived from them, before anything is
allocated.

All of it is decided here, once, so that a bad combination (a draft model with another
vocabulary or window, ``cuda_graphs=True`` for a model no graph can hold, positions past a
model's ``floor_scale``) is refused before a pool or KV cache exists. The sizes:

* **context**: ``max_context_len`` plus the ``N + 1`` positions a verify looks ahead with
  ``N`` draft tokens (the pool's ``max_context_len``);
* **max_prefill_tokens**: by default ``max_bs`` contexts capped at 8192 tokens, but never less
  than one context: a whole batch of short prompts fits one prefill, and so does any prompt;
* **pages**: the full-attention cache's pages (default: ``max_bs`` whole contexts plus the pad
  page; 2 when no model has a full-attention layer);
* **window pages** (models with sliding-window layers): every running request's steady window
  span plus one prefill batch of prompts, never more than the full cache would take.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch

from ...config import PoolConfig, ceil_div, is_int
from ...errors import CapacityError, InputError, LayoutError
from .model import ModelSpec, graph_blocker, model_spec
from .window_paging import WindowPageAllocator


def check_int(name: str, v: object, lo: int) -> int:
    """``v`` when it is an int (not a bool) ``>= lo``; else an :class:`InputError` naming it."""
    if not is_int(v) or v < lo:
        raise InputError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def check_prompts(prompts: object, vocab: int, max_new: int, max_context_len: int,
                  max_prefill_tokens: int) -> list[list[int]]:
    """Each prompt as a list of ints, checked: non-empty, ids in ``[0, vocab)``, room for
    ``max_new`` tokens in ``max_context_len``, and for the prompt plus its first new token in
    one prefill (``max_prefill_tokens``).

    A token id is anything with an exact integer value (``int``, a NumPy integer, a 0-d integer
    tensor: ``operator.index`` takes it); a float or a bool is refused, never truncated to
    another token.

    Raises:
        InputError: not a list of non-empty token-id lists, or an id outside the vocabulary.
        CapacityError: a prompt too long for the context or for one prefill.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InputError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        toks = _ids(p) if isinstance(p, Sequence) and not isinstance(p, str) else None
        if toks is None or not toks:
            raise InputError(f"prompt {i} must be a non-empty list of integer token ids, got {p!r}")
        if min(toks) < 0 or max(toks) >= vocab:
            raise InputError(f"prompt {i}: token ids must be in [0, {vocab}), got "
                             f"{min(toks)}..{max(toks)}")
        if len(toks) + max_new > max_context_len:
            raise CapacityError(f"prompt {i}: {len(toks)} tokens + max_new_tokens={max_new} "
                                f"must be <= max_context_len={max_context_len}")
        if len(toks) + 1 > max_prefill_tokens:
            raise CapacityError(f"prompt {i}: {len(toks)} tokens (+1) must be <= "
                                f"max_prefill_tokens={max_prefill_tokens}")
        out.append(toks)
    return out


def _ids(p: Sequence[Any]) -> list[int] | None:
    """``p``'s token ids as ints, or None when one is not an integer (a float, a bool, text)."""
    if any(isinstance(t, bool) for t in p):
        return None
    try:
        return [operator.index(t) for t in p]
    except TypeError:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class Sizing:
    """A generator's checked layout.

    Attributes:
        spec, draft: the target's and the draft's :class:`ModelSpec` (draft None without one).
        num_draft_tokens: N (0 without a draft).
        chunk: the models' ``attention_chunk_size`` (one for both), or None.
        graphs: whether decode steps replay CUDA graphs.
        context: the pool's ``max_context_len`` (the requests' plus the verify lookahead).
        max_prefill_tokens: most prompt tokens in one prefill forward.
        max_tokens: most tokens one forward stores (a prefill, or a verify of every row).
        has_full: some model has full-attention layers (else the full cache holds nothing).
        pages, window_pages: pages of the full and the sliding-window cache, pad page included.
        window_alloc: the window pages' allocator (models with window layers), or None.
        pool: the :class:`PoolConfig` of the generator's one pool.
    """

    spec: ModelSpec
    draft: ModelSpec | None
    num_draft_tokens: int
    chunk: int | None
    graphs: bool
    context: int
    max_prefill_tokens: int
    max_tokens: int
    has_full: bool
    pages: int
    window_pages: int
    window_alloc: WindowPageAllocator | None
    pool: PoolConfig


def size(model: Any, *, max_bs: int, max_context_len: int, page_size: int,
         device: str | torch.device, draft_model: Any, num_draft_tokens: int,
         cuda_graphs: bool | str, num_pages: int | None, max_prefill_tokens: int | None,
         num_window_pages: int | None) -> Sizing:
    """Check a generator's arguments (as :class:`PagedGenerator` documents them) and size it.

    Raises:
        InputError: a bad value, a device other than the model's, a draft without draft
            tokens (or the reverse), ``cuda_graphs=True`` off CUDA.
        LayoutError: models that one pool cannot serve together (windows or chunk sizes that
            differ), ``cuda_graphs=True`` for a model no graph can hold, positions reaching a
            model's ``floor_scale``.
    """
    spec = model_spec(model)
    check_int("max_bs", max_bs, 1)
    check_int("max_context_len", max_context_len, 2)
    n = check_int("num_draft_tokens", num_draft_tokens, 0)
    if (draft_model is None) != (n == 0):
        raise InputError("speculative decoding needs both draft_model and num_draft_tokens "
                         f">= 1; got draft_model={type(draft_model).__name__}, "
                         f"num_draft_tokens={n}")
    dev = spec.device if str(device) == "auto" else torch.device(device)
    if dev.type != spec.device.type or (dev.index is not None and dev.index != spec.device.index):
        raise InputError(f"device must be the model's device ({spec.device}), got {dev}")
    dspec = None
    if draft_model is not None:
        dspec = model_spec(draft_model, "draft_model")
        if dspec.vocab_size != spec.vocab_size or dspec.device != spec.device:
            raise InputError(f"draft_model must share the model's vocabulary and device: "
                             f"expected {spec.vocab_size} tokens on {spec.device}, got "
                             f"{dspec.vocab_size} on {dspec.device}")
        if None not in (dspec.sliding_window, spec.sliding_window) and \
                dspec.sliding_window != spec.sliding_window:
            raise LayoutError(f"draft_model's sliding_window ({dspec.sliding_window}) must be "
                              f"the model's ({spec.sliding_window}) or None: one pool's "
                              "window parts serve both")
    if cuda_graphs not in ("auto", True, False):
        raise InputError(f"cuda_graphs must be 'auto', True or False, got {cuda_graphs!r}")
    chunks = {s.attention_chunk_size for s in (spec, dspec)
              if s is not None and s.attention_chunk_size is not None}
    if len(chunks) > 1:
        raise LayoutError(f"draft_model's attention_chunk_size must be the model's: one "
                          f"pool's local phase serves both, got {sorted(chunks)}")
    chunk = next(iter(chunks), None)
    blocker = graph_blocker(model, chunk)
    if blocker.refuse and cuda_graphs is True:
        raise LayoutError(f"cuda_graphs=True: {blocker.reason}")
    graphs = spec.device.type == "cuda" and not blocker.reason if cuda_graphs == "auto" \
        else bool(cuda_graphs)
    if graphs and spec.device.type != "cuda":
        raise InputError(f"cuda_graphs=True needs a model on CUDA, got {spec.device}")
    # Verify looks N + 1 positions past the committed tokens: the pool's context has room.
    context = max_context_len + (n + 1 if n else 0)
    default_t = max(context, min(max_bs * context, 8192))
    prefill = check_int("max_prefill_tokens", default_t if max_prefill_tokens is None
                        else max_prefill_tokens, 1)
    specs = [spec] if dspec is None else [spec, dspec]
    limits = [s.position_limit for s in specs if s.position_limit is not None]
    if limits and max(context, prefill) >= min(limits):
        raise LayoutError(
            f"positions and packed tokens must stay below floor_scale={min(limits)} (the "
            f"model's attn_temperature_tuning reads token indices of the packed step as "
            f"positions); got max_context_len + lookahead {context} and "
            f"max_prefill_tokens {prefill}")
    has_full = any(s.full_layers for s in specs)
    window = spec.sliding_window or (dspec.sliding_window if dspec is not None else None)
    full_default = max_bs * ceil_div(context, max(1, page_size)) + 1
    pages = check_int("num_pages", num_pages if num_pages is not None else
                      full_default if has_full else 2, 2)
    window_alloc, wpages = None, 2
    if any(s.window_layers for s in specs):
        assert window is not None  # window layers exist only with a window
        probe = WindowPageAllocator(2, page_size, window, n + 2 if n else 1)
        steady = max_bs * (probe.span + 1) + probe.pages_for(prefill) + 1
        wpages = check_int("num_window_pages", num_window_pages if num_window_pages is not None
                           else min(full_default, steady), 2)
        window_alloc = WindowPageAllocator(wpages, page_size, window, probe.lookahead)
    cfg = PoolConfig(max_bs=max_bs, max_context_len=context, page_size=page_size,
                     device=spec.device, num_draft_tokens=n + 1 if n else 0,
                     spec_steps=max(n - 1, 0), max_extend_tokens=prefill,
                     num_pages=max(pages, wpages), sliding_window=window,
                     attention_chunk_size=chunk)
    return Sizing(spec, dspec, n, chunk, graphs, context, prefill,
                  max(prefill, max_bs * (n + 1)), has_full, pages, wpages, window_alloc, cfg)
