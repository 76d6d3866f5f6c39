"""What the generator needs to know about a transformers model, checked once, and how it calls it.

A model can be served when its attention is the functional kind transformers dispatches through
``AttentionInterface`` (so ours can replace it) and its KV heads fit one MHA/GQA
:class:`attnpool.KVCachePool`: ``H_kv`` heads of ``head_dim`` for K (``head_dim_v`` for V),
``H`` a multiple of ``H_kv``; full causal or sliding-window attention layers (the pool then keeps
window parts: ``PoolConfig(sliding_window=config.sliding_window)``), with or without logit
softcapping and attention sinks (both reach the attention function as its ``softcap`` /
``s_aux`` kwargs), and chunked attention layers (Llama 4's ``attention_chunk_size``: the
pool's ``pool.local`` phase serves them, see :class:`ModelSpec`). Anything else
(encoder-decoder, other layer types) is refused with :class:`attnpool.LayoutError` before any
buffer is allocated.

**Multi-head latent attention** (DeepSeek V2/V3, a config with ``kv_lora_rank``): the cache
holds what the attention function receives, per-head keys of ``qk_nope_head_dim +
qk_rope_head_dim`` and values of ``v_head_dim``, for all ``H`` query heads. The latent form
(``kv_lora_rank + qk_rope_head_dim`` per token, one head) would be far smaller, but transformers
hands the latents only to its own ``Cache`` object and expands them with ``kv_b_proj`` inside
the layer, before the attention function: serving latents would mean expanding every cached
token of every request in every layer and step (what transformers' own cache does), or
absorbing ``kv_b_proj`` into the queries, which changes the model's arithmetic. The expanded
cache keeps the model's computation exactly as ``generate`` does it (tokens identical).

The forward: batch 1, all tokens of the step packed, ``position_ids`` per token and
``use_cache=False`` (the pool's KV cache is the only cache: no transformers cache is passed or
built, under either of its names, ``past_key_values`` before transformers 5.24 and ``cache``
after), and the :class:`~attnpool.integrations.transformers.attention.StepContext` as the kwarg
``attnpool``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...errors import InputError, LayoutError
from .attention import ATTN_NAME, StepContext


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Sizes of a model's attention, read from its config.

    Attributes:
        num_layers: attention layers (one KV cache layer each).
        num_heads: query heads ``H``. num_kv_heads: ``H_kv`` (``H % H_kv == 0``).
        head_dim: ``D`` of queries and keys (and values, unless ``head_dim_v`` says otherwise).
        vocab_size: logits per token.
        dtype: parameter dtype (the KV cache's). device: where the parameters live.
        sliding_window: ``W`` of the model's sliding-window layers (``config.sliding_window``,
            which transformers passes to those layers' attention as ``sliding_window``), or None
            when every layer attends to the whole sequence.
        variants: the model softcaps its logits or has attention sinks (their adapter paths
            need a masked plan: no prefill shortcut through SDPA's own causal mask).
        sliding_layers: per layer, True for a sliding-window layer (``config.layer_types``; a
            config with a window and no ``layer_types``, Mistral's, slides in every layer). The
            generator keeps those layers' KV in their own cache, whose pages it frees once
            they fall behind every future window.
        head_dim_v: ``D_v`` of values when it differs from ``head_dim`` (MLA: ``v_head_dim``),
            else None.
        chunked_layers: layers with chunked local attention (``layer_types`` entry
            ``"chunked_attention"``): a query at position ``p`` sees keys ``k <= p`` of its own
            chunk, ``k // A == p // A``. transformers passes them nothing that says so (only
            its mask, which a paged kernel cannot take), so the layer index routes them to
            the pool's local view.
        attention_chunk_size: ``A`` (``config.attention_chunk_size``) when some layer is chunked.
        position_limit: a bound every position and packed token index must stay below, or None.
            Llama 4 scales the queries of its no-RoPE layers by a temperature computed from
            ``arange(T)`` of the step's tokens, not from their positions: with one packed
            sequence per step that is right only while both stay below ``floor_scale``, where
            the temperature is exactly 1.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    sliding_window: int | None = None
    variants: bool = False
    sliding_layers: tuple[bool, ...] = ()
    head_dim_v: int | None = None
    chunked_layers: frozenset[int] = frozenset()
    attention_chunk_size: int | None = None
    position_limit: int | None = None

    @property
    def window_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers."""
        return tuple(i for i, s in enumerate(self.sliding_layers) if s)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers."""
        return tuple(i for i in range(self.num_layers)
                     if not (self.sliding_layers and self.sliding_layers[i]))


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    v = getattr(cfg, name, default)
    return default if v is None else v


def model_spec(model: Any, what: str = "model") -> ModelSpec:
    """Read and check ``model``'s attention layout; :class:`LayoutError` if a pool cannot serve it.

    ``what`` names the model in messages ("model", "draft_model").
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise InputError(f"{what} must be a transformers PreTrainedModel, got "
                         f"{type(model).__name__}")
    cfg = model.config
    if _get(cfg, "is_encoder_decoder", False):
        raise LayoutError(f"{what}: encoder-decoder models are not supported (decoder-only only)")
    if not getattr(model, "_supports_attention_backend", False):
        raise LayoutError(f"{what} ({type(model).__name__}) does not dispatch its attention "
                          "through transformers' AttentionInterface, so attnpool cannot serve it")
    heads = _get(cfg, "num_attention_heads")
    hidden = _get(cfg, "hidden_size")
    layers = _get(cfg, "num_hidden_layers")
    vocab = _get(cfg, "vocab_size")
    if not all(isinstance(x, int) and x > 0 for x in (heads, layers, vocab)):
        raise LayoutError(f"{what}: config needs num_attention_heads, num_hidden_layers and "
                          f"vocab_size > 0, got {heads}, {layers}, {vocab}")
    kv_heads = _get(cfg, "num_key_value_heads", heads)
    head_dim = _get(cfg, "head_dim", hidden // heads if isinstance(hidden, int) else None)
    if not isinstance(head_dim, int) or head_dim < 1:
        raise LayoutError(f"{what}: cannot tell the head dim (head_dim={head_dim}, hidden_size="
                          f"{hidden})")
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise LayoutError(f"{what}: query heads must be a multiple of KV heads for a paged "
                          f"MHA/GQA cache; got num_attention_heads={heads}, "
                          f"num_key_value_heads={kv_heads}")
    head_dim_v = None
    if getattr(cfg, "kv_lora_rank", None) is not None:  # MLA: per-head K/V after expansion
        got = [getattr(cfg, n, None) for n in ("qk_nope_head_dim", "qk_rope_head_dim",
                                               "v_head_dim")]
        dims = [d for d in got if isinstance(d, int) and d >= 0]
        if len(dims) != 3 or not dims[2]:
            raise LayoutError(f"{what}: an MLA config needs qk_nope_head_dim, qk_rope_head_dim "
                              f"and v_head_dim, got {got}")
        kv_heads, head_dim = heads, dims[0] + dims[1]
        head_dim_v = None if dims[2] == head_dim else dims[2]
    elif _get(cfg, "v_head_dim", head_dim) != head_dim:
        head_dim_v = _get(cfg, "v_head_dim")
    window = _get(cfg, "sliding_window")
    layer_types = list(_get(cfg, "layer_types", [
        "full_attention" if window is None else "sliding_attention"] * layers))
    types = set(layer_types)
    if types - {"full_attention", "sliding_attention", "chunked_attention"}:
        raise LayoutError(f"{what}: full, sliding-window and chunked attention layers are "
                          f"served, config has layer_types {sorted(types)}")
    chunk = _get(cfg, "attention_chunk_size") if "chunked_attention" in types else None
    if "chunked_attention" in types and (not isinstance(chunk, int) or chunk < 1):
        raise LayoutError(f"{what}: chunked_attention layers need attention_chunk_size >= 1, got "
                          f"{chunk!r}")
    limit = None
    if _get(cfg, "attn_temperature_tuning", False) and not all(
            _get(cfg, "no_rope_layers", [1] * layers)):
        limit = _get(cfg, "floor_scale")
        if not isinstance(limit, int) or limit < 1:
            raise LayoutError(f"{what}: attn_temperature_tuning needs an int floor_scale >= 1, "
                              f"got {limit!r}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise LayoutError(f"{what}: sliding_window must be an int >= 1, got {window!r}")
    if "sliding_attention" in types and window is None:
        raise LayoutError(f"{what}: sliding_attention layers need config.sliding_window, got None")
    p = next(model.parameters(), None)
    if p is None:
        raise InputError(f"{what} has no parameters")
    if not p.dtype.is_floating_point:
        raise LayoutError(f"{what}: parameters must be floating point, got {p.dtype}")
    variants = (_get(cfg, "attn_logit_softcapping") is not None
                or any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter)
                       for m in model.modules()))
    if len(layer_types) != layers:
        raise LayoutError(f"{what}: config.layer_types has {len(layer_types)} entries for "
                          f"{layers} layers")
    sliding = tuple(t == "sliding_attention" for t in layer_types) if window else ()
    chunked = frozenset(i for i, t in enumerate(layer_types) if t == "chunked_attention")
    return ModelSpec(layers, heads, kv_heads, head_dim, vocab, p.dtype, p.device, window,
                     variants, sliding, head_dim_v, chunked, chunk, limit)


