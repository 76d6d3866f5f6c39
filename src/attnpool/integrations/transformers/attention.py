"""The attention function a transformers model calls when ``attn_implementation="attnpool"``.

Transformers (>= 5) passes every keyword argument of a model's forward down to its attention
function. The generator passes one, ``attnpool=StepContext(...)``: the view of the current phase
(decode, extend, verify, a draft step, draft extend) and the :class:`attnpool.KVCachePool` the
layers store into. The function then does what an engine's attention backend does:

1. store the step's new K/V at the pool's ``slot_mapping`` (written once per step by the
   generator, before the forward; padded tokens have slot -1 and are skipped) through a
   :class:`attnpool.kv.cache.StepStore`: each token's page and offset are computed once per
   forward, not once per layer,
2. attend over the paged cache through the adapter call every engine integration binds
   (:class:`attnpool.adapters.binding.Run`): SDPA (any device, any float dtype) or flash-attn
   FA3/FA2 on CUDA when importable and the dtype/page size allow.

Queries arrive as transformers lays them out, ``[1, H, T, D]`` with all ``T`` tokens of the step
packed in one sequence (the generator runs the model with batch 1 and per-token
``position_ids``), which is exactly the adapters' packed ``[T, H, D]`` after a transpose (a view).
The output goes back as ``[1, T, H, D]``, the layout transformers' own functions return.

This module imports no model library (plain torch plus the adapters); the package's
``__init__`` imports transformers to register the function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from ...adapters.backends import Backend, Need, select
from ...adapters.binding import DRIVEN
from ...errors import InputError, LayoutError
from ...kv import KVCachePool
from ...views import DecodeView, PagedView

#: The name the function is registered under in transformers' ``AttentionInterface``.
ATTN_NAME = "attnpool"


def resolve_backend(backend: Backend, device: torch.device, dtype: torch.dtype,
                    page_size: int, head_dim: int = 64, head_dim_v: int | None = None,
                    window: bool = False) -> Backend:
    """The backend that runs (never ``AUTO``), chosen through the adapters' registry
    (:func:`attnpool.adapters.backends.select`): ``AUTO`` takes FA3 on CUDA when
    ``flash_attn_interface`` imports, the dtype is fp16/bf16 and FA3 has the head sizes; FA2
    when ``flash_attn`` imports, the dtype fits, K and V heads are the same size and the page
    size is a multiple of 256; SDPA otherwise (always on CPU). A forced one that cannot run
    raises :class:`LayoutError` here, at construction, naming why. ``head_dim_v``: the values'
    head size when it differs from the keys'."""
    need = Need(device=device.type, dtype=dtype, head_size=head_dim, page_size=page_size,
                head_size_v=head_dim if head_dim_v is None else head_dim_v, window=window)
    return select(need, backend, DRIVEN, "the transformers integration")


@dataclass(frozen=True, slots=True)
class StepContext:
    """What one forward's attention layers need, passed as the forward kwarg ``attnpool``.

    Attributes:
        view: the phase view of this forward (a :class:`attnpool.PagedView`, or a chain
            :class:`attnpool.VerifyView` / :class:`attnpool.DraftStepView`).
        kv: the model's KV cache; ``kv.slot_mapping[:T]`` holds this step's new-token slots.
        run: the adapter call bound to ``view`` (:func:`attnpool.adapters.binding.bind`, a
            ``Run``; any callable with its arguments, e.g. a timing wrapper).
        caches: ``(k_cache, v_cache)`` of every layer, ``kv.k_cache(i)`` / ``kv.v_cache(i)``
            looked up once (the cache never moves), not once per layer and step.
        store: ``kv.step_store(T)``: the step's K/V store, its slots resolved once for every
            layer (built after the step's slot mapping is written; a
            :class:`~attnpool.kv.cache.StepStore`, or any callable with its arguments
            ``(layer, k, v)``).
        sliding_window: the pool's window (``PoolConfig.sliding_window``), which every layer
            called with a ``sliding_window`` must match, or None.
        window_layers: the layers whose KV lives in the window cache (``caches`` and ``store``
            already point them there); empty when the model keeps every layer in one cache.
            A layer in it must be called with a ``sliding_window`` and no other may be: its
            pages are addressed by the window table only, which the full part never reads.
        local_layers: the chunked attention layers (they read ``run``'s local view).
    """

    view: object
    kv: KVCachePool
    run: Callable[..., Tensor]
    caches: tuple[tuple[Tensor, Tensor], ...]
    store: Callable[[int, Tensor, Tensor], None]
    sliding_window: int | None = None
    window_layers: frozenset[int] = frozenset()
    local_layers: frozenset[int] = frozenset()


