"""SGLang's attention backend ``attnpool``: its base, decode and extend batches (importing this
module imports SGLang).

:class:`AttnpoolAttnBackend` owns the model runner's :class:`attnpool.BufferPool`
(:class:`.step.BatchFiller`), refills it from every ``ForwardBatch`` in
:meth:`~AttnpoolAttnBackend.init_forward_metadata` and attends each layer through attnpool's
adapters: K/V go into SGLang's own KV pool (``set_kv_buffer`` at ``out_cache_loc``), and the
adapter reads that pool's buffers in place as pages (:func:`.step.kv_pages`). On a CPU that is
PyTorch SDPA, one call per layer for the whole batch (SGLang's ``torch_native`` backend loops
over the requests in Python); on CUDA the fastest installed adapter that serves the model
(FlashInfer when every layer shares its scale and soft cap and none has sinks, planned once per
forward: :mod:`attnpool.adapters.flashinfer_step`; then flash-attn FA3, FA4, FA2, then SDPA:
:func:`attnpool.adapters.binding.choose`; the choice is logged, and ``ATTNPOOL_SGLANG_KERNEL``
forces one).

Models this base does not serve have their own subclass, built by
:func:`.factory.backend_for` (SGLang's factory): speculative decoding in :mod:`.spec`,
encoder-decoder models (cross attention) in :mod:`.cross`. The base knows none of them (they
import it, never the reverse); it refuses what a runner needs of one unless the subclass
declares it serves it (:class:`Extra`).

What the backend does not serve is refused when SGLang builds it, at engine start, with the
reason and the setting to change (:func:`refusals`): cross attention with speculative
decoding, encoder-only and bidirectional layers, multi-head latent attention, KV caches of
another dtype than the model's (fp8), hybrid sliding-window KV pools, more than one sliding
window, query/value head sizes that differ (and what :mod:`.spec` and :mod:`.cross` refuse
of their own).

CUDA graphs (decode): :meth:`~AttnpoolAttnBackend.init_forward_metadata_out_graph` binds the
layers' call to ``pool.decode.view(bs)`` before a capture; the refill of that view (no host
read; padded rows carry the fill value
:meth:`~AttnpoolAttnBackend.get_cuda_graph_seq_len_fill_value` declares) is the in-graph part,
the capturable update recorded with the graph on the fused path, else an update before each
replay. Only with flash-attn or FlashInfer attending: SDPA plans each batch on the host, so
with SDPA ``init_cuda_graph_state`` refuses (a CPU engine captures none). FlashInfer plans the
captured size's graph wrapper after each refill, on the host: its refill runs before each
replay, never recorded in the graph.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from ...adapters.backends import Backend, Need
from ...adapters.binding import Run, choose
from ...adapters.flashinfer_step import LayerFacts
from ...errors import CapacityError, LayoutError
from ..engine import layer_facts
from .served import REPORT, Served
from .step import KERNEL, NAME, BatchFiller, RunnerSizes, kv_pages

__all__ = ["REPORT", "AttnpoolAttnBackend", "Extra", "Served", "kept", "pick", "refusals",
           "speculative"]

logger = logging.getLogger(__name__)


class Extra(Enum):
    """What a subclass of :class:`AttnpoolAttnBackend` serves beyond the base (so the base's
    :func:`refusals` does not refuse it)."""

    #: speculative decoding (:class:`.spec.AttnpoolSpecBackend`)
    SPEC = "speculative decoding"
    #: cross attention of encoder-decoder models (:class:`.cross.AttnpoolCrossBackend`)
    CROSS = "cross attention"


def speculative(model_runner: Any) -> bool:
    """Whether the runner runs a speculative algorithm (SGLang's ``spec_algorithm``)."""
    algo = getattr(model_runner, "spec_algorithm", None)
    return algo is not None and not algo.is_none()


def _layers(model_runner: Any) -> list[RadixAttention]:
    return [m for m in model_runner.model.modules() if isinstance(m, RadixAttention)]


def _has_sinks(model_runner: Any) -> bool:
    """Whether the model's attention passes sink logits (``sinks=`` to its layers, as gpt-oss
    does): a module holding a ``sinks`` tensor."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor)
               for m in model_runner.model.modules())


def _need(model_runner: Any, layers: list[RadixAttention]) -> Need:
    """What the runner's layers ask of the adapter (SGLang's KV buffers read as NHD pages)."""
    first = layers[0]
    return Need(device=torch.device(model_runner.device).type, dtype=model_runner.dtype,
                head_size=first.qk_head_dim, head_size_v=first.v_head_dim,
                page_size=int(model_runner.page_size), varying_queries=True,
                window=any(layer.sliding_window_size > -1 for layer in layers),
                softcap=any(layer.logit_cap for layer in layers),
                sinks=_has_sinks(model_runner))


def pick(model_runner: Any, layers: list[RadixAttention]) -> Backend:
    """The adapter that attends (see the module doc).

    Raises:
        LayoutError: :data:`.step.KERNEL` names no adapter that runs here, or none can.
    """
    need = _need(model_runner, layers)
    # FlashInfer's per-step plans cover decode and extend views only: not offered with
    # speculative decoding (verify and draft views are tree or multi-step views)
    return choose(need, os.environ.get(KERNEL, "").strip().lower(),
                  f"attention_backend={NAME!r}", KERNEL,
                  planned=not need.sinks and _facts(model_runner, layers) is not None
                  and not speculative(model_runner))


def _facts(model_runner: Any, layers: list[RadixAttention]) -> LayerFacts | None:
    """What FlashInfer's one plan per forward fixes for every layer, as the layers have it;
    None when they differ (FlashInfer is then not offered)."""
    return layer_facts(((layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim,
                         layer.scaling, layer.logit_cap or 0.0) for layer in layers),
                       model_runner.dtype)


def refusals(model_runner: Any, layers: list[RadixAttention],
             served: frozenset[Extra] = frozenset()) -> list[str]:
    """What in this runner the base backend cannot serve, each with the setting to change
    (empty: everything is served); ``served``: what the subclass asking serves besides (its
    own refusals come on top: :meth:`AttnpoolAttnBackend.refusals`)."""
    out: list[str] = []
    if not layers:
        out.append("the model has no RadixAttention layer")
    if getattr(model_runner, "use_mla_backend", False):
        out.append("multi-head latent attention (MLA) models")
    if Extra.CROSS not in served and any(layer.is_cross_attention for layer in layers):
        out.append("cross attention (encoder-decoder models; attnpool serves them without "
                   "speculative decoding: attnpool.integrations.sglang.cross)")
    kinds = {layer.attn_type for layer in layers} - {AttentionType.DECODER}
    if kinds:
        out.append(f"attention types other than causal decoder attention "
                   f"({', '.join(sorted(k.value for k in kinds))}: encoder-only and "
                   "bidirectional models)")
    if any(layer.qk_head_dim != layer.v_head_dim for layer in layers):
        out.append("layers whose value head size differs from the query's")
    if getattr(model_runner, "attention_chunk_size", None) and any(
            getattr(layer, "use_irope", False) for layer in layers):
        out.append("chunked local attention (attention_chunk_size: Llama 4's local layers)")
    if any(layer.logit_cap and getattr(layer, "logit_capping_method", "tanh") != "tanh"
           for layer in layers):
        out.append("logit capping other than tanh")
    if any(getattr(layer, "xai_temperature_len", -1) > 0 for layer in layers):
        out.append("attention temperature scaling (xai_temperature_len)")
    args = getattr(model_runner, "server_args", None)
    if getattr(args, "dllm_config", None) or getattr(args, "enable_pdmux", False):
        out.append("diffusion-LLM or PD-multiplexing batches (dllm_config, enable_pdmux)")
    windows = {layer.sliding_window_size for layer in layers if layer.sliding_window_size > -1}
    if len(windows) > 1:
        out.append(f"more than one sliding window ({sorted(windows)})")
    kv = model_runner.token_to_kv_pool
    if type(kv) is not MHATokenToKVPool:
        out.append(f"the KV pool {type(kv).__name__} (attnpool reads MHATokenToKVPool's "
                   "buffers: a hybrid sliding-window or quantized pool is not served)")
    elif layers and kv.get_key_buffer(layers[0].layer_id).dtype != model_runner.dtype:
        out.append(f"a KV cache of {kv.get_key_buffer(layers[0].layer_id).dtype} with a "
                   f"{model_runner.dtype} model (kv_cache_dtype)")
    if Extra.SPEC not in served and speculative(model_runner):
        out.append("speculative decoding in this backend class (attnpool's speculative "
                   "backend, attnpool.integrations.sglang.spec.AttnpoolSpecBackend, serves it: "
                   "attnpool.integrations.sglang.factory.backend_for builds it)")
    if layers and not out:
        try:
            pick(model_runner, layers)
        except LayoutError as e:
            out.append(f"these layers with the adapters installed ({e})")
    return out


def sizes(model_runner: Any, layers: list[RadixAttention]) -> RunnerSizes:
    """The pool's sizes from the runner (no speculative sizes: :mod:`.spec` adds them)."""
    table = model_runner.req_to_token_pool.req_to_token
    kv = model_runner.token_to_kv_pool
    page, args = int(model_runner.page_size), model_runner.server_args
    slots = int(kv.get_key_buffer(layers[0].layer_id).shape[0])
    requests, width = int(table.shape[0]), int(table.shape[1])
    # One extend batch: the prefill budget or one whole prompt, plus a mixed chunk's decode
    # rows; never more new tokens than the KV pool has slots.
    budget = max(int(getattr(args, "chunked_prefill_size", None) or 0),
                 int(getattr(args, "max_prefill_tokens", None) or 0), width)
    windows = {layer.sliding_window_size for layer in layers if layer.sliding_window_size > -1}
    return RunnerSizes(max_requests=requests, max_context_len=width,
                       max_extend_tokens=min(budget + requests, slots),
                       page_size=page,
                       sliding_window=next(iter(windows)) + 1 if windows else None,
                       num_pages=slots // page, device=torch.device(model_runner.device))


class AttnpoolAttnBackend(AttentionBackend):
    """SGLang's ``attnpool`` attention backend (see the module doc): decode batches through
    ``pool.decode``, extend batches (prefill, chunks, mixed chunks) through ``pool.extend``.

    Subclasses serve more (:class:`Extra`): they declare it in :attr:`SERVES`, add their own
    refusals (:meth:`refusals`) and pool sizes (:meth:`runner_sizes`) and take the batches
    they serve in :meth:`refill`, handing the rest to this class's."""

    #: what this class serves beyond decode and extend batches of a decoder-only model
    SERVES: frozenset[Extra] = frozenset()

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        layers = self.served_layers(model_runner)
        reasons = self.refusals(model_runner, layers)
        if reasons:
            msg = (f"attention_backend={NAME!r} does not serve: " + "; ".join(reasons)
                   + ". Start SGLang with another attention_backend (torch_native on a CPU).")
            logger.error(msg)
            raise LayoutError(msg)
        first = layers[0]
        self.device = model_runner.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        masked = any(layer.logit_cap for layer in layers) or _has_sinks(model_runner)
        backend = pick(model_runner, layers)
        facts = _facts(model_runner, layers) if backend is Backend.FLASHINFER else None
        self.filler = BatchFiller(self.runner_sizes(model_runner, layers), backend,
                                  first.tp_q_head_num, first.tp_k_head_num, model_runner.dtype,
                                  masked=masked, facts=facts)
        logger.info("attnpool serves attention of %d layers with %s: one pool of %d bytes",
                    len(layers), backend.name, self.filler.pool.nbytes)
        self.page_size = self.filler.sizes.page_size
        self.run: Run | None = None
        report = os.environ.get(REPORT)
        self.served = None if not report else Served.of(report, self.filler.pool.nbytes)

    @classmethod
    def served_layers(cls, model_runner: Any) -> list[RadixAttention]:
        """The layers whose attention reaches this backend (every ``RadixAttention``; a
        subclass may leave out layers its models attend to by themselves)."""
        return _layers(model_runner)

    @classmethod
    def refusals(cls, model_runner: Any, layers: list[RadixAttention]) -> list[str]:
        """What of this runner the class cannot serve (module :func:`refusals` with what the
        class serves; a subclass adds its own)."""
        return refusals(model_runner, layers, cls.SERVES)

    @classmethod
    def runner_sizes(cls, model_runner: Any, layers: list[RadixAttention]) -> RunnerSizes:
        """The pool's sizes (module :func:`sizes`; a subclass adds its own)."""
        return sizes(model_runner, layers)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Refill the pool from ``forward_batch`` (SGLang calls this before every forward) and
        bind the adapter call its layers make (:meth:`refill`); an idle batch binds none."""
        if forward_batch.forward_mode.is_idle():
            self.run = None
            return
        self.run = self.refill(forward_batch)

    def refill(self, forward_batch: ForwardBatch) -> Run:
        """A decode batch through ``pool.decode``, an extend batch (prefill, mixed) through
        ``pool.extend``; any other mode is refused (a subclass takes its own first)."""
        fb, mode = forward_batch, forward_batch.forward_mode
        if not (mode.is_decode() or mode.is_extend_or_draft_extend_or_mixed()) \
                or mode.is_split_prefill():
            raise LayoutError(f"attention_backend={NAME!r} serves decode and extend batches, "
                              f"got {mode.name}")
        decode = mode.is_decode()
        lens = None if decode else fb.extend_seq_lens_cpu
        # the real new tokens (a batch SGLang pads for data or attention parallelism counts
        # its padding in extend_num_tokens, and narrows its layers' inputs to the real ones)
        tokens = fb.batch_size if decode else (
            sum(lens) if lens is not None else int(fb.extend_num_tokens))
        run = self.filler.fill(
            decode=decode, req_pool_indices=fb.req_pool_indices, req_to_token=self.req_to_token,
            seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu, num_tokens=tokens,
            extend_seq_lens=None if decode else fb.extend_seq_lens, extend_seq_lens_cpu=lens,
            extend_prefix_lens_cpu=None if decode else fb.extend_prefix_lens_cpu)
        self._count(Served.DECODE if decode else Served.EXTEND)
        return run

    def _count(self, kind: int) -> None:
        if self.served is not None:
            self.served.count(kind)

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool,
                run: Run | None = None, loc: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        """Store the layer's new K/V (at ``loc``, by default the call's ``out_cache_loc``) and
        attend through ``run`` (by default the forward's :attr:`run`)."""
        run = self.run if run is None else run
        if run is None:
            raise LayoutError("attention ran before init_forward_metadata refilled the pool")
        kv = self.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            # the layer call's own out_cache_loc: SGLang narrows it per call for padded batches
            kv.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc if loc is None
                                               else loc), k, v)
        h, d = layer.tp_q_head_num, layer.qk_head_dim
        out = run(q.reshape(-1, h, d),
                       kv_pages(kv.get_key_buffer(layer.layer_id), self.page_size),
                       kv_pages(kv.get_value_buffer(layer.layer_id), self.page_size),
                       layer.scaling, window=layer.sliding_window_size > -1,
                       softcap=float(layer.logit_cap or 0.0), sinks=kwargs.get("sinks"))
        return out.reshape(-1, h * layer.v_head_dim)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def init_cpu_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """SGLang's CPU graphs (``enable_torch_compile``) are refused: SDPA plans each batch on
        the host."""
        raise LayoutError(f"attention_backend={NAME!r} does not run in SGLang's CPU graphs: "
                          "start SGLang without enable_torch_compile")

    def get_cpu_graph_seq_len_fill_value(self) -> int:
        return self.filler.pool.cfg.pad_seq_len

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Nothing to allocate (the pool holds every buffer); refused where a captured decode
        graph could not replay correctly: SDPA attending (its gather plan is made on the host
        from the batch's lengths) or more rows than the pool has."""
        if self.filler.backend is Backend.SDPA:
            raise LayoutError(f"attention_backend={NAME!r} captures CUDA graphs only with "
                              "flash-attn or FlashInfer attending (SDPA plans each batch on "
                              "the host): install one of them, or start SGLang with "
                              "disable_cuda_graph=True")
        if max_bs > self.filler.sizes.max_requests:
            raise CapacityError(f"CUDA graphs of {max_bs} rows, but the pool has "
                                f"max_requests={self.filler.sizes.max_requests}")

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch,
                                        in_capture: bool = False) -> None:
        """Before a decode graph's capture (``in_capture``): bind the layers' call to the
        captured view. Before a replay: nothing when the graph refills the view itself
        (:meth:`init_forward_metadata_in_graph`, the fused path), else the refill, in place.
        Eager batches go through :meth:`init_forward_metadata` instead."""
        fb = forward_batch
        if not fb.forward_mode.is_decode():
            raise LayoutError(f"attention_backend={NAME!r} captures decode graphs only, got "
                              f"{fb.forward_mode.name}")
        if in_capture:
            self.run = self.filler.capture(fb.batch_size)
        elif not self.filler.recordable:
            self.filler.replay(fb.batch_size, req_pool_indices=fb.req_pool_indices,
                               req_to_token=self.req_to_token, seq_lens=fb.seq_lens)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """Inside the capture: the capturable refill (the fused path), recorded with the graph,
        so that each replay refills the captured view from the graph's input buffers
        (``seq_lens``, ``req_pool_indices``) before its kernels read it; without the fused
        path nothing (the refill runs before each replay)."""
        fb = forward_batch
        if self.filler.recordable:
            self.filler.replay(fb.batch_size, req_pool_indices=fb.req_pool_indices,
                               req_to_token=self.req_to_token, seq_lens=fb.seq_lens,
                               recorded=True)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.filler.pool.cfg.pad_seq_len

    def support_triton(self) -> bool:
        return False


B = TypeVar("B", bound=AttnpoolAttnBackend)


def kept(model_runner: Any, make: Callable[[Any], B]) -> AttnpoolAttnBackend:
    """The runner's one backend: built by ``make`` on first use, then kept on the runner.
    SGLang builds a draft runner's backends in several places (its own registry call, then the
    draft backend factory's extend and decode backends), and they all share the one pool (its
    draft, draft extend and extend phases never run in the same forward)."""
    got = getattr(model_runner, "_attnpool_backend", None)
    if got is None:
        got = make(model_runner)
        model_runner._attnpool_backend = got
    return got  # type: ignore[no-any-return]