@contextlib.contextmanager
def attnpool_attention_on(models: Sequence[Any]) -> Iterator[None]:
    """Switch each model's attention to ``"attnpool"`` for the duration, then restore it, so the
    caller's model still runs its own implementation (``model.generate``) afterwards."""
    done: list[tuple[Any, Any]] = []
    try:
        for m in models:
            if any(m is d for d, _ in done):
                continue
            prev = m.config._attn_implementation
            if prev != ATTN_NAME:
                m.set_attn_implementation(ATTN_NAME)
            done.append((m, prev))
        yield
    finally:
        for m, prev in reversed(done):
            if prev is not None and prev != ATTN_NAME:
                m.set_attn_implementation(prev)


def forward_logits(model: Any, ids: Tensor, positions: Tensor, ctx: StepContext,
                   keep: Tensor | None = None) -> Tensor:
    """Logits ``[T or len(keep), V]`` of one packed step.

    Args:
        ids: ``[T]`` token ids; positions: ``[T]`` their absolute positions (any int dtype).
        keep: optional ``[k]`` int64 indices of the tokens whose logits are needed (the last
            token of each prefilled request): the LM head runs on those rows only.
    """
    out = model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                attnpool=ctx, logits_to_keep=0 if keep is None else keep)
    logits: Tensor = out.logits[0]
    return logits