def as_decode(view: PagedView, window: PagedView | None = None) -> DecodeView:
    """A one-query-per-row part (a chain draft step) seen as a :class:`DecodeView`: the same
    tensors, so the SDPA adapter takes its decode path (row ``i`` is query ``i``); ``window``:
    the step's sliding-window part, seen the same way."""
    kw = {f.name: getattr(view, f.name) for f in fields(view)}
    if window is not None:
        kw["window"] = as_decode(window)
    return DecodeView(**kw)


def attnpool_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function (``AttentionInterface``) backed by a pool and a KV cache.

    Args:
        module: the attention layer (its ``layer_idx`` picks the cache layer).
        query: ``[1, H, T, D]``; key, value: ``[1, H_kv, T, D]`` (the step's new tokens).
        attention_mask: ignored: masking comes from the view (lengths, causal), and transformers
            builds none for an implementation without a registered mask function.
        scaling: softmax scale (default ``1 / sqrt(D)``).
        kwargs: must carry ``attnpool`` (a :class:`StepContext`). ``sliding_window`` (the
            window layers': their view's window part), ``softcap`` (Gemma 2's logit
            softcapping) and ``s_aux`` (gpt-oss's per-head sinks) go to the adapter.

    Returns:
        ``(out [1, T, H, D], None)``.
    """
    ctx = kwargs.get("attnpool")
    if not isinstance(ctx, StepContext):
        raise InputError(f"attn_implementation={ATTN_NAME!r} needs the forward kwarg attnpool="
                         f"StepContext(...) (run the model through PagedGenerator), got "
                         f"{type(ctx).__name__}")
    window = kwargs.get("sliding_window")
    if window is not None and window != ctx.sliding_window:
        raise LayoutError(f"layer {getattr(module, 'layer_idx', None)}: sliding_window={window!r}, "
                          f"but the pool's window parts are built for {ctx.sliding_window}")
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int) or not 0 <= layer < len(ctx.caches):
        raise LayoutError(f"attention module {type(module).__name__}: layer_idx must be an int "
                          f"in [0, {len(ctx.caches)}), got {layer!r}")
    if query.dim() != 4 or query.shape[0] != 1 or key.shape[0] != 1:
        raise InputError(f"expected packed queries [1, H, T, D] and keys [1, H_kv, T, D], got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}")
    if ctx.window_layers and (layer in ctx.window_layers) != (window is not None):
        raise LayoutError(f"layer {layer}: called with sliding_window={window!r}, but the model's "
                          f"config puts its KV in the {'window' if window is None else 'full'} "
                          "cache (config.layer_types disagrees with the layer)")
    kv = ctx.kv
    want = (kv.cfg.num_kv_heads, kv.cfg.head_dim)
    if (key.shape[1], key.shape[3]) != want or value.shape[3] != kv.cfg.head_dim_v:
        raise LayoutError(f"layer {layer}: the KV cache holds {want[0]} heads of {want[1]} (K) "
                          f"and {kv.cfg.head_dim_v} (V), the model gave keys "
                          f"{tuple(key.shape)} and values {tuple(value.shape)}")
    q = query[0].transpose(0, 1)  # [T, H, D]: a view of transformers' layout
    ctx.store(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
    k_cache, v_cache = ctx.caches[layer]
    if layer in ctx.local_layers:
        out = ctx.run(q, k_cache, v_cache, scaling, local=True,
                      softcap=kwargs.get("softcap") or 0.0, sinks=kwargs.get("s_aux"))
    else:
        out = ctx.run(q, k_cache, v_cache, scaling, window=window is not None,
                      softcap=kwargs.get("softcap") or 0.0, sinks=kwargs.get("s_aux"))
    return out[None], None
