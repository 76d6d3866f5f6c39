"""SGLang's attention backend ``attnpool`` (importing this module imports SGLang).

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

What the backend does not serve is refused when SGLang builds it, at engine start, with the
reason and the setting to change (:func:`refusals`): cross attention (encoder-decoder
models), encoder-only and bidirectional layers, multi-head latent attention, KV caches of
another dtype than the model's (fp8), hybrid sliding-window KV pools, speculative decoding,
more than one sliding window, and query/value head sizes that differ.

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
from typing import Any

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
from .step import KERNEL, NAME, BatchFiller, RunnerSizes, kv_pages

logger = logging.getLogger(__name__)
#: set to a path: each engine process writes its refill counts to ``<path>.<pid>`` (see
#: :class:`Served`); off by default (nothing is counted)
REPORT = "ATTNPOOL_SGLANG_REPORT"


class Served:
    """What one engine process's pool served, kept in a file for another process to read:
    SGLang runs its scheduler (and so this backend) in a spawned process, where the caller
    that started the engine cannot look. Three int64: decode refills, extend refills and the
    pool's bytes, in a file memory-mapped once, so a refill costs one store (only when
    :data:`REPORT` is set; ``examples/sglang_smollm2.py`` prints them as its proof that the
    pool served the run)."""

    def __init__(self, path: str, nbytes: int) -> None:
        import numpy as np

        self.counts = np.memmap(f"{path}.{os.getpid()}", dtype=np.int64, mode="w+", shape=(3,))
        self.counts[:] = (0, 0, nbytes)
        self.counts.flush()

    def count(self, decode: bool) -> None:
        self.counts[0 if decode else 1] += 1

    @staticmethod
    def read(path: str) -> tuple[int, int, int]:
        """The counts of every process that wrote ``<path>.<pid>`` files, summed: (decode
        refills, extend refills, the pools' bytes)."""
        import glob

        import numpy as np

        total = [0, 0, 0]
        for name in glob.glob(f"{glob.escape(path)}.*"):
            got = np.fromfile(name, dtype=np.int64, count=3)
            for i in range(min(3, got.shape[0])):
                total[i] += int(got[i])
        return total[0], total[1], total[2]


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
    return choose(need, os.environ.get(KERNEL, "").strip().lower(),
                  f"attention_backend={NAME!r}", KERNEL,
                  planned=not need.sinks and _facts(model_runner, layers) is not None)


def _facts(model_runner: Any, layers: list[RadixAttention]) -> LayerFacts | None:
    """What FlashInfer's one plan per forward fixes for every layer, as the layers have it;
    None when they differ (FlashInfer is then not offered)."""
    return layer_facts(((layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim,
                         layer.scaling, layer.logit_cap or 0.0) for layer in layers),
                       model_runner.dtype)


def refusals(model_runner: Any, layers: list[RadixAttention]) -> list[str]:
    """What in this runner the backend cannot serve, each with the setting to change (empty:
    everything is served)."""
    out: list[str] = []
    if not layers:
        out.append("the model has no RadixAttention layer")
    if getattr(model_runner, "use_mla_backend", False):
        out.append("multi-head latent attention (MLA) models")
    if any(layer.is_cross_attention for layer in layers):
        out.append("cross attention (encoder-decoder models)")
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
    if getattr(model_runner, "spec_algorithm", None) is not None \
            and not model_runner.spec_algorithm.is_none():
        out.append("speculative decoding (speculative_algorithm)")
    if layers and not out:
        try:
            pick(model_runner, layers)
        except LayoutError as e:
            out.append(f"these layers with the adapters installed ({e})")
    return out


def _sizes(model_runner: Any, layers: list[RadixAttention]) -> RunnerSizes:
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
    """SGLang's ``attnpool`` attention backend (see the module doc)."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        layers = _layers(model_runner)
        reasons = refusals(model_runner, layers)
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
        self.filler = BatchFiller(_sizes(model_runner, layers), backend,
                                  first.tp_q_head_num, first.tp_k_head_num, model_runner.dtype,
                                  masked=masked, facts=facts)
        logger.info("attnpool serves attention of %d layers with %s: one pool of %d bytes",
                    len(layers), backend.name, self.filler.pool.nbytes)
        self.page_size = self.filler.sizes.page_size
        self.run: Run | None = None
        report = os.environ.get(REPORT)
        self.served = None if not report else Served(report, self.filler.pool.nbytes)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Refill the pool from ``forward_batch`` (SGLang calls this before every forward) and
        bind the adapter call its layers make."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.run = None
            return
        if not (mode.is_decode() or mode.is_extend_or_draft_extend_or_mixed()) \
                or mode.is_split_prefill():
            raise LayoutError(f"attention_backend={NAME!r} serves decode and extend batches, "
                              f"got {mode.name}")
        fb = forward_batch
        decode = mode.is_decode()
        lens = None if decode else fb.extend_seq_lens_cpu
        # the real new tokens (a batch SGLang pads for data or attention parallelism counts
        # its padding in extend_num_tokens, and narrows its layers' inputs to the real ones)
        tokens = fb.batch_size if decode else (
            sum(lens) if lens is not None else int(fb.extend_num_tokens))
        self.run = self.filler.fill(
            decode=decode, req_pool_indices=fb.req_pool_indices, req_to_token=self.req_to_token,
            seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu, num_tokens=tokens,
            extend_seq_lens=None if decode else fb.extend_seq_lens, extend_seq_lens_cpu=lens,
            extend_prefix_lens_cpu=None if decode else fb.extend_prefix_lens_cpu)
        if self.served is not None:
            self.served.count(decode)

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool,
                **kwargs: Any) -> torch.Tensor:
        if self.run is None:
            raise LayoutError("attention ran before init_forward_metadata refilled the pool")
        kv = self.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            # the layer call's own out_cache_loc: SGLang narrows it per call for padded batches
            kv.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, v)
        h, d = layer.tp_q_head_num, layer.qk_head_dim
        out = self.run(q.reshape(-1, h, d),
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
