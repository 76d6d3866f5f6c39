"""What the serving-engine integrations (vLLM's, SGLang's) share: a pool's sizes, the layers'
shared facts and the filler skeleton.

Both engines hand attnpool one batch per step and read the refilled view in every attention
layer of the step. Each engine's package reads its own config into its own record (vLLM's
:class:`~attnpool.integrations.vllm.step.EngineSizes`, SGLang's
:class:`~attnpool.integrations.sglang.step.RunnerSizes`: the engine's names for the values,
and where the engine keeps them), which it turns into the :class:`PoolSizes` here, in the
pool's names; :func:`pool_config` makes the one :class:`attnpool.PoolConfig` both engines
want from them, and :class:`Filler` is what a per-step filler of either engine holds: the pool,
FlashInfer's plans when FlashInfer attends, and the layers' heads and dtype each step's adapter
call is bound with (:meth:`Filler.bind`). :func:`layer_facts` is what FlashInfer's one plan per
step fixes for every layer of a group, from the layers as the engine has them.

Plain torch: nothing here imports an engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..adapters.backends import Backend
from ..adapters.binding import Run, bind
from ..adapters.flashinfer_step import LayerFacts, plans_for
from ..config import Layout, PoolConfig
from ..pool import BufferPool
from ..views import DecodeView, ExtendView


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """An engine's pool sizes in the pool's words (each engine's record says where they come
    from in its config).

    Fields:
        max_bs: requests in one batch.
        max_context_len: the longest sequence a batch can carry.
        max_extend_tokens: new tokens one extend batch packs (``T``).
        page_size: tokens per KV page (block).
        sliding_window: ``W`` keys (the query's own included) of the sliding-window layers, or
            None (no window part).
        num_pages: pages of the engine's KV cache when known: the page-id bound of the pool's
            checks.
        device: the engine's device.
        num_draft_tokens, topk, spec_steps: speculative decoding's sizes (``N``, ``K``, ``S``:
            the verify, draft and draft-extend phases), 0 / 1 / 0 without it.
        max_encoder_len: the longest encoder input of an encoder-decoder model (the encoder
            phase), 0 without one.
    """

    max_bs: int
    max_context_len: int
    max_extend_tokens: int
    page_size: int
    sliding_window: int | None
    num_pages: int | None
    device: torch.device
    num_draft_tokens: int = 0
    topk: int = 1
    spec_steps: int = 0
    max_encoder_len: int = 0


def pool_config(s: PoolSizes, layout: Layout = Layout.FLASH_ATTN) -> PoolConfig:
    """An engine's :class:`attnpool.PoolConfig`: page tables in ``layout`` (flash-attn's, the
    one SDPA and flash-attn read; FlashInfer's CSR lists when it attends), the pad page 0 (the
    page both engines keep for padding: vLLM's null block, SGLang's padding slot), decode and
    extend phases, and the speculative and encoder phases when ``s`` has their sizes."""
    return PoolConfig(max_bs=s.max_bs, max_context_len=s.max_context_len,
                      page_size=s.page_size, device=s.device, layout=layout,
                      max_extend_tokens=s.max_extend_tokens, sliding_window=s.sliding_window,
                      num_pages=s.num_pages, pad_page=0, num_draft_tokens=s.num_draft_tokens,
                      topk=s.topk, spec_steps=s.spec_steps,
                      max_encoder_len=s.max_encoder_len)


def layer_facts(layers: Iterable[tuple[int, int, int, float, float]],
                dtype: torch.dtype) -> LayerFacts | None:
    """The one :class:`~attnpool.adapters.flashinfer_step.LayerFacts` a group's layers share,
    from each layer's ``(num_heads, num_kv_heads, head_dim, scale, softcap)`` (softcap 0:
    none); None when the layers differ in any of them (no one FlashInfer plan per step serves
    them)."""
    shared = {(h, kv, d, float(scale), float(cap)) for h, kv, d, scale, cap in layers}
    if len(shared) != 1:
        return None
    heads, kv_heads, head_dim, scale, softcap = shared.pop()
    return LayerFacts(heads, kv_heads, head_dim, dtype, scale, softcap)


class Filler:
    """What a per-step filler of either engine holds (vLLM's
    :class:`~attnpool.integrations.vllm.step.StepFiller`, SGLang's
    :class:`~attnpool.integrations.sglang.step.BatchFiller` build on it).

    Args:
        sizes: the pool's sizes.
        backend: the adapter that attends (resolved: SDPA on a CPU).
        num_heads, num_kv_heads: query and KV heads of a layer on this rank.
        dtype: the queries' dtype (SDPA's additive masks are built for it once per step).
        facts: what every layer shares, for FlashInfer's plans (required when ``backend`` is
            FlashInfer: the pool then keeps CSR page lists, and each step's parts are planned
            when its adapter call is bound).

    Raises:
        LayoutError: FlashInfer without ``facts``.
    """

    def __init__(self, sizes: PoolSizes, backend: Backend, num_heads: int, num_kv_heads: int,
                 dtype: torch.dtype, facts: LayerFacts | None = None) -> None:
        #: FlashInfer's wrappers, planned per step (None for the other adapters)
        self.plans, layout = plans_for(backend, facts, sizes.device)
        self.pool = BufferPool(pool_config(sizes, layout))
        self.backend, self.dtype = backend, dtype
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        #: the pool is on a CPU: the engine's host lengths are passed as the pool's
        self.host = sizes.device.type == "cpu"

    def bind(self, view: DecodeView | ExtendView, num_tokens: int, *,
             prefix_free: bool = False) -> Run:
        """The adapter call every layer of the step makes over ``view`` (``num_tokens`` packed
        queries; ``prefix_free``: an extend step with nothing cached, SDPA's causal
        shortcut); FlashInfer's parts are planned here."""
        return bind(self.backend, view, num_tokens, self.num_heads, self.num_kv_heads,
                    self.dtype, prefix_free=prefix_free, plans=self.plans)