@dataclass(frozen=True, slots=True)
class GraphBlocker:
    """Why decode steps of a model should not replay from CUDA graphs.

    Attributes:
        reason: "" when nothing stands in the way; else what ``cuda_graphs="auto"`` avoids.
        refuse: ``cuda_graphs=True`` is refused (a capture cannot succeed), not only avoided.
    """

    reason: str
    refuse: bool


def graph_blocker(model: Any, chunk: int | None) -> GraphBlocker:
    """What keeps ``model``'s decode steps out of CUDA graphs (see :class:`GraphBlocker`).

    * Chunked attention layers read ``pool.local``, refilled per forward outside the decode
      graphs: refused.
    * Mixture-of-experts layers (a submodule named ``experts``). With transformers' ``eager``
      experts (or none named) the routing has data-dependent shapes, which a capture refuses
      (``cudaErrorStreamCaptureInvalidated`` for Qwen3-MoE): refused. Other implementations
      (``grouped_mm``) are avoided by ``"auto"`` too, since whether they capture depends on the
      GPU and the transformers version; ``cuda_graphs=True`` asks for them anyway.
    """
    if chunk is not None:
        return GraphBlocker("a model with chunked attention layers runs eagerly (its pool.local "
                            "view is refilled per forward, outside the decode graphs)", True)
    if not any(name.rsplit(".", 1)[-1] == "experts" for name, _ in model.named_modules()):
        return GraphBlocker("", False)
    impl = getattr(model.config, "_experts_implementation", None)
    if impl in (None, "eager"):
        return GraphBlocker("a mixture-of-experts model with transformers' eager experts runs "
                            "eagerly (they route tokens with data-dependent shapes, which a CUDA "
                            "graph cannot capture)", True)
    return GraphBlocker(f"a mixture-of-experts model (experts implementation {impl!r}) runs "
                        "eagerly unless cuda_graphs=True asks for graphs", False)
