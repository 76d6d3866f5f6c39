"""The vLLM attention backend: classes vLLM instantiates (importing this module imports vLLM).

- :class:`AttnpoolCPUBackend` replaces vLLM's ``CPU_ATTN`` (the CPU platform only ever returns
  that backend, so the plugin registers an override of it): vLLM's CPU facts (dtypes, block
  sizes, head sizes, the ``LBHNC`` cache) are inherited; metadata, K/V stores and attention
  are attnpool's.
- :class:`AttnpoolBackend` is vLLM's ``CUSTOM`` backend on CUDA
  (``LLM(..., attention_backend="CUSTOM")``).
- :class:`AttnpoolMetadataBuilder`: one per KV-cache group; owns the group's pool
  (:class:`.step.StepFiller`) and refills it in :meth:`~AttnpoolMetadataBuilder.build`.
- :class:`AttnpoolImpl`: one per layer; stores the step's K/V into vLLM's cache tensor at the
  step's slots (:func:`.cache.store_`) and attends through attnpool's adapters.

Encoder-only layers (BERT-style embedding models) are an extend step without a cached prefix,
attended non-causally by vLLM's CPU kernel over a scratch cache of the step
(:mod:`.encoder_only`). Cross-attention layers (encoder-decoder models, e.g. Whisper) are a
group of their own: vLLM's cross-attention builder, which subclasses the group's builder, hands
:meth:`AttnpoolMetadataBuilder.build` the encoder's lengths as ``seq_lens`` and the group's
block table of the encoder's K/V, and vLLM's CPU kernel attends non-causally over the refilled
view. What attnpool cannot serve (encoder-only and cross attention, ALiBi and fp8 caches unless
vLLM's CPU kernel attends; a head size or variant no adapter of this device takes:
:func:`attnpool.adapters.backends.select`) is refused when the layer is built, that is when the
engine starts, never by a wrong token: logged at ERROR under vLLM's logger with the setting to
change (:func:`refuse`), then raised.

CUDA graphs, declared per kernel (:meth:`AttnpoolMetadataBuilder.get_cudagraph_support`):
``ALWAYS`` with flash-attn (FA3, FA4), whose extend view keeps its static bounds and tensors
when refilled on CUDA, so one full graph per size replays every mixed batch padded to it
(:func:`.step.mixed_graphs`; in vLLM's ``FULL`` mode every batch is then an extend update,
``StepFiller.one_phase``); ``UNIFORM_BATCH`` with speculative decoding and flash-attn FA2
(uniform verify steps, ``1 + k`` queries per request, refill the verify view a graph of that
size captured: :func:`.step.uniform_graphs`); ``UNIFORM_SINGLE_TOKEN_DECODE`` otherwise (decode
views captured per size; FlashInfer plans each captured size's graph wrapper in every
:meth:`build`). Declared only: no GPU has run them.

Speculative decoding (vLLM's n-gram and draft-model methods, which vLLM's CPU build runs):
a step in which every request verifies ``k`` drafts (``1 + k`` queries) is a ``pool.verify``
refill, every other step a decode or extend one (:mod:`.step`); the drafter model's layers
are a group of their own, served the same way. FlashInfer keeps verify steps on
``pool.extend`` (its plans take decode and extend parts).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor
from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_interface import CrossAttentionSpec, EncoderOnlyAttentionSpec

from ...adapters.backends import Backend, KVLayout, Need
from ...adapters.flashinfer_step import LayerFacts
from ...errors import LayoutError
from ...views import DecodeView
from ..engine import layer_facts
from . import cpu_kernel_mode
from .cache import cpu_views, cuda_views, slot_index_, store_
from .choice import KERNEL, pick
from .cpu_kernel import CPUKernel, kernel_isa
from .decode_cpu import attend
from .encoder_only import EncoderOnlySteps, scratch_blocks
from .runtime import BackendClasses, group_impls, layer_scales, logger, refuse, step_metadata
from .step import EngineSizes, StepFiller, StepMetadata, group_window, mixed_graphs, uniform_graphs

#: the attention types a layer may have: decoder self-attention everywhere, encoder-only and
#: cross attention where vLLM's CPU kernel attends (non-causally)
_SERVED = (AttentionType.DECODER, AttentionType.ENCODER_ONLY, AttentionType.ENCODER_DECODER)


class AttnpoolImpl(AttentionImpl[StepMetadata]):
    """One attention layer: the K/V store and the adapter call (see the module docstring)."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: Tensor | None = None, **extra: Any) -> None:
        cfg = get_current_vllm_config()
        device = torch.device(cfg.device_config.device)
        #: vLLM's CPU kernel attends (:mod:`.cpu_kernel`): it takes ALiBi and fp8 caches
        kernel = device.type == "cpu" and cpu_kernel_mode() == "vllm"
        only_kernel = "only with vLLM's CPU kernel attending"
        refuse([what for what, bad in (
            (f"ALiBi slopes ({only_kernel})", alibi_slopes is not None and not kernel),
            (f"an fp8 KV cache (kv_cache_dtype={kv_cache_dtype!r}; {only_kernel})",
             kv_cache_dtype != "auto" and not kernel),
            (f"{attn_type} attention (decoder self-attention; encoder-only and cross "
             f"attention {only_kernel})", attn_type not in _SERVED
             or (attn_type != AttentionType.DECODER and not kernel)),
            (f"arguments {sorted(extra)}", bool(extra))) if bad],
            kernel_fixes=device.type == "cpu" and not kernel)
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(
            alibi_slopes, dtype=torch.float32)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.sliding_window = sliding_window
        self.softcap = float(logits_soft_cap or 0.0)
        self.sinks = sinks
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.cpu = device.type == "cpu"
        #: ((data_ptr, shape) of the cache tensor, its (k_cache, v_cache) views)
        self._cached: tuple[tuple[int, torch.Size], tuple[Tensor, Tensor]] | None = None
        need = Need(device=device.type, dtype=cfg.model_config.dtype, head_size=head_size,
                    page_size=cfg.cache_config.block_size, varying_queries=True,
                    kv_layout=KVLayout.HND if self.cpu else KVLayout.NHD,
                    window=sliding_window is not None, softcap=bool(self.softcap),
                    sinks=sinks is not None)
        #: vLLM's CPU kernel, set by the group's builder when the group attends with it
        self.kernel: CPUKernel | None = None
        #: the adapter this layer runs (the same for every layer of a model: .choice)
        try:
            self.backend = pick(need)
        except LayoutError as e:
            refuse([f"this layer with the adapters installed ({e})"])
            raise

    def _views(self, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        """``(k_cache, v_cache)`` of the layer's cache tensor, made once: vLLM allocates it
        once and passes the same tensor every step (the store and the attention of every step
        reuse the views instead of building four strided views per layer and step)."""
        key = (kv_cache.data_ptr(), kv_cache.shape)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        views = cpu_views(kv_cache) if self.cpu else cuda_views(kv_cache)
        self._cached = (key, views)
        return views

    def forward(self, layer: Any, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor,
                attn_metadata: StepMetadata | None, output: Tensor,
                output_scale: Tensor | None = None,
                output_block_scale: Tensor | None = None) -> Tensor:
        """Attention of the step's ``num_actual_tokens`` queries into ``output[:T]``."""
        if output_scale is not None or output_block_scale is not None:
            refuse(["fused output quantization"])
        if attn_metadata is None:  # vLLM's warm-up (no metadata, an empty cache)
            return output
        t = attn_metadata.num_actual_tokens
        sinks = self.sinks
        if sinks is not None and sinks.dtype != torch.float32:
            # once, after the weights are loaded (the adapter takes float32 sinks)
            sinks = self.sinks = sinks.float()
        view = attn_metadata.view
        if attn_metadata.kernel is not None and self.kernel is not None:
            # vLLM's CPU kernel over the pool's buffers (.cpu_kernel)
            shape = (t, self.num_heads, self.head_size)
            if attn_metadata.encoder_cache is not None and attn_metadata.encoder_slots is not None:
                # encoder-only: this layer's keys and values into the step's scratch (.encoder_only)
                kv_cache = attn_metadata.encoder_cache
                self.kernel.store(key, value, kv_cache, attn_metadata.encoder_slots,
                                  layer_scales(layer))
            q = query if query.shape == shape else query[:t].view(shape)
            out = output if output.shape == shape else output[:t].view(shape)
            self.kernel.attend(attn_metadata.kernel, q, kv_cache, out, self.scale,
                               self.sliding_window, self.softcap, sinks, self.alibi_slopes,
                               layer_scales(layer))
            return output
        if self.cpu and isinstance(view, DecodeView):
            # decode on a CPU: straight from the cache blocks (keys stay transposed)
            part = view.window if self.sliding_window is not None else view
            if part is None:
                raise LayoutError("a sliding-window layer needs the pool's window part")
            q = query[:t].view(t, self.num_heads, self.head_size)
            out = attend(attn_metadata.block_plan(part, self.num_kv_heads), q, kv_cache, self.scale,
                         self.softcap, sinks)
            output[:t].copy_(out.view(output[:t].shape))
            return output
        run = attn_metadata.run
        if run is None:
            raise LayoutError("this step's metadata was built for vLLM's CPU kernel, which "
                              "this layer does not attend with")
        k_cache, v_cache = self._views(kv_cache)
        out = run(query[:t], k_cache, v_cache, self.scale,
                                window=self.sliding_window is not None, softcap=self.softcap,
                                sinks=sinks)
        output[:t].copy_(out.view(output[:t].shape))
        return output

    def do_kv_cache_update(self, layer: Any, key: Tensor, value: Tensor, kv_cache: Tensor,
                           slot_mapping: Tensor) -> None:
        """Store the step's new K/V at ``slot_mapping`` (-1: padding, skipped into the null
        block), through the block/offset pair the step's metadata computed once; with vLLM's
        CPU kernel attending (:mod:`.cpu_kernel`), by its companion store op, one call for K
        and V (the same bytes: the tests compare them)."""
        if self.attn_type == AttentionType.ENCODER_ONLY:
            return  # (no cache between steps: forward stores into the step's scratch)
        if self.kernel is not None:
            self.kernel.store(key, value, kv_cache, slot_mapping, layer_scales(layer))
            return
        k_cache, v_cache = self._views(kv_cache)
        t = slot_mapping.shape[0]
        md = step_metadata(getattr(layer, "layer_name", None))
        if md is not None and md.blocks.shape[0] == t:
            blocks, offsets = md.blocks, md.offsets
        else:  # no step metadata to share (a caller outside a model step): computed here
            blocks = torch.empty(t, dtype=torch.int64, device=slot_mapping.device)
            offsets = torch.empty_like(blocks)
            slot_index_(slot_mapping, k_cache.shape[1], blocks, offsets)
        store_(k_cache, v_cache, key[:t], value[:t], blocks, offsets)


def verify_rows(vllm_config: VllmConfig) -> int:
    """``N = 1 + num_speculative_tokens``, the query rows of one request in a speculative
    verify step (vLLM's ``uniform_decode_query_len``), or 0 without speculative decoding."""
    spec = getattr(vllm_config, "speculative_config", None)  # (as vLLM's own readers do)
    k = 0 if spec is None else int(spec.num_speculative_tokens or 0)
    return 1 + k if k > 0 else 0


def _facts(impls: list[AttnpoolImpl], num_kv_heads: int, dtype: torch.dtype) -> LayerFacts:
    """What FlashInfer's plans fix for a group's layers, refused when the layers differ in it
    (one plan per step and part serves every layer)."""
    layers = [(i.num_heads, num_kv_heads, i.head_size, i.scale, i.softcap) for i in impls]
    facts = layer_facts(layers, dtype)
    if facts is None:
        refuse([f"FlashInfer over layers that differ in heads, head size, scale or soft cap "
                f"({sorted(set(layers))}; set {KERNEL}=fa4, fa3 or sdpa)"])
    assert facts is not None  # (refuse raised)
    return facts


class AttnpoolMetadataBuilder(AttentionMetadataBuilder[StepMetadata]):
    """One KV-cache group: its pool, sized once, refilled by every :meth:`build`."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        impls = group_impls(vllm_config, Attention, AttnpoolImpl, layer_names)
        first = impls[0]
        sched, model = vllm_config.scheduler_config, vllm_config.model_config
        encoder_only = isinstance(kv_cache_spec, EncoderOnlyAttentionSpec)
        #: a cross-attention group (encoder-decoder models): vLLM's cross-attention builder,
        #: a subclass of this one, hands :meth:`build` the encoder's lengths as ``seq_lens``
        #: and the group's block table of encoder K/V; the kernel attends non-causally
        cross = isinstance(kv_cache_spec, CrossAttentionSpec)
        longest = max(model.max_model_len, sched.max_num_encoder_input_tokens) if cross \
            else model.max_model_len
        sizes = EngineSizes(
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=longest, block_size=kv_cache_spec.block_size,
            sliding_window=group_window({i.sliding_window for i in impls}),
            num_blocks=scratch_blocks(sched.max_num_batched_tokens, kv_cache_spec.block_size,
                                      sched.max_num_seqs) if encoder_only
            else vllm_config.cache_config.num_gpu_blocks, device=torch.device(device),
            num_draft_tokens=0 if encoder_only or cross or first.backend is Backend.FLASHINFER
            else verify_rows(vllm_config))
        # vLLM's CPU kernel applies each layer's window itself over the full part: the pool
        # then has no window part (its bytes would be written every step and never read)
        kernel = sizes.device.type == "cpu" and cpu_kernel_mode() == "vllm"
        self.filler = StepFiller(sizes, first.backend, first.num_heads,
                                 kv_cache_spec.num_kv_heads, model.dtype, window_part=not kernel,
                                 facts=_facts(impls, kv_cache_spec.num_kv_heads, model.dtype)
                                 if first.backend is Backend.FLASHINFER else None)
        if kernel:
            self._use_cpu_kernel(impls, kv_cache_spec, model.dtype,
                                 vllm_config.cache_config.cache_dtype,
                                 not (encoder_only or cross))
        #: whether ``filler.one_phase`` was set from vLLM's resolved graph mode (first build)
        self._phase_set = False
        #: an encoder-only group's scratch cache and refill (.encoder_only), else None
        self.encoder_only = EncoderOnlySteps(self.filler, kv_cache_spec.num_kv_heads,
                                             kv_cache_spec.head_size, model.dtype) \
            if encoder_only else None
        logger.info("attnpool serves attention of %d layers (%s): one pool of %d bytes, "
                    "max_bs %d, %d extend tokens, block size %d, window %s",
                    len(impls), "vLLM's CPU kernel" if self.filler.kernel is not None
                    else first.backend.name, self.filler.pool.nbytes,
                    sizes.max_num_seqs, sizes.max_num_batched_tokens, sizes.block_size,
                    sizes.sliding_window)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec: Any
                              ) -> AttentionCGSupport:
        """``ALWAYS`` when every attnpool layer attends with flash-attn FA3 or FA4 on CUDA
        (:func:`.step.mixed_graphs`); ``UNIFORM_BATCH`` with speculative decoding when every
        layer attends with flash-attn (FA2 included: a verify step has one query count for
        every row), whose uniform verify steps are refilled through the verify view a graph
        of that size captured (:func:`.step.uniform_graphs`); else
        ``UNIFORM_SINGLE_TOKEN_DECODE`` (also before the layers exist: the safe
        declaration)."""
        layers = get_layers_from_vllm_config(vllm_config, Attention)
        backends = {layer.impl.backend for layer in layers.values()
                    if isinstance(layer.impl, AttnpoolImpl)}
        device = torch.device(vllm_config.device_config.device).type
        if mixed_graphs(backends, device):
            return AttentionCGSupport.ALWAYS
        if uniform_graphs(backends, device, verify_rows(vllm_config)):
            return AttentionCGSupport.UNIFORM_BATCH
        return cls._cudagraph_support

    def _one_phase(self) -> bool:
        """vLLM's graph mode keeps one full graph per size for decode and mixed batches alike
        (``FULL``: no separate decode routine), and this group's kernels replay mixed ones:
        then every batch goes through the extend phase (see the module docstring)."""
        mode = self.vllm_config.compilation_config.cudagraph_mode
        return (self.filler.sizes.device.type == "cuda" and mode is not None
                and mode.mixed_mode() == type(mode).FULL and not mode.separate_routine()
                and type(self).get_cudagraph_support(self.vllm_config, self.kv_cache_spec)
                is AttentionCGSupport.ALWAYS)

    def _use_cpu_kernel(self, impls: list[AttnpoolImpl], spec: Any, dtype: torch.dtype,
                        kv_cache_dtype: str, causal: bool) -> None:
        """Attend with vLLM's CPU kernel over the pool's buffers (:mod:`.cpu_kernel`), in the
        cache layout vLLM picks for the group (its store op writes it)."""
        from vllm import envs

        isa = kernel_isa(dtype, spec.block_size, spec.head_size, kv_cache_dtype)
        windows = {i.sliding_window for i in impls}
        kernel = CPUKernel(impls[0].num_heads, spec.num_kv_heads, spec.head_size, dtype,
                           next(iter(windows)) if len(windows) == 1 else None, isa,
                           bool(envs.VLLM_CPU_ATTN_SPLIT_KV), kv_cache_dtype, causal)
        self.filler.kernel = kernel
        for impl in impls:
            impl.kernel = kernel

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> StepMetadata:
        cm = common_attn_metadata
        if self.encoder_only is not None:
            return self.encoder_only.fill(num_reqs=cm.num_reqs,
                                          num_actual_tokens=cm.num_actual_tokens,
                                          max_query_len=cm.max_query_len,
                                          query_start_loc=cm.query_start_loc,
                                          seq_lens=cm.seq_lens)
        if self._phase_set is False:
            self.filler.one_phase = self._one_phase()
            self._phase_set = True
        return self.filler.step(cm.num_reqs, cm.num_actual_tokens, cm.max_query_len,
                                cm.query_start_loc, cm.seq_lens, cm.block_table_tensor,
                                cm.slot_mapping)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> StepMetadata:
        """The capture batch's metadata: the same refill (a uniform decode batch writes the
        decode view a graph of that size replays; :meth:`build` refills it before each
        replay). With FlashInfer, the batch size becomes a captured one: its decode steps
        plan the graph wrapper of that size, built here, outside the graph, on the pool's
        own CSR buffers."""
        cm = common_attn_metadata
        plans = self.filler.plans
        if plans is not None and cm.max_query_len == 1:
            plans.capture_size(cm.num_reqs)
        return self.build(0, cm)


class _AttnpoolClasses(BackendClasses):
    """The impl and builder of attnpool's two (non-MLA) backend classes."""

    impl, builder = AttnpoolImpl, AttnpoolMetadataBuilder


class AttnpoolCPUBackend(_AttnpoolClasses, CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` slot, served by attnpool (same name: the CPU platform looks the
    backend up by it)."""


class AttnpoolBackend(_AttnpoolClasses, AttentionBackend):
    """vLLM's ``CUSTOM`` backend on CUDA (``attention_backend="CUSTOM"``)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True
